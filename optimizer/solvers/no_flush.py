"""``auto`` for schedules without a flush (``training.flush: false``, objective ``step_period``).

The search works on the repeating per-rank pattern of :mod:`pipesched.optimizer.pattern`, and every
pattern is judged by the steady-state timing there (the one simulator on the unrolled steps, the extra
weight version and the activations in flight counted against the memory limit).

Order of work within ``solver.time_limit_s``:

1. Feasibility: a rank whose limit is below static + the extra weight versions + one microbatch's
   activations (:mod:`pipesched.optimizer.solvers.infeasible`) admits no schedule: ``infeasible`` with the
   least limit.
2. Lower bound: :func:`pipesched.optimizer.pattern.step_period_lower_bound` (the busiest rank's work
   per step, and Little's law on the memory a microbatch holds while it is in flight).
3. Warm starts, in this order: ``pipedream-2bw``; the best flushed schedule the ``auto`` portfolio finds in
   40% of the time left, 70% when 2BW does not fit (at the limit less the extra weight version, objective
   stage_span), its steps overlapped; 1F1B without a flush with more microbatches in flight per rank
   (p − r + e, and k·(p − r)), and the same capped at the microbatches each rank's free memory holds; with
   split backward each of these with W passes deferred by d_r backward slots (ZB-H1's trick: W fills the
   wait for the round trip); every flushed family's one-step order as a pattern (its steps then overlap
   without a flush); one microbatch at a time (always fits when anything does, and is timed even past the
   deadline when nothing else fitted). Each counts only where it fits the limit (judged from the orders,
   before any timing); no evaluation starts that the longest one so far says would end past the deadline
   (the unrolled run of p = 32, m = 256 takes about 2 s here).
4. Local search until the deadline: move one action within its rank's pattern, or swap the last action of
   a rank's step with the next step's first, re-cut the pattern at the step boundary
   (:func:`canonical_pattern`), keep the move when the pattern stays valid (no deadlock, two weight
   versions, memory) and the step period does not grow.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Iterator

from pipesched.optimizer.families import applicable_families
from pipesched.optimizer.families._base import backward
from pipesched.optimizer.instance import compile_problem
from pipesched.optimizer.ir import Action, ActionKind, Orders, compute_only
from pipesched.optimizer.pattern import (
    MIN_STEPS,
    SteadyState,
    SteadyStateEvaluator,
    pattern_from_sequence,
    schedule_from_steady_state,
    step_period_lower_bound,
)
from pipesched.optimizer.problem import Problem, weight_version_memory
from pipesched.optimizer.progress import ProgressCallback, SearchContext, StopCheck
from pipesched.optimizer.result import Schedule, infeasible_schedule
from pipesched.optimizer.simulate import InvalidSchedule, action_orders
from pipesched.optimizer.solvers.heuristic import sequential_orders
from pipesched.optimizer.solvers.infeasible import infeasibility_reason, min_memory_limit
from pipesched.optimizer.solvers.portfolio import solve_auto

__all__ = ["canonical_pattern", "no_flush_patterns", "sequential_pattern", "solve_steady_state"]


def canonical_pattern(row: list[tuple[Action, int]], num_microbatches: int) -> list[Action] | None:
    """Re-cut one rank's cyclic sequence at its step boundary.

    ``row`` holds ``(action with microbatch id in [0, m), step offset δ)`` in order; repeated once per step it
    is the rank's endless sequence. Returns the pattern that ends with the last action of its own step
    (ids ``j`` or ``m + j``), or ``None`` when the sequence would run an action two steps ahead before the
    step ends (a third weight version).
    """
    m = num_microbatches
    length = len(row)
    if length == 0:
        return []
    boundary = max(i - delta * length for i, (_, delta) in enumerate(row))
    placed: list[tuple[int, Action, int]] = []
    for i, (action, delta) in enumerate(row):
        # The copy of element i that lies in (boundary − length, boundary].
        copy = math.floor((boundary - i) / length)
        position = i + copy * length
        offset = copy + delta
        if offset not in (0, 1):
            return None
        placed.append((position, action, offset))
    placed.sort(key=lambda item: item[0])
    return [Action(a.stage, a.kind, a.microbatch + offset * m) for _, a, offset in placed]


def _cyclic(pattern_row: list[Action], m: int) -> list[tuple[Action, int]]:
    return [(Action(a.stage, a.kind, a.microbatch % m), a.microbatch // m) for a in pattern_row]


def _sequence_pattern(problem: Problem, per_rank: list[list[Action]]) -> Orders | None:
    """Patterns cut at step 1 from per-rank endless sequences given for steps 0 … 2 (``None`` if invalid)."""
    m = problem.pipeline.num_microbatches
    per_step = 3 if problem.split_backward else 2
    try:
        return [pattern_from_sequence(seq, m, per_step * m) for seq in per_rank]
    except ValueError:
        return None


def _one_f_one_b(problem: Problem, in_flight: list[int], deferred: list[int]) -> Orders | None:
    """1F1B without a flush, ``in_flight[r]`` forwards before rank r's first backward and (split backward)
    each W ``deferred[r]`` backward slots after its I (loop placement, one stage per rank)."""
    m = problem.pipeline.num_microbatches
    total = 3 * m
    sequences = []
    for rank, ahead in enumerate(in_flight):
        seq = [Action(rank, ActionKind.FORWARD, g) for g in range(min(ahead, total))]
        for g in range(total):
            if problem.split_backward:
                seq.append(Action(rank, ActionKind.BACKWARD_INPUT, g))
                if g >= deferred[rank]:
                    seq.append(Action(rank, ActionKind.BACKWARD_WEIGHT, g - deferred[rank]))
            else:
                seq.extend(backward(problem, rank, g))
            if g + ahead < total:
                seq.append(Action(rank, ActionKind.FORWARD, g + ahead))
        if problem.split_backward:
            seq.extend(Action(rank, ActionKind.BACKWARD_WEIGHT, g) for g in range(total - deferred[rank], total))
        sequences.append(seq)
    return _sequence_pattern(problem, sequences)


def no_flush_patterns(problem: Problem) -> Iterator[tuple[str, Orders]]:
    """The warm starts of the module docstring, ``(name, pattern)``, each built when asked for: the
    1F1B-without-flush variants first (PipeDream-2BW's own first), then the flushed families, then one
    microbatch at a time (the least memory)."""
    m = problem.pipeline.num_microbatches
    p = problem.pipeline.num_ranks
    if problem.pipeline.placement == "loop" and problem.pipeline.stages_per_rank == 1:
        base = [p - r for r in range(p)]
        # Microbatches each rank's free memory holds (activations only, the extra weight version counted).
        assert problem.memory is not None
        activation = problem.stage_values(problem.memory.activation)
        free = [
            limit - static - extra
            for limit, static, extra in zip(
                problem.memory_limits, problem.static_memory, weight_version_memory(problem), strict=True
            )
        ]
        cap = [
            max(1, int(f // a)) if math.isfinite(f) and a > 0 else m + 1 for f, a in zip(free, activation, strict=True)
        ]
        variants: list[tuple[str, list[int], list[int]]] = [("family:pipedream-2bw", base, [0] * p)]
        for extra in (1, 2, 3):
            variants.append((f"1F1B no flush, p − r + {extra} in flight", [b + extra for b in base], [0] * p))
        for k in (1.5, 2.0):
            variants.append((f"1F1B no flush, {k:g}·(p − r) in flight", [math.ceil(k * b) for b in base], [0] * p))
        seen = {tuple(in_flight) for _, in_flight, _ in variants}
        for name, in_flight, deferred in list(variants):
            capped = [min(n, c) for n, c in zip(in_flight, cap, strict=True)]
            if tuple(capped) not in seen:
                seen.add(tuple(capped))
                variants.append((f"{name}, capped by memory", capped, deferred))
        if problem.split_backward:
            for name, in_flight, _ in list(variants):
                variants.append((f"{name}, W deferred by r", in_flight, list(range(p))))
                variants.append((f"{name}, W deferred by 2r", in_flight, [2 * r for r in range(p)]))
        for name, in_flight, deferred in variants:
            if max(in_flight) > m + 1 or max(deferred) > m:
                continue
            pattern = _one_f_one_b(problem, in_flight, deferred)
            if pattern is not None:
                yield name, pattern
    flushed = problem.with_changes(
        **{
            "training": {"flush": True, "weight_versions": 1, "post_validation": problem.training.post_validation},
            "objective": "makespan",
        }
    )
    for family in applicable_families(flushed):
        try:
            pattern = family.generate(flushed)
        except ValueError:
            continue
        yield f"family:{family.name} (no flush)", pattern
    yield "sequential", sequential_pattern(problem)


def sequential_pattern(problem: Problem) -> Orders:
    """One microbatch at a time through the whole pipeline, as a pattern: the least memory any schedule has."""
    inst = compile_problem(problem, step_actions=False)
    return action_orders(inst, sequential_orders(inst))


EVALUATION_S_PER_ACTION = 2e-5
"""Seconds per unrolled action assumed for the first timing of a pattern (then measured)."""


class _Search(SearchContext[SteadyState]):
    """One no-flush search: the shared :class:`~pipesched.optimizer.progress.SearchContext` over timed patterns
    (the incumbent's value is its step period), with the problem and its pattern evaluator."""

    def __init__(self, problem: Problem, progress: ProgressCallback | None, should_stop: StopCheck | None) -> None:
        started = time.perf_counter()
        limit = problem.solver.time_limit_s
        evaluator = SteadyStateEvaluator(problem)
        # Leave room to build the answer (one steady-state copy as pydantic objects, ~40 µs per action here).
        margin = min(0.25 * limit, 0.2 + 5e-5 * len(evaluator.base.actions))
        super().__init__(started, started + limit - margin, progress, should_stop)
        self.problem = problem
        self.evaluator = evaluator
        # The longest evaluation so far (before the first: a guess from the unrolled size, measured here at
        # 10–40 µs per unrolled action): no new one starts that would end past the deadline.
        self.step_s = EVALUATION_S_PER_ACTION * MIN_STEPS * len(evaluator.base.actions)

    def offer(self, pattern: Orders, backend: str, *, checked: bool = False) -> bool | None:
        """Time ``pattern``; keep it when it fits and is no longer than the best. ``None``: not valid."""
        if not self.evaluator.fits(pattern):
            return None
        try:
            with self.step():
                state = self.evaluator.evaluate(pattern, checked=checked)
        except InvalidSchedule:
            return None
        if not state.fits:
            return None
        if self.improve(state, state.step_period, backend, f"{backend}: step period {state.step_period:.3f} ms"):
            return True
        if self.best is not None and state.step_period <= self.best_value + 1e-9:
            self.best, self.best_value = state, state.step_period  # a sideways move: same period, keep walking
            return True
        return False


def solve_steady_state(
    problem: Problem,
    *,
    progress: ProgressCallback | None = None,
    should_stop: StopCheck | None = None,
) -> Schedule:
    """Search the no-flush pattern with the least ``step_period`` under the memory limit (module docstring).

    Returns:
        A schedule with ``step_period``, ``lower_bound`` and ``gap`` on it, status ``optimal`` when the bound
        is met; or ``infeasible`` with ``min_memory_limit`` (static + the extra weight versions + one
        microbatch's activations per rank).
    """
    search = _Search(problem, progress, should_stop)
    evaluator = search.evaluator
    versions = weight_version_memory(problem)
    inst = dataclasses.replace(
        evaluator.base, static=[s + x for s, x in zip(evaluator.base.static, versions, strict=True)]
    )
    reason = infeasibility_reason(inst)
    if reason is not None:
        return infeasible_schedule(
            problem,
            method="auto",
            backend="bounds",
            reason=f"{reason} (static includes the second weight version: memory.weights)",
            min_memory_limit=min_memory_limit(inst),
            solve_time_s=search.elapsed(),
        )
    search.lower_bound = step_period_lower_bound(problem, evaluator.base)
    search.report("bounds", f"lower bound {search.lower_bound:.3f} ms")
    flushed_tried = False
    for index, (name, pattern) in enumerate(no_flush_patterns(problem)):
        if search.should_stop():
            break
        if not flushed_tried and (index > 0 or name != "family:pipedream-2bw"):
            # Right after PipeDream-2BW (when it is not already at the bound): the strongest warm start
            # where memory is tight.
            flushed_tried = True
            # Where 2BW does not fit, memory is tight and the flushed search is the best hope: more time.
            share = FLUSHED_SEARCH_SHARE if search.best is not None else FLUSHED_SEARCH_SHARE_TIGHT
            _flushed_search(search, share)
            if search.should_stop():
                break
        search.offer(pattern, name)
    if search.best is None:  # out of time before anything fitted: the sequential pattern always does
        search.offer(sequential_pattern(problem), "sequential")
    assert search.best is not None, "the sequential pattern fits whenever the limit admits one microbatch"
    _local_search(search)
    best = search.best
    return schedule_from_steady_state(
        problem,
        best,
        method="auto",
        backend=search.best_backend,
        lower_bound=search.lower_bound,
        solve_time_s=search.elapsed(),
    )


FLUSHED_SEARCH_SHARE = 0.4
"""The share of the time left that the flushed search (the ``auto`` portfolio) gets as a warm start."""

FLUSHED_SEARCH_SHARE_TIGHT = 0.7
"""Its share when PipeDream-2BW does not fit the limit."""


def _flushed_search(search: _Search, share: float) -> None:
    """The best flushed schedule ``auto`` finds in ``share`` of the time left, at the limit
    less the extra weight versions, as a pattern: its steps then overlap without a flush. Where memory is too
    tight for 1F1B's p − r microbatches in flight, this is the strong warm start."""
    problem = search.problem
    # Keep time to time the answer as a pattern afterwards.
    budget = (search.deadline - time.perf_counter() - search.step_s) * share
    if budget < 0.2:
        return
    static = [s + x for s, x in zip(problem.static_memory, weight_version_memory(problem), strict=True)]
    flushed = problem.with_changes(
        **{
            "training": {"flush": True, "weight_versions": 1, "post_validation": True},
            "objective": "stage_span",
            "memory.static": static,
            "memory.weights": None,
            "costs.optimizer_step": None,  # the pattern's timing adds it (and the reductions) at each step
            "costs.reduce_grad": None,
            "costs.unshard": None,
            "data_parallel": None,
            "solver.time_limit_s": budget,
        }
    )
    schedule = solve_auto(flushed, should_stop=search.user_stop)
    if schedule.status != "infeasible":
        search.offer(compute_only(schedule.orders()), f"auto (flushed: {schedule.backend}) without its flush")


def _local_search(search: _Search) -> None:
    """Single-action moves on the best pattern until the deadline (module docstring, step 4)."""
    rng = random.Random(search.problem.solver.seed)
    m = search.problem.pipeline.num_microbatches
    while not search.should_stop():
        assert search.best is not None
        pattern = search.best.pattern
        rank = rng.randrange(len(pattern))
        row = _cyclic(pattern[rank], m)
        if len(row) < 2:
            continue
        if rng.random() < 0.2:
            # The step's last action and the next step's first trade places across the boundary.
            (first, first_delta), (last, last_delta) = row[0], row[-1]
            moved = [(last, last_delta - 1), *row[1:-1], (first, first_delta + 1)]
        else:
            i = rng.randrange(len(row))
            j = min(len(row) - 1, max(0, i + rng.choice((-3, -2, -1, 1, 2, 3))))
            moved = list(row)
            moved.insert(j, moved.pop(i))
        new_row = canonical_pattern(moved, m)
        if new_row is None or new_row == pattern[rank]:
            continue
        candidate = [list(r) for r in pattern]
        candidate[rank] = new_row
        search.offer(candidate, "heuristic", checked=True)
