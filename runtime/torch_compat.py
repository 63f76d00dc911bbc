"""The one module touching private ``torch.distributed.pipelining`` APIs (``docs/RUNTIME.md``, "PyTorch facts").

Supported torch: 2.13.x (the ``runtime`` extra pins ``torch==2.13.0``). Private names used here:
``torch.distributed.pipelining._backward.stage_backward_input`` / ``stage_backward_weight`` (the
split backward, I and W) and ``torch.distributed.pipelining.schedules._PipelineScheduleRuntime``
(``_load_csv(path, "compute_only")`` / ``_prepare_schedule_with_comms``) to run a compute-only
schedule with PyTorch's own runtime. :func:`check_torch_version` says when the installed torch is
outside the tested range; the launcher and the profiler warn with it.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipesched.runtime.records import MeasuredAction

__all__ = [
    "SUPPORTED_TORCH",
    "TorchPipeline",
    "TorchRuntimeRun",
    "backward_input",
    "backward_weight",
    "check_torch_version",
    "fsdp_defer_reduction",
    "fsdp_modules",
    "fsdp_reduce_grad",
    "warn_if_unsupported_torch",
]

#: torch versions (major.minor) whose private pipelining APIs this module was written against.
SUPPORTED_TORCH = ("2.13",)


def check_torch_version(version: str | None = None) -> str | None:
    """``None`` when ``version`` (default: the installed ``torch.__version__``, e.g. ``"2.13.0+cpu"``) is in
    :data:`SUPPORTED_TORCH`, else a sentence saying so, for a warning. Raises nothing.

    :func:`pipesched.runtime.launch.run_schedules` and :func:`pipesched.runtime.profile.profile_model` warn with it
    (``RuntimeWarning``) and go on: the private APIs may still work, and every run is verified anyway.
    """
    version = str(torch.__version__ if version is None else version).split("+")[0]
    if ".".join(version.split(".")[:2]) in SUPPORTED_TORCH:
        return None
    return (
        f"torch {version} is untested with the pipesched runtime (tested: {', '.join(SUPPORTED_TORCH)}); "
        "install the runtime extra (torch==2.13.0)"
    )


def warn_if_unsupported_torch() -> None:
    """Warn (``RuntimeWarning``, pointing at the caller's caller) when the installed torch is untested."""
    unsupported = check_torch_version()
    if unsupported is not None:
        warnings.warn(unsupported, RuntimeWarning, stacklevel=3)


def backward_input(
    output: torch.Tensor, output_grad: torch.Tensor | None, stage_input: torch.Tensor, module: nn.Module
) -> Any:
    """I: the gradient of ``stage_input`` only (accumulated into ``stage_input.grad``).

    ``output``: the stage output (or the scaled loss on the last stage, then ``output_grad`` is None).
    Returns the parameter groups :func:`backward_weight` needs; the autograd graph is retained until then.
    """
    from torch.distributed.pipelining._backward import stage_backward_input

    _, param_groups = stage_backward_input(
        [output], None if output_grad is None else [output_grad], [stage_input], module.parameters()
    )
    return param_groups


def backward_weight(param_groups: Any, module: nn.Module) -> None:
    """W: accumulate the parameter gradients of one microbatch from :func:`backward_input`'s groups."""
    from torch.distributed.pipelining._backward import stage_backward_weight

    stage_backward_weight(module.parameters(), param_groups, retain_graph=False)


class TorchRuntimeRun:
    """One rank's step under ``_PipelineScheduleRuntime``: the compute actions in executed order with their start
    and end (ms from the step's start), the losses of local last-stage microbatches, and ``communication``: the
    data-parallel actions torch lowered and ran (``"{stage}UNSHARD"`` from issue to completion,
    ``"{stage}REDUCE_GRAD"``), same fields."""

    def __init__(self) -> None:
        self.actions: list[MeasuredAction] = []
        self.communication: list[MeasuredAction] = []
        self.losses: list[float] = []


class _Clock:
    """Where the records of the current step go, and the step's time origin (``perf_counter`` s)."""

    def __init__(self) -> None:
        self.run = TorchRuntimeRun()
        self.origin = time.perf_counter()


def _record(
    clock: _Clock,
    stage_index: int,
    kind_of: Callable[..., str],
    method: Callable,
    memory_bytes: Callable[[], int] | None,
):
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        result = method(*args, **kwargs)
        ended = time.perf_counter()
        clock.run.actions.append(
            MeasuredAction.timed(
                f"{stage_index}{kind_of(*args, **kwargs)}{args[0]}",
                clock.origin,
                started,
                ended,
                memory_bytes=None if memory_bytes is None else int(memory_bytes()),
            )
        )
        return result

    return wrapped


def fsdp_modules(module: nn.Module) -> list[Any]:
    """The ``FSDPModule``s in ``module`` (itself included), outermost first; empty for a plain module."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def fsdp_defer_reduction(module: nn.Module) -> None:
    """Before a pipelined step of an FSDP2 stage: accumulate unsharded gradients over the microbatches and
    reduce once at REDUCE_GRAD, as ``PipelineStage.backward_maybe_with_nosync`` does (split backward
    runs I and W apart, so FSDP's own per-backward reduction would fire before W has computed anything)."""
    for fsdp in fsdp_modules(module)[:1]:
        fsdp.set_is_last_backward(False)
        fsdp.set_reshard_after_backward(False)
        fsdp.set_requires_gradient_sync(False)


def fsdp_reduce_grad(module: nn.Module) -> None:
    """REDUCE_GRAD of an FSDP2 stage: run FSDP's post-backward for every parameter group (reduce-scatter
    of the accumulated gradients over the data-parallel mesh, averaging) and its final callback, as
    ``PipelineStage.perform_reduce_grad`` does (torch 2.13), without its microbatch scaling."""
    from torch.distributed.fsdp import fully_shard

    roots = fsdp_modules(module)[:1]
    for fsdp in roots:
        fsdp.set_is_last_backward(True)
        fsdp.set_reshard_after_backward(True)
        fsdp.set_requires_gradient_sync(True)
        state = fully_shard.state(fsdp)  # type: ignore[attr-defined]
        for member in state._state_ctx.all_states:
            # torch 2.13 keeps a list of parameter groups per state; 2.11 one group or None
            groups = getattr(member, "_fsdp_param_groups", None)
            if groups is None:
                groups = [group] if (group := getattr(member, "_fsdp_param_group", None)) is not None else []
            for group in groups:
                group.post_backward()
        state._root_post_backward_final_callback()


def _without_own_rank(stage: Any) -> Callable[[], list[Any]]:
    """``stage._get_init_p2p_neighbors_ops`` less the operations whose peer is the stage's own rank.

    torch 2.11's ``_PipelineScheduleMulti._initialize_stages`` warms up each stage's p2p with its previous and next
    stage by a batch of ``isend``/``irecv``, also where that stage sits on the same rank (a V placement: pipeline
    rank 1 holds stages 1 and 2). NCCL sends to itself; gloo has no connection to itself and fails ("Pair is not
    connected ... <--> [none]"). Adjacent stages on one rank hand activations over in memory, never by p2p, so
    their warm-up has nothing to warm. torch 2.13 replaced the warm-up (``_warmup_p2p``) and needs none of this.
    """
    operations = stage._get_init_p2p_neighbors_ops

    def without_own_rank() -> list[Any]:
        return [op for op in operations() if getattr(op, "group_peer", None) != stage.group_rank]

    return without_own_rank


class TorchPipeline:
    """PyTorch's ``_PipelineScheduleRuntime`` built once for a rank and stepped many times.

    ``modules``: this rank's stage index → module (plain, or FSDP2 ``fully_shard``-ed: torch then lowers
    UNSHARD/RESHARD/REDUCE_GRAD itself). ``group``: the pipeline-parallel process group (``None``: the
    default group). Compute actions are recorded by wrapping each stage's ``forward_one_chunk``,
    ``backward_one_chunk`` and ``backward_weight_one_chunk``; REDUCE_GRAD by wrapping
    ``perform_reduce_grad``; an UNSHARD from the call of ``unshard`` to the return of its handle's wait.
    ``communication_rows`` (every rank's row, as action strings): run the schedule's own UNSHARD/RESHARD/REDUCE_GRAD
    where they stand (see :meth:`_follow_communication`).
    """

    def __init__(
        self,
        csv_path: Path,
        modules: dict[int, nn.Module],
        *,
        num_stages: int,
        num_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device,
        memory_bytes: Callable[[], int] | None = None,
        group: Any = None,
        communication_rows: list[list[str]] | None = None,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

        self.device = device
        self.modules = modules
        self.stages = [
            PipelineStage(module, stage_index=index, num_stages=num_stages, device=device, group=group)
            for index, module in sorted(modules.items())
        ]
        self.schedule = _PipelineScheduleRuntime(
            self.stages, n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=True
        )
        if not hasattr(self.schedule, "_warmup_p2p"):  # torch 2.11: every neighbour warmed up, itself included
            for stage in self.stages:
                stage._get_init_p2p_neighbors_ops = _without_own_rank(stage)  # type: ignore[method-assign]
        self.schedule._load_csv(str(csv_path), "compute_only")
        if communication_rows is not None:
            self._follow_communication(communication_rows, num_stages)
        self.clock = _Clock()
        clock = self.clock
        for stage in self.stages:
            index = stage.stage_index
            stage.forward_one_chunk = _record(  # type: ignore[method-assign]
                clock, index, lambda *a, **k: "F", stage.forward_one_chunk, memory_bytes
            )
            stage.backward_one_chunk = _record(  # type: ignore[method-assign]
                clock,
                index,
                lambda *a, **k: "B" if k.get("full_backward", True) else "I",
                stage.backward_one_chunk,
                memory_bytes,
            )
            stage.backward_weight_one_chunk = _record(  # type: ignore[method-assign]
                clock, index, lambda *a, **k: "W", stage.backward_weight_one_chunk, memory_bytes
            )
            stage.perform_reduce_grad = self._timed(  # type: ignore[method-assign]
                f"{index}REDUCE_GRAD", stage.perform_reduce_grad
            )
            for fsdp in fsdp_modules(stage.submod)[:1]:
                fsdp.unshard = self._timed_unshard(f"{index}UNSHARD", fsdp.unshard)

    def _follow_communication(self, rows: list[list[str]], num_stages: int) -> None:
        """Run the schedule's own UNSHARD/RESHARD/REDUCE_GRAD where its rows place them (FSDP2 prefetch and reshard
        as scheduled) instead of torch's lowering (``_add_unshard_reshard``, a window of 3 stages, and
        ``_add_reduce_grad``); torch still inserts the sends and receives (``_add_send_recv``). OPTIMIZER_STEP is the
        training loop's."""
        from torch.distributed.pipelining.schedules import _Action, _add_send_recv

        schedule = self.schedule
        actions = {
            rank: [_Action.from_str(text) for text in row if text != "OPTIMIZER_STEP"] for rank, row in enumerate(rows)
        }
        lowered = _add_send_recv(
            actions, stage_to_rank=lambda s: schedule.stage_index_to_group_rank[s], num_stages=num_stages
        )
        if getattr(schedule, "_defer_pp_recv", False):  # torch 2.13 (2.11 has neither the flag nor the pass)
            from torch.distributed.pipelining.schedules import _defer_recv_ops

            lowered = _defer_recv_ops(lowered, stage_to_rank=lambda s: schedule.stage_index_to_group_rank[s])
        schedule.pipeline_order_with_comms = lowered

    def _timed(self, name: str, method: Callable) -> Callable:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            result = method(*args, **kwargs)
            self.clock.run.communication.append(
                MeasuredAction.timed(name, self.clock.origin, started, time.perf_counter())
            )
            return result

        return wrapped

    def _timed_unshard(self, name: str, method: Callable) -> Callable:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            handle = method(*args, **kwargs)
            run, position = self.clock.run, len(self.clock.run.communication)
            run.communication.append(MeasuredAction.timed(name, self.clock.origin, started, time.perf_counter()))
            if handle is not None and hasattr(handle, "wait"):
                wait = handle.wait

                def timed_wait(*a: Any, **k: Any) -> Any:
                    out = wait(*a, **k)
                    run.communication[position] = MeasuredAction.timed(
                        name, self.clock.origin, started, time.perf_counter()
                    )
                    return out

                handle.wait = timed_wait
            return handle

        return wrapped

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, origin: float) -> TorchRuntimeRun:
        """One step over the whole (per-replica) batch, split by torch into the microbatches on dim 0; times in
        the records are ms from ``origin`` (``time.perf_counter`` s, the step's common start).

        Gradients accumulate into the modules' ``.grad`` (zero them between steps), scaled by
        ``1/num_microbatches``. Returns the records of this step. Raises ``RuntimeError`` from torch ("Malformed
        compute schedule", a failed stage).
        """
        self.clock.run = run = TorchRuntimeRun()
        self.clock.origin = origin
        has_first = any(stage.is_first for stage in self.stages)
        has_last = any(stage.is_last for stage in self.stages)
        losses: list[torch.Tensor] = []
        args = (inputs.to(self.device),) if has_first else ()
        if has_last:
            self.schedule.step(*args, target=targets.to(self.device), losses=losses)
        else:
            self.schedule.step(*args)
        run.losses = [float(loss.detach()) for loss in losses]
        return run
