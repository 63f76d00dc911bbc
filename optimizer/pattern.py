"""Schedules without a flush (``training.flush: false``, PipeDream-2BW) as a repeating per-rank pattern.

A no-flush schedule is one **pattern** per rank: the actions the rank runs between the end of its step
t−1 and the end of its step t, in order. Microbatch ids name the step: ``j`` (``0 ≤ j < m``) is
microbatch j of step t, ``m + j`` is microbatch j of step t+1 (a forward, or with split backward any pass,
started before step t ends). Every action of the rank appears once modulo m, and the row ends with an
action of step t (the rank's step boundary, where its optimizer step runs). Nothing of step t+2 can come
before step t ends: two weight versions (PipeDream-2BW, Narayanan et al. 2020, §3.1) — step t+1's
microbatches use the version that exists when step t starts, the update after step t makes the version
step t+2 uses, so a rank holds the version of the steps in flight and the next one, never three.

With split backward a microbatch's I and W use the version of its F; the version is released only after
the last W that uses it, which is the step's last action at the latest, so the pattern shape above already
keeps the count at two.

**Timing** (no second simulator): :func:`unroll` lays K
copies of the pattern end to end — copy c (c = −1 … K−1) shifts microbatch ids by c·m and keeps the ids in
``[0, K·m)`` — into one instance of K·m microbatches (dependencies stay within a microbatch), and
:func:`pipesched.optimizer.simulate.simulate_indexed` times it. Copy −1 keeps only step 0's early passes
(the warm-up), copy K−1 drops step K's (the drain), so the K-step run is exactly the first K steps of the
endless one. Rank r's **step end** E_r(t) is the end of its last action of step t, plus
``costs.optimizer_step[r]`` (the rank's update runs right after it, on the rank: the action's duration is
extended, no global barrier). The steps' ends of a repeating schedule are eventually periodic
(max-plus linear systems: E(t + c) = E(t) + c·λ after a transient, cyclicity c); the ``step_period`` is λ,
read from the last steps once every rank's E(t) − E(t − c) is the same over two windows, with K doubled
(from :data:`MIN_STEPS`) until that holds.

**Data parallelism** (d > 1, sharding ``none`` or ``optimizer``; PipeDream-2BW, Narayanan et al. 2020, §3: the
gradients are all-reduced every step): per step t and stage s a ``REDUCE_GRAD`` on the rank's communication
stream after s's last backward of step t, and per rank an ``OPTIMIZER_STEP`` after its stages' reductions of
step t. Two weight versions let the update of step t wait until the rank's first forward of step t+2 (which
computes with the version it makes): it runs there, so the reductions overlap step t+1's passes as far as the
pattern allows. In the pattern's rows each stage's ``REDUCE_GRAD`` follows its last backward of the step and
``OPTIMIZER_STEP`` precedes the first action of the next step (or starts the row when there is none):
:func:`pattern_with_communication`. The step ends E_r(t) stay the ends of the rank's last pass of step t.

**Memory**: static memory plus the extra weight versions
(:func:`~pipesched.optimizer.problem.weight_version_memory`: weights only) plus the activations of every
microbatch in flight, counted by the same simulator over the K steps (the warm-up never holds more than the
steady state of a repeating pattern, and the peak is taken over all).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pipesched.optimizer.instance import Instance, compile_problem
from pipesched.optimizer.ir import Action, ActionKind, Orders
from pipesched.optimizer.problem import Problem, weight_version_memory
from pipesched.optimizer.simulate import InvalidSchedule, SimulationResult, check_placement, simulate_indexed

if TYPE_CHECKING:
    from pipesched.optimizer.result import Schedule

__all__ = [
    "MAX_STEPS",
    "MIN_STEPS",
    "SteadyState",
    "SteadyStateEvaluator",
    "check_pattern",
    "memory_timelines",
    "pattern_from_sequence",
    "pattern_memory_timelines",
    "pattern_with_communication",
    "repeating_schedule",
    "schedule_from_steady_state",
    "steady_state",
    "step_period_lower_bound",
    "unroll",
]

MIN_STEPS = 8
"""Steps unrolled first; doubled until the period is stable (at most :data:`MAX_STEPS`)."""

MAX_STEPS = 64
"""Most steps unrolled (also capped so the unrolled instance stays within the problem's size limits)."""

_TOLERANCE_MS = 1e-6


@dataclass
class SteadyState:
    """The timing of a pattern in steady state.

    Attributes:
        pattern: per-rank pattern (module docstring), microbatch ids in ``[0, 2m)``.
        steps: K, the steps unrolled.
        instance: the unrolled instance (K·m microbatches; static includes the extra weight versions).
        simulation: the unrolled run (times ms, memory bytes).
        step_ends: ``step_ends[t][r]`` = E_r(t), ms from the run's first start (the last step is the drain's).
        step_period: λ, ms per step in steady state.
        cyclicity: c, steps after which the timing repeats (1 for most patterns).
        converged: whether λ was read from a periodic tail; false means the mean of the last half.
        window_step: the step whose pattern copy the answer shows with times.
        peak_memory: per rank, bytes over the whole run (static, weight versions and activations).
        fits: whether every rank stayed within its limit.
    """

    pattern: Orders
    steps: int
    instance: Instance
    simulation: SimulationResult
    step_ends: list[list[float]]
    step_period: float
    cyclicity: int
    converged: bool
    window_step: int
    peak_memory: list[float]
    fits: bool

    def window(self) -> list[list[tuple[Action, float, float]]]:
        """Per rank, the pattern copy of :attr:`window_step` as ``(action as in the pattern, start, end)``,
        times in ms from the earliest start of that copy over all ranks."""
        m = self.instance.num_microbatches // self.steps
        sim = self.simulation
        rows = []
        shown = self.pattern
        if self.instance.has_step_actions:
            shown = _rows_with_communication(self.pattern, m, self.instance.problem.data_parallel_size > 1)
        for rank, rank_row in enumerate(shown):
            late = 1 if any(a.microbatch >= m for a in self.pattern[rank]) else 2
            row = []
            for action in rank_row:
                if action.kind == ActionKind.REDUCE_GRAD:
                    unrolled = Action(action.stage, action.kind, self.window_step)
                elif action.kind == ActionKind.OPTIMIZER_STEP:
                    unrolled = Action(rank, action.kind, self.window_step - late)
                    if unrolled not in self.instance.index:
                        continue  # the window's copy updates no step (the run's start)
                else:
                    unrolled = _shift(action, self.window_step * m)
                idx = self.instance.index[unrolled]
                row.append((action, sim.start[idx], sim.end[idx]))
            rows.append(row)
        origin = min((row[0][1] for row in rows if row), default=0.0)
        return [[(a, s - origin, e - origin) for a, s, e in row] for row in rows]


def _shift(action: Action, offset: int) -> Action:
    return Action(action.stage, action.kind, action.microbatch + offset)


def _optimizer_position(row: list[Action], num_microbatches: int) -> int:
    """Where a pattern row's OPTIMIZER_STEP stands: before its first action of the next step, else first."""
    return next((k for k, action in enumerate(row) if action.microbatch >= num_microbatches), 0)


def _reduce_positions(row: list[Action], num_microbatches: int) -> dict[int, int]:
    """Per stage of the row, the position of its last backward (W, or B) of the row's own step."""
    last: dict[int, int] = {}
    for k, action in enumerate(row):
        if action.kind in (ActionKind.BACKWARD_WEIGHT, ActionKind.BACKWARD) and action.microbatch < num_microbatches:
            last[action.stage] = k
    return last


def pattern_with_communication(problem: Problem, pattern: Orders) -> Orders:
    """The pattern's rows with each stage's ``REDUCE_GRAD`` after its last backward of the step and the rank's
    ``OPTIMIZER_STEP`` where its update runs (module docstring, data parallelism); ``pattern`` as it is
    without data parallelism."""
    if not problem.has_step_actions:
        return [list(row) for row in pattern]
    return _rows_with_communication(pattern, problem.pipeline.num_microbatches, problem.data_parallel_size > 1)


def _rows_with_communication(pattern: Orders, m: int, reduces: bool) -> Orders:
    rows: Orders = []
    for rank, row in enumerate(pattern):
        positions = _reduce_positions(row, m) if reduces else {}
        optimizer = _optimizer_position(row, m)
        out: list[Action] = []
        for k, action in enumerate(row):
            if k == optimizer:
                out.append(Action(rank, ActionKind.OPTIMIZER_STEP, 0))
            out.append(action)
            out.extend(Action(s, ActionKind.REDUCE_GRAD, 0) for s, at in sorted(positions.items()) if at == k)
        rows.append(out)
    return rows


def check_pattern(inst: Instance, pattern: Orders) -> None:
    """Check that ``pattern`` has the shape of the module docstring for the one-step instance ``inst``.

    Raises:
        InvalidSchedule: ``malformed`` (rank count), ``unknown_action``/``wrong_rank`` (an action the rank does
            not have, or an id outside ``[0, 2m)``), ``duplicate_action``/``missing_action`` (each action once
            modulo m), ``weight_versions`` (a row that does not end with an action of its own step).
    """
    m = inst.num_microbatches
    if len(pattern) != inst.num_ranks:
        raise InvalidSchedule(
            "malformed",
            f"the pattern has {len(pattern)} ranks but the problem has {inst.num_ranks}",
            expected=inst.num_ranks,
            got=len(pattern),
        )
    seen: set[int] = set()
    for rank, row in enumerate(pattern):
        for action in row:
            base = Action(action.stage, action.kind, action.microbatch % m) if action.microbatch < 2 * m else None
            idx = inst.index.get(base) if base is not None else None
            check_placement(
                inst,
                rank,
                action,
                idx,
                seen,
                unknown=(
                    f"a pattern of this problem cannot hold (microbatch ids 0 … {m - 1} for this step, {m} … "
                    f"{2 * m - 1} for the next)"
                ),
                twice=f" modulo {m} microbatches",
            )
        if row and row[-1].microbatch >= m:
            raise InvalidSchedule(
                "weight_versions",
                f"rank {rank}'s pattern ends with {row[-1]}, an action of the next step: a pattern ends with the "
                "last action of its own step (the step boundary), and nothing two steps ahead may run before it "
                "(two weight versions)",
                rank=rank,
                action=str(row[-1]),
            )
    if len(seen) != len(inst.actions):
        missing = [inst.actions[i] for i in range(len(inst.actions)) if i not in seen]
        first = missing[0]
        raise InvalidSchedule(
            "missing_action",
            f"{len(missing)} action(s) missing from the pattern, first {first} on rank {inst.rank[inst.index[first]]}",
            rank=inst.rank[inst.index[first]],
            action=str(first),
            count=len(missing),
        )


def unroll(pattern: Orders, num_microbatches: int, steps: int) -> Orders:
    """The first ``steps`` steps of a pattern as one run: per-rank orders over ``steps · m`` microbatches.

    Global microbatch ``g`` is microbatch ``g mod m`` of step ``g // m``; copy c of the pattern (c = −1 … K−1)
    shifts ids by c·m and keeps those in ``[0, K·m)``. This is what a runtime executes for ``--steps K``.
    """
    m = num_microbatches
    total = steps * m
    orders: Orders = []
    for row in pattern:
        out: list[Action] = []
        for copy in range(-1, steps):
            offset = copy * m
            for action in row:
                g = action.microbatch + offset
                if 0 <= g < total:
                    out.append(Action(action.stage, action.kind, g))
        orders.append(out)
    return orders


def pattern_from_sequence(sequence: list[Action], num_microbatches: int, length: int, step: int = 1) -> list[Action]:
    """One rank's pattern cut from a longer run of it in global microbatch ids (``g = t·m + j``).

    The pattern is the ``length`` actions ending with the last action of ``step`` in ``sequence``, ids taken
    relative to ``step`` (so ``j`` or ``m + j``). ``sequence`` must cover ``step`` and the steps around it.

    Raises:
        ValueError: when the cut holds an action of an earlier step or of ``step + 2`` (not a valid pattern).
    """
    m = num_microbatches
    last = max(k for k, action in enumerate(sequence) if action.microbatch // m == step)
    first = last - length + 1
    if first < 0:
        raise ValueError(f"the sequence is too short to cut a pattern of {length} actions ending at step {step}")
    row = []
    for action in sequence[first : last + 1]:
        relative = action.microbatch - step * m
        if not 0 <= relative < 2 * m:
            raise ValueError(f"{action} lies outside steps {step} and {step + 1}: not a two-version pattern")
        row.append(Action(action.stage, action.kind, relative))
    return row


class SteadyStateEvaluator:
    """Times patterns of one problem, keeping the unrolled instances (they depend on K only).

    Args:
        problem: a problem with ``training.flush`` false (validated).
    """

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.base = compile_problem(problem, step_actions=False)
        self.m = problem.pipeline.num_microbatches
        self._unrolled: dict[int, Instance] = {}
        self._optimizer = problem.rank_values(problem.costs.optimizer_step if problem.costs else None, 0.0)
        stages = problem.pipeline.num_stages
        self.max_steps = max(
            MIN_STEPS,
            min(MAX_STEPS, 100_000 // self.m, 1_000_000 // (self.m * stages)),
        )

    def unrolled_instance(self, steps: int) -> Instance:
        """The instance of ``steps`` steps (K·m microbatches), static memory plus the extra weight versions; with
        data parallelism also each step's reductions and optimizer steps (:func:`_add_step_communication`)."""
        inst = self._unrolled.get(steps)
        if inst is None:
            unrolled = self.problem.with_changes(**{"pipeline.num_microbatches": steps * self.m})
            inst = compile_problem(unrolled, step_actions=False)
            extra = weight_version_memory(self.problem)
            inst = dataclasses.replace(inst, static=[s + x for s, x in zip(inst.static, extra, strict=True)])
            if self.problem.has_step_actions:
                _add_step_communication(inst, self.problem, steps)
            self._unrolled[steps] = inst
        return inst

    def peak_memory(self, pattern: Orders) -> list[float]:
        """Per rank, the most bytes the pattern ever holds (static, extra weight versions, activations), from
        the orders alone: a rank's memory changes only through its own actions, which never overlap, so the
        levels do not depend on the times. A copy of the pattern frees what it allocates, so the warm-up copy
        and one full copy reach every level there is."""
        extra = weight_version_memory(self.problem)
        m = self.m
        per_microbatch = len(self.base.actions) // m
        delta = {(a.stage, a.kind): self.base.mem_delta[i] for i, a in enumerate(self.base.actions[:per_microbatch])}
        peaks = []
        for rank, row in enumerate(pattern):
            level = self.base.static[rank] + extra[rank]
            peak = level
            for copy in (-1, 0):
                for action in row:
                    if action.microbatch + copy * m >= 0:
                        level += delta[action.stage, action.kind]
                        peak = max(peak, level)
            peaks.append(peak)
        return peaks

    def fits(self, pattern: Orders) -> bool:
        """Whether :meth:`peak_memory` stays within every rank's limit."""
        return all(
            peak <= limit * (1 + 1e-12) + 1e-9
            for peak, limit in zip(self.peak_memory(pattern), self.base.limit, strict=True)
        )

    def evaluate(self, pattern: Orders, *, checked: bool = False) -> SteadyState:
        """Time ``pattern`` (module docstring).

        Raises:
            InvalidSchedule: a malformed pattern (:func:`check_pattern`) or a ``deadlock`` of the unrolled run.
        """
        if not checked:
            check_pattern(self.base, pattern)
        steps = MIN_STEPS
        while True:
            state = self._run(pattern, steps)
            if state.converged or steps >= self.max_steps:
                return state
            steps = min(2 * steps, self.max_steps)

    def _run(self, pattern: Orders, steps: int) -> SteadyState:
        inst = self.unrolled_instance(steps)
        m = self.m
        total = steps * m
        duration = list(inst.duration)
        # compile_problem lays out microbatch after microbatch, the same actions in the same order for each
        # (one chain), so action (stage, kind, g) has index g·A + its index for microbatch 0.
        per_microbatch = len(self.base.actions) // m
        local = {(a.stage, a.kind): i for i, a in enumerate(self.base.actions[:per_microbatch])}
        orders: list[list[int]] = []
        boundary: list[list[int]] = []  # per rank, the index of the last action of each step
        for rank, row in enumerate(pattern):
            cells = [(action.microbatch, local[action.stage, action.kind]) for action in row]
            ids: list[int] = []
            ends: list[int] = []
            for copy in range(-1, steps):
                offset = copy * m
                for microbatch, position in cells:
                    g = microbatch + offset
                    if 0 <= g < total:
                        ids.append(g * per_microbatch + position)
                if copy >= 0 and cells:
                    last = (cells[-1][0] + offset) * per_microbatch + cells[-1][1]
                    ends.append(last)
                    if not inst.has_step_actions:
                        duration[last] += self._optimizer[rank]  # with d > 1 OPTIMIZER_STEP is an action
            if inst.has_step_actions:
                ids = _with_step_communication(inst, pattern, rank, ids, steps)
            orders.append(ids)
            boundary.append(ends)
        timed = dataclasses.replace(inst, duration=duration)
        sim = simulate_indexed(timed, orders, check_memory=False)
        step_ends = [
            [sim.end[boundary[r][t]] if boundary[r] else 0.0 for r in range(len(pattern))] for t in range(steps)
        ]
        # Copy K−1 lost the next step's early passes (the drain), which speeds up its own last actions: only
        # steps 0 … K−2 are those of the endless run.
        period, cyclicity, converged, window = _period(step_ends[:-1])
        return SteadyState(
            pattern=pattern,
            steps=steps,
            instance=timed,
            simulation=sim,
            step_ends=step_ends,
            step_period=period,
            cyclicity=cyclicity,
            converged=converged,
            window_step=window,
            peak_memory=sim.peak_memory,
            fits=sim.fits,
        )


def _add_step_communication(inst: Instance, problem: Problem, steps: int) -> None:
    """Append per step t: ``REDUCE_GRAD(s, t)`` after every last backward (W or B) of stage s in step t, on the
    communication stream, and ``OPTIMIZER_STEP(r, t)`` after rank r's reductions of step t, on its compute
    stream (module docstring). Microbatch ids of these actions are step numbers."""
    assert problem.costs is not None
    m = problem.pipeline.num_microbatches
    reduces = problem.data_parallel_size > 1
    reduce_grad = problem.stage_values(problem.costs.reduce_grad or 0.0)
    reduce_grad_wait = problem.stage_values(problem.costs.reduce_grad_wait or 0.0)
    optimizer = problem.rank_values(problem.costs.optimizer_step, 0.0)
    inst.num_passes = len(inst.actions)
    inst.stream = [0] * inst.num_passes
    inst.has_step_actions = True
    inst.sync_before_step = False  # no flush: nothing waits for the other ranks

    def add(action: Action, rank: int, duration: float, stream: int, preds: list[int]) -> None:
        idx = len(inst.actions)
        inst.actions.append(action)
        inst.index[action] = idx
        inst.rank.append(rank)
        inst.duration.append(duration)
        inst.mem_delta.append(0.0)
        inst.stream.append(stream)
        inst.preds.append([(p, 0.0) for p in preds])
        inst.succs.append([])
        inst.rank_actions[rank].append(idx)
        for p in preds:
            inst.succs[p].append((idx, 0.0))

    final = ActionKind.BACKWARD_WEIGHT if inst.split_backward else ActionKind.BACKWARD
    for t in range(steps):
        finals = {
            stage: [inst.action_id(stage, final, t * m + j) for j in range(m)] for stage in range(len(inst.stage_ranks))
        }
        if reduces:
            for stage, rank in enumerate(inst.stage_ranks):
                duration = reduce_grad[inst.model_stage[stage]]
                add(Action(stage, ActionKind.REDUCE_GRAD, t), rank, duration, 1, finals[stage])
                if reduce_grad_wait[inst.model_stage[stage]] > 0:  # as the flushed step's (instance.py)
                    inst.replica_wait[len(inst.actions) - 1] = reduce_grad_wait[inst.model_stage[stage]]
        for rank in range(inst.num_ranks):
            local = _local_stages(inst, rank)
            if reduces:
                after = [inst.index[Action(s, ActionKind.REDUCE_GRAD, t)] for s in local]
            else:
                after = [idx for s in local for idx in finals[s]]
            add(Action(rank, ActionKind.OPTIMIZER_STEP, t), rank, optimizer[rank], 0, after)
            inst.optimizer_steps.append(len(inst.actions) - 1)


def _local_stages(inst: Instance, rank: int) -> list[int]:
    return [s for s, r in enumerate(inst.stage_ranks) if r == rank]


def _with_step_communication(inst: Instance, pattern: Orders, rank: int, ids: list[int], steps: int) -> list[int]:
    """One rank's unrolled order (``ids``) with its reductions and optimizer steps inserted where
    :func:`pattern_with_communication` puts them in every copy; updates no copy places go last."""
    m = inst.num_microbatches // steps
    per_microbatch = inst.num_passes // inst.num_microbatches
    row = pattern[rank]
    reduces = _reduce_positions(row, m) if inst.problem.data_parallel_size > 1 else {}
    optimizer_at = _optimizer_position(row, m)
    late = 1 if any(action.microbatch >= m for action in row) else 2  # copy c updates step c − late
    placed: set[int] = set()
    out: list[int] = []
    position = 0  # index into ids, which hold the copies' kept actions in order
    for copy in range(-1, steps):
        for k, action in enumerate(row):
            if k == optimizer_at and 0 <= copy - late < steps:
                out.append(inst.index[Action(rank, ActionKind.OPTIMIZER_STEP, copy - late)])
                placed.add(copy - late)
            g = action.microbatch + copy * m
            if not 0 <= g < steps * m:
                continue
            assert ids[position] // per_microbatch == g
            out.append(ids[position])
            position += 1
            if g < (copy + 1) * m:  # an action of the copy's own step
                out.extend(
                    inst.index[Action(s, ActionKind.REDUCE_GRAD, copy)] for s, at in sorted(reduces.items()) if at == k
                )
    out.extend(inst.index[Action(rank, ActionKind.OPTIMIZER_STEP, t)] for t in range(steps) if t not in placed)
    return out


def _period(step_ends: list[list[float]]) -> tuple[float, int, bool, int]:
    """``(λ, cyclicity, converged, window step)`` from per-step, per-rank ends (module docstring).

    Cyclicity c holds when, on every rank, E(s) − E(s−c) is the same for the last ``max(2c, 4)`` steps s
    and the c steps before each of them.
    """
    steps = len(step_ends)
    ranks = len(step_ends[0]) if step_ends else 0
    last = steps - 1
    for c in range(1, 7):
        window = max(2 * c, 4)
        if last - window + 1 - 2 * c < 0:
            break
        stable = True
        for r in range(ranks):
            for s in range(last - window + 1, last + 1):
                now = step_ends[s][r] - step_ends[s - c][r]
                before = step_ends[s - c][r] - step_ends[s - 2 * c][r]
                if abs(now - before) > _TOLERANCE_MS * max(1.0, abs(now)):
                    stable = False
                    break
            if not stable:
                break
        if stable:
            spans = [step_ends[last][r] - step_ends[last - c][r] for r in range(ranks)]
            return max(spans) / c, c, True, last - c
    half = steps // 2
    rates = [(step_ends[last][r] - step_ends[half - 1][r]) / (last - half + 1) for r in range(ranks)]
    return max(rates), 1, False, max(0, last - 1)


def steady_state(problem: Problem, pattern: Orders) -> SteadyState:
    """Time one pattern of ``problem`` (a fresh :class:`SteadyStateEvaluator`).

    Raises:
        InvalidSchedule: as :meth:`SteadyStateEvaluator.evaluate`.
    """
    return SteadyStateEvaluator(problem).evaluate(pattern)


def step_period_lower_bound(problem: Problem, inst: Instance | None = None) -> float:
    """A lower bound on the ``step_period`` of every pattern, ms: the larger of

    * **work**: the busiest rank's work per step, ``max_r (compute_r + optimizer_step_r)``;
    * **communication** (d > 1): the busiest communication stream per step, ``max_r Σ_{s on r} reduce_grad_s``;
    * **memory (Little's law)**: a microbatch holds ``activation_s`` on stage s from its F's start until its
      I (B) ends, at least ``D_s`` = the longest dependency path from that F's start to that I's end, and
      ``retained_for_weight_s`` for at least its W's duration after that; each step brings m microbatches
      and a rank holds at most ``limit − static − extra weight versions`` on average, so
      ``λ ≥ m · Σ_{s on r} (activation_s·D_s + retained_s·T_W,s) / (limit_r − static_r − versions_r)``.

    For 1F1B without a flush (PipeDream-2BW) at a limit of p activations, fused backward and uniform costs,
    the memory term is ``m·(F + B) + 2·m·(p−1)·p2p / p``: its step period when p divides m.
    """
    from pipesched.optimizer.bounds import _topological

    inst = inst or compile_problem(problem, step_actions=False)
    optimizer = problem.rank_values(problem.costs.optimizer_step if problem.costs else None, 0.0)
    bound = max(c + o for c, o in zip(inst.compute, optimizer, strict=True))
    if problem.data_parallel_size > 1 and problem.costs is not None and problem.costs.reduce_grad is not None:
        reduce_grad = problem.stage_values(problem.costs.reduce_grad)
        communication = [0.0] * inst.num_ranks
        for stage, rank in enumerate(inst.stage_ranks):
            communication[rank] += reduce_grad[inst.model_stage[stage]]
        bound = max(bound, max(communication))
    versions = weight_version_memory(problem)
    m = inst.num_microbatches
    backward = inst.backward_kind
    microbatch_actions: dict[int, list[int]] = {}
    for idx, action in enumerate(inst.actions):
        microbatch_actions.setdefault(action.microbatch, []).append(idx)
    for r in range(inst.num_ranks):
        capacity = inst.limit[r] - inst.static[r] - versions[r]
        if not math.isfinite(capacity):
            continue
        memory_time = 0.0
        by_chain: dict[tuple[int, ...], float] = {}
        for j in range(m):
            chain = tuple(inst.chains[j])
            if chain not in by_chain:
                by_chain[chain] = _held(inst, r, j, _topological(inst, microbatch_actions[j]), backward)
            memory_time += by_chain[chain]
        if capacity <= 0:
            return math.inf
        bound = max(bound, memory_time / capacity)
    return bound


def _held(inst: Instance, rank: int, microbatch: int, order: list[int], backward: ActionKind) -> float:
    """Least bytes × ms microbatch ``microbatch`` holds on ``rank`` (see :func:`step_period_lower_bound`)."""
    from pipesched.optimizer.bounds import _longest_from

    total = 0.0
    for stage in _stages_of(inst, rank, microbatch):
        f = inst.action_id(stage, ActionKind.FORWARD, microbatch)
        b = inst.action_id(stage, backward, microbatch)
        dist = _longest_from(inst, f, order)
        total += inst.mem_delta[f] * (dist[b] + inst.duration[b])
        if inst.split_backward:
            w = inst.action_id(stage, ActionKind.BACKWARD_WEIGHT, microbatch)
            total += -inst.mem_delta[w] * inst.duration[w]
    return total


def _stages_of(inst: Instance, rank: int, microbatch: int) -> Iterable[int]:
    return [s for s in inst.chains[microbatch] if inst.stage_ranks[s] == rank]


def schedule_from_steady_state(
    problem: Problem,
    state: SteadyState,
    *,
    method: str,
    backend: str,
    lower_bound: float | None = None,
    solve_time_s: float = 0.0,
) -> Schedule:
    """The answer for a pattern: ``ranks`` hold the pattern with the times of one steady-state copy
    (:meth:`SteadyState.window`, ms from that copy's first start), ``step_period`` = ``step_time`` = λ,
    ``makespan`` and ``stage_span`` of that copy, ``peak_memory`` over the whole unrolled run (static, the
    extra weight versions and activations), ``bubble_rate`` = (λ − ideal) / λ with ideal the busiest rank's
    compute per step. ``status`` is ``optimal`` when ``lower_bound`` meets λ."""
    from pipesched.optimizer.result import OPTIMALITY_TOLERANCE_MS, ActionTiming, RankSchedule, Schedule

    period = state.step_period
    window = state.window()
    gap = None
    status: Literal["optimal", "feasible"] = "feasible"
    if lower_bound is not None:
        lower_bound = min(lower_bound, period)
        gap = max(0.0, (period - lower_bound) / period) if period > 0 else 0.0
        if period - lower_bound <= OPTIMALITY_TOLERANCE_MS:
            gap, status = 0.0, "optimal"
    ranks = [
        RankSchedule(
            rank=rank,
            actions=[
                ActionTiming(
                    action=str(action),
                    stage=None if action.kind == ActionKind.OPTIMIZER_STEP else action.stage,
                    kind=action.kind.value,
                    microbatch=action.microbatch if action.is_compute else None,
                    start=round(start, 6),
                    end=round(end, 6),
                )
                for action, start, end in row
            ],
        )
        for rank, row in enumerate(window)
    ]
    ends = [row[-1][2] for row in window if row]
    spans = [row[-1][2] - row[0][1] for row in window if row]
    ideal = max(state.instance.compute) / state.steps
    return Schedule(
        status=status,
        method=method,
        backend=backend,
        objective=problem.objective,
        makespan=round(max(ends, default=0.0), 6),
        stage_span=round(max(spans, default=0.0), 6),
        step_time=round(period, 6),
        step_period=round(period, 6),
        lower_bound=None if lower_bound is None else round(lower_bound, 6),
        gap=gap,
        bubble_rate=round((period - ideal) / period, 6) if period > 0 else 0.0,
        peak_memory=state.peak_memory,
        solve_time_s=round(solve_time_s, 4),
        stage_to_rank=problem.pipeline.stage_to_rank,
        ranks=ranks,
        problem=problem,
        fits_memory=state.fits,
    )


def repeating_schedule(
    problem: Problem,
    pattern: Orders,
    *,
    method: str,
    backend: str = "family",
    started: float | None = None,
    lower_bound: float | None = None,
) -> Schedule:
    """Time ``pattern`` and wrap it as a :class:`~pipesched.optimizer.result.Schedule` (memory not enforced:
    ``fits_memory`` says whether it fits).

    Raises:
        InvalidSchedule: as :meth:`SteadyStateEvaluator.evaluate`.
    """
    import time

    started = time.perf_counter() if started is None else started
    state = steady_state(problem, pattern)
    return schedule_from_steady_state(
        problem,
        state,
        method=method,
        backend=backend,
        lower_bound=lower_bound,
        solve_time_s=time.perf_counter() - started,
    )


def memory_timelines(schedule: Schedule) -> tuple[list[list[tuple[float, float]]], list[float]]:
    """Per rank, ``(time ms, bytes)`` steps of its memory and its peak (bytes), by the schedule's shape: a
    repeating pattern's from :func:`pattern_memory_timelines`, a step's from the simulator.

    Raises:
        InvalidSchedule: when a step's orders do not run on its problem.
    """
    if schedule.shape == "pattern":
        return pattern_memory_timelines(schedule), list(schedule.peak_memory)
    from pipesched.optimizer.instance import compile_for_orders
    from pipesched.optimizer.simulate import simulate

    orders = schedule.orders()
    sim = simulate(compile_for_orders(schedule.problem, orders), orders, check_memory=False)
    return sim.memory_timeline, sim.peak_memory


def pattern_memory_timelines(schedule: Schedule) -> list[list[tuple[float, float]]]:
    """Per rank, ``(time ms, bytes)`` steps of a no-flush schedule's shown copy (the times of its ``ranks``):
    static, the extra weight versions and the activations in flight when the copy starts (what the next
    step's early passes allocated in the copy before), then each action's allocation from its start and its
    frees from its end, as :func:`pipesched.optimizer.simulate.simulate` counts them. For the plots and the
    Chrome trace, which cannot re-simulate a pattern on the one-step problem."""
    problem = schedule.problem
    base = compile_problem(problem, step_actions=False)
    m = problem.pipeline.num_microbatches
    per_microbatch = len(base.actions) // m
    delta: dict[tuple[int | None, str], float] = {
        (a.stage, a.kind.value): base.mem_delta[i] for i, a in enumerate(base.actions[:per_microbatch])
    }
    extra = weight_version_memory(problem)
    timelines = []
    for rank_schedule in schedule.ranks:
        rank = rank_schedule.rank
        level = base.static[rank] + extra[rank]
        level += sum(
            delta.get((a.stage, a.kind), 0.0)
            for a in rank_schedule.actions
            if a.microbatch is not None and a.microbatch >= m
        )
        timeline = [(0.0, level)]
        for a in rank_schedule.actions:
            change = delta.get((a.stage, a.kind), 0.0)
            level += change
            timeline.append((a.start if change > 0 else a.end, level))
        timelines.append(timeline)
    return timelines
