"""The Zero Bubble authors' automatic scheduler, re-implemented as a warm start for ``auto``.

Every published ZB-1p / ZB-2p figure (Zero Bubble paper, arXiv 2401.10241, Sec. 3.1 and Table 5)
comes from the authors' greedy ``manual_order`` / ``initial_solution`` (their ``auto_schedule.py``,
later ``zerobubble/scheduler/zb.py``; the ILP next to it is switched off). This module replays the
same decisions on an :class:`~pipesched.optimizer.instance.Instance`, so that on the paper's own inputs the
``auto`` search starts from the paper's schedule and can never end worse than it.

The greedy, per microbatch ``i`` (Zero Bubble paper, arXiv 2401.10241, Sec. 3):

* ``i = 0`` (warm-up): one F of microbatch 0 on every rank, then, from the last rank backwards, as
  many extra F per rank as memory allows and as fit before the first I (input-gradient backward)
  comes back from the next rank (``bubble_before_first_backward`` lets the last of them overrun that
  arrival); each rank then keeps strictly fewer extra F than the rank before it; then I of
  microbatch 0 from the last rank to the first.
* ``i ≥ 1`` (steady state): a rank runs its next F unless ``prioritize_backward`` and it is already
  two F ahead of the next rank and an F would delay the I coming back (or the wait is smaller than
  the gap between this rank's bubble and the largest bubble); a rank only runs an F when all later
  ranks do. Before each F and each I, W passes are put first while memory is at the limit, while a
  W fits in the idle time before the pass's input arrives, and, for a shorter gap, when the gap would
  grow this rank's bubble past the largest one (or always with ``fill_small_gaps``). Rank 0 flushes
  its W before its I once all its F are done.
* finally every rank flushes its remaining W.

The three flags give 8 variants; :func:`zb_auto_orders` runs all of them and keeps the best order by
our simulator (:func:`pipesched.optimizer.simulate.simulate_indexed`) and the problem's objective.

Domain (what the authors' scheduler supports): one stage per rank in loop placement (stage ``s`` on
rank ``s``), split backward (F / I / W), identical microbatch chains. Per-stage costs and memory are
supported; p2p latency may differ per stage (the authors use one ``cost_comm``; here each wait uses
the sender's latency, exactly as :func:`pipesched.optimizer.instance.compile_problem` does), and each rank's
memory budget is its limit minus its static memory. Outside this domain :func:`zb_auto_orders`
returns ``None``.

One deviation, in the warm-up: no rank runs more warm-up F than the rank before it. The authors let a
rank whose budget takes all ``m`` forwards keep them even when the previous rank (with a smaller
budget) keeps fewer, which deadlocks; on uniform budgets, the paper's inputs included, the clamp never
binds, and wherever the authors' order runs at all it is unchanged.

Times are compared in integer nanoseconds, so the greedy's many ties (identical microbatches) break
exactly as in the authors' integer-cost code rather than by floating-point noise.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from pipesched.optimizer.instance import Instance
from pipesched.optimizer.ir import ActionKind
from pipesched.optimizer.progress import check_deadline
from pipesched.optimizer.simulate import InvalidSchedule, simulate_indexed

__all__ = ["ZB_AUTO_VARIANTS", "ZbAutoVariant", "in_zb_auto_domain", "zb_auto_order", "zb_auto_orders"]

_NS_PER_MS = 1_000_000

_FORWARD, _BACKWARD_INPUT, _BACKWARD_WEIGHT = 0, 1, 2
_KINDS = (ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)


@dataclass(frozen=True)
class ZbAutoVariant:
    """One of the authors' 8 heuristic settings (their argument names in brackets).

    Attributes:
        bubble_before_first_backward: in warm-up, the last extra F may end after the first I
            arrives (``allow_bubble_before_first_b``).
        prioritize_backward: a rank two F ahead of the next one may skip an F to keep the I coming
            back on time (``prioritize_b``).
        fill_small_gaps: a W fills an idle gap shorter than itself even when the gap would not make
            this rank's bubble the largest (``no_bubble_greedy``).
    """

    bubble_before_first_backward: bool
    prioritize_backward: bool
    fill_small_gaps: bool


ZB_AUTO_VARIANTS: tuple[ZbAutoVariant, ...] = tuple(
    ZbAutoVariant(a, b, c) for a, b, c in itertools.product((True, False), repeat=3)
)


class _CannotFit(Exception):
    """Memory is at the limit and no W is left to free any: the variant gives up (as the authors')."""


def in_zb_auto_domain(inst: Instance) -> bool:
    """Whether the authors' scheduler applies: split backward, one stage per rank, stage ``s`` on rank ``s``."""
    p = inst.num_ranks
    return (
        inst.split_backward
        and inst.num_stages == p
        and inst.stage_ranks == list(range(p))
        and all(chain == list(range(p)) for chain in inst.chains)
    )


def _ns(ms: float) -> int:
    return round(ms * _NS_PER_MS)


class _Greedy:
    """State of one run of the greedy: per rank counts, clock, memory and bubble; per action end time."""

    def __init__(self, inst: Instance) -> None:
        p, m = inst.num_ranks, inst.num_microbatches
        self.p, self.m = p, m
        # ids[kind][rank][microbatch] → action index (stage == rank in this domain).
        self.ids = [[[inst.action_id(r, kind, j) for j in range(m)] for r in range(p)] for kind in _KINDS]
        self.duration = [[_ns(inst.duration[self.ids[k][r][0]]) for r in range(p)] for k in range(3)]
        self.mem = [[inst.mem_delta[self.ids[k][r][0]] for r in range(p)] for k in range(3)]
        self.budget = [inst.limit[r] - inst.static[r] for r in range(p)]
        # p2p latency (read from the instance's edges) of the F arriving on rank r from r-1 and of the I from r+1.
        self.comm_forward = [self._latency(inst, _FORWARD, r, r - 1) if r > 0 else 0 for r in range(p)]
        self.comm_backward = [self._latency(inst, _BACKWARD_INPUT, r, r + 1) if r + 1 < p else 0 for r in range(p)]
        self.count = [[0] * p for _ in range(3)]
        self.held = [0.0] * p
        self.free_at = [0] * p
        self.bubble = [0] * p
        self.end = [[[0] * m for _ in range(p)] for _ in range(3)]
        self.orders: list[list[int]] = [[] for _ in range(p)]

    def _latency(self, inst: Instance, kind: int, rank: int, sender: int) -> int:
        sent = self.ids[kind][sender][0]
        return max(_ns(latency) for pred, latency in inst.preds[self.ids[kind][rank][0]] if pred == sent)

    def place(self, rank: int, kind: int) -> None:
        """Append the rank's next pass of ``kind`` and time it as soon as possible."""
        check_deadline()
        j = self.count[kind][rank]
        cost = self.duration[kind][rank]
        no_wait = self.free_at[rank] + cost
        finish = no_wait
        if kind == _FORWARD and rank > 0:
            finish = max(finish, self.end[_FORWARD][rank - 1][j] + self.comm_forward[rank] + cost)
        if kind == _BACKWARD_INPUT and rank + 1 < self.p:
            finish = max(finish, self.end[_BACKWARD_INPUT][rank + 1][j] + self.comm_backward[rank] + cost)
        if self.count[_FORWARD][rank] > 0:
            self.bubble[rank] += finish - no_wait
        self.free_at[rank] = finish
        self.end[kind][rank][j] = finish
        self.held[rank] += self.mem[kind][rank]
        self.count[kind][rank] += 1
        self.orders[rank].append(self.ids[kind][rank][j])

    def weights_pending(self, rank: int) -> bool:
        return self.count[_BACKWARD_WEIGHT][rank] < self.count[_BACKWARD_INPUT][rank]

    def make_room(self, rank: int, kind: int) -> None:
        """Put W passes until the next pass of ``kind`` fits in memory."""
        while self.held[rank] + self.mem[kind][rank] > self.budget[rank]:
            if not self.weights_pending(rank):
                raise _CannotFit
            self.place(rank, _BACKWARD_WEIGHT)

    def fill_gap(self, rank: int, arrival: int, fill_small_gaps: bool) -> None:
        """Put W passes into the idle time before an input arriving at ``arrival`` (ns)."""
        w_cost = self.duration[_BACKWARD_WEIGHT][rank]
        while self.weights_pending(rank) and self.free_at[rank] + w_cost <= arrival:
            self.place(rank, _BACKWARD_WEIGHT)
        if self.weights_pending(rank) and self.free_at[rank] < arrival:
            if arrival - self.free_at[rank] <= max(self.bubble) - self.bubble[rank]:
                if fill_small_gaps:
                    self.place(rank, _BACKWARD_WEIGHT)
            else:
                self.place(rank, _BACKWARD_WEIGHT)

    def warm_up(self, variant: ZbAutoVariant) -> None:
        """Microbatch 0: F everywhere, extra F per rank as memory and the first I's return allow, then I."""
        p, m = self.p, self.m
        for r in range(p):
            self.place(r, _FORWARD)
        extra = [0] * p
        first_backward_end = 0
        for r in range(p - 1, -1, -1):
            if r == p - 1:
                first_backward_end = self.end[_FORWARD][r][0] + self.duration[_BACKWARD_INPUT][r]
                continue
            held, clock = self.held[r], self.free_at[r]
            arrival = first_backward_end + self.comm_backward[r]
            f_cost, f_mem = self.duration[_FORWARD][r], self.mem[_FORWARD][r]
            while self.count[_FORWARD][r] + extra[r] < m and held + f_mem <= self.budget[r]:
                if variant.bubble_before_first_backward:
                    if clock + f_cost > arrival:
                        break
                elif clock >= arrival:
                    break
                held += f_mem
                clock += f_cost
                extra[r] += 1
            first_backward_end = max(clock, arrival) + self.duration[_BACKWARD_INPUT][r]
        for r in range(1, p):
            while extra[r] > 0 and extra[r] >= extra[r - 1] and self.count[_FORWARD][r] + extra[r] < m:
                extra[r] -= 1
            # Not in the authors' code: a rank whose budget takes all m forwards kept more of them than the
            # rank before it, whose I0 then waits on forwards that wait on it (only possible with uneven
            # budgets; wherever the authors' order runs this changes nothing).
            extra[r] = min(extra[r], extra[r - 1])
        for r in range(p):
            for _ in range(extra[r]):
                self.place(r, _FORWARD)
        for r in range(p - 1, -1, -1):
            self.place(r, _BACKWARD_INPUT)

    def wants_forward(self, rank: int, variant: ZbAutoVariant) -> bool:
        """Whether ``rank`` runs an F in this steady-state step (before the ranks' monotone cut)."""
        if self.count[_FORWARD][rank] >= self.m:
            return False
        nxt = rank + 1
        if not variant.prioritize_backward or nxt >= self.p:
            return True
        if self.count[_FORWARD][rank] < self.count[_FORWARD][nxt] + 2:
            return True
        # When the next rank has run its next F and I, this rank's I can start.
        backward_due = (
            self.free_at[nxt]
            + self.duration[_FORWARD][nxt]
            + self.duration[_BACKWARD_INPUT][nxt]
            + self.comm_backward[rank]
        )
        if self.free_at[rank] >= backward_due:
            return False
        w_cost, w_done = 0, self.count[_BACKWARD_WEIGHT][rank]
        held = self.held[rank] + self.mem[_FORWARD][rank]
        while held > self.budget[rank] and w_done < self.count[_BACKWARD_INPUT][rank]:
            w_cost += self.duration[_BACKWARD_WEIGHT][rank]
            held += self.mem[_BACKWARD_WEIGHT][rank]
            w_done += 1
        if self.free_at[rank] + self.duration[_FORWARD][rank] + w_cost <= backward_due:
            return True
        # The authors reset the W time here, so the test compares the bare idle time.
        return not backward_due - self.free_at[rank] <= max(self.bubble) - self.bubble[rank]

    def steady_step(self, microbatch: int, variant: ZbAutoVariant) -> None:
        """One step ``i ≥ 1``: maybe an F per rank (first to last), then I of ``microbatch`` (last to first)."""
        p = self.p
        want = [self.wants_forward(r, variant) for r in range(p)]
        for r in range(p - 2, -1, -1):
            want[r] = want[r] and want[r + 1]
        for r in range(p):
            if not want[r]:
                continue
            self.make_room(r, _FORWARD)
            if r > 0:
                arrival = self.end[_FORWARD][r - 1][self.count[_FORWARD][r]] + self.comm_forward[r]
                self.fill_gap(r, arrival, variant.fill_small_gaps)
            self.place(r, _FORWARD)
        for r in range(p - 1, -1, -1):
            assert self.count[_BACKWARD_INPUT][r] == microbatch
            self.make_room(r, _BACKWARD_INPUT)
            if r + 1 < p:
                arrival = self.end[_BACKWARD_INPUT][r + 1][microbatch] + self.comm_backward[r]
                self.fill_gap(r, arrival, variant.fill_small_gaps)
            if r == 0 and self.count[_FORWARD][r] == self.m:
                while self.weights_pending(r):
                    self.place(r, _BACKWARD_WEIGHT)
            self.place(r, _BACKWARD_INPUT)

    def run(self, variant: ZbAutoVariant) -> list[list[int]]:
        self.warm_up(variant)
        for i in range(1, self.m):
            self.steady_step(i, variant)
        for r in range(self.p):
            while self.count[_BACKWARD_WEIGHT][r] < self.m:
                self.place(r, _BACKWARD_WEIGHT)
        return self.orders


def zb_auto_order(inst: Instance, variant: ZbAutoVariant) -> list[list[int]] | None:
    """The authors' greedy order for one variant.

    Args:
        inst: a compiled problem inside the domain (:func:`in_zb_auto_domain`).
        variant: the three flags.

    Returns:
        Per rank, action indices in execution order; ``None`` when the greedy gives up because memory
        is full and no W is left to run (the authors raise "Cannot fit memory" there). The order is
        not checked: the first F of microbatch 0 ignores the limit, as in the authors' code.

    Raises:
        ValueError: ``inst`` is outside the domain.
    """
    if not in_zb_auto_domain(inst):
        raise ValueError("zb_auto needs split_backward, one stage per rank and loop placement")
    if inst.num_microbatches < 1:
        return None
    try:
        return _Greedy(inst).run(variant)
    except _CannotFit:
        return None


def zb_auto_orders(inst: Instance, objective: str) -> list[list[int]] | None:
    """Best order of the authors' automatic scheduler (all 8 variants) by our simulator.

    Source: Zero Bubble paper (arXiv 2401.10241), Sec. 3.1 "automatic scheduling"; the authors'
    ``initial_solution``. Each variant's order is timed by :func:`pipesched.optimizer.simulate.simulate_indexed`
    (which also checks every rank's memory limit, static memory included); invalid orders are dropped.

    Args:
        inst: compiled problem.
        objective: ``"stage_span"`` or ``"makespan"`` (ms), the value minimised.

    Returns:
        Per rank, action indices in execution order (``inst.rank_actions`` reordered), or ``None``
        when the problem is outside the domain (fused backward, several stages per rank, a placement
        other than stage ``s`` on rank ``s``, bidirectional) or no variant gives a valid order.
    """
    if not in_zb_auto_domain(inst):
        return None
    best: list[list[int]] | None = None
    best_value = math.inf
    for variant in ZB_AUTO_VARIANTS:
        orders = zb_auto_order(inst, variant)
        if orders is None:
            continue
        try:
            value = simulate_indexed(inst, orders).objective_value(objective)
        except InvalidSchedule:
            continue
        if value < best_value:
            best, best_value = orders, value
    return best
