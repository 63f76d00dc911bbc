"""The ``auto`` portfolio (first cut: the best family that fits; the search backends extend it)."""

from __future__ import annotations

import time

from optimizer.families import applicable_families
from optimizer.instance import compile_problem
from optimizer.problem import Problem
from optimizer.result import Schedule, build_schedule, infeasible_schedule
from optimizer.solve import Progress, ProgressCallback, StopCheck


def solve_auto(
    problem: Problem,
    *,
    progress: ProgressCallback | None = None,
    should_stop: StopCheck | None = None,
) -> Schedule:
    """Best schedule among the applicable families that fit the memory limit."""
    started = time.perf_counter()
    inst = compile_problem(problem)
    lower_bound = inst.ideal
    best: Schedule | None = None
    for family in applicable_families(problem):
        schedule = build_schedule(
            problem,
            family.generate(problem),
            method="auto",
            backend=f"family:{family.name}",
            instance=inst,
            check_memory=False,
            lower_bound=lower_bound,
        )
        if schedule.fits_memory and (best is None or (schedule.objective_value or 0) < (best.objective_value or 0)):
            best = schedule
            if progress:
                progress(Progress(best.objective_value, lower_bound, time.perf_counter() - started, "family"))
    if best is None:
        return infeasible_schedule(
            problem,
            method="auto",
            backend="family",
            reason="no known schedule fits the memory limit",
            solve_time_s=time.perf_counter() - started,
        )
    best.solve_time_s = round(time.perf_counter() - started, 4)
    return best
