"""``pipesched worker``: solver processes that take their work from the PostgreSQL queue.

One ``pipesched worker`` is a supervisor and ``--processes`` solver processes. Each solver process is a
procrastinate worker (concurrency 1: a solve is CPU-bound) on queue :data:`QUEUE_NAME`, registered in
``procrastinate_workers`` with a heartbeat every ``PIPESCHED_WORKER_STALLED_AFTER_S / 3`` s.

Riding out a database outage (procrastinate 3.x alone does not; see :class:`SolverProcess`): a solver
process keeps its heartbeat going through database errors (tried every second until it answers), keeps
its registration (registers again if its row is gone), runs a fresh procrastinate worker when the old
one stopped on a database error, and its solve goes on (:func:`pipesched.api.jobs.run_job` stores the
schedule once the database answers). The supervisor:

- restarts a solver process that died (its task is then a *stalled* task: see below);
- every :data:`SWEEP_INTERVAL_S` asks procrastinate for stalled tasks — ``doing`` tasks whose worker's
  heartbeat is older than ``PIPESCHED_WORKER_STALLED_AFTER_S`` (``JobManager.get_stalled_jobs``) — and
  retries them (``JobManager.retry_job``); any live worker, on any machine, takes the task within its
  fetch poll (:data:`FETCH_POLL_S`), and :meth:`Store.take_job` counts the attempt on the job row. A
  killed worker's job is thus running again at most ``stalled_after_s + SWEEP_INTERVAL_S +
  FETCH_POLL_S`` after its last heartbeat (10 + 2 + 1 s by default), while another worker is free.
  A heartbeat is judged only once the database has answered for ``stalled_after_s`` — since this
  supervisor last reached it and since the server started (``pg_postmaster_start_time()``) — so the
  heartbeats an outage held back are never taken for dead workers;
- in the same sweeps, defers jobs no task waits for (:func:`pipesched.api.queue.orphaned_jobs`: their
  front end lost the database between storing the row and deferring) and prunes worker rows whose
  heartbeat is older than :data:`PRUNE_AFTER_S`;
- pings the database every second; when it cannot reach it, it logs so, sets
  ``pipesched_worker_database_up`` to 0, counts ``pipesched_worker_database_errors_total`` and backs
  off (1, 2, 4 … up to :data:`MAX_BACKOFF_S` s), restarting no solver process until it answers again;
- serves its Prometheus metrics on ``PIPESCHED_WORKER_METRICS_HOST:PIPESCHED_WORKER_METRICS_PORT``
  (``/metrics``; loopback unless told otherwise: it has no token).

A solver process whose supervisor is gone (killed with SIGKILL) ends itself within a second, so a
killed worker leaves nothing running. SIGTERM or SIGINT stops the worker gracefully: each solver
process finishes its current solve (bounded by its time limit) and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pipesched.api.queue import (
    QUEUE_NAME,
    RUNNING_TASKS,
    build_queue_app,
    database_uptime_s,
    defer_job_async,
    ensure_queue_schema,
    orphaned_jobs,
    worker_name,
)
from pipesched.api.settings import Settings
from pipesched.api.storage import Store, is_unreachable

__all__ = [
    "FETCH_POLL_S",
    "MAX_BACKOFF_S",
    "PRUNE_AFTER_S",
    "SWEEP_INTERVAL_S",
    "SolverProcess",
    "WorkerSupervisor",
    "run_worker",
]

log = logging.getLogger("pipesched.worker")

#: Seconds between two stalled-task sweeps of a supervisor.
SWEEP_INTERVAL_S = 2.0
#: A solver process's longest wait for a task when no notification arrives (a retried task sends none), s.
FETCH_POLL_S = 1.0
#: The longest back-off between two attempts to reach the database, s.
MAX_BACKOFF_S = 30.0
#: Seconds between a solver process's checks that its supervisor still lives.
PARENT_CHECK_S = 0.5
#: Seconds between two heartbeat tries while the database does not answer.
HEARTBEAT_RETRY_S = 1.0
#: A worker row whose heartbeat is older than this is deleted (by a starting procrastinate worker or a sweep), s.
#: Far above the stalled-task bound: deleting a live worker's row would orphan its running task.
PRUNE_AFTER_S = 3600.0
#: A job that no task waits for is deferred again once its row is this old, s.
ORPHAN_AFTER_S = 30.0
#: procrastinate's own heartbeat loop ends on its first database error; :class:`SolverProcess` sends them
#: instead, and procrastinate's waits this long (it never runs).
_OWN_HEARTBEAT_OFF_S = 365 * 24 * 3600.0


def _configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s")
    logging.getLogger("procrastinate").setLevel(logging.WARNING)


def _exit_with_parent(parent_pid: int) -> None:
    """End this process at once when its supervisor is gone (a thread; the solve may hold the GIL briefly)."""

    def watch() -> None:
        while True:
            time.sleep(PARENT_CHECK_S)
            if os.getppid() != parent_pid:
                os._exit(70)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def solver_process_main(settings: Settings, parent_pid: int) -> None:
    """A solver process: :class:`SolverProcess` until SIGTERM/SIGINT or its parent dies."""
    _configure_logging()
    _exit_with_parent(parent_pid)
    asyncio.run(SolverProcess(settings).run())


class SolverProcess:
    """One procrastinate worker (concurrency 1) that rides out database outages.

    Why not procrastinate's worker alone (3.x, read in its ``worker.py``): its heartbeat loop
    (``Worker._update_heartbeat``) ends on the first database error, and the task meant to notice a side
    task's failure (``_monitor_side_tasks``) returns as soon as the first side task ends — the periodic
    deferrer, which returns at once when the app has no periodic task. So after an outage the worker
    goes on taking and solving tasks with a heartbeat frozen at the outage: every sweep then hands its
    healthy tasks back as stalled (solved twice), and once a starting worker prunes its row
    (``prune_stalled_workers``), its next ``fetch_job`` fails with a foreign-key violation.

    Here procrastinate's worker takes, runs, retries and aborts the tasks, registers and unregisters
    itself, and this class sends its heartbeats (``JobManager.update_heartbeat``, every
    ``stalled_after_s / 3``, every :data:`HEARTBEAT_RETRY_S` while the database does not answer), registers
    it again (``JobManager.register_worker``) when its row is gone, and runs a fresh worker when one
    stopped on a database error (its ``fetch_job`` failed during an outage).
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.heartbeat_s = settings.worker_stalled_after_s / 3
        self.worker: Any = None
        self._stop: asyncio.Event | None = None
        self._idle_before: set[int] = set()

    def stop(self) -> None:
        """Stop after the running task (SIGTERM, SIGINT)."""
        if self._stop is not None:
            self._stop.set()
        if self.worker is not None:
            self.worker.stop()

    async def run(self) -> None:
        """Until :meth:`stop`: a procrastinate worker; a fresh one (after a back-off) when one ends on a
        database error."""
        self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        backoff = HEARTBEAT_RETRY_S
        while not self._stop.is_set():
            try:
                app = build_queue_app(self.settings, asynchronous=True)
                async with app.open_async():
                    await self._work(app)
                backoff = HEARTBEAT_RETRY_S
            except Exception as error:
                if not is_unreachable(error):
                    raise
                log.warning(
                    "solver process %s lost the database (%s); working again once it answers (next try in %.0f s)",
                    worker_name(), type(error).__name__, backoff,
                )  # fmt: skip
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)

    async def _work(self, app: Any) -> None:
        from procrastinate.worker import Worker

        self.worker = Worker(
            app=app,
            queues=[QUEUE_NAME],
            name=worker_name(),
            concurrency=1,
            fetch_job_polling_interval=FETCH_POLL_S,
            abort_job_polling_interval=FETCH_POLL_S,
            update_heartbeat_interval=_OWN_HEARTBEAT_OFF_S,
            stalled_worker_timeout=PRUNE_AFTER_S,
            delete_jobs="successful",
            shutdown_graceful_timeout=None,
            install_signal_handlers=False,
        )
        heartbeats = asyncio.create_task(self._heartbeats(app, self.worker), name="pipesched-heartbeats")
        try:
            await self.worker.run()
        finally:
            heartbeats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeats

    async def _heartbeats(self, app: Any, worker: Any) -> None:
        failing = False
        while True:
            await asyncio.sleep(HEARTBEAT_RETRY_S if failing else self.heartbeat_s)
            if worker.worker_id is None:  # not registered yet, or unregistered on the way out
                continue
            try:
                await self._beat(app, worker)
                if failing:
                    log.info("solver process %s: heartbeats sent again", worker_name())
                failing = False
            except Exception as error:
                if not failing:
                    log.warning("solver process %s: heartbeat failed (%s); trying every %.0f s", worker_name(),
                                type(error).__name__, HEARTBEAT_RETRY_S)  # fmt: skip
                failing = True

    async def _beat(self, app: Any, worker: Any) -> None:
        """One heartbeat; a new registration when the worker's row is gone (pruned while it was cut off)."""
        worker_id = worker.worker_id
        await app.job_manager.update_heartbeat(worker_id)
        row = await app.connector.execute_query_one_async(
            "SELECT count(*) AS n FROM procrastinate_workers WHERE id = %(worker_id)s", worker_id=worker_id
        )
        if row["n"] == 0 and worker.worker_id == worker_id:
            worker.worker_id = await app.job_manager.register_worker()
            log.warning(
                "solver process %s: its worker row %s was deleted; registered again as %s",
                worker_name(), worker_id, worker.worker_id,
            )  # fmt: skip
        await self._hand_back_ended(app, worker.worker_id)

    async def _hand_back_ended(self, app: Any, worker_id: int) -> None:
        """Hand back (``retry_job_by_id``) the tasks the database says this process runs but it does not, two
        heartbeats in a row: tasks whose end it could not record while the database was away. Their retry
        finds the job ended (or the schedule stored) and does nothing; without it they would stay
        ``doing`` under a live heartbeat, never retried."""
        rows = await app.connector.execute_query_all_async(
            "SELECT id FROM procrastinate_jobs WHERE worker_id = %(worker_id)s AND status = 'doing'",
            worker_id=worker_id,
        )
        idle = {int(row["id"]) for row in rows} - RUNNING_TASKS
        for task_id in sorted(idle & self._idle_before):
            try:
                await app.job_manager.retry_job_by_id_async(task_id, retry_at=datetime.now(UTC))
            except Exception as error:  # ended meanwhile
                log.debug("task %s not handed back: %s", task_id, error)
                continue
            log.warning("solver process %s: task %s ended without its end recorded; handed back", worker_name(),
                        task_id)  # fmt: skip
        self._idle_before = idle


@dataclass
class WorkerMetrics:
    """The supervisor's Prometheus metrics (its own registry)."""

    registry: Any = None
    database_up: Any = None
    database_errors: Any = None
    processes: Any = None
    restarts: Any = None
    stalled_retried: Any = None
    orphans_deferred: Any = None

    @classmethod
    def create(cls) -> WorkerMetrics:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        registry = CollectorRegistry()
        return cls(
            registry=registry,
            database_up=Gauge(
                "pipesched_worker_database_up", "1 when the worker reaches the database, else 0.", registry=registry
            ),
            database_errors=Counter(
                "pipesched_worker_database_errors",
                "Failed attempts to reach the database (each followed by a back-off).",
                registry=registry,
            ),
            processes=Gauge("pipesched_worker_processes", "Solver processes alive.", registry=registry),
            restarts=Counter(
                "pipesched_worker_process_restarts", "Solver processes restarted after they died.", registry=registry
            ),
            stalled_retried=Counter(
                "pipesched_worker_stalled_tasks_retried",
                "Tasks of stopped workers (stale heartbeat) handed back to the queue by this worker.",
                registry=registry,
            ),
            orphans_deferred=Counter(
                "pipesched_worker_orphaned_jobs_deferred",
                "Jobs no task waited for (their front end lost the database before deferring), deferred again.",
                registry=registry,
            ),
        )


@dataclass
class WorkerSupervisor:
    """Keeps ``processes`` solver processes alive, sweeps stalled tasks, watches the database.

    Args:
        settings: the worker's settings (PostgreSQL ``database_url`` checked by the caller).
        processes: solver processes on this machine.
        metrics_port: Prometheus port (0: none).
    """

    settings: Settings
    processes: int
    metrics_port: int = 0
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics.create)
    _children: list[multiprocessing.process.BaseProcess | None] = field(default_factory=list)
    _stopping: bool = False
    _opened: bool = False
    _reachable_since: float = field(default_factory=time.monotonic)
    _waiting_logged: bool = False

    def _context(self) -> multiprocessing.context.BaseContext:
        return multiprocessing.get_context("spawn")

    def _start_child(self, index: int) -> None:
        child = self._context().Process(
            target=solver_process_main,
            args=(self.settings, os.getpid()),
            name=f"pipesched-solver-{index}",
            daemon=False,
        )
        child.start()
        self._children[index] = child
        log.info("solver process %d started (pid %s)", index, child.pid)

    def _check_children(self) -> None:
        for index, child in enumerate(self._children):
            if child is not None and child.is_alive():
                continue
            if child is not None:
                log.warning(
                    "solver process %d (pid %s) ended with %s; starting a new one (its task is retried once "
                    "its heartbeat is %.0f s old)",
                    index,
                    child.pid,
                    child.exitcode,
                    self.settings.worker_stalled_after_s,
                )
                self.metrics.restarts.inc()
            self._start_child(index)
        self.metrics.processes.set(sum(1 for c in self._children if c is not None and c.is_alive()))

    def _settled_s(self, uptime_s: float) -> float:
        """How long the database has answered without a break: since the server started and since this
        supervisor last failed to reach it, s (the shorter)."""
        return min(uptime_s, time.monotonic() - self._reachable_since)

    async def _sweep(self, app: Any, store: Store) -> None:
        """Hand back stalled tasks, defer orphaned jobs, prune long-dead worker rows — once the database has
        answered for ``stalled_after_s`` (before that, a live worker's heartbeat may still be held back)."""
        stalled_after_s = self.settings.worker_stalled_after_s
        settled_s = self._settled_s(await asyncio.to_thread(database_uptime_s, store))
        if settled_s < stalled_after_s:
            if not self._waiting_logged:
                log.info(
                    "the database has answered for %.0f s only: heartbeats are judged once it has for %.0f s",
                    settled_s, stalled_after_s,
                )  # fmt: skip
                self._waiting_logged = True
            return
        self._waiting_logged = False
        await self._retry_stalled(app)
        for job_id in await asyncio.to_thread(orphaned_jobs, store, ORPHAN_AFTER_S):
            try:
                await defer_job_async(app, job_id)
            except Exception as error:  # another supervisor deferred it first (its queueing lock)
                log.debug("job %s not deferred here: %s", job_id, error)
                continue
            self.metrics.orphans_deferred.inc()
            log.warning("job %s had no task waiting for it (queued over %.0f s ago); deferred", job_id, ORPHAN_AFTER_S)
        await app.job_manager.prune_stalled_workers(PRUNE_AFTER_S)

    async def _retry_stalled(self, app: Any) -> None:
        stalled = await app.job_manager.get_stalled_jobs(
            queue=QUEUE_NAME, seconds_since_heartbeat=self.settings.worker_stalled_after_s
        )
        for task in stalled:
            try:
                await app.job_manager.retry_job(task)
            except Exception as error:  # another worker's sweep retried it first
                log.debug("task %s not retried here: %s", task.id, error)
                continue
            self.metrics.stalled_retried.inc()
            log.warning(
                "task %s (%s %s) of a stopped worker handed back to the queue (its heartbeat is over %.0f s old)",
                task.id,
                task.task_name,
                task.task_kwargs,
                self.settings.worker_stalled_after_s,
            )

    def stop(self) -> None:
        """Stop gracefully: SIGTERM to every solver process (each finishes its current solve)."""
        self._stopping = True
        for child in self._children:
            if child is not None and child.is_alive() and child.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGTERM)

    async def run(self) -> None:
        """Until :meth:`stop` (SIGTERM/SIGINT): supervise, sweep, watch the database."""
        from prometheus_client import start_http_server

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        if self.metrics_port:
            start_http_server(self.metrics_port, addr=self.settings.worker_metrics_host, registry=self.metrics.registry)
            log.info("metrics on %s port %d (/metrics)", self.settings.worker_metrics_host, self.metrics_port)
        store = Store(self.settings.database_url)
        app = build_queue_app(self.settings, asynchronous=True)
        self._children = [None] * self.processes
        self._opened = False
        try:
            await self._supervise(app, store)
        finally:
            await asyncio.to_thread(self._join_children)
            if self._opened:
                with contextlib.suppress(Exception):
                    await app.close_async()
            store.dispose()

    async def _supervise(self, app: Any, store: Store) -> None:
        backoff = 1.0
        last_sweep = 0.0
        where = _safe_url(self.settings.database_url)
        self._reachable_since = time.monotonic()
        while not self._stopping:
            try:
                await asyncio.to_thread(store.ping)
                if not self._opened:
                    await app.open_async()
                    self._opened = True
            except Exception as error:
                self.metrics.database_up.set(0)
                self.metrics.database_errors.inc()
                reason = str(getattr(error, "orig", None) or error).strip().splitlines()[0][:300]
                log.error(
                    "cannot reach the database %s (%s: %s); retrying in %.0f s", where, type(error).__name__,
                    reason, backoff,
                )  # fmt: skip
                await self._sleep(backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)
                continue
            if backoff > 1.0:
                log.info("the database %s answers again", where)
                self._reachable_since = time.monotonic()
            backoff = 1.0
            self.metrics.database_up.set(1)
            self._check_children()
            if time.monotonic() - last_sweep >= SWEEP_INTERVAL_S:
                last_sweep = time.monotonic()
                try:
                    await self._sweep(app, store)
                except Exception as error:
                    log.warning("stalled-task sweep failed: %s: %s", type(error).__name__, error)
            await self._sleep(1.0)

    async def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self._stopping and time.monotonic() < end:
            await asyncio.sleep(min(0.2, end - time.monotonic()))

    def _join_children(self) -> None:
        self.stop()
        for child in self._children:
            if child is not None:
                child.join()
        log.info("worker stopped")


def _safe_url(database_url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(database_url).render_as_string(hide_password=True)


def run_worker(settings: Settings, *, processes: int, metrics_port: int) -> None:
    """Install the queue's schema when missing, then supervise ``processes`` solver processes until stopped.

    Raises:
        sqlalchemy.exc.OperationalError, psycopg.OperationalError: the database cannot be reached at start.
    """
    _configure_logging()
    Store(settings.database_url).dispose()  # the service's tables, created when missing
    ensure_queue_schema(settings.database_url)
    log.info(
        "worker %s: %d solver process(es) on queue %s of %s",
        worker_name(),
        processes,
        QUEUE_NAME,
        _safe_url(settings.database_url),
    )
    asyncio.run(WorkerSupervisor(settings, processes, metrics_port).run())
