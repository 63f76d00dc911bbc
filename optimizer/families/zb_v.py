"""ZB-V (Zero Bubble paper, Sec. 6 "Zero Bubble V schedule"; Qi et al. 2024).

V placement: rank r holds stages r and 2p−1−r, so rank 0 runs both the first and the last stage.
ZB-V aims at a near-zero bubble at 1F1B's activation peak: 2p half-size stage activations per rank
(p microbatches of the rank's two stages, i.e. 1F1B's p·M_B).

We port the authors' V-schedule generator (the ``try_v_schedule`` greedy of the Zero Bubble
reference implementation, ``zerobubble/scheduler/zbv.py``) rule for rule, in our own names:

1. Warm-up: one chunk-0 forward on every rank; then, from the last rank up, each rank runs extra
   chunk-0 forwards (together with every rank above it) while its memory allows
   ``2 + 2·rank`` more activations and the rank would otherwise idle before its first chunk-1
   forward arrives; then the rank's first chunk-1 forward.
2. Ramp: walking down the ranks, each rank catches up on forwards, alternating chunk 0 and chunk 1,
   until it holds as many forwards as the rank above and one more chunk-1 forward.
3. Steady state, 2m rounds: every rank runs one backward (I) — chunk 1's (stage 2p−1−r, which the
   authors call "chunk 0 of the backward") or chunk 0's, whichever has its gradient — then one forward,
   the chunk-1 forward if its input has arrived, else a chunk-0 forward. Before each pass a rank runs
   pending W while the pass's input would still be in flight (filling the bubble), and one W more
   when the wait exceeds the bubble budget (``fill_b`` / ``fill_f`` say whether backwards / forwards
   may take it); W also runs whenever the memory cap (2p activations) would be exceeded.
4. Cool-down: the pending W.

The generator is run on the problem's mean per-stage costs and memory (as the authors do: "V
schedule does not consider memory differences between stages"); it retries with the per-rank
bubbles of the last try as the approved budget while that lowers the largest bubble, over the four
``(fill_b, fill_f)`` choices, and keeps the order with the smallest bubble. Our simulator then times
the orders with the real per-stage costs. Needs split backward (it schedules I and W separately).

Where the generator cannot complete (its dependency or memory assertion would fail, which the
authors never hit for m ≥ 2p but can for very few microbatches), or its order does not pass
:func:`pipesched.optimizer.simulate.simulate`, we fall back to the memory-capped list scheduler of
:mod:`._greedy` at the same cap.

PyTorch's ``ScheduleZBVZeroBubble`` (torch 2.13) is not this generator but a fixed pattern; it runs the
same passes in another order, shorter at m = p (and with fewer activations), up to 1.5% longer at m ≥ 2p
on random per-stage costs. ``auto`` starts from both (:func:`~pipesched.optimizer.families._peers.torch_zbv_orders`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pipesched.optimizer.families._base import FamilySpec, PlannerEstimate, TorchClass
from pipesched.optimizer.families.v_shape import capped_v_orders, mean_stage_costs, valid_or_none
from pipesched.optimizer.ir import Action, ActionKind, Orders
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.progress import check_deadline

__all__ = ["zbv_orders"]

_EPS = 1e-9
# Pass categories of the authors' generator: forward, backward (input gradient), weight gradient.
_F, _B, _W = 0, 1, 2


class _GeneratorStuck(RuntimeError):
    """The authors' generator reached a state its assertions rule out (few microbatches)."""


@dataclass
class _Try:
    """State of one run of the V greedy (costs in ms, memory in units of one stage activation)."""

    p: int
    m: int
    cost: tuple[float, float, float]
    comm: float
    mem: tuple[float, float, float]
    max_mem: float
    approved: list[float]
    count: list[list[int]] = field(init=False)
    end: dict[tuple[int, int, int, int], float] = field(default_factory=dict)
    cur: list[float] = field(init=False)
    held: list[float] = field(init=False)
    bubble: list[float] = field(init=False)
    pending_w: list[deque[int]] = field(init=False)
    order: list[list[tuple[int, int, int]]] = field(init=False)

    def __post_init__(self) -> None:
        self.count = [[0] * 6 for _ in range(self.p)]
        self.cur = [0.0] * self.p
        self.held = [0.0] * self.p
        self.bubble = [0.0] * self.p
        self.pending_w = [deque() for _ in range(self.p)]
        self.order = [[] for _ in range(self.p)]

    def done(self, cat: int, chunk: int, rank: int, mb: int) -> float:
        """End time of a placed pass, or −1 when not placed yet."""
        return self.end.get((cat, chunk, rank, mb), -1.0)

    def max_bubble(self, rank: int = -1) -> float:
        worst = max(self.bubble)
        if rank >= 0:
            worst = max(worst, max(self.approved) - self.approved[rank])
        return worst

    def check(self, ok: bool) -> None:
        if not ok:
            raise _GeneratorStuck("the V greedy cannot place the next pass")

    def put(self, cat: int, chunk: int, rank: int) -> None:
        """Append the next pass of (cat, chunk) on ``rank`` at its earliest time after the rank's last pass."""
        check_deadline()
        t = no_bubble = self.cur[rank] + self.cost[cat]
        mb = self.count[rank][cat * 2 + chunk]
        self.check(mb < self.m)
        self.check(self.held[rank] + self.mem[cat] <= self.max_mem + _EPS)
        if cat > 0 or chunk > 0:
            before = cat * 2 + chunk - 1
            if cat < _W:
                self.check(self.done(before // 2, before % 2, rank, mb) >= 0)
            else:
                self.check(self.done(_B, chunk, rank, mb) >= 0)
        if cat < _W and ((chunk == 1 and rank < self.p - 1) or (chunk == 0 and rank > 0)):
            upstream = rank + 1 if chunk == 1 else rank - 1
            arrival = self.done(cat, chunk, upstream, mb)
            self.check(arrival >= 0)
            t = max(t, arrival + self.comm + self.cost[cat])
        if self.count[rank][0] > 0:
            self.bubble[rank] += t - no_bubble
        self.end[(cat, chunk, rank, mb)] = t
        self.cur[rank] = t
        self.held[rank] += self.mem[cat]
        self.order[rank].append((cat, chunk, mb))
        if cat == _B:
            self.pending_w[rank].append(chunk)
        self.count[rank][cat * 2 + chunk] += 1

    def put_w(self, rank: int) -> None:
        self.check(len(self.pending_w[rank]) > 0)
        self.put(_W, self.pending_w[rank].popleft(), rank)

    def fill_with_w(self, rank: int, upstream: tuple[int, int, int, int] | None, take_extra: bool) -> None:
        """W while the next pass's input is in flight; one more when the wait exceeds the bubble budget."""
        arrival = self.end.get(upstream, -1.0) if upstream is not None else -1.0
        while self.pending_w[rank] and upstream is not None and arrival + self.comm >= self.cur[rank] + self.cost[_W]:
            self.put_w(rank)
        # The authors compare with the last-placed end of a missing upstream as −1 (an always-false wait).
        wait = arrival + self.comm - self.cur[rank] if upstream is not None else -1.0 + self.comm - self.cur[rank]
        if self.pending_w[rank] and wait > self.max_bubble(rank) - self.bubble[rank] and take_extra:
            self.put_w(rank)

    def run(self, fill_f: bool, fill_b: bool) -> None:
        p, m = self.p, self.m
        for rank in range(p):
            self.put(_F, 0, rank)
        for rank in range(p - 1, -1, -1):
            if rank == p - 1:
                self.put(_F, 1, rank)
                continue
            arrival = self.done(_F, 1, rank + 1, 0) + self.comm
            while (
                self.held[rank] + self.mem[_F] * (2 + rank * 2) <= self.max_mem + _EPS
                and self.cur[rank] + self.cost[_F] <= arrival
                and self.count[rank][0] < m
            ):
                for upper in range(rank + 1):
                    self.put(_F, 0, upper)
            self.put(_F, 1, rank)
        chunk = 0
        for rank in range(1, p):
            while (
                self.count[rank][0] + self.count[rank][1] < self.count[rank - 1][0] + self.count[rank - 1][1]
                or self.count[rank][1] <= self.count[rank - 1][1] < m
            ):
                for lower in range(p - 1, rank - 1, -1):
                    if self.count[lower][chunk] < m:
                        self.put(_F, chunk, lower)
                chunk = 1 - chunk
        for _ in range(2 * m):
            for rank in range(p):
                while self.held[rank] + self.mem[_B] > self.max_mem + _EPS:
                    self.put_w(rank)
            first_ranks, second_ranks = [], []
            for rank in range(p):
                if self.count[rank][3] >= self.count[rank][2]:
                    first_ranks.append(rank)
                elif rank == p - 1 or self.done(_B, 1, rank + 1, self.count[rank][3]) >= 0 or self.count[rank][2] >= m:
                    second_ranks.append(rank)
                else:
                    first_ranks.append(rank)
            plan = [(rank, 1) for rank in reversed(second_ranks)] + [(rank, 0) for rank in first_ranks]
            for rank, bchunk in plan:
                upstream = None
                if bchunk == 1 and rank < p - 1:
                    upstream = (_B, 1, rank + 1, self.count[rank][3])
                if bchunk == 0 and rank > 0:
                    upstream = (_B, 0, rank - 1, self.count[rank][2])
                self.fill_with_w(rank, upstream, bchunk == 1 or fill_b)
                self.put(_B, bchunk, rank)
            for rank in range(p):
                if self.count[rank][1] >= m:
                    continue
                item = None
                if self.count[rank][1] >= self.count[rank][0]:
                    item = 0
                elif rank == p - 1 or self.done(_F, 1, rank + 1, self.count[rank][1]) >= 0:
                    item = 1
                elif self.count[rank][0] < m and (rank == 0 or self.done(_F, 0, rank - 1, self.count[rank][0]) >= 0):
                    item = 0
                if item is None:
                    continue
                while self.held[rank] + self.mem[_F] > self.max_mem + _EPS:
                    self.put_w(rank)
                upstream = None
                if item == 0 and rank > 0:
                    upstream = (_F, 0, rank - 1, self.count[rank][0])
                if item == 1 and rank < p - 1:
                    upstream = (_F, 1, rank + 1, self.count[rank][1])
                self.fill_with_w(rank, upstream, fill_f)
                self.put(_F, item, rank)
        for rank in range(p):
            while self.pending_w[rank]:
                self.put_w(rank)


def _best_try(
    p: int,
    m: int,
    cost: tuple[float, float, float],
    comm: float,
    mem: tuple[float, float, float],
    fill_f: bool,
    fill_b: bool,
) -> _Try:
    """The authors' retry loop: rerun with the last per-rank bubbles as approved budget while it helps."""
    approved = [-1.0] * p
    best: _Try | None = None
    while True:
        attempt = _Try(p, m, cost, comm, mem, 2.0 * p * mem[_F], approved)
        try:
            attempt.run(fill_f, fill_b)
        except _GeneratorStuck:
            if best is None:
                raise
            return best
        if best is not None and attempt.max_bubble() >= best.max_bubble():
            return best
        best = attempt
        if max(approved) >= 0 and attempt.max_bubble() >= max(approved):
            return best
        approved = list(attempt.bubble)


def zbv_orders(problem: Problem) -> Orders | None:
    """Per-rank ZB-V orders from the authors' generator, or ``None`` where it cannot complete.

    Args:
        problem: V placement (rank r holds stages r and 2p−1−r), split backward.

    Returns:
        One order per rank (F, I and W of both stages for every microbatch), or ``None`` when the
        generator gets stuck or its order does not pass the simulator.
    """
    p, m = problem.pipeline.num_ranks, problem.pipeline.num_microbatches
    forward_ms, input_ms, weight_ms, comm_ms, activation, retained = mean_stage_costs(problem)
    # Memory in units of one stage activation: F +1, I −(1 − ρ), W −ρ with ρ = retained / activation.
    rho = retained / activation if activation > 0 else 0.0
    mem = (1.0, -(1.0 - rho), -rho)
    cost = (forward_ms, input_ms, weight_ms)
    best: _Try | None = None
    for fill_b in (True, False):
        for fill_f in (True, False):
            try:
                attempt = _best_try(p, m, cost, comm_ms, mem, fill_f, fill_b)
            except _GeneratorStuck:
                continue
            if best is None or attempt.max_bubble() < best.max_bubble():
                best = attempt
    if best is None:
        return None
    kinds = (ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)
    orders: Orders = []
    for rank, row in enumerate(best.order):
        first, second = rank, 2 * p - 1 - rank
        actions = []
        for cat, chunk, mb in row:
            # Forward chunk 0 is the rank's first stage; the backward and W chunks count from the loss.
            forward_first = cat == _F and chunk == 0
            backward_first = cat != _F and chunk == 1
            stage = first if forward_first or backward_first else second
            actions.append(Action(stage, kinds[cat], mb))
        orders.append(actions)
    return valid_or_none(problem, orders)


def _build(problem: Problem) -> Orders:
    orders = zbv_orders(problem)
    if orders is None:
        return capped_v_orders(problem, lambda p: p)
    return orders


FAMILIES = [
    FamilySpec(
        name="zb-v",
        description="ZB-V: V placement, W fills the bubbles, at 1F1B's activation peak (p microbatches per rank).",
        build=_build,
        listing_order=80,
        placements=("v",),
        stages_per_rank=range(2, 3),
        backward="split",
        backward_hint="use dualpipe-v",
        torch=TorchClass("ZBVZeroBubble", backward="split"),
        # 2p half-size chunks on rank 0 (Qi et al. 2024, Table 1: 1F1B's peak).
        planner=PlannerEstimate(
            in_flight=lambda p, v, m: min(2 * m, 2 * p), bubble=0.15, seconds_per_thousand_actions=0.35
        ),
    )
]
