"""Execute one rank's part of a schedule with ``torch.distributed`` and record what happened.

PyTorch's ``_PipelineScheduleRuntime`` (driven by :mod:`pipesched.runtime.torch_compat` from the compute-only
CSV) runs every loop and V schedule, and is the default engine there (``engine="auto"`` in
:mod:`pipesched.runtime.launch`). This own executor is for what that runtime cannot follow:

* ``"bidirectional"`` placement (two model replicas whose stage ids ``S … 2S−1`` map back onto model
  stages ``0 … S−1``) and explicit placement lists: it reads the microbatch chains from
  :func:`pipesched.optimizer.instance.compile_problem`, where ``_PipelineScheduleRuntime`` knows one chain
  ``0 … S−1`` placed loop- or V-wise;
* runs that need the wait before each action apart from its compute (``wait_ms``), and a
  second, independent execution of the same order to compare with PyTorch's (``engine="pipesched"``).

The backward split uses PyTorch's own ``stage_backward_input`` / ``stage_backward_weight`` (through
:mod:`pipesched.runtime.torch_compat`), so I and W do what they do in ``torch.distributed.pipelining``. On a
stage whose input needs no gradient (the first model stage) I has nothing to compute and W runs the
whole backward, as PyTorch does (``torch/distributed/pipelining/_backward.py``).

Point-to-point messages use ``isend``/``irecv`` with one tag per (stage, pass, microbatch), so
transfers between the same two ranks cannot be mismatched (gloo matches by tag). Every receive waits
at most ``p2p_timeout_s``; a message that never arrives raises :class:`PipelineRuntimeError` naming the
action, the peer and the wait instead of hanging. NCCL ignores tags and matches in issue order; the
executor issues sends in the order the schedule produces them, which suffices for the orders the
simulator accepts with one stream per rank pair, but mixed streams between two ranks under NCCL are
not exercised here.
"""

from __future__ import annotations

import re
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipesched.optimizer.instance import Instance, compile_for_orders
from pipesched.optimizer.ir import Action, ActionKind, parse_action
from pipesched.optimizer.result import Schedule
from pipesched.runtime import torch_compat
from pipesched.runtime.models import PipelineModel

__all__ = [
    "COMMUNICATION_KINDS",
    "PipelineRuntimeError",
    "RankRun",
    "SavedActivationMeter",
    "execute_rank",
    "split_action",
]

#: Data-parallel communication actions a schedule may hold beside F/I/W/B (contract, Terms), PyTorch's
#: names: ``"{stage}UNSHARD"``, ``"{stage}RESHARD"``, ``"{stage}REDUCE_GRAD"``; and ``OPTIMIZER_STEP``,
#: the end of a rank's step (with or without a stage prefix), which the training loop runs, not the executor.
COMMUNICATION_KINDS = ("UNSHARD", "RESHARD", "REDUCE_GRAD", "OPTIMIZER_STEP")
_COMMUNICATION_RE = re.compile(r"(0|[1-9][0-9]*)?(UNSHARD|RESHARD|REDUCE_GRAD|OPTIMIZER_STEP)")


def split_action(text: str) -> Action | tuple[int | None, str]:
    """A compute action (:class:`Action`), or a communication action as ``(stage or None, kind)``.

    Raises:
        ValueError: for anything else (the message of :func:`parse_action`).
    """
    match = _COMMUNICATION_RE.fullmatch(text) if isinstance(text, str) else None
    if match is not None:
        return (None if match.group(1) is None else int(match.group(1)), match.group(2))
    return parse_action(text)


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]
_META_LEN = 10


class PipelineRuntimeError(RuntimeError):
    """The run cannot go on; ``reason`` is one of ``p2p_timeout``, ``schedule``, ``model``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _Saved:
    """A saved tensor counted by :class:`SavedActivationMeter`; releasing it uncounts the storage."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedActivationMeter:
    """Live bytes of tensors autograd saved for backward (activation memory), and their peak.

    Installed as ``torch.autograd.graph.saved_tensors_hooks``: every saved tensor is counted once per
    storage (views of one storage count once) until the last saved reference to it is released (the
    graph freed by a backward without ``retain_graph``). Parameters are not counted (static memory).
    """

    def __init__(self, exclude: list[torch.Tensor]) -> None:
        # Sharded (DTensor) parameters: exclude their local shards.
        self.exclude = {getattr(p, "_local_tensor", p).untyped_storage().data_ptr() for p in exclude}
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[int, list[int]] = {}

    def _release(self, pointer: int) -> None:
        entry = self._refs.get(pointer)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._refs[pointer]
            self.live_bytes -= entry[1]

    def pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        pointer, size = storage.data_ptr(), storage.nbytes()
        if pointer in self.exclude or size == 0:
            return tensor
        entry = self._refs.get(pointer)
        if entry is None:
            self._refs[pointer] = [1, size]
            self.live_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        else:
            entry[0] += 1
        saved = _Saved(tensor.detach())  # detached: a saved output must not keep its own grad_fn alive (cycle)
        weakref.finalize(saved, self._release, pointer)
        return saved

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context manager that installs the meter."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


@dataclass
class RankRun:
    """What one rank did: its actions with measured times (ms from the common start), memory, results.

    ``actions[k]``: ``{"action", "start", "end", "wait_ms", "memory_bytes"}``; ``memory_bytes`` is the live
    saved-activation bytes after the action (CPU) or ``torch.cuda.memory_allocated`` (GPU).
    ``losses``: microbatch → loss, on the rank holding a chain's last stage. ``gradients``:
    ``"{stage id}/{parameter name}"`` → gradient (CPU, fp32), summed over the step's microbatches.
    """

    rank: int
    actions: list[dict[str, Any]] = field(default_factory=list)
    executed: list[str] = field(default_factory=list)
    peak_memory_bytes: int = 0
    memory_measure: str = "saved-activations"
    losses: dict[int, float] = field(default_factory=dict)
    gradients: dict[str, torch.Tensor] = field(default_factory=dict)
    device: str = "cpu"
    communication: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class _Microbatch:
    input: torch.Tensor | None = None
    output: torch.Tensor | None = None
    output_grad: torch.Tensor | None = None
    param_groups: Any = None
    input_grad: torch.Tensor | None = None
    backward_done: bool = False


def _tag(stage: int, microbatch: int, backward: bool, num_microbatches: int, meta: bool) -> int:
    return (((stage * num_microbatches + microbatch) * 2 + int(backward)) * 2 + int(meta)) + 1


class _P2P:
    """Tagged point-to-point transfers with a bounded wait (shape travels in a small header)."""

    def __init__(
        self,
        rank: int,
        device: torch.device,
        num_microbatches: int,
        timeout_s: float,
        to_global: Callable[[int], int] | None = None,
    ) -> None:
        self.to_global = to_global or (lambda peer: peer)
        self.rank = rank
        self.device = device
        self.m = num_microbatches
        self.timeout = timedelta(seconds=timeout_s)
        self.pending: list[tuple[dist.Work | None, torch.Tensor]] = []

    def send(self, tensor: torch.Tensor, peer: int, stage: int, microbatch: int, backward: bool) -> None:
        tensor = tensor.detach().contiguous()
        meta = torch.zeros(_META_LEN, dtype=torch.int64, device=self.device)
        meta[0] = _DTYPES.index(tensor.dtype)
        meta[1] = tensor.dim()
        meta[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        for payload, is_meta in ((meta, True), (tensor, False)):
            work = dist.isend(payload, dst=self.to_global(peer), tag=_tag(stage, microbatch, backward, self.m, is_meta))
            self.pending.append((work, payload))

    def _wait(self, work: dist.Work | None, what: str, peer: int) -> None:
        if work is None:
            return
        try:
            completed = work.wait(self.timeout)
        except RuntimeError as error:
            raise PipelineRuntimeError(
                "p2p_timeout",
                f"rank {self.rank} waited {self.timeout.total_seconds():g} s for {what} from rank {peer} and it "
                f"never arrived (a deadlocked order, a missing action, or a dead rank): {str(error).splitlines()[0]}",
            ) from None
        if completed is False:
            raise PipelineRuntimeError(
                "p2p_timeout", f"rank {self.rank}: receiving {what} from rank {peer} did not complete"
            )

    def recv(self, peer: int, stage: int, microbatch: int, backward: bool, what: str) -> torch.Tensor:
        meta = torch.zeros(_META_LEN, dtype=torch.int64, device=self.device)
        self._wait(
            dist.irecv(meta, src=self.to_global(peer), tag=_tag(stage, microbatch, backward, self.m, True)), what, peer
        )
        ndim = int(meta[1])
        shape = [int(x) for x in meta[2 : 2 + ndim]]
        tensor = torch.empty(shape, dtype=_DTYPES[int(meta[0])], device=self.device)
        self._wait(
            dist.irecv(tensor, src=self.to_global(peer), tag=_tag(stage, microbatch, backward, self.m, False)),
            what,
            peer,
        )
        return tensor

    def drain(self) -> None:
        for work, _ in self.pending:
            self._wait(work, "the completion of a send", -1)
        self.pending.clear()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def execute_rank(
    schedule: Schedule,
    model: PipelineModel,
    *,
    rank: int,
    device: torch.device,
    p2p_timeout_s: float,
    warmup_steps: int = 1,
    inst: Instance | None = None,
    modules: dict[int, nn.Module] | None = None,
    make_microbatch: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    to_global: Callable[[int], int] | None = None,
    communicate: Callable[[int, str], None] | None = None,
) -> RankRun:
    """Run ``schedule``'s actions of ``rank`` in their order, exchanging activations and gradients.

    ``warmup_steps`` untimed steps run first (their gradients discarded). The process group must be
    initialised with one process per rank. Loss per microbatch is
    ``model.loss_fn(...) / num_microbatches`` so the gradients are those of the mean loss.

    For training (:mod:`pipesched.runtime.training`): ``modules`` (stage id → module, already on
    ``device``, gradients left as they are: zero them between steps) replaces building them from ``model``;
    ``make_microbatch``/``loss_fn`` replace the model's (a data-parallel replica's microbatches);
    ``to_global`` maps a pipeline rank to the global rank of this replica's peer (p2p on a pp × dp mesh);
    ``communicate(stage, kind)`` runs a communication action of the schedule (``UNSHARD``, ``RESHARD``,
    ``REDUCE_GRAD``), timed into ``RankRun.communication``. Without it, or for ``OPTIMIZER_STEP``, such an
    action is skipped with a note in ``RankRun.notes``.

    Raises:
        PipelineRuntimeError: a receive that does not complete within ``p2p_timeout_s`` (reason
            ``p2p_timeout``), or an order this rank cannot run (reason ``schedule``: W before I, an
            action of a stage it does not hold).
    """
    inst = inst or compile_for_orders(schedule.problem, schedule.orders())
    m = inst.num_microbatches
    order = [split_action(a.action) for a in schedule.ranks[rank].actions]
    my_stages = sorted({s for s, r in enumerate(inst.stage_ranks) if r == rank})
    make_microbatch = make_microbatch or model.make_microbatch
    loss_fn = loss_fn or model.loss_fn
    if modules is None:
        modules = {}
        for stage in my_stages:
            modules[stage] = model.build_stage(inst.model_stage[stage]).to(device)
            modules[stage].zero_grad(set_to_none=True)
    previous: dict[tuple[int, int], int | None] = {}
    following: dict[tuple[int, int], int | None] = {}
    for j, chain in enumerate(inst.chains):
        for k, stage in enumerate(chain):
            previous[stage, j] = chain[k - 1] if k > 0 else None
            following[stage, j] = chain[k + 1] if k + 1 < len(chain) else None

    meter = SavedActivationMeter([p for module in modules.values() for p in module.parameters()])
    p2p = _P2P(rank, device, m, p2p_timeout_s, to_global)
    state: dict[tuple[int, int], _Microbatch] = {}
    run = RankRun(rank=rank, device=str(device))
    run.memory_measure = "cuda-max-allocated" if device.type == "cuda" else "saved-activations"

    def fail(action: Action, message: str) -> PipelineRuntimeError:
        return PipelineRuntimeError("schedule", f"rank {rank}, action {action}: {message}")

    def step(record: bool) -> None:
        state.clear()
        dist.barrier()
        origin = time.perf_counter()
        for item in order:
            if not isinstance(item, Action):
                communication_stage, communication_kind = item
                name = f"{'' if communication_stage is None else communication_stage}{communication_kind}"
                if communicate is None or communication_kind == "OPTIMIZER_STEP" or communication_stage is None:
                    if record:
                        run.notes.append(f"{name}: skipped by the executor (run by the training loop)")
                    continue
                started = time.perf_counter()
                communicate(communication_stage, communication_kind)
                _synchronize(device)
                ended = time.perf_counter()
                if record:
                    run.communication.append(
                        {
                            "action": name,
                            "start": round((started - origin) * 1e3, 6),
                            "end": round((ended - origin) * 1e3, 6),
                        }
                    )
                continue
            action = item
            stage, kind, j = action
            if stage not in modules:
                raise fail(action, f"stage {stage} is held by rank {inst.stage_ranks[stage]}, not this rank")
            module = modules[stage]
            mb = state.setdefault((stage, j), _Microbatch())
            waited = time.perf_counter()
            if kind == ActionKind.FORWARD:
                before = previous[stage, j]
                if before is None:
                    x, _ = make_microbatch(j)
                    x = x.to(device)
                elif inst.stage_ranks[before] == rank:
                    produced = state.get((before, j))
                    if produced is None or produced.output is None:
                        raise fail(action, f"runs before {before}F{j} on the same rank")
                    x = produced.output.detach().requires_grad_(produced.output.is_floating_point())
                else:
                    x = p2p.recv(inst.stage_ranks[before], before, j, False, f"the activation of {before}F{j}")
                    x.requires_grad_(x.is_floating_point())
                started = time.perf_counter()
                with meter.hooks():
                    out = module(x)
                    if following[stage, j] is None:
                        _, target = make_microbatch(j)
                        loss = loss_fn(out, target.to(device))
                        run.losses[j] = float(loss.detach())
                        out = loss / m
                mb.input, mb.output = x, out
                after = following[stage, j]
                if after is not None and inst.stage_ranks[after] != rank:
                    p2p.send(out, inst.stage_ranks[after], stage, j, False)
            elif kind in (ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD):
                if mb.output is None:
                    raise fail(action, f"runs before {stage}F{j}")
                if mb.backward_done:
                    raise fail(action, "the backward of this microbatch ran already")
                after = following[stage, j]
                grad: torch.Tensor | None = None
                if after is not None:
                    if inst.stage_ranks[after] == rank:
                        downstream = state.get((after, j))
                        if downstream is None or downstream.input_grad is None:
                            raise fail(action, f"runs before the backward of {after} for microbatch {j} on this rank")
                        grad = downstream.input_grad
                    else:
                        grad = p2p.recv(inst.stage_ranks[after], after, j, True, f"the gradient from stage {after}")
                started = time.perf_counter()
                mb.output_grad = grad
                needs_input_grad = isinstance(mb.input, torch.Tensor) and mb.input.requires_grad
                with meter.hooks():
                    if kind == ActionKind.BACKWARD:
                        torch.autograd.backward([mb.output], None if grad is None else [grad])
                        mb.param_groups = None
                    elif needs_input_grad and mb.input is not None:
                        mb.param_groups = torch_compat.backward_input(mb.output, grad, mb.input, module)
                    else:
                        mb.param_groups = "full"  # nothing to compute for I here: W runs the whole backward
                if needs_input_grad:
                    assert mb.input is not None
                    mb.input_grad = mb.input.grad
                    if mb.input_grad is None:
                        mb.input_grad = torch.zeros_like(mb.input)
                    before = previous[stage, j]
                    if before is not None and inst.stage_ranks[before] != rank:
                        p2p.send(mb.input_grad, inst.stage_ranks[before], stage, j, True)
                mb.backward_done = kind == ActionKind.BACKWARD
                if kind == ActionKind.BACKWARD:
                    mb.output = mb.input = None
            elif kind == ActionKind.BACKWARD_WEIGHT:
                if mb.param_groups is None:
                    raise fail(action, f"runs before {stage}I{j}")
                started = time.perf_counter()
                with meter.hooks():
                    if isinstance(mb.param_groups, str):
                        assert mb.output is not None
                        torch.autograd.backward([mb.output], None if mb.output_grad is None else [mb.output_grad])
                    else:
                        torch_compat.backward_weight(mb.param_groups, module)
                mb.param_groups = None
                mb.output = mb.input = mb.output_grad = None
                mb.backward_done = True
            else:  # pragma: no cover - ActionKind has four members
                raise fail(action, f"unknown kind {kind}")
            _synchronize(device)
            ended = time.perf_counter()
            memory = torch.cuda.memory_allocated(device) if device.type == "cuda" else meter.live_bytes
            if mb.backward_done and mb.output is None:
                # Keep the input gradient for a same-rank upstream stage; drop everything else.
                state[stage, j] = _Microbatch(input_grad=mb.input_grad, backward_done=True)
            if not record:
                continue
            run.actions.append(
                {
                    "action": str(action),
                    "start": round((started - origin) * 1e3, 6),
                    "end": round((ended - origin) * 1e3, 6),
                    "wait_ms": round((started - waited) * 1e3, 6),
                    "memory_bytes": int(memory),
                }
            )
            run.executed.append(str(action))
        p2p.drain()

    for _ in range(warmup_steps):  # untimed: first calls pay for lazy initialisation
        step(record=False)
        for module in modules.values():
            module.zero_grad(set_to_none=True)
        meter.peak_bytes = meter.live_bytes
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step(record=True)
    run.peak_memory_bytes = (
        int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else int(meter.peak_bytes)
    )
    for stage, module in modules.items():
        for name, parameter in module.named_parameters():
            if parameter.grad is not None:
                run.gradients[f"{stage}/{name}"] = parameter.grad.detach().float().cpu()
    return run
