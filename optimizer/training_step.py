"""The time of one flushed training step, optimizer included (contract, Terms: ``step_time``).

With no data parallelism (d = 1) and ``costs.optimizer_step`` o_r per rank (ms, 0 when absent):

* synchronous (``training.post_validation`` false): every rank waits for the global checks (gradient norm,
  inf/NaN) after the flush, then steps: ``step_time = makespan + max_r o_r``;
* post-validation (Zero Bubble paper, Qi et al. 2023, §4): each rank steps as soon as its own passes end and
  the checks ride along the pipeline, so the next step's rank r starts after its own step; the time per
  step is the Zero Bubble paper's cost plus the update: ``step_time = max_r (span_r + o_r)`` with
  ``span_r`` = the rank's last end − first start (with o = 0: the stage_span).

Data-parallel communication (UNSHARD/REDUCE_GRAD) adds to this where it is not hidden; that part belongs to
the simulator's communication stream, not here.
"""

from __future__ import annotations

from pipesched.optimizer.problem import Problem
from pipesched.optimizer.simulate import SimulationResult

__all__ = ["flushed_step_time"]


def flushed_step_time(problem: Problem, sim: SimulationResult) -> float:
    """``step_time`` in ms of a flushed schedule timed as ``sim`` (module docstring)."""
    optimizer = problem.rank_values(problem.costs.optimizer_step if problem.costs else None, 0.0)
    if not problem.training.post_validation:
        return sim.makespan + max(optimizer, default=0.0)
    spans = [
        sim.end[row[-1]] - sim.start[row[0]] + optimizer[rank] if row else optimizer[rank]
        for rank, row in enumerate(sim.orders)
    ]
    return max(spans, default=0.0)
