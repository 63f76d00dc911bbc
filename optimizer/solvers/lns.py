"""Large-neighbourhood search over CP-SAT: fix most of the incumbent's order, re-optimise a window.

Each step takes a time window of the incumbent's simulated schedule; on every rank the actions that
start inside it form a contiguous segment of the rank's order. :class:`~.cpsat_model.OrderModel`
frees exactly those segments: the actions before them keep their times (constants), the ones after
keep their order but may move in time, and memory is checked with the prefix's bytes as the base.
CP-SAT re-optimises the window with the incumbent as hint and its objective as a cut; the new orders
are re-simulated with the float simulator and kept when the objective improves. Windows sweep the
schedule from its end back to its start with half-window overlap (measured on the Zero Bubble
settings, improvements come from the cool-down and the steady state, not the warm-up), and grow
after a sweep without improvement.

Every few steps the neighbourhood is instead every W of the schedule over the fixed order of the F's
and I's (W can float: it has no successor but its own rank's memory).

No lower bound is claimed (the neighbourhoods are restrictions of the problem).
"""

from __future__ import annotations

import bisect
import time

from pipesched.optimizer.instance import Instance
from pipesched.optimizer.ir import ActionKind
from pipesched.optimizer.progress import Progress, ProgressCallback, StopCheck
from pipesched.optimizer.simulate import InvalidSchedule, SimulationResult, simulate_indexed
from pipesched.optimizer.solvers.base import BackendResult, BackendStatus
from pipesched.optimizer.solvers.cpsat_model import OrderModel, run_model

__all__ = ["LnsBackend", "large_neighbourhood_search", "window_segments"]

_IMPROVEMENT_MS = 1e-6


def _key(sim: SimulationResult, objective: str) -> tuple[float, float]:
    """Lexicographic acceptance: the objective (rounded to the improvement tolerance), then the sum
    over ranks of the per-rank span (stage span) or rank end (makespan)."""
    first = min(sim.start[row[0]] for row in sim.orders if row)
    total = 0.0
    for row in sim.orders:
        if row:
            total += sim.end[row[-1]] - (sim.start[row[0]] if objective == "stage_span" else first)
    value = sim.objective_value(objective)
    return round(value / _IMPROVEMENT_MS) * _IMPROVEMENT_MS, round(total / _IMPROVEMENT_MS) * _IMPROVEMENT_MS


def window_segments(starts: list[list[float]], t_from: float, t_to: float) -> list[tuple[int, int]]:
    """Per rank, the positions ``(lo, hi)`` of the actions starting in ``[t_from, t_to)``.

    Args:
        starts: per rank, the start times (ms) of its actions in order (non-decreasing).
    """
    return [(bisect.bisect_left(row, t_from), bisect.bisect_left(row, t_to)) for row in starts]


def large_neighbourhood_search(
    inst: Instance,
    *,
    objective: str,
    incumbent: list[list[int]],
    time_limit_s: float,
    num_workers: int = 2,
    window_actions: int = 200,
    window_time_limit_s: float = 2.0,
    weights_every: int = 4,
    adaptive: bool = True,
    progress: ProgressCallback | None = None,
    should_stop: StopCheck | None = None,
) -> BackendResult:
    """Improve ``incumbent`` (per-rank FIFO orders that fit memory) by window re-optimisation.

    Args:
        inst: the compiled problem.
        objective: ``"makespan"`` or ``"stage_span"``.
        incumbent: the warm start; must fit the memory limits.
        time_limit_s: total wall-clock budget, s.
        window_actions: about how many actions each window frees (grows by half after a fruitless sweep).
        window_time_limit_s: CP-SAT budget per window, s.
        adaptive: grow a window by a quarter after CP-SAT closes it in under half its budget,
            shrink it by a fifth when CP-SAT cannot close it.
        weights_every: every this many steps, the neighbourhood is instead "all W's float over the
            fixed F/I skeleton" (split backward only; 0 turns it off).

    Returns:
        FEASIBLE with the best orders found (the incumbent when nothing better was found).

    Raises:
        InvalidSchedule: the incumbent deadlocks or breaks a memory limit.
    """
    started = time.perf_counter()
    deadline = started + time_limit_s
    best = [list(row) for row in incumbent]
    sim = simulate_indexed(inst, best)
    best_value = sim.objective_value(objective)
    best_key = _key(sim, objective)
    n = len(inst.actions)
    size = max(8, min(window_actions, n))
    windows = accepted = 0
    weight_actions = {i for i, action in enumerate(inst.actions) if action.kind == ActionKind.BACKWARD_WEIGHT}
    back = 0.0  # sweep progress from the schedule's end, ms
    step = 0
    fruitless_sweep = True
    # Building a window model is not interruptible and costs about O(n²/p) (the memory order
    # literals of the whole rank), seconds on large instances: never start one that cannot finish.
    # One estimate per kind of neighbourhood: time windows are small, the W float spans everything.
    build_estimate_s = {"window": 0.1 + 1e-5 * n, "float": 3e-6 * n * n / max(1, inst.num_ranks)}
    while time.perf_counter() < deadline - 0.05:
        if should_stop is not None and should_stop():
            break
        starts = [[sim.start[i] for i in row] for row in best]
        first = min(row[0] for row in starts if row)
        end = max(sim.end[row[-1]] for row in best if row)
        width = (end - first) * size / n
        if end - back <= first:
            back = 0.0
            if fruitless_sweep:
                size = min(n, int(size * 1.5))
                if size >= n:
                    size = max(8, window_actions)
            fruitless_sweep = True
            continue
        step += 1
        floating: set[int] | None = None
        if weights_every and step % weights_every == 0 and weight_actions:
            # Float every W over the fixed F/I skeleton of the whole schedule.
            segments = [(0, len(row)) for row in best]
            floating = weight_actions
        else:
            segments = window_segments(starts, end - back - width, end - back)
            back += width / 2
        if sum(hi - lo for lo, hi in segments) < 2:
            continue
        remaining = deadline - time.perf_counter()
        kind = "window" if floating is None else "float"
        if remaining < build_estimate_s[kind] + 0.2:
            if kind == "float":
                continue
            break
        build_started = time.perf_counter()
        model = OrderModel(
            inst,
            objective,
            incumbent=best,
            segments=segments,
            floating=floating,
            upper_bound_ms=best_value,
            secondary=True,
        )
        build_estimate_s[kind] = max(build_estimate_s[kind] * 0.5, time.perf_counter() - build_started)
        remaining = deadline - time.perf_counter()
        solver, status = run_model(
            model,
            time_limit_s=min(window_time_limit_s, remaining),
            num_workers=num_workers,
            should_stop=should_stop,
            backend="cpsat-lns",
            started=started,
        )
        windows += 1
        if floating is None and adaptive:
            # Neighbourhoods CP-SAT closes quickly are too small to hold an improvement: grow them;
            # ones it cannot close in time are too big: shrink them.
            if solver.status_name(status) == "OPTIMAL" and solver.wall_time < 0.5 * window_time_limit_s:
                size = min(n, int(size * 1.25) + 1)
            elif solver.status_name(status) != "OPTIMAL":
                size = max(8, int(size * 0.8))
        if solver.status_name(status) not in ("OPTIMAL", "FEASIBLE"):
            continue
        candidate = model.orders(solver)
        try:
            candidate_sim = simulate_indexed(inst, candidate)
        except InvalidSchedule:
            continue
        value = candidate_sim.objective_value(objective)
        key = _key(candidate_sim, objective)
        if key < best_key:
            best, sim, best_value, best_key = candidate, candidate_sim, value, key
            accepted += 1
            fruitless_sweep = False
            if progress is not None:
                progress(
                    Progress(
                        best_objective=best_value,
                        lower_bound=None,
                        elapsed_s=time.perf_counter() - started,
                        backend="cpsat-lns",
                        message=f"window {windows}: improved to {best_value:.3f} ms",
                    )
                )
    return BackendResult(
        status=BackendStatus.FEASIBLE,
        orders=best,
        lower_bound=None,
        message=f"CP-SAT large-neighbourhood search: {accepted} of {windows} windows improved, {best_value:.3f} ms",
        stats={
            "windows": float(windows),
            "accepted": float(accepted),
            "window_actions": float(size),
            "wall_s": round(time.perf_counter() - started, 4),
        },
    )


class LnsBackend:
    """:func:`large_neighbourhood_search` as a :class:`~pipesched.optimizer.solvers.base.Backend`: it improves
    ``hint`` (FIFO per-rank orders that fit memory) and finds nothing without one.

    Args:
        num_workers: CP-SAT search workers per window.
    """

    name = "cpsat-lns"

    def __init__(self, *, num_workers: int = 2) -> None:
        self.num_workers = num_workers

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
        """Window re-optimisation of ``hint`` for ``time_limit_s`` (module docstring); ``UNKNOWN`` without a
        hint that fits memory."""
        unknown = BackendResult(BackendStatus.UNKNOWN, message="large-neighbourhood search needs a warm start")
        if hint is None:
            return unknown
        try:
            return large_neighbourhood_search(
                inst,
                objective=objective,
                incumbent=hint,
                time_limit_s=time_limit_s,
                num_workers=self.num_workers,
                progress=progress,
                should_stop=should_stop,
            )
        except InvalidSchedule:  # the hint deadlocks or breaks a memory limit
            return unknown
