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
- ``solve_sync(problem_json, problem_hash, deadline_s)``: a synchronous ``POST /v1/schedules`` solve;
  the worker stores the schedule under its problem key, where the waiting front end reads it.

procrastinate is imported only here and only when the queue is used (the ``workers`` extra): the
embedded default (SQLite, in-process pool) needs none of it.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from typing import Any

from pipesched.api.jobs import JobOutcome, SolverDied, SolverPool, run_job
from pipesched.api.settings import Settings
from pipesched.api.storage import Store
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
    "ensure_queue_schema",
    "libpq_dsn",
    "make_runner",
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
#: An advisory-lock key: one process at a time installs procrastinate's schema.
_SCHEMA_LOCK_KEY = 0x70697065  # "pipe"

DATABASE_FIX = (
    "set PIPESCHED_DATABASE_URL=postgresql+psycopg://USER:PASSWORD@HOST:PORT/DATABASE (the database every "
    "`pipesched serve` replica with PIPESCHED_QUEUE=postgres and every `pipesched worker` share)"
)
INSTALL_FIX = "pip install 'pipesched[workers]' (procrastinate and psycopg)"


_STORES: dict[str, Store] = {}


def _store(database_url: str) -> Store:
    """One :class:`Store` per database in a worker process."""
    if database_url not in _STORES:
        _STORES[database_url] = Store(database_url)
    return _STORES[database_url]


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

    pool_args: dict[str, Any] = {
        "conninfo": libpq_dsn(settings.database_url),
        "min_size": 1,
        "max_size": 4,
        "timeout": 10.0,
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

    @app.task(name=SOLVE_JOB_TASK, queue=QUEUE_NAME, retry=retry)
    def solve_job(job_id: str) -> str:
        """Run the stored job ``job_id`` (see the module's docstring); its status as it ended."""
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
            store.fail_job(job_id, reason, attempt)
            return "failed"
        ended = store.job_status(job_id) or "unknown"
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

    @app.task(name=SOLVE_SYNC_TASK, queue=QUEUE_NAME, retry=retry)
    def solve_sync(problem_json: str, problem_hash: str, deadline_s: float) -> str:
        """Solve a synchronous request's problem and store it under ``problem_hash``; the schedule id."""
        store = _store(database_url)
        problem = Problem.model_validate_json(problem_json)
        stop_at = time.monotonic() + deadline_s
        schedule = solve(problem, should_stop=lambda: time.monotonic() >= stop_at)
        stored, _created = store.put_schedule(problem_hash, schedule)
        log.info("synchronous solve %s… stored as %s on %s", problem_hash[:12], stored.id, worker_name())
        return str(stored.id)

    return app


class QueueRunner:
    """A front end's runner with PostgreSQL workers: the :class:`SolverPool` methods, solving nothing here.

    Args:
        store: the service's store (PostgreSQL).
        settings: the service's settings (``database_url``, ``max_job_attempts``).
        poll_interval_s: how often a synchronous request looks for its stored schedule, s.
    """

    def __init__(self, store: Store, settings: Settings, *, poll_interval_s: float = 0.05) -> None:
        self.store = store
        self.settings = settings
        self.poll_interval_s = poll_interval_s
        ensure_queue_schema(settings.database_url)
        self.app = build_queue_app(settings, asynchronous=False)
        self.app.open()

    def reserve_job(self) -> None:
        """Admission for a job: the PostgreSQL queue takes every job (workers drain it at their pace)."""

    def release_job(self) -> None:
        """Give back a reservation the job did not use (nothing to give back here)."""

    def submit_job(self, job_id: str, attempt: int, time_limit_s: float, *, reserved: bool = False) -> None:
        """Defer the stored job to the workers (``attempt`` and ``time_limit_s`` are read from its row there)."""
        del attempt, time_limit_s, reserved
        self.app.configure_task(SOLVE_JOB_TASK, queue=QUEUE_NAME).defer(job_id=job_id)

    def solve(self, problem: Problem, timeout_s: float) -> Schedule:
        """Have a worker solve ``problem`` and wait at most ``timeout_s`` for its stored schedule.

        Raises:
            TimeoutError: no answer within ``timeout_s`` (no worker free, or none running).
            SolverDied: the task failed on the worker (its error is in the worker's log).
        """
        from pipesched.api.storage import problem_key

        key = problem_key(problem)
        deadline_s = problem.solver.time_limit_s + DEADLINE_GRACE_S
        task_id = self.app.configure_task(SOLVE_SYNC_TASK, queue=QUEUE_NAME).defer(
            problem_json=problem.model_dump_json(), problem_hash=key, deadline_s=deadline_s
        )
        give_up = time.monotonic() + timeout_s
        checks = 0
        while True:
            stored = self.store.schedule_by_hash(key)
            if stored is not None:
                return stored
            checks += 1
            if checks % 20 == 0 and self._task_failed(task_id):
                stored = self.store.schedule_by_hash(key)
                if stored is not None:
                    return stored
                raise SolverDied("the worker's solve failed (see the worker's log)")
            if time.monotonic() >= give_up:
                self._cancel_task(task_id)
                raise TimeoutError(f"no worker answered within {timeout_s:.0f} s")
            time.sleep(self.poll_interval_s)

    def _task_failed(self, task_id: int) -> bool:
        try:
            status = self.app.job_manager.get_job_status(task_id)
        except Exception:  # deleted once it succeeded: the schedule is there
            return False
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
