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
    """Per-rank orders built by the greedy of the module docstring, or ``None`` if it deadlocked."""
    p = inst.num_ranks
    n = len(inst.actions)
    m = inst.num_microbatches
    kinds = [a.kind for a in inst.actions]
    duration = inst.duration
    is_forward = [k == ActionKind.FORWARD for k in kinds]
    is_weight = [k == ActionKind.BACKWARD_WEIGHT for k in kinds]
    num_stage_ids = len(inst.stage_ranks)
    # Forward ids per (stage, microbatch); stages a microbatch visits on each rank, in chain order.
    fwd = [[-1] * m for _ in range(num_stage_ids)]
    for idx, action in enumerate(inst.actions):
        if is_forward[idx]:
            fwd[action.stage][action.microbatch] = idx
    chain = inst.chains[0]
    if any(c != chain for c in inst.chains):
        raise ValueError("the greedy needs every microbatch to pass the same stages (not bidirectional)")
    rank_stages: list[list[int]] = [[] for _ in range(p)]
    for s in chain:
        rank_stages[inst.stage_ranks[s]].append(s)
    footprint = [sum(inst.mem_delta[fwd[s][0]] for s in rank_stages[r]) for r in range(p)]
    capacity = [inst.limit[r] - inst.static[r] for r in range(p)]
    last = len(chain) - 1
    position = {s: k for k, s in enumerate(chain)}
    target = []
    for r in range(p):
        if not rank_stages[r]:
            target.append(0.0)
            continue
        depth = last - position[rank_stages[r][0]]
        goal = variant.warmup_base + variant.warmup_slope * depth
        unbounded = footprint[r] <= 0 or math.isinf(capacity[r])
        cap = m if unbounded else max(1, int((capacity[r] + _EPS) // footprint[r]))
        target.append(min(goal, cap, m))

    remaining = [len(inst.preds[i]) for i in range(n)]
    ready_at = [0.0] * n
    end = [math.nan] * n
    free = [0.0] * p
    live = [0.0] * p
    reserved = [0.0] * p  # bytes of admitted microbatches' forwards not yet run
    admitted = [0] * p
    finished_first = [0] * p  # microbatches whose last backward-input on the rank is done
    next_f = {s: 0 for s in chain}
    backward_heap: list[list[tuple[float, int, int]]] = [[] for _ in range(p)]
    weight_queue: list[deque[int]] = [deque() for _ in range(p)]
    orders: list[list[int]] = [[] for _ in range(p)]
    left = [len(inst.rank_actions[r]) for r in range(p)]
    first_stage = [rank_stages[r][0] if rank_stages[r] else -1 for r in range(p)]
    backward_kind = inst.backward_kind
    last_backward_stage = [rank_stages[r][0] if rank_stages[r] else -1 for r in range(p)]

    def forward_candidate(r: int) -> tuple[float, int] | None:
        best: tuple[float, int] | None = None
        for s in rank_stages[r]:
            j = next_f[s]
            if j >= m:
                continue
            idx = fwd[s][j]
            if remaining[idx]:
                continue
            act = inst.mem_delta[idx]
            if s == first_stage[r]:
                if admitted[r] - finished_first[r] >= target[r]:
                    continue
                need = footprint[r] if variant.reserve else act
                if live[r] + reserved[r] + need > capacity[r] * (1 + 1e-12) + _EPS:
                    continue
            elif not variant.reserve and live[r] + act > capacity[r] * (1 + 1e-12) + _EPS:
                continue
            t = max(free[r], ready_at[idx])
            if best is None or t < best[0] - _EPS:
                best = (t, idx)
        return best

    def decide(r: int) -> tuple[float, int] | None:
        if not left[r]:
            return None
        t_free = free[r]
        heap = backward_heap[r]
        b = (max(t_free, heap[0][0]), heap[0][2]) if heap else None
        f = forward_candidate(r)
        in_flight = admitted[r] - finished_first[r]
        warm = in_flight < target[r]
        if (
            f is not None
            and f[0] <= t_free + _EPS
            and (b is None or b[0] > t_free + _EPS or (variant.forward_first and warm))
        ):
            return f
        if b is not None and b[0] <= t_free + _EPS:
            return b
        if f is not None and f[0] <= t_free + _EPS:
            return f
        queue = weight_queue[r]
        if queue:
            w = queue[0]
            t_w = max(t_free, ready_at[w])
            t_next = min(b[0] if b else math.inf, f[0] if f else math.inf)
            forwards_left = any(next_f[s] < m for s in rank_stages[r])
            gap_ok = t_next - t_w >= variant.w_gap * duration[w] - _EPS or (f is None and forwards_left)
            if gap_ok and t_w <= t_next + _EPS:
                return (t_w, w)
        options = [c for c in (b, f) if c is not None]
        if not options:
            if queue:
                return (max(t_free, ready_at[queue[0]]), queue[0])
            return None
        if b is not None and f is not None and abs(b[0] - f[0]) <= _EPS:
            return f if variant.forward_first and warm else b
        return min(options)

    decisions: list[tuple[float, int] | None] = [decide(r) for r in range(p)]
    scheduled = 0
    while scheduled < n:
        check_deadline()
        best_rank = -1
        best_t = math.inf
        for r in range(p):
            d = decisions[r]
            if d is not None and d[0] < best_t - _EPS:
                best_t = d[0]
                best_rank = r
        if best_rank < 0:
            return None
        r = best_rank
        t, idx = decisions[r]  # type: ignore[misc]
        action = inst.actions[idx]
        orders[r].append(idx)
        end[idx] = t + duration[idx]
        free[r] = end[idx]
        left[r] -= 1
        scheduled += 1
        delta = inst.mem_delta[idx]
        live[r] += delta
        if is_forward[idx]:
            next_f[action.stage] += 1
            if action.stage == first_stage[r]:
                admitted[r] += 1
                if variant.reserve:
                    reserved[r] += footprint[r] - delta
            elif variant.reserve:
                reserved[r] -= delta
        elif is_weight[idx]:
            weight_queue[r].popleft()
        else:
            heapq.heappop(backward_heap[r])
            if kinds[idx] == backward_kind and action.stage == last_backward_stage[r]:
                finished_first[r] += 1
        touched = {r}
        for succ, latency in inst.succs[idx]:
            ready_at[succ] = max(ready_at[succ], end[idx] + latency)
            remaining[succ] -= 1
            if remaining[succ] == 0:
                q = inst.rank[succ]
                touched.add(q)
                if is_weight[succ]:
                    weight_queue[q].append(succ)
                elif not is_forward[succ]:
                    heapq.heappush(backward_heap[q], (ready_at[succ], inst.actions[succ].microbatch, succ))
        for q in touched:
            decisions[q] = decide(q)
    return orders


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
