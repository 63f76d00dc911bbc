"""``pipesched worker``: solver processes that take their work from the PostgreSQL queue.

One ``pipesched worker`` is a supervisor and ``--processes`` solver processes. Each solver process is a
procrastinate worker (concurrency 1: a solve is CPU-bound) on queue :data:`QUEUE_NAME`, with its own
heartbeat row in ``procrastinate_workers`` every ``PIPESCHED_WORKER_STALLED_AFTER_S / 3`` s. The
supervisor:

- restarts a solver process that died (its task is then a *stalled* task: see below);
- every :data:`SWEEP_INTERVAL_S` asks procrastinate for stalled tasks — ``doing`` tasks whose worker's
  heartbeat is older than ``PIPESCHED_WORKER_STALLED_AFTER_S`` (``JobManager.get_stalled_jobs``) — and
  retries them (``JobManager.retry_job``); any live worker, on any machine, takes the task within its
  fetch poll (:data:`FETCH_POLL_S`), and :meth:`Store.take_job` counts the attempt on the job row. A
  killed worker's job is thus running again at most ``stalled_after_s + SWEEP_INTERVAL_S +
  FETCH_POLL_S`` after its last heartbeat (10 + 2 + 1 s by default), while another worker is free;
- pings the database every second; when it cannot reach it, it logs so, sets
  ``pipesched_worker_database_up`` to 0, counts ``pipesched_worker_database_errors_total`` and backs
  off (1, 2, 4 … up to :data:`MAX_BACKOFF_S` s), restarting no solver process until it answers again;
- serves its Prometheus metrics on ``PIPESCHED_WORKER_METRICS_PORT`` (``/metrics``).

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
from typing import Any

from pipesched.api.queue import QUEUE_NAME, build_queue_app, ensure_queue_schema, worker_name
from pipesched.api.settings import Settings
from pipesched.api.storage import Store

__all__ = ["FETCH_POLL_S", "MAX_BACKOFF_S", "SWEEP_INTERVAL_S", "WorkerSupervisor", "run_worker"]

log = logging.getLogger("pipesched.worker")

#: Seconds between two stalled-task sweeps of a supervisor.
SWEEP_INTERVAL_S = 2.0
#: A solver process's longest wait for a task when no notification arrives (a retried task sends none), s.
FETCH_POLL_S = 1.0
#: The longest back-off between two attempts to reach the database, s.
MAX_BACKOFF_S = 30.0
#: Seconds between a solver process's checks that its supervisor still lives.
PARENT_CHECK_S = 0.5


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
    """A solver process: one procrastinate worker (concurrency 1) until SIGTERM/SIGINT or its parent dies."""
    _configure_logging()
    _exit_with_parent(parent_pid)
    stalled = settings.worker_stalled_after_s

    async def main() -> None:
        app = build_queue_app(settings, asynchronous=True)
        async with app.open_async():
            await app.run_worker_async(
                queues=[QUEUE_NAME],
                name=worker_name(),
                concurrency=1,
                fetch_job_polling_interval=FETCH_POLL_S,
                abort_job_polling_interval=FETCH_POLL_S,
                update_heartbeat_interval=stalled / 3,
                stalled_worker_timeout=stalled,
                delete_jobs="successful",
                shutdown_graceful_timeout=None,
            )

    asyncio.run(main())


@dataclass
class WorkerMetrics:
    """The supervisor's Prometheus metrics (its own registry)."""

    registry: Any = None
    database_up: Any = None
    database_errors: Any = None
    processes: Any = None
    restarts: Any = None
    stalled_retried: Any = None

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

    async def _sweep_stalled(self, app: Any) -> None:
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
            start_http_server(self.metrics_port, addr="0.0.0.0", registry=self.metrics.registry)
            log.info("metrics on port %d (/metrics)", self.metrics_port)
        store = Store(self.settings.database_url)
        app = build_queue_app(self.settings, asynchronous=True)
        self._children = [None] * self.processes
        backoff = 1.0
        last_sweep = 0.0
        opened = False
        where = _safe_url(self.settings.database_url)
        try:
            while not self._stopping:
                try:
                    await asyncio.to_thread(store.ping)
                    if not opened:
                        await app.open_async()
                        opened = True
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
                backoff = 1.0
                self.metrics.database_up.set(1)
                self._check_children()
                if time.monotonic() - last_sweep >= SWEEP_INTERVAL_S:
                    last_sweep = time.monotonic()
                    try:
                        await self._sweep_stalled(app)
                    except Exception as error:
                        log.warning("stalled-task sweep failed: %s: %s", type(error).__name__, error)
                await self._sleep(1.0)
        finally:
            await asyncio.to_thread(self._join_children)
            if opened:
                with contextlib.suppress(Exception):
                    await app.close_async()
            store.dispose()

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
