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
    return _CappedGreedy(inst, cap, reserve).run(should_stop)


#: A rank's next choice: (start ms, priority, action index, rank).
_Choice = tuple[float, tuple[int, int, int], int, int]


class _CappedGreedy:
    """The capped greedy's state: per rank its clock, held and committed bytes and pending W's; per stage and
    kind the next microbatch in order (module docstring)."""

    def __init__(self, inst: Instance, cap: list[float], reserve: bool) -> None:
        self.inst, self.cap, self.reserve = inst, cap, reserve
        p = inst.num_ranks
        self.kinds = (ActionKind.FORWARD, inst.backward_kind)
        # Per rank and stage, the microbatches passing the stage in order, and the next position per kind.
        self.stage_mbs: dict[int, list[int]] = {}
        for j, chain in enumerate(inst.chains):
            for stage in chain:
                self.stage_mbs.setdefault(stage, []).append(j)
        self.rank_stages = [[s for s in sorted(self.stage_mbs) if inst.stage_ranks[s] == r] for r in range(p)]
        self.next_pos = {(s, kind): 0 for s in self.stage_mbs for kind in self.kinds}
        self.first_stage_on_rank: dict[tuple[int, int], int] = {}
        for j, chain in enumerate(inst.chains):
            for stage in chain:
                self.first_stage_on_rank.setdefault((inst.stage_ranks[stage], j), stage)
        # Microbatches of different replicas (bidirectional) interleave: priority by position in the replica.
        seen: dict[tuple[int, ...], int] = {}
        groups: dict[tuple[int, ...], int] = {}
        self.seq: list[int] = []
        self.group: list[int] = []
        for chain in inst.chains:
            chain_key = tuple(chain)
            self.seq.append(seen.get(chain_key, 0))
            seen[chain_key] = self.seq[-1] + 1
            self.group.append(groups.setdefault(chain_key, len(groups)))
        self.num_groups = len(groups)
        self.reservation = {(r, j): microbatch_reservation(inst, r, j) for (r, j) in self.first_stage_on_rank}
        self.end = [math.nan] * len(inst.actions)
        self.free = [0.0] * p
        # Committed bytes per rank and replica: each replica gets an equal share of the cap, so that no
        # replica can fill a rank with microbatches that wait on a rank the other replica has filled.
        self.committed = [[0.0] * self.num_groups for _ in range(p)]
        self.held = [0.0] * p
        self.pending_weights: list[list[int]] = [[] for _ in range(p)]
        self.remaining = [len(ids) for ids in inst.rank_actions]
        self.orders: Orders = [[] for _ in range(p)]

    def ready_time(self, idx: int) -> float:
        """When every predecessor's output has arrived (``inf`` while one has not run)."""
        ready = 0.0
        for pred, latency in self.inst.preds[idx]:
            t = self.end[pred]
            if t != t:
                return math.inf
            ready = max(ready, t + latency)
        return ready

    def candidates(self, rank: int) -> list[tuple[float, tuple[int, int, int], int]]:
        """(ready time, priority, action) of each pass the rank may run next: backwards first, then forwards
        (a microbatch's first on the rank only when its reservation fits the replica's share), then a W."""
        inst, found = self.inst, []
        for stage in self.rank_stages[rank]:
            mbs = self.stage_mbs[stage]
            for kind in self.kinds:
                pos = self.next_pos[(stage, kind)]
                if pos >= len(mbs):
                    continue
                j = mbs[pos]
                idx = inst.action_id(stage, kind, j)
                if kind == ActionKind.FORWARD and self.first_stage_on_rank[(rank, j)] == stage:
                    need = self.reservation[(rank, j)]
                    base = self.committed[rank][self.group[j]] if self.reserve else self.held[rank]
                    if base > 1e-9 and base + need > self.cap[rank] / self.num_groups * (1 + 1e-12):
                        continue
                    priority = (2, self.seq[j], j)
                elif kind == ActionKind.FORWARD:
                    priority = (1, self.seq[j], j)
                else:
                    priority = (0, self.seq[j], -inst.chains[j].index(stage))
                found.append((self.ready_time(idx), priority, idx))
        for idx in self.pending_weights[rank][:1]:
            found.append((self.ready_time(idx), (3, 0, 0), idx))
        return found

    def choose(self, rank: int) -> _Choice | None:
        """Among what the rank can start at its earliest moment, the highest priority (W only if nothing else)."""
        if not self.remaining[rank]:
            return None
        known = [(max(t, self.free[rank]), prio, idx) for t, prio, idx in self.candidates(rank) if t < math.inf]
        if not known:
            return None
        start = min(t for t, _, _ in known)
        choice = min((prio, idx) for t, prio, idx in known if t <= start)
        return (start, choice[0], choice[1], rank)

    def run(self, should_stop: Callable[[], bool] | None) -> Orders:
        """Place every action, earliest choice first. A rank's choice changes only when it runs an action or
        an action feeding one of its candidates ends: only those ranks are re-evaluated per step."""
        choice_of: list[_Choice | None] = [None] * self.inst.num_ranks
        dirty = set(range(self.inst.num_ranks))
        while any(self.remaining):
            check_deadline()
            if should_stop is not None and should_stop():
                raise SearchStopped("capped greedy stopped before every action was placed")
            for rank in dirty:
                choice_of[rank] = self.choose(rank)
            best = min((key for key in choice_of if key is not None), default=None)
            if best is None:
                raise RuntimeError("capped greedy scheduler is stuck; no rank can progress")
            start, _, idx, rank = best
            dirty = {rank, *(self.inst.rank[succ] for succ, _ in self.inst.succs[idx])}
            self.commit(start, idx, rank)
        return self.orders

    def commit(self, start: float, idx: int, rank: int) -> None:
        """Run action ``idx`` on ``rank`` from ``start``: the clock, held and committed bytes, the queues."""
        inst = self.inst
        action = inst.actions[idx]
        group = self.group[action.microbatch]
        self.end[idx] = start + inst.duration[idx]
        self.free[rank] = self.end[idx]
        self.remaining[rank] -= 1
        self.held[rank] += inst.mem_delta[idx]
        self.orders[rank].append(action)
        if action.kind == ActionKind.BACKWARD_WEIGHT:
            self.pending_weights[rank].remove(idx)
            self.committed[rank][group] += inst.mem_delta[idx]
            return
        self.next_pos[(action.stage, action.kind)] += 1
        if action.kind == ActionKind.FORWARD:
            if self.first_stage_on_rank[(rank, action.microbatch)] == action.stage:
                self.committed[rank][group] += self.reservation[(rank, action.microbatch)]
        else:
            self.committed[rank][group] += inst.mem_delta[idx]
            if action.kind == ActionKind.BACKWARD_INPUT:
                weight = inst.action_id(action.stage, ActionKind.BACKWARD_WEIGHT, action.microbatch)
                self.pending_weights[rank].append(weight)
