"""pipesched: pipeline-parallel training schedule optimizer.

The installed package has three parts, kept as top-level folders of the repository and installed under
this namespace: :mod:`pipesched.optimizer` (the problem, schedule model, simulator and search; no torch),
:mod:`pipesched.api` (HTTP service and the ``pipesched`` command line) and :mod:`pipesched.runtime`
(torch execution and verification).

For integration from Python::

    from pipesched import Problem, solve

    schedule = solve(Problem.model_validate(json.load(open("problem.json"))))
    print(schedule.status, schedule.makespan, schedule.lower_bound)
"""

from __future__ import annotations

from pipesched.optimizer.problem import Problem
from pipesched.optimizer.result import Schedule
from pipesched.optimizer.simulate import InvalidSchedule
from pipesched.optimizer.solve import Progress, solve

__all__ = ["InvalidSchedule", "Problem", "Progress", "Schedule", "solve"]
__version__ = "0.1.0"
