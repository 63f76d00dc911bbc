"""When no schedule fits: the least per-rank memory limit that admits one.

Claim: with ``static[r]`` the rank's static bytes and ``a(s)`` the activation of stage s, the least
per-rank peak over all schedules is

    need[r] = static[r] + max over microbatches j of Σ a(s) over the stages s of j's chain on rank r.

Lower bound (every schedule): take microbatch j and its last stage s* on rank r in forward order.
Every other stage s of j on r comes before s* in the chain, so F(s, j) ends before F(s*, j) starts and
the backward of s (I or B) waits, through the chain, for the backward of s*, which waits for F(s*, j).
When F(s*, j) starts, the rank therefore holds the full activation of every stage of j on r (I frees
only part of it, W the rest, both later), plus F(s*, j)'s own allocation, counted from its start.

Upper bound (a schedule that reaches it): run the microbatches one at a time through the whole
pipeline, every F of j, then every backward of j with each W right after its I
(:func:`pipesched.optimizer.solvers.heuristic.sequential_orders`). At any instant a rank holds only the current
microbatch's activations on it, at most ``need[r] − static[r]``.

So a problem is feasible exactly when ``limit[r] ≥ need[r]`` on every rank, and ``need`` is the
``min_memory_limit`` of an infeasible answer.
"""

from __future__ import annotations

from pipesched.optimizer.instance import Instance
from pipesched.optimizer.ir import ActionKind
from pipesched.optimizer.units import format_bytes

__all__ = ["infeasibility_reason", "min_memory_limit"]


def min_memory_limit(inst: Instance) -> list[float]:
    """Per rank, the least memory limit (bytes, static included) that admits any schedule.

    O(stages × distinct chains): one pass over each distinct chain.
    """
    need = list(inst.static)
    best = [0.0] * inst.num_ranks
    seen: set[tuple[int, ...]] = set()
    for j, chain in enumerate(inst.chains):
        key = tuple(chain)
        if key in seen:
            continue
        seen.add(key)
        total = [0.0] * inst.num_ranks
        for s in chain:
            total[inst.stage_ranks[s]] += inst.mem_delta[inst.action_id(s, ActionKind.FORWARD, j)]
        best = [max(b, t) for b, t in zip(best, total, strict=True)]
    for rank in range(inst.num_ranks):
        need[rank] += best[rank]
    return need


def infeasibility_reason(inst: Instance) -> str | None:
    """A sentence naming the first rank whose limit is below :func:`min_memory_limit`, else ``None``.

    E.g. ``"rank 0 needs at least 1.192 MiB (static 1 MiB + one microbatch's activations on the
    rank, 201216 bytes); its limit is 1 MiB: raise memory.limit"``.
    """
    need = min_memory_limit(inst)
    for rank, (required, limit) in enumerate(zip(need, inst.limit, strict=True)):
        if required > limit * (1 + 1e-12) + 1e-9:
            static = inst.static[rank]
            return (
                f"rank {rank} needs at least {format_bytes(required)} (static {format_bytes(static)} + one "
                f"microbatch's activations on the rank, {required - static:.0f} bytes); its limit is "
                f"{format_bytes(limit)}: raise memory.limit to at least {required:.0f} bytes on rank {rank}"
            )
    return None
