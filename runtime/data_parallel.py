"""A rank's stages over its data-parallel group: UNSHARD, RESHARD, REDUCE_GRAD, and mirrored stages' gradients.

``sharding: full`` wraps each stage module with FSDP2 ``fully_shard(module, mesh=mesh["dp"], reshard_after_forward=…)``
(PyTorch's ``_PipelineScheduleRuntime`` lowers UNSHARD/RESHARD/REDUCE_GRAD for it; the own executor runs them on
the rank's communication stream through FSDP2's ``unshard``/``reshard`` and
:func:`pipesched.runtime.torch_compat.fsdp_reduce_grad`). ``sharding: none`` keeps plain modules and reduces
gradients itself: one ``all_reduce`` of the stage's gradients (flattened into one buffer, as DDP's buckets; sum,
then ÷ D) over the dp group — DDP's hooks break with split backward (pytorch#144530).

Every action runs on the rank's :class:`~pipesched.runtime.streams.CommunicationStream`, in the row's order: a
REDUCE_GRAD where the schedule places it (right after the stage's last backward), else after the step.

Bidirectional placements (BitPipe, Wu et al. 2024, §3.3) hold a model stage twice, on two ranks (mirrored
replicas): their gradients are summed (:class:`MirrorGradients`), eagerly — an asynchronous all-reduce between the
two holders issued as soon as the stage's gradients are complete on this rank (right after its REDUCE_GRAD when
the schedule has one, else right after its last backward), overlapping the rest of the step, as BitPipe's
schedule places it.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipesched.optimizer.ir import Action, ActionKind
from pipesched.runtime import torch_compat
from pipesched.runtime.streams import CommunicationStream, PendingCommunication

__all__ = ["WARM_ROUNDS", "DataParallelStages", "MirrorGradients", "local_tensor", "reduce_stage_gradients"]

#: Untimed all-gathers over the dp group before a run's first step (:meth:`DataParallelStages.warm_transport`): the
#: 8 MiB all-gather of two gloo processes settled after about 6.
WARM_ROUNDS = 8


def local_tensor(tensor: Any) -> Any:
    """A DTensor's local shard, a plain tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten_into(flat: torch.Tensor, targets: list[torch.Tensor], scale: float = 1.0) -> None:
    offset = 0
    for target in targets:
        count = target.numel()
        piece = flat[offset : offset + count].view_as(target)
        target.copy_(piece if scale == 1.0 else piece * scale)
        offset += count


def reduce_stage_gradients(module: nn.Module, group: Any, size: int, sharded: bool) -> None:
    """REDUCE_GRAD of one stage over its dp ``group`` of ``size`` ranks: FSDP2's reduce-scatter (``sharded``), or one
    all-reduce of the flattened gradients, ÷ ``size``."""
    if sharded:
        torch_compat.fsdp_reduce_grad(module)
    elif size > 1:
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        flat = _flat(grads)
        dist.all_reduce(flat, group=group)
        _unflatten_into(flat, grads, 1.0 / size)


class MirrorGradients:
    """Model stages held by two stage ids (bidirectional placement): per model stage, the ids on this rank and the
    process group of the ranks holding it in this replica (``None`` when every id is on this rank).

    Every process must build it (``dist.new_group`` is collective).
    """

    def __init__(self, stage_ranks: list[int], model_stage: list[int], *, size: int, pp_rank: int, dp_rank: int):
        self.model_stage = model_stage
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

    def mirrored(self, stage: int) -> bool:
        """Whether ``stage`` (an id) is one copy of a mirrored model stage."""
        return self.model_stage[stage] in self.mirrors

    def sum(self, model_stage: int, modules: dict[int, nn.Module]) -> torch.futures.Future | None:
        """Issue the sum of the model stage's gradients over its holders (asynchronous); every copy receives the
        sum when the returned future completes (``None``: summed here already, every copy on this rank)."""
        ids, group = self.mirrors[model_stage]
        local = [modules[s] for s in ids if s in modules]
        copies = [[local_tensor(p.grad) for p in module.parameters() if p.grad is not None] for module in local]
        total = _flat([sum(grads) for grads in zip(*copies, strict=True)])  # type: ignore[misc]

        def spread(_: Any = None) -> None:
            for grads in copies:
                _unflatten_into(total, grads)

        if group is None:
            spread()
            return None
        return dist.all_reduce(total, group=group, async_op=True).get_future().then(spread)


class DataParallelStages:
    """The data-parallel communication of one rank's stages (the executor's ``StageCommunication``).

    ``size``: D. ``sharded``: the modules are FSDP2 modules (sharding full, D > 1). ``reduced``: the stages whose
    REDUCE_GRAD was issued this step (reset by :meth:`start_step`). ``mirrors``: mirrored model stages, summed as
    soon as complete. ``scheduled``: the stages whose REDUCE_GRAD the rank's row holds (BitPipe's rows hold one per
    mirrored stage even without data parallelism: the replicas' sum is then issued there, not at the last backward).
    """

    def __init__(
        self,
        modules: dict[int, nn.Module],
        *,
        group: Any,
        size: int,
        sharded: bool,
        mirrors: MirrorGradients,
        stream: CommunicationStream,
        scheduled: frozenset[int] = frozenset(),
        reshard_after_forward: bool = False,
    ) -> None:
        self.modules = modules
        self.collectives_on_compute = sharded and reshard_after_forward
        self.scheduled = scheduled
        self.group = group
        self.size = size
        self.sharded = sharded
        self.mirrors = mirrors
        self.stream = stream
        self.reduced: set[int] = set()
        self._complete: dict[int, int] = {}

    def warm_transport(self, rounds: int = WARM_ROUNDS) -> list[float]:
        """All-gather a buffer of the largest stage's full weights ``rounds`` times over the dp group, untimed, before
        the first step; each round's ms (nothing where D = 1).

        A fresh connection carries its first few MB-sized messages slower than its later ones (TCP's receive buffer
        grows with the traffic it sees, ``net.ipv4.tcp_moderate_rcvbuf``; gloo's pairs are TCP connections opened
        with the group): on the project's 2-core machine an 8 MiB all-gather between two gloo processes took
        15–24 ms for its first 6 rounds and 8 ms after; in a pp 2 × dp 2 FSDP run pipeline rank 0's UNSHARD of its
        first stage took 59, 52, 39, 27, 22 ms over steps 1–5 (11–24 ms later), so the first steps' collectives, and
        the passes they overlap, were not yet the steady ones the profile's calibration run (its median of 15 steps)
        predicts (bench/results/issue25_bars.md, R22). The buffer is the size of the largest UNSHARD's output."""
        if self.size == 1:
            return []
        elements = max(sum(p.numel() for p in module.parameters()) for module in self.modules.values())
        device = next(p.device for module in self.modules.values() for p in module.parameters())
        shard = torch.zeros(-(-elements // self.size), device=device)
        gathered = [torch.empty_like(shard) for _ in range(self.size)]
        took = []
        for _ in range(rounds):
            started = time.perf_counter()
            dist.all_gather(gathered, shard, group=self.group)
            took.append(round((time.perf_counter() - started) * 1e3, 3))
        return took

    def start_step(self, *, deferred: bool) -> None:
        """Before a step. ``deferred`` (the own engine with FSDP2): accumulate unsharded gradients over the
        microbatches and reduce once, at REDUCE_GRAD (:func:`torch_compat.fsdp_defer_reduction`)."""
        self.reduced.clear()
        self._complete.clear()
        if self.sharded and deferred:
            for module in self.modules.values():
                torch_compat.fsdp_defer_reduction(module)

    def issue(self, action: Action) -> PendingCommunication:
        """Issue UNSHARD, RESHARD or REDUCE_GRAD of ``action.stage`` on the communication stream (from the compute
        stream, in the row's order); :meth:`run` does it there."""
        if action.kind == ActionKind.REDUCE_GRAD:
            self.reduced.add(action.stage)
        return self.stream.submit(str(action), lambda: self.run(action))

    def run(self, action: Action) -> Any:
        """UNSHARD (all-gather the stage's weights), RESHARD (free them) or REDUCE_GRAD of ``action.stage`` (on the
        communication stream)."""
        fsdp = torch_compat.fsdp_modules(self.modules[action.stage])[:1]
        if action.kind == ActionKind.REDUCE_GRAD:
            return self.reduce_grad(action.stage)
        for module in fsdp:
            if action.kind == ActionKind.UNSHARD:
                module.unshard()
            elif action.kind == ActionKind.RESHARD:
                module.reshard()
        return None

    def reduce_grad(self, stage: int) -> torch.futures.Future | None:
        """REDUCE_GRAD of one stage over the dp group (FSDP2's reduce-scatter, or one all-reduce ÷ D), then, for a
        mirrored stage, the eager sum over its replicas (its future)."""
        reduce_stage_gradients(self.modules[stage], self.group, self.size, self.sharded)
        return self._mirror(stage)

    def _mirror(self, stage: int) -> torch.futures.Future | None:
        """The eager sum of a mirrored stage once every copy on this rank is complete."""
        if not self.mirrors.mirrored(stage):
            return None
        model_stage = self.mirrors.model_stage[stage]
        self._complete[model_stage] = self._complete.get(model_stage, 0) + 1
        ids, _ = self.mirrors.mirrors[model_stage]
        if self._complete[model_stage] < sum(1 for s in ids if s in self.modules):
            return None
        return self.mirrors.sum(model_stage, self.modules)

    def before_pass(self, stage: int, timeout_s: float | None) -> None:
        """Before a pass of ``stage`` on the compute stream. FSDP2 modules that reshard after forward gather their
        weights again inside the pass (their pre-forward and pre-backward hooks) and reduce after its backward, on
        the compute stream's thread: wait until the communication stream has run every action issued so far, so
        that no two threads issue collectives on the data-parallel group at once (gloo and NCCL match a group's
        collectives in issue order; two threads' orders differ between replicas: a mismatched all-gather
        aborts the process). Without resharding after forward the pass runs no collective: no wait."""
        if self.collectives_on_compute:
            self.stream.wait_all(timeout_s)

    def stage_done(self, stage: int) -> None:
        """A stage's last backward ended. Without data parallelism (no REDUCE_GRAD in the row) a mirrored stage is
        summed over its replicas now; with it, or where the row places it, right after its REDUCE_GRAD
        (:meth:`reduce_grad`)."""
        if self.size == 1 and self.mirrors.mirrored(stage) and stage not in self.scheduled:
            self.reduced.add(stage)
            self.stream.submit(f"{stage}REDUCE_GRAD", lambda: self._mirror(stage))

    def reduce_remaining(self) -> None:
        """Issue REDUCE_GRAD for the stages no REDUCE_GRAD of the schedule reduced (after the step)."""
        for stage in sorted(self.modules):
            if stage in self.reduced or (self.size == 1 and not self.mirrors.mirrored(stage)):
                continue
            self.reduced.add(stage)
            self.stream.submit(f"{stage}REDUCE_GRAD", lambda stage=stage: self.reduce_grad(stage))
