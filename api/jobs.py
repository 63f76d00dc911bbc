"""Solving off the event loop: a bounded pool of worker processes.

At most ``solver_workers`` solves run at once (a :class:`concurrent.futures.ProcessPoolExecutor`);
a burst queues in the pool. A job's worker writes its progress to the job row, polls the row to
learn of a cancellation (``should_stop``) and stores its schedule and the ``done`` status in one
transaction. A synchronous solve runs in the same pool and stops at its deadline.

After a restart, :meth:`SolverPool.recover` re-queues the jobs left ``queued``/``running`` (or fails
them with the reason once they have lived through ``max_job_attempts`` restarts): none stays running.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from pipesched.api.storage import Store
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.result import Schedule
from pipesched.optimizer.solve import Progress, solve

__all__ = ["JobOutcome", "SolverDied", "SolverPool", "run_job", "run_solve"]

log = logging.getLogger("pipesched.jobs")

#: Seconds between two progress writes or two cancellation polls of one job.
POLL_INTERVAL_S = 0.25

_STORES: dict[str, Store] = {}


def _store(database_url: str) -> Store:
    """One :class:`Store` per database per worker process."""
    if database_url not in _STORES:
        _STORES[database_url] = Store(database_url)
    return _STORES[database_url]


class SolverDied(RuntimeError):
    """A solver process ended abruptly (killed, out of memory)."""


@dataclass(frozen=True)
class JobOutcome:
    """What a job's worker reports back: the schedule id (None when nothing was stored) and solve time, s."""

    job_id: str
    schedule_id: str | None
    status: str | None
    method: str
    solve_time_s: float


def run_solve(problem_json: str, deadline_s: float) -> str:
    """Solve in a worker process; ``deadline_s`` seconds from now the search is told to stop.

    Returns:
        The schedule's JSON.

    Raises:
        FamilyDomainError: as :func:`pipesched.optimizer.solve.solve`.
    """
    problem = Problem.model_validate_json(problem_json)
    stop_at = time.monotonic() + deadline_s
    return solve(problem, should_stop=lambda: time.monotonic() >= stop_at).model_dump_json()


def make_stop_check(store: Store, job_id: str, attempt: int, stop_at: float) -> Callable[[], bool]:
    """``should_stop`` for a job: True once the job is no longer this attempt's ``running`` job
    (cancelled, or re-queued after a restart) or ``stop_at`` (monotonic s) has passed.

    The job row is read at most every :data:`POLL_INTERVAL_S`.
    """
    state = {"checked": 0.0, "stop": False}

    def should_stop() -> bool:
        now = time.monotonic()
        if state["stop"] or now >= stop_at:
            return True
        if now - state["checked"] >= POLL_INTERVAL_S:
            state["checked"] = now
            job = store.job(job_id)
            state["stop"] = job is None or job.status != "running" or job.attempt != attempt
        return bool(state["stop"])

    return should_stop


def run_job(database_url: str, job_id: str, attempt: int, deadline_s: float) -> JobOutcome:
    """Run one job in a worker process: mark it running, solve with progress and cancellation, store.

    Returns:
        The outcome; ``schedule_id`` None when the job was cancelled (before or while solving).

    Raises:
        Whatever the solver raises (the pool marks the job failed with it).
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
        store.record_progress(
            job_id,
            attempt,
            best_objective=update.best_objective,
            lower_bound=update.lower_bound,
            elapsed_s=round(max(update.elapsed_s, now - started), 4),
            message=update.message or update.backend,
        )

    def progress(update: Progress) -> None:
        latest[0] = update
        write_progress()

    stop_check = make_stop_check(store, job_id, attempt, started + deadline_s)

    def should_stop() -> bool:
        write_progress()
        return stop_check()

    schedule = solve(problem, progress=progress, should_stop=should_stop)
    stored = store.finish_job(job_id, attempt, job.problem_hash, schedule)
    return JobOutcome(
        job_id,
        None if stored is None else stored.id,
        schedule.status,
        schedule.method,
        schedule.solve_time_s,
    )


def _context() -> multiprocessing.context.BaseContext:
    # Never fork a process that runs an event loop and threads: forkserver where there is one.
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")


class SolverPool:
    """The bounded pool of solver processes and the jobs in flight.

    Args:
        store: the service's store (jobs are read and finished by the workers through the same URL).
        workers: the most solves at once.
        deadline_grace_s: added to a problem's time limit before its search is told to stop.
        on_job_done: called in a pool thread with each finished :class:`JobOutcome` (metrics).
        on_job_failed: called in a pool thread with (job id, reason).
        max_job_attempts: passed on to :meth:`Store.recover_jobs`.
    """

    def __init__(
        self,
        store: Store,
        workers: int,
        *,
        deadline_grace_s: float = 2.0,
        on_job_done: Callable[[JobOutcome], None] | None = None,
        max_job_attempts: int = 3,
    ) -> None:
        self.store = store
        self.workers = workers
        self.deadline_grace_s = deadline_grace_s
        self.on_job_done = on_job_done
        self.max_job_attempts = max_job_attempts
        self._lock = threading.Lock()
        self._executor = self._new_executor()
        self._futures: dict[str, Future[JobOutcome]] = {}

    def _new_executor(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(max_workers=self.workers, mp_context=_context())

    def _submit(self, fn: Callable[..., object], *args: object) -> Future:
        with self._lock:
            try:
                return self._executor.submit(fn, *args)
            except BrokenProcessPool:
                log.warning("solver pool broken; starting a new one")
                self._executor = self._new_executor()
                return self._executor.submit(fn, *args)

    def submit_task(self, fn: Callable[..., object], *args: object) -> Future:
        """Run ``fn(*args)`` in a worker (a plan search): it shares the pool's bound on concurrent work."""
        return self._submit(fn, *args)

    def solve(self, problem: Problem, timeout_s: float) -> Schedule:
        """Solve in a worker and wait at most ``timeout_s`` (the search is told to stop before).

        Raises:
            TimeoutError: no answer within ``timeout_s``.
            SolverDied: the worker process died.
            FamilyDomainError: as :func:`pipesched.optimizer.solve.solve`.
        """
        deadline_s = problem.solver.time_limit_s + self.deadline_grace_s
        future = self._submit(run_solve, problem.model_dump_json(), deadline_s)
        try:
            text = future.result(timeout=timeout_s)
        except TimeoutError:
            future.cancel()
            raise
        except BrokenProcessPool:
            with self._lock:
                self._executor = self._new_executor()
            raise SolverDied("the solver process died (out of memory or killed) while solving this problem") from None
        return Schedule.model_validate_json(str(text))

    def submit_job(self, job_id: str, attempt: int, time_limit_s: float) -> None:
        """Queue a stored job for a worker."""
        future: Future[JobOutcome] = self._submit(
            run_job, self.store.database_url, job_id, attempt, time_limit_s + self.deadline_grace_s
        )
        with self._lock:
            self._futures[job_id] = future
        future.add_done_callback(lambda done: self._job_finished(job_id, attempt, done))

    def _job_finished(self, job_id: str, attempt: int, future: Future[JobOutcome]) -> None:
        with self._lock:
            self._futures.pop(job_id, None)
        if future.cancelled():
            return
        error = future.exception()
        if error is None:
            outcome = future.result()
            if self.on_job_done is not None and outcome.schedule_id is not None:
                self.on_job_done(outcome)
            return
        if isinstance(error, BrokenProcessPool):
            reason = "the solver process died (out of memory or killed) while solving this job"
        else:
            reason = f"the solver failed: {type(error).__name__}: {error}"
        log.error("job %s failed: %s", job_id, reason)
        try:
            self.store.fail_job(job_id, reason, attempt)
        except Exception:  # the database itself is gone; recovery at the next start handles the row
            log.exception("could not mark job %s failed", job_id)

    def cancel(self, job_id: str) -> None:
        """Drop a job that has not started yet from the pool's queue (a running one polls its row)."""
        with self._lock:
            future = self._futures.get(job_id)
        if future is not None:
            future.cancel()

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
        """Solves submitted to the pool and not yet finished (queued behind the workers included)."""
        with self._lock:
            return len(self._futures)

    def shutdown(self) -> None:
        """Stop taking work; queued solves are dropped (their rows are recovered at the next start)."""
        with self._lock:
            self._executor.shutdown(wait=False, cancel_futures=True)
