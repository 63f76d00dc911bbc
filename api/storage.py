"""Persistence of schedules and jobs (SQLAlchemy 2.0): SQLite by default, PostgreSQL by URL.

Schedules are keyed by the SHA-256 of the problem's canonical JSON (:meth:`Problem.canonical_json`,
costs and memory filled in, keys sorted) *as solved*: the whole ``solver`` block is part of the key —
``method`` and the clamped ``time_limit_s`` change the answer, and so may ``backends`` and ``seed`` —
so the same problem asked again returns the stored schedule without solving.

Every write is one transaction: a schedule row and the job row that points at it are committed
together or not at all.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Float, ForeignKey, Integer, String, Text, create_engine, event, func, select, text, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from pipesched.optimizer.planner.request import PlanAnswer
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.result import Schedule

__all__ = [
    "ACTIVE_JOB_STATUSES",
    "JOB_STATUSES",
    "CallbackRow",
    "DatabaseUnavailable",
    "JobRow",
    "PlanRow",
    "ProfileRow",
    "ScheduleRow",
    "Store",
    "is_unreachable",
    "problem_key",
]

JOB_STATUSES = ("queued", "running", "done", "failed", "cancelled")
#: Longest wait for a PostgreSQL server to accept a connection, s.
CONNECT_TIMEOUT_S = 5
#: The advisory lock under which a process creates the tables ("tabl").
_TABLES_LOCK_KEY = 0x7461626C
ACTIVE_JOB_STATUSES = ("queued", "running")


def problem_key(problem: Problem) -> str:
    """The cache key: hex SHA-256 of ``problem.canonical_json()`` (the whole solver block included)."""
    return hashlib.sha256(problem.canonical_json().encode()).hexdigest()


class DatabaseUnavailable(RuntimeError):
    """The database cannot be reached now (the service answers 503 with ``Retry-After``)."""


def is_unreachable(error: BaseException) -> bool:
    """True when ``error`` says the database cannot be reached now — connection refused or lost, the pool
    exhausted, the server shutting down, SQLite locked — rather than that a statement is wrong.

    Looks through the ``__cause__`` chain, so a queue library's wrapper of a driver error counts too.
    """
    try:
        import psycopg

        driver: tuple[type[BaseException], ...] = (psycopg.OperationalError, psycopg.InterfaceError)
    except ImportError:  # SQLite only
        driver = ()
    seen: BaseException | None = error
    for _ in range(4):
        if seen is None:
            return False
        if isinstance(seen, (DatabaseUnavailable, OperationalError, InterfaceError, PoolTimeoutError, *driver)):
            return True
        if isinstance(seen, DBAPIError) and seen.connection_invalidated:
            return True
        seen = seen.__cause__
    return False


class Base(DeclarativeBase):
    """The tables' common SQLAlchemy base (its metadata creates them)."""


class ScheduleRow(Base):
    """A solved problem. ``problem_hash`` is unique: one stored answer per problem as solved."""

    __tablename__ = "schedules"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    problem_hash: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    status: Mapped[str] = mapped_column(String(16))
    method: Mapped[str] = mapped_column(String(32))
    schedule_json: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)


class JobRow(Base):
    """An asynchronous solve and its progress (best objective and lower bound in ms, elapsed s)."""

    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    problem_hash: Mapped[str] = mapped_column(String(64))
    problem_json: Mapped[str] = mapped_column(Text)
    schedule_id: Mapped[str | None] = mapped_column(String(32), ForeignKey("schedules.id"), nullable=True)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    best_objective: Mapped[float | None] = mapped_column(Float, nullable=True)
    lower_bound: Mapped[float | None] = mapped_column(Float, nullable=True)
    elapsed_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    message: Mapped[str | None] = mapped_column(Text, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    cache_hit: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class PlanRow(Base):
    """A plan search (``POST /v1/plans``): the request, its progress and the answer (ranked plans) as JSON.

    While running, ``answer_json`` holds the best plans found so far.
    """

    __tablename__ = "plans"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    request_json: Mapped[str] = mapped_column(Text)
    phase: Mapped[str | None] = mapped_column(String(16), nullable=True)
    evaluated: Mapped[int] = mapped_column(Integer, default=0)
    total: Mapped[int] = mapped_column(Integer, default=0)
    best_step_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    elapsed_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    answer_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class ProfileRow(Base):
    """An accelerator profile registered with ``POST /v1/profiles`` (what ``pipesched calibrate`` writes), kept
    so that the solver processes that run plans, and the service's next start, know its name."""

    __tablename__ = "profiles"

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    profile_json: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)


class CallbackRow(Base):
    """A job's or plan's callback (:mod:`pipesched.api.callbacks`): where to POST it once it ends, and how the
    deliveries went (``next_at``: Unix time, s, of the next attempt, or when a claimed one's lease ends)."""

    __tablename__ = "callbacks"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    kind: Mapped[str] = mapped_column(String(8))
    target_id: Mapped[str] = mapped_column(String(32), index=True)
    url: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), index=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_at: Mapped[float] = mapped_column(Float, default=0.0)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    delivered_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class _NotThisAttempt(Exception):
    """Raised inside a transaction to roll it back: the job is no longer this attempt's."""


def _new_id() -> str:
    return uuid.uuid4().hex


def _make_engine(database_url: str, *, pool_size: int = 10, max_overflow: int = 20) -> Engine:
    if database_url.startswith("sqlite"):
        pooling = {} if ":memory:" in database_url else {"pool_size": pool_size, "max_overflow": max_overflow}
        engine = create_engine(database_url, connect_args={"timeout": 30, "check_same_thread": False}, **pooling)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            if ":memory:" not in database_url:
                cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        return engine
    # A server that does not answer fails a request within seconds (503), not after the OS's TCP timeout.
    return create_engine(
        database_url,
        pool_pre_ping=True,
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_timeout=10,
        connect_args={"connect_timeout": CONNECT_TIMEOUT_S},
    )


class Store:
    """Schedules and jobs in one database. Safe to use from several threads and processes.

    Args:
        database_url: a SQLAlchemy URL (``sqlite:///path`` or ``postgresql+psycopg://…``). Tables are
            created when missing.
    """

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url
        self.engine = _make_engine(database_url)
        with self.engine.begin() as connection:
            if connection.dialect.name == "postgresql":  # processes starting together create the tables once
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _TABLES_LOCK_KEY})
            Base.metadata.create_all(connection)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        # Health probes and counts on connections of their own: requests holding every pooled connection (a
        # flood of submissions) never hold up /healthz or /metrics. (One in-memory SQLite database: one engine.)
        self._monitor = (
            self.engine if ":memory:" in database_url else _make_engine(database_url, pool_size=1, max_overflow=2)
        )
        self._monitor_sessions = sessionmaker(self._monitor, expire_on_commit=False)

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """A session whose writes commit together on exit, or roll back on any exception."""
        with self._sessions.begin() as session:
            yield session

    def ping(self) -> None:
        """Raise when the database cannot be reached (on the monitoring connections)."""
        with self._monitor_sessions() as session:
            session.execute(select(1))

    def dispose(self) -> None:
        """Close the engines' pooled connections (the app's shutdown; tests that open their own store)."""
        self.engine.dispose()
        self._monitor.dispose()

    # --- schedules -------------------------------------------------------------------------------

    def schedule_by_hash(self, problem_hash: str) -> Schedule | None:
        """The stored schedule for a problem key, or None."""
        with self._sessions() as session:
            row = session.scalars(select(ScheduleRow).where(ScheduleRow.problem_hash == problem_hash)).first()
            return None if row is None else Schedule.model_validate_json(row.schedule_json)

    def schedule_json_by_hash(self, problem_hash: str) -> str | None:
        """The stored schedule's JSON text for a problem key (no parsing: the cache-hit path), or None."""
        with self._sessions() as session:
            return session.scalar(select(ScheduleRow.schedule_json).where(ScheduleRow.problem_hash == problem_hash))

    def schedule_json(self, schedule_id: str) -> str | None:
        """The stored schedule's JSON text (no parsing: the read path), or None."""
        with self._sessions() as session:
            return session.scalar(select(ScheduleRow.schedule_json).where(ScheduleRow.id == schedule_id))

    def schedule(self, schedule_id: str) -> Schedule | None:
        """The stored schedule with this id, or None."""
        with self._sessions() as session:
            row = session.get(ScheduleRow, schedule_id)
            return None if row is None else Schedule.model_validate_json(row.schedule_json)

    def _insert_schedule(self, session: Session, problem_hash: str, schedule: Schedule) -> Schedule:
        stored = schedule.model_copy(update={"id": _new_id()})
        session.add(
            ScheduleRow(
                id=stored.id,
                problem_hash=problem_hash,
                status=stored.status,
                method=stored.method,
                schedule_json=stored.model_dump_json(),
                created_at=time.time(),
            )
        )
        session.flush()
        return stored

    def put_schedule(self, problem_hash: str, schedule: Schedule) -> tuple[Schedule, bool]:
        """Store ``schedule`` under ``problem_hash``; returns (stored schedule with its ``id``, created).

        When another writer stored the same key first, its schedule is returned with ``created`` False.
        """
        try:
            with self.transaction() as session:
                return self._insert_schedule(session, problem_hash, schedule), True
        except IntegrityError:
            existing = self.schedule_by_hash(problem_hash)
            if existing is None:
                raise
            return existing, False

    def count_schedules(self) -> int:
        """How many schedules are stored (used by tests to check what a request stored)."""
        with self._sessions() as session:
            return int(session.scalar(select(func.count()).select_from(ScheduleRow)) or 0)

    # --- jobs ------------------------------------------------------------------------------------

    def create_job(self, problem: Problem, problem_hash: str, cached: Schedule | None = None) -> JobRow:
        """A new job, ``queued``; or ``done`` at once when ``cached`` (a stored schedule) answers it."""
        now = time.time()
        row = JobRow(
            id=_new_id(),
            status="done" if cached is not None else "queued",
            problem_hash=problem_hash,
            problem_json=problem.model_dump_json(),
            schedule_id=None if cached is None else cached.id,
            attempt=0,
            cache_hit=int(cached is not None),
            message="answered from the stored schedule" if cached is not None else None,
            elapsed_s=0.0 if cached is not None else None,
            best_objective=None if cached is None else cached.objective_value,
            lower_bound=None if cached is None else cached.lower_bound,
            created_at=now,
            updated_at=now,
        )
        with self.transaction() as session:
            session.add(row)
        return row

    def job(self, job_id: str) -> JobRow | None:
        """The job with this id (a detached row: read its fields, do not write them), or None."""
        with self._sessions() as session:
            return session.get(JobRow, job_id)

    def job_status(self, job_id: str) -> str | None:
        """The job's status alone (``queued``/``running``/``done``/``failed``/``cancelled``), or None when unknown.

        Used by tests; :meth:`job` gives the whole row.
        """
        with self._sessions() as session:
            return session.scalar(select(JobRow.status).where(JobRow.id == job_id))

    def start_job(self, job_id: str, attempt: int) -> bool:
        """Mark a queued job ``running`` for ``attempt``; False when it was cancelled or taken over."""
        with self.transaction() as session:
            result = session.execute(
                update(JobRow)
                .where(JobRow.id == job_id, JobRow.status == "queued", JobRow.attempt == attempt)
                .values(status="running", updated_at=time.time())
            )
            return bool(result.rowcount)  # type: ignore[attr-defined]

    def record_progress(
        self,
        job_id: str,
        attempt: int,
        *,
        best_objective: float | None,
        lower_bound: float | None,
        elapsed_s: float,
        message: str = "",
    ) -> None:
        """Write a running job's progress (ms, ms, s)."""
        with self.transaction() as session:
            session.execute(
                update(JobRow)
                .where(JobRow.id == job_id, JobRow.status == "running", JobRow.attempt == attempt)
                .values(
                    best_objective=best_objective,
                    lower_bound=lower_bound,
                    elapsed_s=elapsed_s,
                    message=message or None,
                    updated_at=time.time(),
                )
            )

    def finish_job(self, job_id: str, attempt: int, problem_hash: str, schedule: Schedule) -> Schedule | None:
        """Store the job's schedule and mark it ``done``, in one transaction.

        Returns the stored schedule, or None (nothing written) when the job is no longer this
        attempt's to finish (cancelled meanwhile, or re-queued after a restart).
        """
        existing = self.schedule_by_hash(problem_hash)
        try:
            with self.transaction() as session:
                stored = existing or self._insert_schedule(session, problem_hash, schedule)
                result = session.execute(
                    update(JobRow)
                    .where(JobRow.id == job_id, JobRow.status == "running", JobRow.attempt == attempt)
                    .values(
                        status="done",
                        schedule_id=stored.id,
                        best_objective=stored.objective_value,
                        lower_bound=stored.lower_bound,
                        elapsed_s=schedule.solve_time_s,
                        updated_at=time.time(),
                    )
                )
                if not result.rowcount:  # type: ignore[attr-defined]
                    raise _NotThisAttempt
                return stored
        except _NotThisAttempt:
            return None
        except IntegrityError:
            # Another writer stored the same problem meanwhile: point the job at that schedule.
            return self.finish_job(job_id, attempt, problem_hash, schedule)

    def fail_job(self, job_id: str, reason: str, attempt: int | None = None) -> bool:
        """Mark an active job ``failed`` with ``reason``; False when it had already ended."""
        with self.transaction() as session:
            condition = [JobRow.id == job_id, JobRow.status.in_(ACTIVE_JOB_STATUSES)]
            if attempt is not None:
                condition.append(JobRow.attempt == attempt)
            result = session.execute(
                update(JobRow).where(*condition).values(status="failed", error=reason, updated_at=time.time())
            )
            return bool(result.rowcount)  # type: ignore[attr-defined]

    def cancel_job(self, job_id: str) -> JobRow | None:
        """Mark an active job ``cancelled`` (a finished one stays as it is); the job, or None if unknown."""
        with self.transaction() as session:
            session.execute(
                update(JobRow)
                .where(JobRow.id == job_id, JobRow.status.in_(ACTIVE_JOB_STATUSES))
                .values(status="cancelled", message="cancelled by request", updated_at=time.time())
            )
        return self.job(job_id)

    def recover_jobs(self, max_attempts: int) -> tuple[list[tuple[str, int]], list[str]]:
        """After a restart: re-queue jobs left ``queued``/``running``, or fail those out of attempts.

        A job's ``attempt`` counts the restarts it has lived through; it lives through ``max_attempts``
        of them and is failed at the next (``max_attempts`` 1: re-queued once, failed the second time).

        Returns ``([(job id, new attempt), …] to submit again, [failed job ids])``.
        """
        requeued: list[tuple[str, int]] = []
        failed: list[str] = []
        with self.transaction() as session:
            rows = session.scalars(
                select(JobRow).where(JobRow.status.in_(ACTIVE_JOB_STATUSES)).order_by(JobRow.created_at)
            ).all()
            for row in rows:
                row.updated_at = time.time()
                was = row.status
                if row.attempt >= max_attempts:
                    row.status = "failed"
                    row.error = (
                        f"the service restarted {row.attempt + 1} times while this job was {was}; "
                        "submit it again, perhaps with a shorter solver.time_limit_s"
                    )
                    failed.append(row.id)
                else:
                    row.status = "queued"
                    row.attempt += 1
                    row.message = f"re-queued after a service restart (was {was})"
                    requeued.append((row.id, row.attempt))
        return requeued, failed

    def take_job(self, job_id: str, max_attempts: int) -> int | None:
        """For a queue worker (:mod:`pipesched.api.worker`) about to run a job: the attempt to run, or None.

        A ``queued`` job is run at its attempt. A ``running`` one was left by a worker that stopped
        (the queue retries a stalled task): it is re-queued with ``attempt + 1`` and a message saying
        so — the old attempt can then neither write progress nor finish — or failed with the reason
        once it has been retried ``max_attempts`` times. A job that ended (done, failed, cancelled) or
        is unknown gives None. One transaction, the row locked (``SELECT … FOR UPDATE``).
        """
        with self.transaction() as session:
            row = session.scalars(select(JobRow).where(JobRow.id == job_id).with_for_update()).first()
            if row is None or row.status not in ACTIVE_JOB_STATUSES:
                return None
            if row.status == "queued":
                return row.attempt
            row.updated_at = time.time()
            if row.attempt >= max_attempts:
                row.status = "failed"
                row.error = (
                    f"the worker solving this job stopped {row.attempt + 1} times (killed, out of memory, or cut "
                    "off from the database); submit it again, perhaps with a shorter solver.time_limit_s"
                )
                return None
            row.status = "queued"
            row.attempt += 1
            row.message = f"retried after its worker stopped (attempt {row.attempt})"
            return row.attempt

    def running_jobs_time_left_s(self, grace_s: float) -> list[float]:
        """For each running job: its time limit + ``grace_s`` less the time it has run (its last reported
        ``elapsed_s``, else since it was queued), s, at least 0 (``Retry-After`` of a full job queue)."""
        now = time.time()
        with self._sessions() as session:
            rows = session.execute(
                select(JobRow.problem_json, JobRow.elapsed_s, JobRow.created_at).where(JobRow.status == "running")
            ).all()
        left = []
        for problem_json, elapsed_s, created_at in rows:
            limit_s = float(json.loads(problem_json).get("solver", {}).get("time_limit_s", 0.0))
            ran_s = elapsed_s if elapsed_s is not None else now - created_at
            left.append(max(0.0, limit_s + grace_s - ran_s))
        return left

    def count_jobs_by_status(self) -> dict[str, int]:
        """Jobs per status (every status present, zero when none; on the monitoring connections)."""
        counts = dict.fromkeys(JOB_STATUSES, 0)
        with self._monitor_sessions() as session:
            for status, count in session.execute(select(JobRow.status, func.count()).group_by(JobRow.status)):
                counts[status] = int(count)
        return counts

    # --- plans -----------------------------------------------------------------------------------

    def create_plan(self, request_json: str, total: int) -> PlanRow:
        """A new plan search, ``queued``, over ``total`` configurations to evaluate."""
        now = time.time()
        row = PlanRow(
            id=_new_id(),
            status="queued",
            request_json=request_json,
            evaluated=0,
            total=total,
            created_at=now,
            updated_at=now,
        )
        with self.transaction() as session:
            session.add(row)
        return row

    def plan(self, plan_id: str) -> PlanRow | None:
        """The plan search with this id, or None."""
        with self._sessions() as session:
            return session.get(PlanRow, plan_id)

    def record_plan_progress(
        self,
        plan_id: str,
        *,
        phase: str,
        evaluated: int,
        total: int,
        best_step_ms: float | None,
        elapsed_s: float,
        answer_json: str | None,
    ) -> None:
        """Mark the search running and record where it stands (and the best plans so far)."""
        values: dict[str, Any] = {
            "status": "running",
            "phase": phase,
            "evaluated": evaluated,
            "total": total,
            "best_step_ms": best_step_ms,
            "elapsed_s": elapsed_s,
            "updated_at": time.time(),
        }
        if answer_json is not None:
            values["answer_json"] = answer_json
        with self.transaction() as session:
            session.execute(
                update(PlanRow).where(PlanRow.id == plan_id, PlanRow.status.in_(ACTIVE_JOB_STATUSES)).values(**values)
            )

    def cancel_plan(self, plan_id: str) -> PlanRow | None:
        """Mark an active plan search ``cancelled`` (a finished one stays as it is): a queued one never starts, a
        running one stops at its next look (:func:`pipesched.api.plans.run_plan`) and stores the plans it found.
        The plan, or None if unknown."""
        with self.transaction() as session:
            session.execute(
                update(PlanRow)
                .where(PlanRow.id == plan_id, PlanRow.status.in_(ACTIVE_JOB_STATUSES))
                .values(status="cancelled", updated_at=time.time())
            )
        return self.plan(plan_id)

    def finish_plan(self, plan_id: str, answer: PlanAnswer, schedules: list[Schedule | None]) -> PlanAnswer:
        """Store the plans' schedules and the answer (their ``schedule_id`` filled in) in one transaction.

        ``schedules[i]`` belongs to ``answer.plans[i]``; a schedule whose problem is stored already keeps the
        stored one's id. A search cancelled meanwhile (:meth:`cancel_plan`) stays ``cancelled``, with the plans
        it found. Returns the answer as stored.
        """
        plans = []
        with self.transaction() as session:
            current = session.scalar(select(PlanRow.status).where(PlanRow.id == plan_id))
            status = "cancelled" if current == "cancelled" else "done"
            for plan, schedule in zip(answer.plans, schedules, strict=True):
                if schedule is None:
                    plans.append(plan)
                    continue
                key = problem_key(schedule.problem)
                schedule_id = session.scalar(select(ScheduleRow.id).where(ScheduleRow.problem_hash == key))
                if schedule_id is None:
                    schedule_id = self._insert_schedule(session, key, schedule).id
                plans.append(plan.model_copy(update={"schedule_id": schedule_id}))
            stored = answer.model_copy(update={"id": plan_id, "status": status, "plans": plans})
            session.execute(
                update(PlanRow)
                .where(PlanRow.id == plan_id)
                .values(status=status, phase="done", answer_json=stored.model_dump_json(), updated_at=time.time())
            )
        return stored

    def fail_plan(self, plan_id: str, reason: str) -> None:
        """Mark the search failed with ``reason``."""
        with self.transaction() as session:
            session.execute(
                update(PlanRow)
                .where(PlanRow.id == plan_id)
                .values(status="failed", error=reason, updated_at=time.time())
            )

    def fail_unfinished_plans(self) -> int:
        """At a start: plan searches a previous run left queued or running fail with the reason; how many."""
        with self.transaction() as session:
            result = session.execute(
                update(PlanRow)
                .where(PlanRow.status.in_(ACTIVE_JOB_STATUSES))
                .values(
                    status="failed",
                    error="the service restarted during this plan search: POST /v1/plans again",
                    updated_at=time.time(),
                )
            )
            return int(getattr(result, "rowcount", 0) or 0)

    # --- profiles --------------------------------------------------------------------------------

    def put_profile(self, name: str, profile_json: str) -> str | None:
        """Store a registered profile under ``name`` (case-insensitive), replacing one of the same name; the
        replaced one's JSON, or None."""
        with self.transaction() as session:
            previous = session.get(ProfileRow, name.lower())
            replaced = previous.profile_json if previous is not None else None
            session.merge(ProfileRow(name=name.lower(), profile_json=profile_json, created_at=time.time()))
        return replaced

    def profiles_stamp(self) -> tuple[int, float]:
        """(how many profiles are stored, when the newest was stored): changes whenever any replica registers or
        replaces one (``put_profile``), so a replica can tell that it must read them again."""
        with self._sessions() as session:
            count, newest = session.execute(select(func.count(), func.max(ProfileRow.created_at))).one()
            return int(count), float(newest or 0.0)

    def profile_jsons(self) -> list[str]:
        """Every registered profile's JSON, oldest first."""
        with self._sessions() as session:
            return list(session.scalars(select(ProfileRow.profile_json).order_by(ProfileRow.created_at)))
