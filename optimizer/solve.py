"""The one entry point: ``solve(problem)`` → :class:`~pipesched.optimizer.result.Schedule`.

``solver.method`` names a family (generate it, simulate it, check the memory limit) or ``"auto"``
(the search portfolio of :mod:`pipesched.optimizer.solvers.portfolio`; with ``training.flush: false`` the
pattern search of :mod:`pipesched.optimizer.solvers.no_flush`).
"""

from __future__ import annotations

import time

from pipesched.optimizer.communication import add_communication
from pipesched.optimizer.families import FamilyDomainError, get_family
from pipesched.optimizer.instance import compile_for_orders, compile_problem
from pipesched.optimizer.pattern import repeating_schedule
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.progress import Deadline, Progress, ProgressCallback, SearchStopped, StopCheck, active_deadline
from pipesched.optimizer.result import Schedule, build_schedule, infeasible_schedule
from pipesched.optimizer.simulate import simulate
from pipesched.optimizer.solvers.no_flush import solve_steady_state
from pipesched.optimizer.solvers.portfolio import solve_auto

__all__ = ["Progress", "ProgressCallback", "StopCheck", "family_peaks", "solve", "solve_family"]


def solve(
    problem: Problem,
    *,
    progress: ProgressCallback | None = None,
    should_stop: StopCheck | None = None,
) -> Schedule:
    """Solve ``problem`` by its ``solver.method``.

    Args:
        problem: a validated problem.
        progress: called with :class:`Progress` whenever the incumbent or the bound improves.
        should_stop: polled by the search; returning True ends it early with the best found.

    Returns:
        A schedule with status ``optimal``/``feasible`` that passed the simulator, or ``infeasible``
        with a reason.

    Raises:
        FamilyDomainError: when a named family does not admit the problem.
    """
    if problem.solver.method == "auto":
        if not problem.training.flush:
            # No flush (PipeDream-2BW): the repeating pattern and its step period, searched on its own.
            return solve_steady_state(problem, progress=progress, should_stop=should_stop)
        if problem.has_step_actions or problem.objective == "step_time":
            from pipesched.optimizer.solvers.step import solve_step

            return solve_step(problem, progress=progress, should_stop=should_stop)
        return solve_auto(problem, progress=progress, should_stop=should_stop)
    return solve_family(problem, problem.solver.method)


def solve_family(problem: Problem, name: str, *, enforce_memory: bool = True) -> Schedule:
    """Generate family ``name`` for ``problem`` and simulate it.

    With ``enforce_memory`` a schedule over the limit comes back ``infeasible`` with the family's
    peak per rank in ``min_memory_limit`` and a reason naming the rank; without it, the schedule comes
    back as is, with ``fits_memory`` false.

    Raises:
        FamilyDomainError: when the family does not admit the problem, or does not finish within
            ``solver.time_limit_s``.
    """
    started = time.perf_counter()
    family = get_family(name)
    inst = compile_problem(problem)
    # A family cannot answer in part: past the time limit (less what building the answer takes) it stops,
    # and the request is answered at once with what to change.
    time_limit = problem.solver.time_limit_s
    deadline = Deadline(started + time_limit - min(0.25 * time_limit, 3 * (time.perf_counter() - started)))
    try:
        with active_deadline(deadline):
            orders = family.generate(problem)
    except SearchStopped:
        pipeline = problem.pipeline
        raise FamilyDomainError(
            f"{name} did not finish within solver.time_limit_s {time_limit:g} s for {pipeline.num_ranks} ranks × "
            f"{pipeline.stages_per_rank} stages per rank × {pipeline.num_microbatches} microbatches: raise "
            "solver.time_limit_s, use fewer ranks or microbatches, or method auto"
        ) from None
    if not family.flush:
        schedule = repeating_schedule(problem, orders, method=name, started=started)
    else:
        # The step's collectives and optimizer steps, placed as the family's paper does (communication.py).
        orders = add_communication(inst, orders, gather_runs=family.gather_runs)
        inst = compile_for_orders(problem, orders, base=inst)
        schedule = build_schedule(
            problem,
            orders,
            method=name,
            backend="family",
            instance=inst,
            check_memory=False,
            solve_time_s=time.perf_counter() - started,
        )
    if enforce_memory and not schedule.fits_memory:
        over = [
            rank
            for rank, (peak, limit) in enumerate(zip(schedule.peak_memory, inst.limit, strict=True))
            if peak > limit
        ]
        rank = over[0]
        return infeasible_schedule(
            problem,
            method=name,
            backend="family",
            reason=(
                f"{name} needs {schedule.peak_memory[rank]:.0f} bytes on rank {rank}, over its limit of "
                f"{inst.limit[rank]:.0f}: raise memory.limit or use method auto"
            ),
            min_memory_limit=schedule.peak_memory,
            solve_time_s=time.perf_counter() - started,
        )
    return schedule


def family_peaks(problem: Problem, name: str) -> tuple[list[float], float]:
    """Family ``name``'s schedule for ``problem``, simulated as :func:`solve_family` does (memory not enforced)
    without building the answer: each rank's peak bytes (static included) and the objective, ms (without a
    flush, the step period). The family's generation polls the caller's active deadline
    (:func:`~pipesched.optimizer.progress.active_deadline`).

    Raises:
        FamilyDomainError: when the family does not admit the problem.
        SearchStopped: when the active deadline passes while the family generates.
    """
    family = get_family(name)
    if not family.flush:
        schedule = solve_family(problem, name, enforce_memory=False)
        assert schedule.step_period is not None
        return list(schedule.peak_memory), schedule.step_period
    inst = compile_problem(problem)
    orders = add_communication(inst, family.generate(problem), gather_runs=family.gather_runs)
    simulation = simulate(compile_for_orders(problem, orders, base=inst), orders, check_memory=False)
    return simulation.peak_memory, simulation.objective_value(problem.objective)
