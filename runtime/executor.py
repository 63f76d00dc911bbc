"""Execute one rank's part of a schedule with ``torch.distributed`` and record what happened.

PyTorch's ``_PipelineScheduleRuntime`` (driven by :mod:`pipesched.runtime.torch_compat` from the compute-only
CSV) runs every loop and V schedule, and is the default engine there (``engine="auto"`` in
:mod:`pipesched.runtime.launch`). This own executor is for what that runtime cannot follow:

* ``"bidirectional"`` placement (two model replicas whose stage ids ``S … 2S−1`` map back onto model
  stages ``0 … S−1``) and explicit placement lists: it reads the microbatch chains from
  :func:`pipesched.optimizer.instance.compile_for_orders`, where ``_PipelineScheduleRuntime`` knows one chain
  ``0 … S−1`` placed loop- or V-wise;
* runs that need the wait before each action apart from its compute (``wait_ms``), and a
  second, independent execution of the same order to compare with PyTorch's (``engine="pipesched"``).

A rank's order is read with the optimizer's IR (:meth:`pipesched.optimizer.result.Schedule.orders`): passes
(F, I, W, B) run here; the data-parallel communication actions (UNSHARD, RESHARD, REDUCE_GRAD) are issued on the
rank's communication stream (:class:`pipesched.runtime.streams.CommunicationStream`) where the row places them,
and waited for only where a dependency requires it: a stage's passes wait for its UNSHARD, the optimizer step
(the training loop's OPTIMIZER_STEP, :mod:`pipesched.runtime.training`) for every REDUCE_GRAD.

The backward split uses PyTorch's own ``stage_backward_input`` / ``stage_backward_weight`` (through
:mod:`pipesched.runtime.torch_compat`), so I and W do what they do in ``torch.distributed.pipelining``. On a
stage whose input needs no gradient (the first model stage) I has nothing to compute and W runs the
whole backward, as PyTorch does (``docs/RUNTIME.md``, "PyTorch facts").

Point-to-point messages use ``isend``/``irecv`` with one tag per (stage, pass, microbatch), so
transfers between the same two ranks cannot be mismatched (gloo matches by tag). A pass's receive is posted
before the pass before it runs (once the stage's message shape is known: from its first microbatch on), so that
the message moves as soon as its sender sends it, as the simulator's transfer does: gloo moves a message only
once both sides have posted it, and a receive posted only when the pass is reached cost the receiver a round
trip through its busy peer every time (12–13 ms median per receive, breadth-first pp 2 × dp 2 on 2 cores, against
7 ms posted ahead). Every receive waits
at most ``p2p_timeout_s``; a message that never arrives raises :class:`PipelineRuntimeError` naming the
action, the peer and the wait instead of hanging. NCCL ignores tags and matches in issue order; the
executor issues sends in the order the schedule produces them, which suffices for the orders the
simulator accepts with one stream per rank pair, but mixed streams between two ranks under NCCL are
not exercised here.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from pipesched.optimizer.instance import compile_for_orders
from pipesched.optimizer.ir import Action, ActionKind
from pipesched.optimizer.result import Schedule
from pipesched.runtime import torch_compat
from pipesched.runtime.records import MeasuredAction, StepRecord, run_delay_ms
from pipesched.runtime.streams import PendingCommunication

__all__ = [
    "PipelineExecutor",
    "PipelineRuntimeError",
    "RankProgram",
    "SavedActivationMeter",
    "StageCommunication",
    "StepInputs",
    "WeightVersions",
    "synchronize",
]

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


def _is_parameter(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a parameter or a view of one (a linear layer saves its weight transposed)."""
    return isinstance(tensor._base if tensor._is_view() else tensor, nn.Parameter)


class SavedActivationMeter:
    """Live bytes of tensors autograd saved for backward (activation memory), and their peak.

    Installed as ``torch.autograd.graph.saved_tensors_hooks``: every saved tensor is counted once per
    storage (views of one storage count once) until the last saved reference to it is released (the
    graph freed by a backward without ``retain_graph``). Parameters are not counted, in any form: those of
    ``exclude`` (static memory) and every other ``nn.Parameter`` a saved tensor is or views — FSDP2's gathered
    weights above all: its unsharded parameters are new tensors at every UNSHARD, in storage the all-gather
    allocates, and a linear layer saves its weight (a view of it) for the backward. Counted as activations they
    added each stage's weight matrices from its first F until its last W of the step (the demo's dualpipe-v, pp 2 ×
    dp 2 FSDP: about 0.4 MB per stage, two stages a rank, in a 2.1–2.2 MB peak); the gathered weights are the
    UNSHARD's memory, not the microbatches'.
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
        if pointer in self.exclude or size == 0 or _is_parameter(tensor):
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

    def restart_peak(self) -> None:
        """Forget the peak so far (after untimed warm-up steps): the peak restarts from what is live now."""
        self.peak_bytes = self.live_bytes


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on CPU, where every op has ended when it returns."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class RankProgram:
    """What one rank runs: its order (the optimizer's IR) and, per (stage id, microbatch), the stage before and
    after it on the microbatch's chain (``None`` at a chain's ends)."""

    rank: int
    order: list[Action]
    stage_ranks: list[int]
    model_stage: list[int]
    num_microbatches: int
    previous: dict[tuple[int, int], int | None]
    following: dict[tuple[int, int], int | None]
    microbatches_per_step: int = 0

    @property
    def per_step(self) -> int:
        """Microbatches per step (the loss's divisor): all of them, or m when the order runs several steps."""
        return self.microbatches_per_step or self.num_microbatches

    @classmethod
    def compile(cls, schedule: Schedule, rank: int, microbatches_per_step: int = 0) -> RankProgram:
        """The program of ``rank`` in ``schedule`` (chains from :func:`compile_for_orders`); ``microbatches_per_step``
        when the schedule holds several steps' microbatches (global ids, step ``g // m``)."""
        orders = schedule.orders()
        inst = compile_for_orders(schedule.problem, orders)
        previous: dict[tuple[int, int], int | None] = {}
        following: dict[tuple[int, int], int | None] = {}
        for j, chain in enumerate(inst.chains):
            for k, stage in enumerate(chain):
                previous[stage, j] = chain[k - 1] if k > 0 else None
                following[stage, j] = chain[k + 1] if k + 1 < len(chain) else None
        return cls(
            rank,
            orders[rank],
            inst.stage_ranks,
            inst.model_stage,
            inst.num_microbatches,
            previous,
            following,
            microbatches_per_step,
        )

    @property
    def stages(self) -> list[int]:
        """The stage ids this rank holds."""
        return sorted(s for s, owner in enumerate(self.stage_ranks) if owner == self.rank)

    @property
    def last_backward(self) -> dict[int, int]:
        """Stage id → position in the order of its last W or B (where its gradients are complete)."""
        return {stage: position for (stage, _), position in self.last_backward_of_steps.items()}

    @property
    def last_backward_of_steps(self) -> dict[tuple[int, int], int]:
        """(stage id, step) → position of the stage's last W or B of that step (one step: step 0)."""
        last: dict[tuple[int, int], int] = {}
        for position, action in enumerate(self.order):
            if action.kind in (ActionKind.BACKWARD_WEIGHT, ActionKind.BACKWARD):
                last[action.stage, action.microbatch // self.per_step] = position
        return last

    def remote(self, stage: int | None) -> bool:
        """Whether ``stage`` (a neighbour on a chain) sits on another rank."""
        return stage is not None and self.stage_ranks[stage] != self.rank


@dataclass(frozen=True)
class StepInputs:
    """One step's data: ``microbatch(j)`` → ``(input, target)`` of local microbatch j; ``loss_fn(output, target)``."""

    microbatch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class WeightVersions(Protocol):
    """Several weight versions per stage (PipeDream-2BW, :mod:`pipesched.runtime.pipedream`): which module a
    microbatch computes with, and what happens around each pass (``last_of_step``: the stage's gradient of the
    pass's step is complete)."""

    def module(self, stage: int, microbatch: int) -> nn.Module: ...

    def before(self, action: Action) -> None: ...

    def after(self, action: Action, last_of_step: bool) -> None: ...


class StageCommunication(Protocol):
    """A rank's data-parallel communication: issues an UNSHARD, RESHARD or REDUCE_GRAD on the rank's communication
    stream (:class:`~pipesched.runtime.streams.CommunicationStream`), and hears when a stage's gradients are
    complete (``stage_done``: it may issue more). Both are called from the compute stream, in the row's order;
    ``before_pass`` before each pass of a stage (it may wait for the communication stream: see
    :meth:`pipesched.runtime.data_parallel.DataParallelStages.before_pass`)."""

    def issue(self, action: Action) -> PendingCommunication: ...

    def stage_done(self, stage: int) -> None: ...

    def before_pass(self, stage: int, timeout_s: float | None) -> None: ...


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


def _shape(meta: torch.Tensor) -> list[int]:
    """The tensor shape a message's header carries (``meta``: dtype code, rank, then the sizes)."""
    return [int(x) for x in meta[2 : 2 + int(meta[1])]]


class PointToPoint:
    """Tagged point-to-point transfers with a bounded wait (shape travels in a small header).

    ``to_global`` maps a pipeline rank to the process of this replica's peer (p2p on a pp × dp mesh).
    """

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
        self.layouts: dict[tuple[int, bool], tuple[list[int], torch.dtype]] = {}
        self.posted: dict[tuple[int, int, bool], tuple[Any, torch.Tensor, Any, torch.Tensor]] = {}

    def send(self, tensor: torch.Tensor, peer: int, stage: int, microbatch: int, backward: bool) -> None:
        tensor = tensor.detach().contiguous()
        # Sends that have completed let their buffers go: a steady run of K steps is one step to drain.
        self.pending = [(work, sent) for work, sent in self.pending if work is not None and not work.is_completed()]
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

    def post(self, peer: int, stage: int, microbatch: int, backward: bool) -> bool:
        """Post the receive of ``stage``'s message for ``microbatch`` (its header and tensor) ahead of the pass that
        needs it, so that it flows as soon as ``peer`` sends it, as the simulator's transfer does (an arrival
        ``costs.p2p`` after the sender's pass, whatever the receiver is doing); gloo moves a message only once
        both sides have posted it. Possible once a message of the same stage and direction was received (its
        shape and dtype: every microbatch's are alike); returns whether the receive is posted."""
        key = (stage, microbatch, backward)
        layout = self.layouts.get((stage, backward))
        if key in self.posted or layout is None:
            return layout is not None
        source = self.to_global(peer)
        meta = torch.zeros(_META_LEN, dtype=torch.int64, device=self.device)
        tensor = torch.empty(layout[0], dtype=layout[1], device=self.device)
        self.posted[key] = (
            dist.irecv(meta, src=source, tag=_tag(stage, microbatch, backward, self.m, True)),
            meta,
            dist.irecv(tensor, src=source, tag=_tag(stage, microbatch, backward, self.m, False)),
            tensor,
        )
        return True

    def recv(self, peer: int, stage: int, microbatch: int, backward: bool, what: str) -> torch.Tensor:
        """The message (posted ahead by :meth:`post`, else received now: header, then tensor).

        Raises:
            PipelineRuntimeError: ``p2p_timeout`` (see the class), or ``model`` when a message posted ahead
                arrives with another shape than the stage's earlier ones.
        """
        posted = self.posted.pop((stage, microbatch, backward), None)
        if posted is not None:
            meta_work, meta, tensor_work, tensor = posted
            self._wait(meta_work, what, peer)
            if _shape(meta) != list(tensor.shape):
                raise PipelineRuntimeError(
                    "model", f"rank {self.rank}: {what} changed shape between microbatches (posted {tensor.shape})"
                )
            self._wait(tensor_work, what, peer)
            return tensor
        source = self.to_global(peer)
        meta = torch.zeros(_META_LEN, dtype=torch.int64, device=self.device)
        self._wait(dist.irecv(meta, src=source, tag=_tag(stage, microbatch, backward, self.m, True)), what, peer)
        shape = _shape(meta)
        tensor = torch.empty(shape, dtype=_DTYPES[int(meta[0])], device=self.device)
        self._wait(dist.irecv(tensor, src=source, tag=_tag(stage, microbatch, backward, self.m, False)), what, peer)
        self.layouts[stage, backward] = (shape, tensor.dtype)
        return tensor

    def drain(self) -> None:
        """Wait for every send of the step to complete."""
        for work, _ in self.pending:
            self._wait(work, "the completion of a send", -1)
        self.pending.clear()


class PipelineExecutor:
    """The own engine: one rank's passes in the schedule's order, activations and gradients exchanged by p2p.

    ``modules``: stage id → module on ``device`` (gradients accumulate: zero them between steps).
    ``communication`` issues the rank's UNSHARD/RESHARD/REDUCE_GRAD on its communication stream where the order
    places them (without it, they are skipped with a note); what is still in flight when the step's passes end is
    the caller's to wait for (the stream's ``wait_all``). The loss per microbatch is
    ``loss_fn(...) / num_microbatches``, so the gradients are those of the mean loss.
    """

    def __init__(
        self,
        program: RankProgram,
        modules: dict[int, nn.Module],
        *,
        device: torch.device,
        p2p: PointToPoint,
        meter: SavedActivationMeter,
        communication: StageCommunication | None = None,
        timeout_s: float | None = None,
        versions: WeightVersions | None = None,
    ) -> None:
        self.program = program
        self.modules = modules
        self.device = device
        self.p2p = p2p
        self.meter = meter
        self.communication = communication
        self.timeout_s = timeout_s
        self.notes: list[str] = []
        self.versions = versions
        self._last_backward = {position: stage for stage, position in program.last_backward.items()}
        self._last_of_step = set(program.last_backward_of_steps.values())
        self._gathers: dict[int, list[PendingCommunication]] = {}
        self._receives = self._remote_inputs()
        self._next_receive: dict[int, int] = {}
        for position in range(len(program.order) - 1, 0, -1):
            following = position if position in self._receives else self._next_receive.get(position)
            if following is not None:
                self._next_receive[position - 1] = following
        self._state: dict[tuple[int, int], _Microbatch] = {}
        self._record = StepRecord()
        self._origin = 0.0
        self._passes: dict[ActionKind, Callable[[int, int, StepInputs], float]] = {
            ActionKind.FORWARD: self._forward,
            ActionKind.BACKWARD_INPUT: self._backward_input,
            ActionKind.BACKWARD: self._backward,
            ActionKind.BACKWARD_WEIGHT: self._backward_weight,
        }

    def run_step(self, inputs: StepInputs, origin: float) -> StepRecord:
        """Run the rank's order once; times in the record are ms from ``origin`` (``time.perf_counter`` s).

        Raises:
            PipelineRuntimeError: a receive that does not complete within the p2p timeout (``p2p_timeout``), or
                an order this rank cannot run (``schedule``: W before I, an action of a stage it does not hold).
        """
        self._state.clear()
        self._record = StepRecord()
        self._origin = origin
        for position, action in enumerate(self.program.order):
            if not action.is_compute:
                self._communicate(action)
                continue
            self._compute(action, inputs, position)
            if self.versions is not None:
                self.versions.after(action, position in self._last_of_step)
            if position in self._last_backward and self.communication is not None:
                self.communication.stage_done(action.stage)
        self.p2p.drain()
        return self._record

    def _remote_inputs(self) -> dict[int, tuple[int, int, int, bool]]:
        """Position in the order → (peer rank, sending stage, microbatch, backward) of the message its pass receives
        (an F's activation, an I's or B's output gradient, from another rank)."""
        program, found = self.program, {}
        for position, action in enumerate(program.order):
            stage, kind, j = action
            if kind == ActionKind.FORWARD:
                neighbour, backward = program.previous.get((stage, j)), False
            elif kind in (ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD):
                neighbour, backward = program.following.get((stage, j)), True
            else:
                continue
            if neighbour is not None and program.remote(neighbour):
                found[position] = (program.stage_ranks[neighbour], neighbour, j, backward)
        return found

    def _post_receives(self, position: int) -> None:
        """Before the pass at ``position``: its own receive, then the next pass's that receives one, posted ahead
        (:meth:`PointToPoint.post`), in the row's order (NCCL matches a pair's messages in issue order)."""
        current = self._receives.get(position)
        if current is not None and not self.p2p.post(*current):
            return
        following = self._next_receive.get(position)
        if following is not None:
            self.p2p.post(*self._receives[following])

    def _module(self, stage: int, microbatch: int) -> nn.Module:
        """The module (weight version) ``microbatch`` computes ``stage`` with."""
        return self.modules[stage] if self.versions is None else self.versions.module(stage, microbatch)

    def _fail(self, action: Action, message: str) -> PipelineRuntimeError:
        return PipelineRuntimeError("schedule", f"rank {self.program.rank}, action {action}: {message}")

    def _compute(self, action: Action, inputs: StepInputs, position: int) -> None:
        stage, kind, j = action
        if stage not in self.modules:
            raise self._fail(action, f"stage {stage} is held by rank {self.program.stage_ranks[stage]}, not this rank")
        waited = time.perf_counter()
        self._post_receives(position)
        for gather in self._gathers.pop(stage, []):  # the stage's weights must be gathered
            gather.wait(self.timeout_s)
        if self.communication is not None:
            self.communication.before_pass(stage, self.timeout_s)
        if self.versions is not None:
            self.versions.before(action)
        delayed = run_delay_ms()
        started = self._passes[kind](stage, j, inputs)
        synchronize(self.device)
        ended = time.perf_counter()
        delay = run_delay_ms()
        memory = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else self.meter.live_bytes
        microbatch = self._state[stage, j]
        if microbatch.backward_done and microbatch.output is None:
            # Keep the input gradient for a same-rank upstream stage; drop everything else.
            self._state[stage, j] = _Microbatch(input_grad=microbatch.input_grad, backward_done=True)
        self._record.actions.append(
            MeasuredAction.timed(
                str(action),
                self._origin,
                started,
                ended,
                wait_ms=round((started - waited) * 1e3, 6),
                memory_bytes=int(memory),
                run_delay_ms=None if delay is None or delayed is None else round(delay - delayed, 6),
            )
        )

    def _communicate(self, action: Action) -> None:
        """Issue the action on the communication stream (a stage's UNSHARD is waited for by its next pass)."""
        if self.communication is None or action.kind == ActionKind.OPTIMIZER_STEP:
            note = f"{action}: skipped by the executor (run by the training loop)"
            if note not in self.notes:
                self.notes.append(note)
            return
        pending = self.communication.issue(action)
        if action.kind == ActionKind.UNSHARD:
            self._gathers.setdefault(action.stage, []).append(pending)

    # --- the passes: each returns the instant its compute started (after its input arrived) ---------------

    def _forward(self, stage: int, j: int, inputs: StepInputs) -> float:
        x = self._forward_input(stage, j, inputs)
        started = time.perf_counter()
        last = self.program.following[stage, j] is None
        with self.meter.hooks():
            out = self._module(stage, j)(x)
            if last:
                _, target = inputs.microbatch(j)
                loss = inputs.loss_fn(out, target.to(self.device))
                self._record.losses[j] = float(loss.detach())
                out = loss / self.program.per_step
        microbatch = self._state.setdefault((stage, j), _Microbatch())
        microbatch.input, microbatch.output = x, out
        after = self.program.following[stage, j]
        if after is not None and self.program.remote(after):
            self.p2p.send(out, self.program.stage_ranks[after], stage, j, False)
        return started

    def _forward_input(self, stage: int, j: int, inputs: StepInputs) -> torch.Tensor:
        before = self.program.previous[stage, j]
        if before is None:
            return inputs.microbatch(j)[0].to(self.device)
        if not self.program.remote(before):
            produced = self._state.get((before, j))
            if produced is None or produced.output is None:
                raise self._fail(Action(stage, ActionKind.FORWARD, j), f"runs before {before}F{j} on the same rank")
            return produced.output.detach().requires_grad_(produced.output.is_floating_point())
        x = self.p2p.recv(self.program.stage_ranks[before], before, j, False, f"the activation of {before}F{j}")
        return x.requires_grad_(x.is_floating_point())

    def _output_grad(self, action: Action) -> torch.Tensor | None:
        """The gradient flowing into the stage's output: from the downstream stage (same rank or p2p)."""
        stage, _, j = action
        after = self.program.following[stage, j]
        if after is None:
            return None
        if self.program.remote(after):
            return self.p2p.recv(self.program.stage_ranks[after], after, j, True, f"the gradient from stage {after}")
        downstream = self._state.get((after, j))
        if downstream is None or downstream.input_grad is None:
            raise self._fail(action, f"runs before the backward of {after} for microbatch {j} on this rank")
        return downstream.input_grad

    def _backward_input(self, stage: int, j: int, inputs: StepInputs, fused: bool = False) -> float:
        action = Action(stage, ActionKind.BACKWARD if fused else ActionKind.BACKWARD_INPUT, j)
        microbatch = self._state.setdefault((stage, j), _Microbatch())
        if microbatch.output is None:
            raise self._fail(action, f"runs before {stage}F{j}")
        if microbatch.backward_done:
            raise self._fail(action, "the backward of this microbatch ran already")
        grad = self._output_grad(action)
        started = time.perf_counter()
        microbatch.output_grad = grad
        needs_input_grad = isinstance(microbatch.input, torch.Tensor) and microbatch.input.requires_grad
        with self.meter.hooks():
            if fused:
                torch.autograd.backward([microbatch.output], None if grad is None else [grad])
            elif needs_input_grad:
                assert microbatch.input is not None
                microbatch.param_groups = torch_compat.backward_input(
                    microbatch.output, grad, microbatch.input, self._module(stage, j)
                )
            else:
                microbatch.param_groups = "full"  # nothing to compute for I here: W runs the whole backward
        if needs_input_grad:
            self._send_input_grad(stage, j, microbatch)
        if fused:
            microbatch.backward_done = True
            microbatch.param_groups = microbatch.output = microbatch.input = None
        return started

    def _send_input_grad(self, stage: int, j: int, microbatch: _Microbatch) -> None:
        assert microbatch.input is not None
        microbatch.input_grad = microbatch.input.grad
        if microbatch.input_grad is None:
            microbatch.input_grad = torch.zeros_like(microbatch.input)
        before = self.program.previous[stage, j]
        if before is not None and self.program.remote(before):
            self.p2p.send(microbatch.input_grad, self.program.stage_ranks[before], stage, j, True)

    def _backward(self, stage: int, j: int, inputs: StepInputs) -> float:
        return self._backward_input(stage, j, inputs, fused=True)

    def _backward_weight(self, stage: int, j: int, inputs: StepInputs) -> float:
        microbatch = self._state.setdefault((stage, j), _Microbatch())
        if microbatch.param_groups is None:
            raise self._fail(Action(stage, ActionKind.BACKWARD_WEIGHT, j), f"runs before {stage}I{j}")
        started = time.perf_counter()
        with self.meter.hooks():
            if isinstance(microbatch.param_groups, str):
                assert microbatch.output is not None
                grad = microbatch.output_grad
                torch.autograd.backward([microbatch.output], None if grad is None else [grad])
            else:
                torch_compat.backward_weight(microbatch.param_groups, self._module(stage, j))
        microbatch.param_groups = microbatch.output = microbatch.input = microbatch.output_grad = None
        microbatch.backward_done = True
        return started
