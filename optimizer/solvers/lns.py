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
    search = _Lns(inst, objective, incumbent, time_limit_s, window_actions, window_time_limit_s, progress)
    while time.perf_counter() < search.deadline - 0.05:
        if should_stop is not None and should_stop():
            break
        neighbourhood = search.next_neighbourhood(weights_every)
        if neighbourhood is None:
            continue
        segments, floating = neighbourhood
        kind = "window" if floating is None else "float"
        if search.deadline - time.perf_counter() < search.build_estimate_s[kind] + 0.2:
            if kind == "float":
                continue
            break
        candidate = search.solve_window(segments, floating, num_workers, adaptive and floating is None, should_stop)
        if candidate is not None:
            search.offer(candidate)
    return search.result()


class _Lns:
    """The state of one large-neighbourhood search: the incumbent and its simulation, the sweep's position and
    window size, and the cost of building each kind of window model."""

    def __init__(
        self,
        inst: Instance,
        objective: str,
        incumbent: list[list[int]],
        time_limit_s: float,
        window_actions: int,
        window_time_limit_s: float,
        progress: ProgressCallback | None,
    ) -> None:
        self.inst, self.objective, self.progress = inst, objective, progress
        self.started = time.perf_counter()
        self.deadline = self.started + time_limit_s
        self.best = [list(row) for row in incumbent]
        self.sim = simulate_indexed(inst, self.best)
        self.best_value = self.sim.objective_value(objective)
        self.best_key = _key(self.sim, objective)
        self.n = len(inst.actions)
        self.window_actions, self.window_time_limit_s = window_actions, window_time_limit_s
        self.size = max(8, min(window_actions, self.n))
        self.windows = self.accepted = 0
        self.weight_actions = {i for i, a in enumerate(inst.actions) if a.kind == ActionKind.BACKWARD_WEIGHT}
        self.back = 0.0  # sweep progress from the schedule's end, ms
        self.step = 0
        self.fruitless_sweep = True
        # Building a window model is not interruptible and costs about O(n²/p) (the memory order
        # literals of the whole rank), seconds on large instances: never start one that cannot finish.
        # One estimate per kind of neighbourhood: time windows are small, the W float spans everything.
        self.build_estimate_s = {
            "window": 0.1 + 1e-5 * self.n,
            "float": 3e-6 * self.n * self.n / max(1, inst.num_ranks),
        }

    def next_neighbourhood(self, weights_every: int) -> tuple[list[tuple[int, int]], set[int] | None] | None:
        """The next neighbourhood: per rank the segment of its order to free, and the floating W's (every
        ``weights_every`` steps) or ``None`` (a time window, sweeping from the end). ``None`` when the sweep
        wrapped round (the window grows after a fruitless sweep) or the window holds under two actions."""
        sim, best = self.sim, self.best
        starts = [[sim.start[i] for i in row] for row in best]
        first = min(row[0] for row in starts if row)
        end = max(sim.end[row[-1]] for row in best if row)
        width = (end - first) * self.size / self.n
        if end - self.back <= first:
            self.back = 0.0
            if self.fruitless_sweep:
                self.size = min(self.n, int(self.size * 1.5))
                if self.size >= self.n:
                    self.size = max(8, self.window_actions)
            self.fruitless_sweep = True
            return None
        self.step += 1
        floating: set[int] | None = None
        if weights_every and self.step % weights_every == 0 and self.weight_actions:
            # Float every W over the fixed F/I skeleton of the whole schedule.
            segments = [(0, len(row)) for row in best]
            floating = self.weight_actions
        else:
            segments = window_segments(starts, end - self.back - width, end - self.back)
            self.back += width / 2
        if sum(hi - lo for lo, hi in segments) < 2:
            return None
        return segments, floating

    def solve_window(
        self,
        segments: list[tuple[int, int]],
        floating: set[int] | None,
        num_workers: int,
        adapt: bool,
        should_stop: StopCheck | None,
    ) -> list[list[int]] | None:
        """CP-SAT on the neighbourhood with the incumbent as hint and cut; its orders, or ``None``. With
        ``adapt``, windows CP-SAT closes quickly grow (too small to hold an improvement) and ones it cannot close
        in time shrink."""
        kind = "window" if floating is None else "float"
        build_started = time.perf_counter()
        model = OrderModel(
            self.inst,
            self.objective,
            incumbent=self.best,
            segments=segments,
            floating=floating,
            upper_bound_ms=self.best_value,
            secondary=True,
        )
        self.build_estimate_s[kind] = max(self.build_estimate_s[kind] * 0.5, time.perf_counter() - build_started)
        solver, status = run_model(
            model,
            time_limit_s=min(self.window_time_limit_s, self.deadline - time.perf_counter()),
            num_workers=num_workers,
            should_stop=should_stop,
            backend="cpsat-lns",
            started=self.started,
        )
        self.windows += 1
        closed = solver.status_name(status) == "OPTIMAL"
        if adapt:
            if closed and solver.wall_time < 0.5 * self.window_time_limit_s:
                self.size = min(self.n, int(self.size * 1.25) + 1)
            elif not closed:
                self.size = max(8, int(self.size * 0.8))
        if solver.status_name(status) not in ("OPTIMAL", "FEASIBLE"):
            return None
        return model.orders(solver)

    def offer(self, candidate: list[list[int]]) -> None:
        """Keep ``candidate`` when its re-simulated objective (then the secondary key) improves; report it."""
        try:
            candidate_sim = simulate_indexed(self.inst, candidate)
        except InvalidSchedule:
            return
        key = _key(candidate_sim, self.objective)
        if key >= self.best_key:
            return
        self.best, self.sim, self.best_key = candidate, candidate_sim, key
        self.best_value = candidate_sim.objective_value(self.objective)
        self.accepted += 1
        self.fruitless_sweep = False
        if self.progress is not None:
            self.progress(
                Progress(
                    best_objective=self.best_value,
                    lower_bound=None,
                    elapsed_s=time.perf_counter() - self.started,
                    backend="cpsat-lns",
                    message=f"window {self.windows}: improved to {self.best_value:.3f} ms",
                )
            )

    def result(self) -> BackendResult:
        """The best orders found (the incumbent when nothing improved), FEASIBLE, no bound claimed."""
        return BackendResult(
            status=BackendStatus.FEASIBLE,
            orders=self.best,
            lower_bound=None,
            message=(
                f"CP-SAT large-neighbourhood search: {self.accepted} of {self.windows} windows improved, "
                f"{self.best_value:.3f} ms"
            ),
            stats={
                "windows": float(self.windows),
                "accepted": float(self.accepted),
                "window_actions": float(self.size),
                "wall_s": round(time.perf_counter() - self.started, 4),
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
