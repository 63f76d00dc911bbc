"""A rank's stages over its data-parallel group: UNSHARD, RESHARD, REDUCE_GRAD, and mirrored stages' gradients.

``sharding: full`` wraps each stage module with FSDP2 ``fully_shard(module, mesh=mesh["dp"], reshard_after_forward=…)``
(PyTorch's ``_PipelineScheduleRuntime`` lowers UNSHARD/RESHARD/REDUCE_GRAD for it; the own executor runs them
through :func:`pipesched.runtime.torch_compat.fsdp_reduce_grad`). ``sharding: none`` keeps plain modules and
reduces gradients itself: one ``all_reduce`` (sum, then ÷ D) per stage over the dp group after its last backward
(the schedule's REDUCE_GRAD where it has one, else after the step) — DDP's hooks break with split backward
(pytorch#144530).

Bidirectional placements (BitPipe) hold a model stage twice, on two ranks (mirrored replicas): their gradients are
summed, as the all-reduce between mirrored ranks does, so both copies take the same steps (:class:`MirrorGradients`).
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist
from torch import nn

from pipesched.optimizer.ir import Action, ActionKind
from pipesched.runtime import torch_compat
from pipesched.runtime.records import MeasuredAction

__all__ = ["DataParallelStages", "MirrorGradients", "local_tensor"]


def local_tensor(tensor: Any) -> Any:
    """A DTensor's local shard, a plain tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class DataParallelStages:
    """The data-parallel communication of one rank's stages (the executor's :class:`StageCommunication`).

    ``size``: D. ``sharded``: the modules are FSDP2 modules (sharding full, D > 1). ``reduced``: the stages whose
    REDUCE_GRAD ran this step (reset by :meth:`start_step`).
    """

    def __init__(self, modules: dict[int, nn.Module], *, group: Any, size: int, sharded: bool) -> None:
        self.modules = modules
        self.group = group
        self.size = size
        self.sharded = sharded
        self.reduced: set[int] = set()

    def start_step(self, *, deferred: bool) -> None:
        """Before a step. ``deferred`` (the own engine with FSDP2): accumulate unsharded gradients over the
        microbatches and reduce once, at REDUCE_GRAD (:func:`torch_compat.fsdp_defer_reduction`)."""
        self.reduced.clear()
        if self.sharded and deferred:
            for module in self.modules.values():
                torch_compat.fsdp_defer_reduction(module)

    def run(self, action: Action) -> None:
        """UNSHARD (all-gather the stage's weights), RESHARD (free them) or REDUCE_GRAD of ``action.stage``."""
        fsdp = torch_compat.fsdp_modules(self.modules[action.stage])[:1]
        if action.kind == ActionKind.REDUCE_GRAD:
            self.reduce_grad(action.stage)
        elif action.kind == ActionKind.UNSHARD:
            for module in fsdp:
                module.unshard()
        elif action.kind == ActionKind.RESHARD:
            for module in fsdp:
                module.reshard()

    def reduce_grad(self, stage: int) -> None:
        """REDUCE_GRAD of one stage over the dp group: FSDP2's reduce-scatter, or an all-reduce ÷ D."""
        module = self.modules[stage]
        if self.sharded:
            torch_compat.fsdp_reduce_grad(module)
        elif self.size > 1:
            for parameter in module.parameters():
                if parameter.grad is not None:
                    dist.all_reduce(parameter.grad, group=self.group)
                    parameter.grad.div_(self.size)
        self.reduced.add(stage)

    def reduce_remaining(self, origin: float) -> list[MeasuredAction]:
        """Reduce the stages no REDUCE_GRAD of the schedule reduced (after the step), timed as REDUCE_GRAD."""
        records = []
        if self.size == 1:
            return records
        for stage in sorted(self.modules):
            if stage in self.reduced:
                continue
            started = time.perf_counter()
            self.reduce_grad(stage)
            records.append(MeasuredAction.timed(f"{stage}REDUCE_GRAD", origin, started, time.perf_counter()))
        return records


class MirrorGradients:
    """Model stages held by two stage ids (bidirectional placement): per model stage, the ids on this rank and
    the process group of the ranks holding it in this replica (``None`` when both ids are on this rank).

    Every process must build it (``dist.new_group`` is collective).
    """

    def __init__(self, stage_ranks: list[int], model_stage: list[int], *, size: int, pp_rank: int, dp_rank: int):
        self.mirrors: dict[int, tuple[list[int], Any]] = {}
        for stage in range(max(model_stage) + 1):
            ids = [s for s, ms in enumerate(model_stage) if ms == stage]
            if len(ids) < 2:
                continue
            holders = sorted({stage_ranks[s] for s in ids})
            for replica in range(size):
                group = dist.new_group([r * size + replica for r in holders]) if len(holders) > 1 else None
                if replica == dp_rank and pp_rank in holders:
                    self.mirrors[stage] = (ids, group)

    def sync(self, modules: dict[int, nn.Module]) -> None:
        """Sum the gradients of every mirrored model stage over its holders and give each copy the sum."""
        for ids, group in self.mirrors.values():
            local = [modules[s] for s in ids if s in modules]
            for copies in zip(*(list(module.parameters()) for module in local), strict=True):
                total = sum(local_tensor(p.grad) for p in copies if p.grad is not None)
                if group is not None:
                    dist.all_reduce(total, group=group)
                for parameter in copies:
                    local_tensor(parameter.grad).copy_(total)
