"""Fan out: N independent schedule searches as queue jobs, gathered within one time limit.

The building block for a caller that needs many solves at once (the planner evaluates one problem per
configuration): each problem becomes a row of ``jobs`` and a task on the PostgreSQL queue, so the
searches run side by side on every ``pipesched worker`` with the jobs' progress, cancellation, stalled
retries and attempt counting. A problem solved before is answered from the stored schedule at once.

    result = solve_many(store, runner, problems, time_limit_s=30, progress=print)
    best = min((s for s in result.schedules if s is not None), key=lambda s: s.objective_value)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pipesched.api.storage import Store, problem_key
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.result import Schedule

__all__ = ["FanOutProgress", "FanOutResult", "JobSubmitter", "solve_many"]

ENDED = ("done", "failed", "cancelled")


class JobSubmitter(Protocol):
    """What hands a stored job to the solvers (:class:`pipesched.api.queue.QueueRunner`, or the in-process
    :class:`pipesched.api.jobs.SolverPool`)."""

    def submit_job(self, job_id: str, attempt: int, time_limit_s: float) -> None: ...


@dataclass(frozen=True)
class FanOutProgress:
    """The searches together, at one moment.

    Attributes:
        total: problems submitted.
        counts: jobs per status (``queued``, ``running``, ``done``, ``failed``, ``cancelled``).
        best_objectives: each problem's best objective so far, ms (None: no schedule yet), in input order.
        best: the least of them, ms, or None.
        elapsed_s: since :func:`solve_many` started, s.
    """

    total: int
    counts: dict[str, int]
    best_objectives: list[float | None]
    best: float | None
    elapsed_s: float

    @property
    def finished(self) -> int:
        """Jobs that ended (done, failed or cancelled)."""
        return sum(self.counts.get(status, 0) for status in ENDED)


@dataclass(frozen=True)
class FanOutResult:
    """What :func:`solve_many` gathered, in input order.

    Attributes:
        job_ids: the jobs (``GET /v1/jobs/{id}`` shows each).
        statuses: each job's status at the end (``cancelled`` for those the time limit cut off).
        schedules: each problem's stored schedule, or None when it did not finish in time or failed.
        errors: each failed job's reason, else None.
        elapsed_s: wall time, s.
    """

    job_ids: list[str]
    statuses: list[str]
    schedules: list[Schedule | None]
    errors: list[str | None]
    elapsed_s: float


def solve_many(
    store: Store,
    runner: JobSubmitter,
    problems: Sequence[Problem],
    *,
    time_limit_s: float,
    progress: Callable[[FanOutProgress], None] | None = None,
    poll_interval_s: float = 0.2,
) -> FanOutResult:
    """Submit every problem as a job, wait until all end or ``time_limit_s`` passes, gather the schedules.

    Each problem's ``solver.time_limit_s`` is clamped to ``time_limit_s`` (a search cannot use more than
    the whole). Jobs still queued or running at ``time_limit_s`` are cancelled (their workers stop
    within a progress poll) and answered as None; the call returns within ``time_limit_s`` plus one
    poll and the final reads.

    Args:
        store: the jobs' database (the workers' PostgreSQL).
        runner: hands each job to the solvers.
        problems: validated problems (e.g. from :func:`pipesched.optimizer.derive.load_problem`).
        time_limit_s: the wall-time budget for all of them together, s.
        progress: called after every poll with the searches' :class:`FanOutProgress`.
        poll_interval_s: seconds between two reads of the job rows.

    Raises:
        ValueError: ``time_limit_s`` is not positive.
    """
    if time_limit_s <= 0:
        raise ValueError(f"time_limit_s must be positive (got {time_limit_s}): give the searches a budget in s")
    started = time.monotonic()
    deadline = started + time_limit_s
    job_ids: list[str] = []
    for problem in problems:
        if problem.solver.time_limit_s > time_limit_s:
            problem = problem.with_changes(**{"solver.time_limit_s": time_limit_s})
        key = problem_key(problem)
        cached = store.schedule_by_hash(key)
        row = store.create_job(problem, key, cached)
        if cached is None:
            runner.submit_job(row.id, row.attempt, problem.solver.time_limit_s)
        job_ids.append(row.id)
    while True:
        rows = [store.job(job_id) for job_id in job_ids]
        statuses = [row.status if row is not None else "failed" for row in rows]
        if progress is not None:
            bests = [row.best_objective if row is not None else None for row in rows]
            known = [b for b in bests if b is not None]
            counts = {status: statuses.count(status) for status in ("queued", "running", *ENDED)}
            progress(
                FanOutProgress(
                    total=len(job_ids),
                    counts=counts,
                    best_objectives=bests,
                    best=min(known) if known else None,
                    elapsed_s=time.monotonic() - started,
                )
            )
        if all(status in ENDED for status in statuses):
            break
        if time.monotonic() >= deadline:
            for job_id, status in zip(job_ids, statuses, strict=True):
                if status not in ENDED:
                    store.cancel_job(job_id)
            continue  # one more read: the rows as they ended
        time.sleep(max(0.0, min(poll_interval_s, deadline - time.monotonic())))
    schedules: list[Schedule | None] = []
    errors: list[str | None] = []
    for row in rows:
        done = row is not None and row.status == "done" and row.schedule_id is not None
        schedules.append(store.schedule(row.schedule_id) if done and row.schedule_id else None)
        errors.append(row.error if row is not None else "the job row disappeared")
    return FanOutResult(
        job_ids=job_ids,
        statuses=statuses,
        schedules=schedules,
        errors=errors,
        elapsed_s=time.monotonic() - started,
    )
