"""A memory-capped list scheduler for multi-stage placements (V, bidirectional, explicit).

It builds per-rank orders by simulating time with the problem's own costs and dependencies
(:class:`~pipesched.optimizer.instance.Instance`): whenever a rank is free it runs, among the actions whose
inputs have arrived, a backward (I or B) first, then a forward, then a W; a W also fills any
idle moment. Passes of one kind on one stage run in microbatch order; the replicas of a bidirectional
placement take turns.

Memory: a microbatch's first forward on a rank *admits* it there and reserves the activation of
every stage it will pass on that rank; a rank admits a microbatch only while its committed bytes
(held plus reserved) stay within ``cap`` bytes (split evenly between the replicas of a
bidirectional placement, so neither can fill a rank the other needs), so the rank's activation
peak never exceeds ``cap`` (or one microbatch's reservation per replica, if that is larger).
Later forwards, backwards and W are never held back, so every admitted microbatch can finish: the
orders never deadlock.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from pipesched.optimizer.instance import Instance
from pipesched.optimizer.ir import ActionKind, Orders
from pipesched.optimizer.progress import SearchStopped, check_deadline

__all__ = ["SearchStopped", "capped_greedy_orders", "max_reservations", "microbatch_reservation"]


def microbatch_reservation(inst: Instance, rank: int, microbatch: int) -> float:
    """Bytes microbatch ``microbatch`` allocates on ``rank`` over its forwards (sum of F deltas)."""
    total = 0.0
    for stage in inst.chains[microbatch]:
        if inst.stage_ranks[stage] == rank:
            total += inst.mem_delta[inst.action_id(stage, ActionKind.FORWARD, microbatch)]
    return total


def max_reservations(inst: Instance) -> list[float]:
    """Per rank, the largest :func:`microbatch_reservation` over the microbatches (bytes), in one pass over
    each microbatch's chain: O(num_microbatches × chain length)."""
    best = [0.0] * inst.num_ranks
    for j, chain in enumerate(inst.chains):
        check_deadline()
        total = [0.0] * inst.num_ranks
        for stage in chain:
            total[inst.stage_ranks[stage]] += inst.mem_delta[inst.action_id(stage, ActionKind.FORWARD, j)]
        best = [max(a, b) for a, b in zip(best, total, strict=True)]
    return best


def capped_greedy_orders(
    inst: Instance, cap: list[float], *, reserve: bool = True, should_stop: Callable[[], bool] | None = None
) -> Orders:
    """Per-rank orders from a time-driven greedy under per-rank activation caps.

    Args:
        inst: the compiled problem (any placement).
        cap: per rank, the most activation bytes (static excluded) the rank may commit.
        should_stop: polled once per placed action; True abandons the construction.

    Returns:
        One order per rank, containing every action of the rank once.

    Raises:
        SearchStopped: ``should_stop`` returned True.
        RuntimeError: if no rank can progress (a bug: the admission rule rules it out).

    Cost: O(n · (1 + successors) · stages per rank) for n actions: a step re-evaluates only the rank that
    ran and the ranks its action feeds.
    """
    p = inst.num_ranks
    kinds = (ActionKind.FORWARD, inst.backward_kind)
    # Per rank and stage, the microbatches passing the stage in order, and the next position per kind.
    stage_mbs: dict[int, list[int]] = {}
    for j, chain in enumerate(inst.chains):
        for stage in chain:
            stage_mbs.setdefault(stage, []).append(j)
    rank_stages = [[s for s in sorted(stage_mbs) if inst.stage_ranks[s] == r] for r in range(p)]
    next_pos = {(s, kind): 0 for s in stage_mbs for kind in kinds}
    first_stage_on_rank: dict[tuple[int, int], int] = {}
    for j, chain in enumerate(inst.chains):
        for stage in chain:
            first_stage_on_rank.setdefault((inst.stage_ranks[stage], j), stage)
    # Microbatches of different replicas (bidirectional) interleave: priority by position in the replica.
    seen: dict[tuple[int, ...], int] = {}
    groups: dict[tuple[int, ...], int] = {}
    seq = []
    group = []
    for chain in inst.chains:
        chain_key = tuple(chain)
        seq.append(seen.get(chain_key, 0))
        seen[chain_key] = seq[-1] + 1
        group.append(groups.setdefault(chain_key, len(groups)))
    num_groups = len(groups)
    reservation = {(r, j): microbatch_reservation(inst, r, j) for (r, j) in first_stage_on_rank}

    end = [math.nan] * len(inst.actions)
    free = [0.0] * p
    # Committed bytes per rank and replica: each replica gets an equal share of the cap, so that no
    # replica can fill a rank with microbatches that wait on a rank the other replica has filled.
    committed = [[0.0] * num_groups for _ in range(p)]
    held = [0.0] * p
    pending_weights: list[list[int]] = [[] for _ in range(p)]
    remaining = [len(ids) for ids in inst.rank_actions]
    orders: Orders = [[] for _ in range(p)]

    def ready_time(idx: int) -> float:
        ready = 0.0
        for pred, latency in inst.preds[idx]:
            t = end[pred]
            if t != t:
                return math.inf
            ready = max(ready, t + latency)
        return ready

    def candidates(rank: int) -> list[tuple[float, tuple[int, int, int], int]]:
        found = []
        for stage in rank_stages[rank]:
            mbs = stage_mbs[stage]
            for kind in kinds:
                pos = next_pos[(stage, kind)]
                if pos >= len(mbs):
                    continue
                j = mbs[pos]
                idx = inst.action_id(stage, kind, j)
                if kind == ActionKind.FORWARD and first_stage_on_rank[(rank, j)] == stage:
                    need = reservation[(rank, j)]
                    base = committed[rank][group[j]] if reserve else held[rank]
                    if base > 1e-9 and base + need > cap[rank] / num_groups * (1 + 1e-12):
                        continue
                    priority = (2, seq[j], j)
                elif kind == ActionKind.FORWARD:
                    priority = (1, seq[j], j)
                else:
                    priority = (0, seq[j], -inst.chains[j].index(stage))
                found.append((ready_time(idx), priority, idx))
        for idx in pending_weights[rank][:1]:
            found.append((ready_time(idx), (3, 0, 0), idx))
        return found

    # Each rank's next choice, (start, priority, action, rank), or None while it has nothing it can start.
    # A rank's choice changes only when the rank runs an action (its clock, memory and queues move) or
    # when an action feeding one of its candidates ends: only those ranks are re-evaluated per step.
    choice_of: list[tuple[float, tuple[int, int, int], int, int] | None] = [None] * p
    dirty = set(range(p))
    while any(remaining):
        check_deadline()
        if should_stop is not None and should_stop():
            raise SearchStopped("capped greedy stopped before every action was placed")
        for rank in dirty:
            choice_of[rank] = None
            if not remaining[rank]:
                continue
            options = candidates(rank)
            known = [(max(t, free[rank]), prio, idx) for t, prio, idx in options if t < math.inf]
            if not known:
                continue
            start = min(t for t, _, _ in known)
            # Among what is ready at the earliest moment, the highest priority; W only if nothing else is.
            choice = min((prio, idx) for t, prio, idx in known if t <= start)
            choice_of[rank] = (start, choice[0], choice[1], rank)
        best = min((key for key in choice_of if key is not None), default=None)
        if best is None:
            raise RuntimeError("capped greedy scheduler is stuck; no rank can progress")
        start, _, idx, rank = best
        dirty = {rank, *(inst.rank[succ] for succ, _ in inst.succs[idx])}
        action = inst.actions[idx]
        end[idx] = start + inst.duration[idx]
        free[rank] = end[idx]
        remaining[rank] -= 1
        held[rank] += inst.mem_delta[idx]
        orders[rank].append(action)
        if action.kind == ActionKind.BACKWARD_WEIGHT:
            pending_weights[rank].remove(idx)
            committed[rank][group[action.microbatch]] += inst.mem_delta[idx]
            continue
        next_pos[(action.stage, action.kind)] += 1
        if action.kind == ActionKind.FORWARD:
            if first_stage_on_rank[(rank, action.microbatch)] == action.stage:
                committed[rank][group[action.microbatch]] += reservation[(rank, action.microbatch)]
        else:
            committed[rank][group[action.microbatch]] += inst.mem_delta[idx]
            if action.kind == ActionKind.BACKWARD_INPUT:
                weight = inst.action_id(action.stage, ActionKind.BACKWARD_WEIGHT, action.microbatch)
                pending_weights[rank].append(weight)
    return orders
