"""Greedy list scheduling in the spirit of the Zero Bubble heuristic, plus a local search.

The greedy (Zero Bubble paper, arXiv 2401.10241, Sec. 3) simulates the
pipeline in time. Whenever a rank is free it picks, from the actions whose inputs are known:

* during warm-up (fewer microbatches in flight on the rank than its target), a forward if one is ready;
* otherwise a ready backward (I, or B when fused), the earliest-ready first;
* a forward when no backward is ready and memory allows it;
* a W when the rank would otherwise idle at least ``w_gap`` × the W's duration, when memory blocks
  the next forward, or when nothing else is left;
* else it waits for the earliest of them.

Memory: a forward of the rank's first stage admits a new microbatch on the rank. With ``reserve``
the admission reserves the activations of all the microbatch's stages on the rank, so an admitted
microbatch can always finish its forwards there (this makes the greedy deadlock-free for V and loop
placements whenever one microbatch fits); without it only the current bytes are checked, which
packs more forwards into V placements and may deadlock (that variant is then dropped). Microbatches
are admitted in order, and each stage runs its forwards in microbatch order.

Variants (warm-up target, W gap threshold, reservation, forward-first) are all tried; the best is then
improved by :func:`improve`, which moves single actions within their rank's order and keeps a move
when the re-simulated objective does not get worse and memory still fits.

A sequential schedule (one microbatch at a time through the whole pipeline) is always added: it
needs the least memory there is (see :mod:`pipesched.optimizer.solvers.infeasible`), so the heuristic finds a
schedule whenever one exists.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections import deque
from dataclasses import dataclass

from pipesched.optimizer.instance import Instance
from pipesched.optimizer.ir import ActionKind
from pipesched.optimizer.progress import ProgressCallback, SearchStopped, StopCheck, check_deadline
from pipesched.optimizer.simulate import InvalidSchedule, SimulationResult, simulate_indexed
from pipesched.optimizer.solvers.base import BackendResult, BackendStatus

__all__ = ["GreedyVariant", "HeuristicBackend", "greedy", "greedy_variants", "improve", "sequential_orders"]

_EPS = 1e-9


@dataclass(frozen=True)
class GreedyVariant:
    """One setting of the greedy's choices.

    Attributes:
        warmup_base: microbatches the deepest rank keeps in flight before preferring backwards.
        warmup_slope: extra in-flight microbatches per pipeline stage between the rank and the last
            stage (1F1B: base 1, slope 1 per stage on one-stage-per-rank pipelines).
        w_gap: a W fills an idle gap of at least ``w_gap`` × its duration.
        reserve: reserve the memory of all the rank's stages when admitting a microbatch.
        forward_first: during warm-up, a ready forward goes before a ready backward.
    """

    warmup_base: float = math.inf
    warmup_slope: float = 0.0
    w_gap: float = 1.0
    reserve: bool = True
    forward_first: bool = True


def greedy_variants(inst: Instance) -> list[GreedyVariant]:
    """The variants :class:`HeuristicBackend` tries, most promising first."""
    variants = []
    spr = max(1, len(inst.stage_ranks) // max(1, inst.num_ranks))
    p = float(inst.num_ranks)
    warmups = [
        (base, slope / spr)
        for base, slope in ((math.inf, 0.0), (p, 1.0), (1.0, 1.0), (1.0, 2.0), (p / 2, 1.0), (p / 2, 1.5), (p, 0.5))
    ]
    for (base, slope), w_gap, reserve, forward_first in itertools.product(
        warmups, (1.0, 0.5), (True, False), (True, False)
    ):
        if not reserve and spr == 1:
            continue  # one stage per rank: reserving changes nothing
        variants.append(GreedyVariant(base, slope, w_gap, reserve, forward_first))
    return variants


def sequential_orders(inst: Instance) -> list[list[int]]:
    """Microbatches one at a time: every stage's F, then every backward (W right after its I).

    Valid for any placement; each rank's peak is static plus one microbatch's activations on the rank,
    the least any schedule can have.
    """
    orders: list[list[int]] = [[] for _ in range(inst.num_ranks)]
    for j, chain in enumerate(inst.chains):
        for stage in chain:
            orders[inst.stage_ranks[stage]].append(inst.action_id(stage, ActionKind.FORWARD, j))
        for stage in reversed(chain):
            rank = inst.stage_ranks[stage]
            if inst.split_backward:
                orders[rank].append(inst.action_id(stage, ActionKind.BACKWARD_INPUT, j))
                orders[rank].append(inst.action_id(stage, ActionKind.BACKWARD_WEIGHT, j))
            else:
                orders[rank].append(inst.action_id(stage, ActionKind.BACKWARD, j))
    return orders


def greedy(inst: Instance, variant: GreedyVariant) -> list[list[int]] | None:
    """Per-rank orders built by the greedy of the module docstring, or ``None`` if it deadlocked.

    Raises:
        ValueError: when microbatches pass different stages (bidirectional placement).
    """
    return _Greedy(inst, variant).run()


class _Greedy:
    """The greedy's state while it simulates the pipeline in time: what each rank holds, has admitted and may run
    next (one pending decision per rank, recomputed for the ranks an action touches)."""

    def __init__(self, inst: Instance, variant: GreedyVariant) -> None:
        self.inst, self.variant = inst, variant
        p, n, m = inst.num_ranks, len(inst.actions), inst.num_microbatches
        self.m = m
        self.kinds = [a.kind for a in inst.actions]
        self.is_forward = [k == ActionKind.FORWARD for k in self.kinds]
        self.is_weight = [k == ActionKind.BACKWARD_WEIGHT for k in self.kinds]
        # Forward ids per (stage, microbatch); stages a microbatch visits on each rank, in chain order.
        self.fwd = [[-1] * m for _ in range(len(inst.stage_ranks))]
        for idx, action in enumerate(inst.actions):
            if self.is_forward[idx]:
                self.fwd[action.stage][action.microbatch] = idx
        chain = inst.chains[0]
        if any(c != chain for c in inst.chains):
            raise ValueError("the greedy needs every microbatch to pass the same stages (not bidirectional)")
        self.rank_stages: list[list[int]] = [[] for _ in range(p)]
        for s in chain:
            self.rank_stages[inst.stage_ranks[s]].append(s)
        self.footprint = [sum(inst.mem_delta[self.fwd[s][0]] for s in self.rank_stages[r]) for r in range(p)]
        self.capacity = [inst.limit[r] - inst.static[r] for r in range(p)]
        self.target = self._targets(chain)
        self.remaining = [len(inst.preds[i]) for i in range(n)]
        self.ready_at = [0.0] * n
        self.free = [0.0] * p
        self.live = [0.0] * p
        self.reserved = [0.0] * p  # bytes of admitted microbatches' forwards not yet run
        self.admitted = [0] * p
        self.finished_first = [0] * p  # microbatches whose last backward-input on the rank is done
        self.next_f = {s: 0 for s in chain}
        self.backward_heap: list[list[tuple[float, int, int]]] = [[] for _ in range(p)]
        self.weight_queue: list[deque[int]] = [deque() for _ in range(p)]
        self.orders: list[list[int]] = [[] for _ in range(p)]
        self.left = [len(inst.rank_actions[r]) for r in range(p)]
        self.first_stage = [stages[0] if stages else -1 for stages in self.rank_stages]

    def _targets(self, chain: list[int]) -> list[float]:
        """Per rank, the microbatches it keeps in flight before preferring backwards (the variant's warm-up,
        capped by what its free memory holds)."""
        variant, m, last = self.variant, self.m, len(chain) - 1
        position = {s: k for k, s in enumerate(chain)}
        target = []
        for r, stages in enumerate(self.rank_stages):
            if not stages:
                target.append(0.0)
                continue
            goal = variant.warmup_base + variant.warmup_slope * (last - position[stages[0]])
            unbounded = self.footprint[r] <= 0 or math.isinf(self.capacity[r])
            cap = m if unbounded else max(1, int((self.capacity[r] + _EPS) // self.footprint[r]))
            target.append(min(goal, cap, m))
        return target

    def forward_candidate(self, r: int) -> tuple[float, int] | None:
        """The earliest forward rank ``r`` may run: its inputs known, and memory (and the warm-up) allowing."""
        best: tuple[float, int] | None = None
        reserve, capacity = self.variant.reserve, self.capacity[r] * (1 + 1e-12) + _EPS
        for s in self.rank_stages[r]:
            j = self.next_f[s]
            if j >= self.m:
                continue
            idx = self.fwd[s][j]
            if self.remaining[idx]:
                continue
            act = self.inst.mem_delta[idx]
            if s == self.first_stage[r]:
                if self.admitted[r] - self.finished_first[r] >= self.target[r]:
                    continue
                need = self.footprint[r] if reserve else act
                if self.live[r] + self.reserved[r] + need > capacity:
                    continue
            elif not reserve and self.live[r] + act > capacity:
                continue
            t = max(self.free[r], self.ready_at[idx])
            if best is None or t < best[0] - _EPS:
                best = (t, idx)
        return best

    def decide(self, r: int) -> tuple[float, int] | None:
        """Rank ``r``'s next action and its start: a forward while warming up, a ready backward, a W that fits
        the gap before the next, else the earliest of them."""
        if not self.left[r]:
            return None
        t_free, heap, forward_first = self.free[r], self.backward_heap[r], self.variant.forward_first
        b = (max(t_free, heap[0][0]), heap[0][2]) if heap else None
        f = self.forward_candidate(r)
        warm = self.admitted[r] - self.finished_first[r] < self.target[r]
        f_now = f is not None and f[0] <= t_free + _EPS
        if f_now and (b is None or b[0] > t_free + _EPS or (forward_first and warm)):
            return f
        if b is not None and b[0] <= t_free + _EPS:
            return b
        if f_now:
            return f
        weight = self._weight_in_gap(r, b, f)
        if weight is not None:
            return weight
        options = [c for c in (b, f) if c is not None]
        if not options:
            queue = self.weight_queue[r]
            return (max(t_free, self.ready_at[queue[0]]), queue[0]) if queue else None
        if b is not None and f is not None and abs(b[0] - f[0]) <= _EPS:
            return f if forward_first and warm else b
        return min(options)

    def _weight_in_gap(
        self, r: int, b: tuple[float, int] | None, f: tuple[float, int] | None
    ) -> tuple[float, int] | None:
        """The oldest pending W when it fits the idle gap before the next backward or forward (or no forward is
        ready while some remain)."""
        queue = self.weight_queue[r]
        if not queue:
            return None
        w = queue[0]
        t_w = max(self.free[r], self.ready_at[w])
        t_next = min(b[0] if b else math.inf, f[0] if f else math.inf)
        forwards_left = any(self.next_f[s] < self.m for s in self.rank_stages[r])
        gap_ok = t_next - t_w >= self.variant.w_gap * self.inst.duration[w] - _EPS or (f is None and forwards_left)
        return (t_w, w) if gap_ok and t_w <= t_next + _EPS else None

    def run(self) -> list[list[int]] | None:
        """Schedule every action, earliest decision first; ``None`` when no rank can move (deadlock)."""
        p, n = self.inst.num_ranks, len(self.inst.actions)
        decisions: list[tuple[float, int] | None] = [self.decide(r) for r in range(p)]
        for _ in range(n):
            check_deadline()
            best_rank, best_t = -1, math.inf
            for r in range(p):
                d = decisions[r]
                if d is not None and d[0] < best_t - _EPS:
                    best_t, best_rank = d[0], r
            if best_rank < 0:
                return None
            t, idx = decisions[best_rank]  # type: ignore[misc]
            for q in self._commit(best_rank, t, idx):
                decisions[q] = self.decide(q)
        return self.orders

    def _commit(self, r: int, t: float, idx: int) -> set[int]:
        """Run action ``idx`` on rank ``r`` from ``t``: update memory, admissions and the successors' readiness.

        Returns:
            The ranks whose next decision may have changed.
        """
        inst, action = self.inst, self.inst.actions[idx]
        self.orders[r].append(idx)
        end = t + inst.duration[idx]
        self.free[r] = end
        self.left[r] -= 1
        delta = inst.mem_delta[idx]
        self.live[r] += delta
        if self.is_forward[idx]:
            self.next_f[action.stage] += 1
            if action.stage == self.first_stage[r]:
                self.admitted[r] += 1
                if self.variant.reserve:
                    self.reserved[r] += self.footprint[r] - delta
            elif self.variant.reserve:
                self.reserved[r] -= delta
        elif self.is_weight[idx]:
            self.weight_queue[r].popleft()
        else:
            heapq.heappop(self.backward_heap[r])
            if self.kinds[idx] == inst.backward_kind and action.stage == self.first_stage[r]:
                self.finished_first[r] += 1
        touched = {r}
        for succ, latency in inst.succs[idx]:
            self.ready_at[succ] = max(self.ready_at[succ], end + latency)
            self.remaining[succ] -= 1
            if self.remaining[succ] == 0:
                q = inst.rank[succ]
                touched.add(q)
                if self.is_weight[succ]:
                    self.weight_queue[q].append(succ)
                elif not self.is_forward[succ]:
                    heapq.heappush(self.backward_heap[q], (self.ready_at[succ], inst.actions[succ].microbatch, succ))
        return touched


def _objective(sim: SimulationResult, objective: str) -> float:
    return sim.makespan if objective == "makespan" else sim.stage_span


def evaluate(inst: Instance, orders: list[list[int]], objective: str) -> float:
    """Simulated objective of ``orders`` in ms, ``inf`` when they deadlock or break a memory limit."""
    try:
        sim = simulate_indexed(inst, orders, check_memory=False)
    except InvalidSchedule:
        return math.inf
    return _objective(sim, objective) if sim.fits else math.inf


def improve(
    inst: Instance,
    orders: list[list[int]],
    objective: str,
    *,
    deadline: float,
    seed: int = 0,
    should_stop: StopCheck | None = None,
    on_improve: ProgressCallback | None = None,
) -> tuple[list[list[int]], float]:
    """Local search: move one action at a time within its rank's order, re-simulating each move.

    Moves favour the ranks that set the objective. A move is kept when the objective does not get
    worse (plateaus are walked), so the result is never worse than ``orders``.

    Args:
        deadline: ``time.perf_counter()`` value to stop at.

    Returns:
        The best orders and their objective, ms.
    """
    rng = random.Random(seed)
    best = [list(row) for row in orders]
    best_value = evaluate(inst, best, objective)
    if not math.isfinite(best_value):
        return best, best_value
    current = [list(row) for row in best]
    current_value = best_value
    ranks = [r for r in range(inst.num_ranks) if len(current[r]) > 1]
    if not ranks:
        return best, best_value
    iteration = 0
    while time.perf_counter() < deadline:
        iteration += 1
        if should_stop is not None and iteration % 16 == 0 and should_stop():
            break
        try:
            sim = simulate_indexed(inst, current, check_memory=False)
        except InvalidSchedule:  # pragma: no cover - current is always valid
            break
        if objective == "stage_span":
            spans = [sim.end[row[-1]] - sim.start[row[0]] if row else 0.0 for row in current]
        else:
            spans = [sim.end[row[-1]] if row else 0.0 for row in current]
        top = max(spans)
        critical = [r for r in ranks if spans[r] >= top - 1e-6]
        r = rng.choice(critical) if rng.random() < 0.7 else rng.choice(ranks)
        row = current[r]
        i = rng.randrange(len(row))
        shift = rng.choice((-3, -2, -1, 1, 2, 3))
        k = min(max(i + shift, 0), len(row) - 1)
        if k == i:
            continue
        candidate = list(row)
        action = candidate.pop(i)
        candidate.insert(k, action)
        current[r] = candidate
        value = evaluate(inst, current, objective)
        if value <= current_value + 1e-9:
            current_value = value
            if value < best_value - 1e-9:
                best_value = value
                best = [list(x) for x in current]
                if on_improve is not None:
                    from pipesched.optimizer.progress import Progress

                    on_improve(Progress(best_value, None, 0.0, "heuristic", "local search"))
        else:
            current[r] = row
    return best, best_value


class HeuristicBackend:
    """The greedy variants plus local search, as a :class:`~pipesched.optimizer.solvers.base.Backend`."""

    name = "heuristic"

    def solve(
        self,
        inst: Instance,
        *,
        objective: str,
        time_limit_s: float,
        hint: list[list[int]] | None = None,
        upper_bound: float | None = None,
        progress: ProgressCallback | None = None,
        should_stop: StopCheck | None = None,
        seed: int = 0,
    ) -> BackendResult:
        """Run every greedy variant, keep the best (or ``hint`` if better), then improve it locally.

        Returns ``FEASIBLE`` with orders whenever a schedule exists within the memory limits, else
        ``UNKNOWN`` (the sequential schedule is among the candidates, so that means none exists).
        """
        started = time.perf_counter()
        deadline = started + time_limit_s
        candidates: list[list[list[int]]] = []
        if hint is not None:
            candidates.append(hint)
        if all(c == inst.chains[0] for c in inst.chains):
            slowest = 0.0  # the longest variant so far: none starts that could not finish in half the budget
            for variant in greedy_variants(inst):
                if candidates and (
                    time.perf_counter() + slowest > started + 0.5 * time_limit_s
                    or (should_stop is not None and should_stop())
                ):
                    break
                variant_started = time.perf_counter()
                try:
                    orders = greedy(inst, variant)
                except SearchStopped:  # the active deadline (portfolio) passed mid-variant
                    break
                slowest = max(slowest, time.perf_counter() - variant_started)
                if orders is not None:
                    candidates.append(orders)
        candidates.append(sequential_orders(inst))
        best: list[list[int]] | None = None
        best_value = math.inf
        for orders in candidates:
            value = evaluate(inst, orders, objective)
            if value < best_value - 1e-9:
                best, best_value = orders, value
        if best is None:
            return BackendResult(BackendStatus.UNKNOWN, message="no order fits the memory limits")
        greedy_value = best_value
        if progress is not None:
            from pipesched.optimizer.progress import Progress

            progress(Progress(best_value, None, time.perf_counter() - started, self.name, "greedy"))
        if not (should_stop is not None and should_stop()):
            best, best_value = improve(
                inst, best, objective, deadline=deadline, seed=seed, should_stop=should_stop, on_improve=progress
            )
        return BackendResult(
            BackendStatus.FEASIBLE,
            orders=best,
            message=f"greedy {greedy_value:.3f} ms, local search {best_value:.3f} ms",
            stats={"greedy_ms": greedy_value, "best_ms": best_value, "candidates": float(len(candidates))},
        )
