"""A synchronous solve in a worker process (:meth:`pipesched.api.jobs.SolverPool.solve`), kept apart from the jobs'
database code: a solve worker imports the optimizer and nothing else (not SQLAlchemy: 0.5 s of a cold answer)."""

from __future__ import annotations

import time

from pipesched.optimizer.problem import Problem, least_time_limit_s
from pipesched.optimizer.result import Schedule
from pipesched.optimizer.solve import solve

__all__ = ["SEARCH_GRACE_S", "UnstorableSchedule", "run_solve", "unstorable_reason"]


class UnstorableSchedule(ValueError):
    """The solver's schedule cannot be stored and read back as computed (non-finite numbers)."""


#: Of the 2 s an answer may take beyond ``solver.time_limit_s``, what a late start may use before the search's own
#: limit shrinks (the rest: the final checks, storing the schedule and the response).
SEARCH_GRACE_S = 0.5


def run_solve(problem_json: str, deadline_s: float, arrived_at: float | None = None) -> str:
    """Solve in a worker process; ``deadline_s`` seconds after the request arrived (``arrived_at``, epoch s; now
    when None) the search is told to stop. The time the request spent before the search began (a worker
    process starting, importing the optimizer, a queue) comes out of the 2 s the answer may take beyond
    ``solver.time_limit_s`` first (:data:`SEARCH_GRACE_S` of it), then out of the limit itself (the search keeps
    at least 5% of it): the answer keeps to the limit + 2 s however slowly the worker started.

    Returns:
        The schedule's JSON.

    Raises:
        FamilyDomainError: as :func:`pipesched.optimizer.solve.solve`.
        UnstorableSchedule: the schedule would not read back as computed (:func:`unstorable_reason`).
    """
    problem = Problem.model_validate_json(problem_json)
    spent = max(0.0, time.time() - arrived_at) if arrived_at is not None else 0.0
    limit = problem.solver.time_limit_s
    if spent > SEARCH_GRACE_S:
        # never below the limit its size is admitted with (the answer re-validates its problem); the stop flag
        # below still ends the search at the request's deadline
        least = least_time_limit_s(problem.pipeline.num_stages, problem.pipeline.num_microbatches)
        shortened = max(0.05 * limit, limit + SEARCH_GRACE_S - spent, least)
        solver = problem.solver.model_copy(update={"time_limit_s": shortened})
        problem = problem.model_copy(update={"solver": solver})
    stop_at = time.monotonic() + max(0.0, deadline_s - spent)
    schedule = solve(problem, should_stop=lambda: time.monotonic() >= stop_at)
    reason = unstorable_reason(schedule)
    if reason is not None:
        raise UnstorableSchedule(reason)
    return schedule.model_dump_json()


def unstorable_reason(schedule: Schedule) -> str | None:
    """Why ``schedule`` cannot be stored and read back as it is (its JSON does not validate again, or
    reads back different: a non-finite time or size is written as null), or None when it round-trips."""
    try:
        again = Schedule.model_validate_json(schedule.model_dump_json())
    except ValueError as error:
        return f"the solver's schedule cannot be stored: it does not read back ({error}); check the problem's costs"
    if again == schedule:
        return None
    written, read = schedule.model_dump(), again.model_dump()
    changed = [name for name in written if written[name] != read[name]] or ["a field"]
    return (
        f"the solver's schedule cannot be stored: {', '.join(changed[:3])} does not read back as computed (a "
        "non-finite number, which JSON cannot hold); check the problem's costs and memory for values near the "
        "float limits"
    )
