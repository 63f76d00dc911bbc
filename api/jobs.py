"""Solving off the event loop: a bounded pool of worker processes.

Jobs and synchronous solves run in two lanes of worker processes (:mod:`pipesched.api.lanes`), each
with its own processes and bounded queue: at most ``solver_workers`` jobs run at once and
``max_queued_jobs`` wait; a full lane refuses more (429). A job's worker writes its progress to the
job row, polls the row to learn of a cancellation (``should_stop``) and stores its schedule and the
``done`` status in one transaction. A synchronous solve runs in its own lane and stops at its deadline.

After a restart, :meth:`SolverPool.recover` re-queues the jobs left ``queued``/``running`` (or fails
them with the reason once they have lived through ``max_job_attempts`` restarts): none stays running.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from pipesched.api.lanes import Lane, LaneClosed, LaneFull, Ticket, WorkerDied
from pipesched.api.solving import UnstorableSchedule, run_solve, unstorable_reason
from pipesched.api.storage import Store, is_unreachable
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.result import Schedule
from pipesched.optimizer.solve import Progress, solve
from pipesched.optimizer.solvers.base import BACKENDS

__all__ = [
    "JobOutcome",
    "LaneFull",
    "SolveTimeout",
    "SolverDied",
    "SolverPool",
    "UnstorableSchedule",
    "retry_while_unreachable",
    "run_job",
    "run_solve",
    "unstorable_reason",
]

log = logging.getLogger("pipesched.jobs")

#: Seconds between two progress writes or two cancellation polls of one job.
POLL_INTERVAL_S = 0.25
#: How long a finished job keeps trying to store its schedule while the database cannot be reached, s.
RESULT_RETRY_S = 300.0
#: Seconds between two such tries.
RESULT_RETRY_WAIT_S = 1.0

T = TypeVar("T")

_STORES: dict[str, Store] = {}


def _store(database_url: str) -> Store:
    """One :class:`Store` per database per worker process."""
    if database_url not in _STORES:
        _STORES[database_url] = Store(database_url)
    return _STORES[database_url]


class SolverDied(RuntimeError):
    """A solver process ended abruptly (killed, out of memory), or the service stopped while it ran."""


class SolveTimeout(TimeoutError):
    """A synchronous solve gave no answer in time; the message says whether it waited or ran."""


@dataclass(frozen=True)
class JobOutcome:
    """What a job's worker reports back: the schedule id (None when nothing was stored) and solve time, s."""

    job_id: str
    schedule_id: str | None
    status: str | None
    method: str
    solve_time_s: float


def make_stop_check(store: Store, job_id: str, attempt: int, stop_at: float) -> Callable[[], bool]:
    """``should_stop`` for a job: True once the job is no longer this attempt's ``running`` job
    (cancelled, or re-queued after a restart) or ``stop_at`` (monotonic s) has passed.

    The job row is read at most every :data:`POLL_INTERVAL_S`. While the database cannot be reached the
    search goes on (a cancellation is seen once it answers again; the time limit still stops it).
    """
    state = {"checked": 0.0, "stop": False, "unreachable": False}

    def should_stop() -> bool:
        now = time.monotonic()
        if state["stop"] or now >= stop_at:
            return True
        if now - state["checked"] >= POLL_INTERVAL_S:
            state["checked"] = now
            try:
                job = store.job(job_id)
            except Exception as error:
                if not is_unreachable(error):
                    raise
                if not state["unreachable"]:
                    log.warning("job %s: cannot read its row (%s); solving on", job_id, type(error).__name__)
                state["unreachable"] = True
                return False
            state["unreachable"] = False
            state["stop"] = job is None or job.status != "running" or job.attempt != attempt
        return bool(state["stop"])

    return should_stop


def retry_while_unreachable(what: str, write: Callable[[], T], give_up_s: float) -> T:
    """``write()``, tried again every :data:`RESULT_RETRY_WAIT_S` while the database cannot be reached, for at
    most ``give_up_s`` s (a result computed during an outage is kept, not thrown away).

    Raises:
        The database error, once ``give_up_s`` has passed; any other error at once.
    """
    give_up = time.monotonic() + give_up_s
    while True:
        try:
            return write()
        except Exception as error:
            if not is_unreachable(error) or time.monotonic() >= give_up:
                raise
            log.warning("%s: the database cannot be reached (%s); trying again", what, type(error).__name__)
            time.sleep(RESULT_RETRY_WAIT_S)


def run_job(database_url: str, job_id: str, attempt: int, deadline_s: float) -> JobOutcome:
    """Run one job in a worker process: mark it running, solve with progress and cancellation, store.

    A database that cannot be reached while it solves costs progress writes only: the search goes on, and
    its schedule is stored once the database answers again (tried for :data:`RESULT_RETRY_S`), so a job
    lives through an outage shorter than that and is solved once.

    Returns:
        The outcome; ``schedule_id`` None when the job was cancelled (before or while solving) or another
        attempt took it over (its result is then discarded).

    Raises:
        Whatever the solver raises (the pool marks the job failed with it); the database's error when it
        stays unreachable for :data:`RESULT_RETRY_S`.
    """
    store = _store(database_url)
    job = store.job(job_id)
    if job is None or not store.start_job(job_id, attempt):
        return JobOutcome(job_id, None, None, "", 0.0)
    problem = Problem.model_validate_json(job.problem_json)
    started = time.monotonic()
    last_write = [0.0]
    latest: list[Progress | None] = [None]

    def write_progress() -> None:
        # The latest update, at most every POLL_INTERVAL_S: an improvement that came within the interval
        # is written at the next call (a search may report nothing new for seconds), and elapsed keeps counting.
        now = time.monotonic()
        update = latest[0]
        if update is None or now - last_write[0] < POLL_INTERVAL_S:
            return
        last_write[0] = now
        try:
            store.record_progress(
                job_id,
                attempt,
                best_objective=update.best_objective,
                lower_bound=update.lower_bound,
                elapsed_s=round(max(update.elapsed_s, now - started), 4),
                message=update.message or update.backend,
            )
        except Exception as error:  # the next write brings it up to date
            if not is_unreachable(error):
                raise

    def progress(update: Progress) -> None:
        latest[0] = update
        write_progress()

    stop_check = make_stop_check(store, job_id, attempt, started + deadline_s)

    def should_stop() -> bool:
        write_progress()
        return stop_check()

    schedule = solve(problem, progress=progress, should_stop=should_stop)
    reason = unstorable_reason(schedule)
    what = f"job {job_id} attempt {attempt}"
    if reason is not None:
        retry_while_unreachable(what, lambda: store.fail_job(job_id, reason, attempt), RESULT_RETRY_S)
        return JobOutcome(job_id, None, "failed", schedule.method, schedule.solve_time_s)
    stored = retry_while_unreachable(
        what, lambda: store.finish_job(job_id, attempt, job.problem_hash, schedule), RESULT_RETRY_S
    )
    return JobOutcome(
        job_id,
        None if stored is None else stored.id,
        schedule.status,
        schedule.method,
        schedule.solve_time_s,
    )


#: What a solver process imports when it starts: the plan search and every backend's module (the exact ones load
#: OR-Tools and PuLP), so that a first search does not spend its time limit importing them.
SOLVER_PRELOAD: tuple[str, ...] = (
    "pipesched.optimizer.planner.rank",
    *(spec.module for spec in BACKENDS),
)


class SolverPool:
    """Two lanes of solver processes (:class:`pipesched.api.lanes.Lane`): synchronous solves and jobs.

    Each lane has its own processes and its own bounded queue, so a flood of jobs never delays a
    synchronous solve; a full queue raises :class:`LaneFull` (the routes answer 429 with ``Retry-After``).
    A worker process that dies fails only what it was running.

    Args:
        store: the service's store (jobs are read and finished by the workers through the same URL).
        workers: job processes (the most jobs solved at once).
        sync_workers: processes for synchronous solves.
        max_queued_jobs: jobs that may wait for a process; more are refused.
        max_queued_solves: synchronous solves that may wait for a process; more are refused.
        deadline_grace_s: added to a problem's time limit before its search is told to stop.
        on_job_done: called in a pool thread with each finished :class:`JobOutcome` (metrics).
        max_job_attempts: passed on to :meth:`Store.recover_jobs`.
    """

    def __init__(
        self,
        store: Store,
        workers: int,
        *,
        sync_workers: int = 1,
        max_queued_jobs: int = 32,
        max_queued_solves: int = 4,
        deadline_grace_s: float = 2.0,
        on_job_done: Callable[[JobOutcome], None] | None = None,
        max_job_attempts: int = 3,
    ) -> None:
        self.store = store
        self.workers = workers
        self.deadline_grace_s = deadline_grace_s
        self.on_job_done = on_job_done
        self.max_job_attempts = max_job_attempts
        self.jobs = Lane("job", workers, max_queued_jobs, preload=SOLVER_PRELOAD)
        self.solves = Lane("solve", sync_workers, max_queued_solves, preload=SOLVER_PRELOAD)
        self._lock = threading.Lock()
        self._tickets: dict[str, Ticket] = {}

    def submit_task(self, fn: Callable[..., object], *args: object, expected_s: float = 60.0) -> Future:
        """Run ``fn(*args)`` in a job process (a plan search): it shares the job lane's processes and bound.

        Raises:
            LaneFull: the job queue is full (the route answers 429 with ``Retry-After``).
        """
        return self.jobs.submit(fn, *args, expected_s=expected_s).future

    def solve(self, problem: Problem, timeout_s: float) -> Schedule:
        """Solve in a worker and wait at most ``timeout_s`` (the search is told to stop before).

        Raises:
            LaneFull: ``max_queued_solves`` solves wait already.
            SolveTimeout: no answer within ``timeout_s`` (saying whether it waited or ran).
            SolverDied: the worker process died.
            FamilyDomainError: as :func:`pipesched.optimizer.solve.solve`.
        """
        deadline_s = problem.solver.time_limit_s + self.deadline_grace_s
        ticket = self.solves.submit(
            run_solve, problem.model_dump_json(), deadline_s, time.time(), expected_s=deadline_s
        )
        try:
            text = ticket.future.result(timeout=timeout_s)
        except TimeoutError:
            if self.solves.cancel(ticket):
                raise SolveTimeout(
                    f"the solve waited {timeout_s:.0f} s for a solver process behind {ticket.queued_behind} other "
                    "synchronous solves and never started"
                ) from None
            ran = time.monotonic() - (ticket.started_at or time.monotonic())
            raise SolveTimeout(
                f"the solver ran {ran:.0f} s without answering (time limit {problem.solver.time_limit_s:g} s; "
                f"this request waits at most {timeout_s:.0f} s)"
            ) from None
        except (WorkerDied, LaneClosed) as error:
            raise SolverDied(f"{error}") from None
        return Schedule.model_validate_json(str(text))

    def reserve_job(self) -> None:
        """Hold a place in the job queue before the job's row is written (raises :class:`LaneFull`)."""
        self.jobs.reserve()

    def release_job(self) -> None:
        """Give back a place held by :meth:`reserve_job` that no job took."""
        self.jobs.release()

    def submit_job(self, job_id: str, attempt: int, time_limit_s: float, *, reserved: bool = False) -> None:
        """Queue a stored job for a worker (after :meth:`reserve_job` with ``reserved``; recovered jobs
        are queued beyond the bound).

        Raises:
            LaneFull: the job queue is full (only without ``reserved``).
        """
        deadline_s = time_limit_s + self.deadline_grace_s
        ticket = self.jobs.submit(
            run_job,
            self.store.database_url,
            job_id,
            attempt,
            deadline_s,
            expected_s=deadline_s,
            reserved=reserved,
            force=not reserved,
        )
        with self._lock:
            self._tickets[job_id] = ticket
        ticket.future.add_done_callback(lambda done: self._job_finished(job_id, attempt, done))

    def _job_finished(self, job_id: str, attempt: int, future: Future[JobOutcome]) -> None:
        with self._lock:
            self._tickets.pop(job_id, None)
        if future.cancelled():
            return
        error = future.exception()
        if error is None:
            outcome = future.result()
            if self.on_job_done is not None and outcome.schedule_id is not None:
                self.on_job_done(outcome)
            return
        if isinstance(error, LaneClosed):  # shutting down: the row is re-queued at the next start
            return
        if isinstance(error, WorkerDied):
            reason = "the solver process died (out of memory or killed) while solving this job"
        else:
            reason = f"the solver failed: {type(error).__name__}: {error}"
        log.error("job %s failed: %s", job_id, reason)
        try:
            self.store.fail_job(job_id, reason, attempt)
        except Exception:  # the database itself is gone; recovery at the next start handles the row
            log.exception("could not mark job %s failed", job_id)

    def cancel(self, job_id: str) -> None:
        """Drop a job that has not started yet from the queue (a running one polls its row)."""
        with self._lock:
            ticket = self._tickets.get(job_id)
        if ticket is not None:
            self.jobs.cancel(ticket)

    def recover(self) -> tuple[int, int]:
        """Re-queue (or fail) jobs a previous run left ``queued``/``running``; (re-queued, failed)."""
        requeued, failed = self.store.recover_jobs(self.max_job_attempts)
        for job_id, attempt in requeued:
            job = self.store.job(job_id)
            if job is not None:
                problem = Problem.model_validate_json(job.problem_json)
                self.submit_job(job_id, attempt, problem.solver.time_limit_s)
        if requeued or failed:
            log.warning("recovered jobs after a restart: %d re-queued, %d failed", len(requeued), len(failed))
        return len(requeued), len(failed)

    def in_flight(self) -> int:
        """Jobs submitted and not yet finished (queued behind the workers included)."""
        with self._lock:
            return len(self._tickets)

    def worker_pids(self) -> list[int]:
        """Live solver processes (both lanes)."""
        return [*self.jobs.worker_pids(), *self.solves.worker_pids()]

    def shutdown(self) -> None:
        """Stop: queued work is dropped and running solves are killed (job rows are recovered at the next
        start), so nothing runs on after the service."""
        self.jobs.close()
        self.solves.close()
