"""The work of ``POST /v1/schedules/check``, run in a check process (:mod:`pipesched.api.lanes`).

Reading a large schedule and simulating it takes seconds of CPU and hundreds of MiB: it runs in its own bounded
lane of processes, so the web process stays responsive and small.
"""

from __future__ import annotations

from typing import Any

from pipesched.optimizer.check import ScheduleInputError, check_schedule, read_schedule
from pipesched.optimizer.problem import Problem

__all__ = ["ScheduleInputError", "run_check"]


def run_check(problem: Problem, schedule: list[list[str]] | str, max_actions: int) -> dict[str, Any]:
    """Time and check ``schedule`` (action lists per rank, or PyTorch's CSV text) on ``problem``.

    Returns:
        :meth:`pipesched.optimizer.check.CheckResult.to_dict` (valid with objective in ms, bubble rate, peak
        memory per rank in bytes; or the first violation).

    Raises:
        ScheduleInputError: a cell that is no action, or more than ``max_actions`` actions.
    """
    orders, notes = read_schedule(schedule)
    cells = sum(len(row) for row in orders)
    if cells > max_actions:
        raise ScheduleInputError(f"the schedule has {cells} actions, over this service's limit of {max_actions}")
    return check_schedule(problem, orders, notes).to_dict()
