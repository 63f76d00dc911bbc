"""Solves on ``pipesched worker`` processes over PostgreSQL, through a procrastinate queue.

With ``PIPESCHED_QUEUE=postgres`` a ``pipesched serve`` replica solves nothing itself: it stores the
job row (as always) and defers a procrastinate task naming the job; any ``pipesched worker`` process,
on any machine, that reaches the same database takes the task (procrastinate's
``SELECT … FOR UPDATE SKIP LOCKED`` claim), solves, writes progress to the job row and stores the
schedule and ``done`` in one transaction — the in-process runner's code (:func:`run_job`), so
progress, cancellation (the search's ``should_stop`` polls the job row) and time limits behave alike.

Queue tasks (names in :data:`SOLVE_JOB_TASK`, :data:`SOLVE_SYNC_TASK`, on queue :data:`QUEUE_NAME`):

- ``solve_job(job_id)``: a row of ``jobs``. When procrastinate retries a task whose worker stopped
  (:mod:`pipesched.api.worker` sweeps stalled tasks), :meth:`Store.take_job` re-queues the row with
  ``attempt + 1``, so the old attempt cannot write or finish, and fails it after ``max_job_attempts``.
  Its task carries the job id as procrastinate ``lock`` and ``queueing_lock``: two tasks of one job
  never run at once, and never wait in the queue side by side.
- ``solve_sync(problem_json, problem_hash, deadline_s)``: a synchronous ``POST /v1/schedules`` solve;
  the worker stores the schedule under its problem key, where the waiting front end reads it. Its
  task has priority :data:`SYNC_PRIORITY` over jobs: a free worker takes the waiting request first.

Admission in a front end: at most ``sync_solver_workers + max_queued_solves`` synchronous solves wait
on one front end, and at most ``max_queued_jobs`` jobs wait in the database (every front end's); beyond
that :class:`LaneFull` (429 with ``Retry-After``). A database that cannot be reached raises
:class:`DatabaseUnavailable` (503), a solve no worker answers in time :class:`SolveTimeout` (504).

procrastinate is imported only here and only when the queue is used (the ``workers`` extra): the
embedded default (SQLite, in-process pool) needs none of it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from pipesched.api.jobs import (
    RESULT_RETRY_S,
    JobOutcome,
    SolverDied,
    SolverPool,
    SolveTimeout,
    _store,
    retry_while_unreachable,
    run_job,
)
from pipesched.api.lanes import Admission, LaneFull
from pipesched.api.settings import Settings
from pipesched.api.storage import DatabaseUnavailable, Store, is_unreachable, problem_key
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.result import Schedule
from pipesched.optimizer.solve import solve

__all__ = [
    "DEADLINE_GRACE_S",
    "QUEUE_NAME",
    "SOLVE_JOB_TASK",
    "SOLVE_SYNC_TASK",
    "QueueRunner",
    "QueueSettingsError",
    "build_queue_app",
    "check_queue_settings",
    "database_uptime_s",
    "defer_job",
    "defer_job_async",
    "ensure_queue_schema",
    "libpq_dsn",
    "make_runner",
    "orphaned_jobs",
]

log = logging.getLogger("pipesched.queue")

#: The procrastinate queue the solver tasks go to.
QUEUE_NAME = "pipesched-solve"
SOLVE_JOB_TASK = "pipesched.solve_job"
SOLVE_SYNC_TASK = "pipesched.solve_sync"
#: Added to a problem's time limit before its search is told to stop, s (as the in-process pool).
DEADLINE_GRACE_S = 2.0
#: A task that raised a database error (the worker lost the database mid-solve) is retried this many
#: times, waiting :data:`DB_ERROR_RETRY_WAIT_S` between tries; the job row's attempt counts each.
DB_ERROR_RETRIES = 5
DB_ERROR_RETRY_WAIT_S = 5
#: A synchronous solve's task priority (jobs have 0; procrastinate takes the highest first).
SYNC_PRIORITY = 10
#: Longest wait for a pooled queue connection in a front end, s (then 503).
FRONT_END_POOL_TIMEOUT_S = 5.0
#: An advisory-lock key: one process at a time installs procrastinate's schema.
_SCHEMA_LOCK_KEY = 0x70697065  # "pipe"

DATABASE_FIX = (
    "set PIPESCHED_DATABASE_URL=postgresql+psycopg://USER:PASSWORD@HOST:PORT/DATABASE (the database every "
    "`pipesched serve` replica with PIPESCHED_QUEUE=postgres and every `pipesched worker` share)"
)
INSTALL_FIX = "pip install 'pipesched[workers]' (procrastinate and psycopg)"


class QueueSettingsError(ValueError):
    """The settings cannot run the PostgreSQL queue; the message names the setting and the fix."""


def is_postgres_url(database_url: str) -> bool:
    """True for a SQLAlchemy URL of PostgreSQL (``postgresql://``, ``postgresql+psycopg://``, …)."""
    return database_url.split(":", 1)[0].split("+", 1)[0] in ("postgresql", "postgres")


def libpq_dsn(database_url: str) -> str:
    """The libpq connection string (``postgresql://…``) of a SQLAlchemy PostgreSQL URL."""
    from sqlalchemy.engine import make_url

    return make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)


def check_queue_settings(settings: Settings, *, role: str) -> None:
    """Raise :class:`QueueSettingsError` when ``role`` (``serve`` or ``worker``) cannot use the queue.

    A worker always needs PostgreSQL; a ``serve`` replica only with ``PIPESCHED_QUEUE=postgres``.
    Both need procrastinate installed.
    """
    if role == "serve" and settings.queue != "postgres":
        return
    who = "`pipesched worker`" if role == "worker" else "PIPESCHED_QUEUE=postgres"
    if not is_postgres_url(settings.database_url):
        scheme = settings.database_url.split(":", 1)[0]
        fix = DATABASE_FIX
        if role == "serve":
            fix += ", or leave PIPESCHED_QUEUE unset (local: solves in this process's pool)"
        else:
            fix += "; with SQLite, run `pipesched serve` alone (it solves in its own process pool)"
        raise QueueSettingsError(
            f"PIPESCHED_DATABASE_URL is a {scheme} database, but {who} takes its work from a PostgreSQL queue: {fix}"
        )
    try:
        import procrastinate  # noqa: F401
        import psycopg  # noqa: F401
    except ImportError as error:
        raise QueueSettingsError(f"{who} needs {error.name}, which this installation lacks: {INSTALL_FIX}") from None


def ensure_queue_schema(database_url: str) -> None:
    """Install procrastinate's tables and functions in the database when missing (one process at a time)."""
    import psycopg
    from procrastinate.schema import SchemaManager

    with psycopg.connect(libpq_dsn(database_url), autocommit=True, connect_timeout=10) as connection:
        connection.execute("SELECT pg_advisory_lock(%s)", (_SCHEMA_LOCK_KEY,))
        try:
            present = connection.execute("SELECT to_regclass('procrastinate_jobs') IS NOT NULL").fetchone()
            if not (present and present[0]):
                log.info("installing procrastinate's schema in the database")
                connection.execute(SchemaManager.get_schema())  # type: ignore[arg-type]
        finally:
            connection.execute("SELECT pg_advisory_unlock(%s)", (_SCHEMA_LOCK_KEY,))


def _database_errors() -> tuple[type[BaseException], ...]:
    import psycopg
    from sqlalchemy.exc import DBAPIError

    return (DBAPIError, psycopg.OperationalError)


def worker_name() -> str:
    """``host:pid`` — how a worker names itself in logs."""
    import os

    return f"{socket.gethostname()}:{os.getpid()}"


def build_queue_app(settings: Settings, *, asynchronous: bool) -> Any:
    """The procrastinate ``App`` on the settings' database, with the two solver tasks.

    Args:
        asynchronous: True in a worker (an ``AsyncConnectionPool``: the worker loop is asyncio),
            False in a front end, which defers from request threads.
    """
    import procrastinate

    # procrastinate's connectors check a pooled connection when it is taken (one the server dropped is replaced).
    pool_args: dict[str, Any] = {
        "conninfo": libpq_dsn(settings.database_url),
        "min_size": 1,
        "max_size": 4,
        "timeout": 10.0 if asynchronous else FRONT_END_POOL_TIMEOUT_S,
        "kwargs": {"connect_timeout": 5},
    }
    connector = (
        procrastinate.PsycopgConnector(**pool_args) if asynchronous else procrastinate.SyncPsycopgConnector(**pool_args)
    )
    app = procrastinate.App(connector=connector)
    retry = procrastinate.RetryStrategy(
        max_attempts=DB_ERROR_RETRIES, wait=DB_ERROR_RETRY_WAIT_S, retry_exceptions=_database_errors()
    )
    database_url = settings.database_url
    max_attempts = settings.max_job_attempts

    @app.task(name=SOLVE_JOB_TASK, queue=QUEUE_NAME, retry=retry, pass_context=True)
    def solve_job(context: Any, job_id: str) -> str:
        """Run the stored job ``job_id`` (see the module's docstring); its status as it ended."""
        with _running(context):
            return _solve_job(database_url, max_attempts, job_id)

    @app.task(name=SOLVE_SYNC_TASK, queue=QUEUE_NAME, retry=retry, pass_context=True)
    def solve_sync(context: Any, problem_json: str, problem_hash: str, deadline_s: float) -> str:
        """Solve a synchronous request's problem and store it under ``problem_hash``; the schedule id."""
        with _running(context):
            return _solve_sync(database_url, problem_json, problem_hash, deadline_s)

    return app


#: The procrastinate task ids this process runs now (a solver process's heartbeat hands back any other
#: task the database says it runs: one whose end it could not record during an outage).
RUNNING_TASKS: set[int] = set()


@contextlib.contextmanager
def _running(context: Any) -> Iterator[None]:
    task_id = context.job.id
    RUNNING_TASKS.add(task_id)
    try:
        yield
    finally:
        RUNNING_TASKS.discard(task_id)


def _solve_job(database_url: str, max_attempts: int, job_id: str) -> str:
    """A ``solve_job`` task: take the job (:meth:`Store.take_job`), run it, log how it ended; its status."""
    store = _store(database_url)
    attempt = store.take_job(job_id, max_attempts)
    if attempt is None:
        log.info("job %s has ended already (%s); nothing to run", job_id, store.job_status(job_id))
        return "skipped"
    job = store.job(job_id)
    assert job is not None
    time_limit_s = Problem.model_validate_json(job.problem_json).solver.time_limit_s
    log.info("job %s attempt %d: solving on %s", job_id, attempt, worker_name())
    try:
        outcome: JobOutcome = run_job(database_url, job_id, attempt, time_limit_s + DEADLINE_GRACE_S)
    except _database_errors():
        raise  # procrastinate retries it (RetryStrategy above); take_job then counts the attempt
    except Exception as error:
        reason = f"the solver failed: {type(error).__name__}: {error}"
        log.exception("job %s attempt %d failed", job_id, attempt)
        retry_while_unreachable(f"job {job_id}", lambda: store.fail_job(job_id, reason, attempt), RESULT_RETRY_S)
        return "failed"
    try:
        ended = store.job_status(job_id) or "unknown"
    except Exception as error:
        if not is_unreachable(error):
            raise
        ended = "unknown (the database did not answer)"
    log.info(
        "job %s attempt %d: %s on %s (%s, %.2f s)",
        job_id,
        attempt,
        ended,
        worker_name(),
        outcome.method or "-",
        outcome.solve_time_s,
    )
    return ended


def _solve_sync(database_url: str, problem_json: str, problem_hash: str, deadline_s: float) -> str:
    """A ``solve_sync`` task: solve and store under ``problem_hash`` (stored once the database answers); the
    schedule id. A problem stored already (a retried task, the same request from another front end) is not
    solved again."""
    store = _store(database_url)
    before = store.schedule_by_hash(problem_hash)
    if before is not None:
        log.info("synchronous solve %s… stored already as %s; nothing to run", problem_hash[:12], before.id)
        return str(before.id)
    problem = Problem.model_validate_json(problem_json)
    stop_at = time.monotonic() + deadline_s
    schedule = solve(problem, should_stop=lambda: time.monotonic() >= stop_at)
    stored, _created = retry_while_unreachable(
        f"synchronous solve {problem_hash[:12]}…", lambda: store.put_schedule(problem_hash, schedule), RESULT_RETRY_S
    )
    log.info("synchronous solve %s… stored as %s on %s", problem_hash[:12], stored.id, worker_name())
    return str(stored.id)


def _job_task(app: Any, job_id: str) -> Any:
    return app.configure_task(SOLVE_JOB_TASK, queue=QUEUE_NAME, lock=job_id, queueing_lock=job_id)


def defer_job(app: Any, job_id: str) -> None:
    """Defer the solve of stored job ``job_id`` (its id as the task's ``lock`` and ``queueing_lock``).

    Raises:
        procrastinate.exceptions.AlreadyEnqueued: a task of this job waits in the queue already.
    """
    _job_task(app, job_id).defer(job_id=job_id)


async def defer_job_async(app: Any, job_id: str) -> None:
    """:func:`defer_job` from an asyncio worker."""
    await _job_task(app, job_id).defer_async(job_id=job_id)


def database_uptime_s(store: Store) -> float:
    """Seconds since the PostgreSQL server started (``pg_postmaster_start_time()``): a restart resets it."""
    from sqlalchemy import text

    with store.transaction() as session:
        return float(session.execute(text("SELECT EXTRACT(EPOCH FROM now() - pg_postmaster_start_time())")).scalar())


def orphaned_jobs(store: Store, older_than_s: float) -> list[str]:
    """Jobs ``queued`` or ``running`` for more than ``older_than_s`` s with no task waiting or running for
    them (their front end stored the row and lost the database before deferring, or their task failed on
    database errors until out of retries); oldest first."""
    from sqlalchemy import text

    query = text(
        "SELECT j.id FROM jobs j WHERE j.status IN ('queued', 'running') AND j.updated_at < :before "
        "AND NOT EXISTS (SELECT 1 FROM procrastinate_jobs p WHERE p.task_name = :task "
        "AND p.status IN ('todo', 'doing') AND p.args ->> 'job_id' = j.id) ORDER BY j.created_at"
    )
    with store.transaction() as session:
        rows = session.execute(query, {"before": time.time() - older_than_s, "task": SOLVE_JOB_TASK})
        return [str(row[0]) for row in rows]


def _queue_errors() -> tuple[type[BaseException], ...]:
    from procrastinate.exceptions import ConnectorException

    return (ConnectorException, *_database_errors())


class QueueRunner:
    """A front end's runner with PostgreSQL workers: the :class:`SolverPool` methods, solving nothing here.

    Args:
        store: the service's store (PostgreSQL).
        settings: the service's settings (``database_url``, ``max_job_attempts``, the queue bounds).
        poll_interval_s: how often a synchronous request looks for its stored schedule, s.
    """

    def __init__(self, store: Store, settings: Settings, *, poll_interval_s: float = 0.05) -> None:
        self.store = store
        self.settings = settings
        self.poll_interval_s = poll_interval_s
        self.solves = Admission("solve", settings.sync_solver_workers + settings.max_queued_solves)
        self._admitting = threading.Lock()
        self._reserved = 0
        ensure_queue_schema(settings.database_url)
        self.app = build_queue_app(settings, asynchronous=False)
        self.app.open()

    def reserve_job(self) -> None:
        """Admission for a job: refused while ``max_queued_jobs`` jobs wait in the database (any front end's),
        counting this front end's jobs being stored (exact within a front end; front ends side by side may
        overshoot by the requests they admit at the same moment).

        Raises:
            LaneFull: the queue is full (429); ``retry_after_s`` from the running jobs' time left.
        """
        with self._admitting:
            queued = self.store.count_jobs_by_status()["queued"] + self._reserved
            if queued >= self.settings.max_queued_jobs:
                left = self.store.running_jobs_time_left_s(DEADLINE_GRACE_S)
                retry_after = max(1, min(3600, math.ceil(min(left, default=DEADLINE_GRACE_S))))
                raise LaneFull("job", queued, self.settings.max_queued_jobs, retry_after)
            self._reserved += 1

    def release_job(self) -> None:
        """Give back a reservation: the job was deferred (its row counts now) or not stored."""
        with self._admitting:
            self._reserved = max(0, self._reserved - 1)

    def submit_job(self, job_id: str, attempt: int, time_limit_s: float, *, reserved: bool = False) -> None:
        """Defer the stored job to the workers (``attempt`` and ``time_limit_s`` are read from its row there).

        Raises:
            DatabaseUnavailable: the task could not be deferred (the job is marked failed when the database
                allows; else the workers' orphan sweep defers it once the database answers).
        """
        del attempt, time_limit_s
        try:
            defer_job(self.app, job_id)
        except _queue_errors() as error:
            with contextlib.suppress(Exception):
                self.store.fail_job(job_id, "the queue could not be reached to start this job: submit it again")
            raise DatabaseUnavailable(f"the queue cannot be reached ({type(error).__name__})") from error
        finally:
            if reserved:
                self.release_job()

    def solve(self, problem: Problem, timeout_s: float) -> Schedule:
        """Have a worker solve ``problem`` and wait at most ``timeout_s`` for its stored schedule.

        Raises:
            LaneFull: ``sync_solver_workers + max_queued_solves`` solves wait on this front end already.
            SolveTimeout: no answer within ``timeout_s`` (no worker free, or none running).
            DatabaseUnavailable: the queue or the database cannot be reached (at the start, or at the end).
            SolverDied: the task failed on the worker (its error is in the worker's log).
        """
        deadline_s = problem.solver.time_limit_s + DEADLINE_GRACE_S
        with self.solves.place(deadline_s):
            key = problem_key(problem)
            try:
                task_id = self.app.configure_task(SOLVE_SYNC_TASK, queue=QUEUE_NAME, priority=SYNC_PRIORITY).defer(
                    problem_json=problem.model_dump_json(), problem_hash=key, deadline_s=deadline_s
                )
            except _queue_errors() as error:
                raise DatabaseUnavailable(f"the queue cannot be reached ({type(error).__name__})") from error
            return self._wait_for(key, task_id, timeout_s)

    def _wait_for(self, key: str, task_id: int, timeout_s: float) -> Schedule:
        """The schedule stored under ``key`` by task ``task_id``; database errors meanwhile are waited out."""
        give_up = time.monotonic() + timeout_s
        checks = 0
        unreachable: BaseException | None = None
        while True:
            try:
                stored = self.store.schedule_by_hash(key)
                if stored is not None:
                    return stored
                checks += 1
                if checks % 20 == 0 and self._task_failed(task_id):
                    raise SolverDied("the worker's solve failed (see the worker's log)")
                unreachable = None
            except Exception as error:
                if not is_unreachable(error):
                    raise
                unreachable = error
            if time.monotonic() >= give_up:
                self._cancel_task(task_id)
                if unreachable is not None:
                    raise DatabaseUnavailable(f"the database cannot be reached ({type(unreachable).__name__})")
                raise SolveTimeout(
                    f"no worker answered within {timeout_s:.0f} s (all busy, or none running: see `pipesched worker`)"
                )
            time.sleep(self.poll_interval_s)

    def _task_failed(self, task_id: int) -> bool:
        try:
            status = self.app.job_manager.get_job_status(task_id)
        except Exception as error:
            if is_unreachable(error):
                raise
            return False  # no such task (procrastinate's NoResult): deleted once it succeeded, the schedule is there
        return str(getattr(status, "value", status)) in ("failed", "aborted", "cancelled")

    def _cancel_task(self, task_id: int) -> None:
        try:
            self.app.job_manager.cancel_job_by_id(task_id, abort=True)
        except Exception:
            log.debug("could not cancel task %s", task_id, exc_info=True)

    def cancel(self, job_id: str) -> None:
        """Nothing to do here: the worker running the job polls its row (``DELETE`` marked it cancelled),
        and a task not yet started finds the job ended and does nothing."""
        del job_id

    def recover(self) -> tuple[int, int]:
        """Nothing to recover in a front end: the workers retry the tasks of a worker that stopped."""
        return 0, 0

    def in_flight(self) -> int:
        """Jobs queued or running in the database (every replica's)."""
        counts = self.store.count_jobs_by_status()
        return counts["queued"] + counts["running"]

    def shutdown(self) -> None:
        """Close the queue's connections (the workers keep solving what was deferred)."""
        self.app.close()


def make_runner(
    settings: Settings,
) -> Callable[..., SolverPool | QueueRunner]:
    """The runner a ``serve`` process hands its solves to: its own process pool (``PIPESCHED_QUEUE=local``)
    or the PostgreSQL queue (``postgres``). Checks the settings now, builds the runner when called.

    Raises:
        QueueSettingsError: the queue cannot be used with these settings (the message says why and the fix).
    """
    check_queue_settings(settings, role="serve")
    if settings.queue == "postgres":
        return lambda store, **_options: QueueRunner(store, settings)

    def local(store: Store, **options: Any) -> SolverPool:
        return SolverPool(
            store,
            settings.solver_workers,
            sync_workers=settings.sync_solver_workers,
            max_queued_jobs=settings.max_queued_jobs,
            max_queued_solves=settings.max_queued_solves,
            max_job_attempts=settings.max_job_attempts,
            **options,
        )

    return local
