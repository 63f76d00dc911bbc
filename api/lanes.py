"""Bounded lanes of worker processes: admission control, one dead process fails one task, no orphans.

A :class:`Lane` runs tasks on ``workers`` slots, each slot a single-process
:class:`concurrent.futures.ProcessPoolExecutor`, and keeps at most ``max_queued`` further tasks waiting in
the web process (beyond that :meth:`Lane.submit` raises :class:`LaneFull`, answered 429 with
``Retry-After``). Nothing waits inside an executor, so:

- a worker process that dies (SIGKILL, out of memory) fails only the task it was running (with
  :class:`WorkerDied`); its slot starts a fresh process for the next task, and queued tasks never see
  ``BrokenProcessPool``;
- :meth:`Lane.close` drops the queued tasks and terminates the running ones: nothing runs after shutdown.

Every worker process runs :func:`guard_worker` first: on Linux it asks the kernel for SIGKILL when its
parent dies (``prctl(PR_SET_PDEATHSIG)``), and on every platform a watchdog thread ends it once the
server process is gone, so a SIGKILL of the server leaves no worker behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import importlib
import logging
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Admission",
    "Lane",
    "LaneClosed",
    "LaneFull",
    "Ticket",
    "WorkerDied",
    "guard_worker",
    "start_worker",
    "worker_context",
]

log = logging.getLogger("pipesched.lanes")

#: Seconds between two checks of the watchdog thread in a worker process.
WATCHDOG_INTERVAL_S = 0.5

_PR_SET_PDEATHSIG = 1


class WorkerDied(RuntimeError):
    """The worker process running a task ended abruptly (killed, out of memory)."""


class LaneClosed(RuntimeError):
    """The lane was closed (the service is shutting down) before or while the task ran."""


class LaneFull(RuntimeError):
    """The lane's queue is full: ``taken`` of its ``places`` (running, waiting and held for a request that
    is being read) are in use; ``retry_after_s`` estimates when one frees up, s."""

    def __init__(self, lane: str, taken: int, places: int, retry_after_s: int) -> None:
        super().__init__(f"the {lane} queue is full ({taken} of {places} places taken)")
        self.lane = lane
        self.taken = taken
        self.places = places
        self.retry_after_s = retry_after_s


def _retry_after(ends: list[float]) -> int:
    """Whole seconds until the soonest of ``ends`` (monotonic s), between 1 and 3600."""
    soonest = min((end - time.monotonic() for end in ends), default=0.0)
    return max(1, min(3600, math.ceil(soonest)))


class Admission:
    """At most ``places`` holders at once, refused beyond (:class:`LaneFull`): the bound of work that waits
    somewhere else — a PostgreSQL queue's workers, or a lane whose request bodies are read only once admitted.

    Args:
        name: the kind of work, in messages (``solve``, ``check``).
        places: holders at once.
    """

    def __init__(self, name: str, places: int) -> None:
        self.name = name
        self.places = places
        self._lock = threading.Lock()
        self._ends: dict[object, float] = {}

    def taken(self) -> int:
        """Places held now."""
        with self._lock:
            return len(self._ends)

    def retry_after_s(self) -> int:
        """Seconds until the soonest holder is expected to leave (at least 1)."""
        with self._lock:
            return _retry_after(list(self._ends.values()))

    @contextlib.contextmanager
    def place(self, expected_s: float) -> Iterator[None]:
        """Hold a place for the ``with`` block, expected to last ``expected_s`` s (for ``Retry-After``).

        Raises:
            LaneFull: every place is held.
        """
        key = object()
        with self._lock:
            if len(self._ends) >= self.places:
                raise LaneFull(self.name, len(self._ends), self.places, _retry_after(list(self._ends.values())))
            self._ends[key] = time.monotonic() + expected_s
        try:
            yield
        finally:
            with self._lock:
                del self._ends[key]


def _process_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (Linux: /proc state; elsewhere: signal 0)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return True


def guard_worker(server_pid: int) -> None:
    """The initializer of every worker process: die with the server.

    Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, so the kernel kills this process when its parent (the
    server, or the forkserver that dies with it) exits. Everywhere: a daemon thread that ends this process
    (``os._exit``) within :data:`WATCHDOG_INTERVAL_S` once ``server_pid`` is gone or the parent changed.
    """
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):  # not glibc/musl: the watchdog alone
            log.debug("prctl(PR_SET_PDEATHSIG) unavailable; relying on the watchdog")
    if not _process_alive(server_pid):  # the server died before the prctl took effect
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(WATCHDOG_INTERVAL_S)
            if os.getppid() != parent or not _process_alive(server_pid):
                os._exit(1)

    threading.Thread(target=watch, name="pipesched-watchdog", daemon=True).start()


def start_worker(server_pid: int, preload: tuple[str, ...]) -> None:
    """The initializer of every worker process: :func:`guard_worker`, then import ``preload`` (module names), so
    that no task pays a library's first import inside its own time (a search's: OR-Tools took 0.5–1.2 s here)."""
    guard_worker(server_pid)
    for module in preload:
        importlib.import_module(module)


def worker_context() -> multiprocessing.context.BaseContext:
    """forkserver where there is one (never fork a process that runs an event loop and threads), else spawn."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")


@dataclass(eq=False)
class Ticket:
    """A task submitted to a lane: its :attr:`future` and when it was queued and started (monotonic s)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    expected_s: float
    queued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    future: Future = field(default_factory=Future)
    queued_behind: int = 0


class _Slot:
    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        self.executor: ProcessPoolExecutor | None = None
        self.ticket: Ticket | None = None

    def ensure_executor(self) -> ProcessPoolExecutor:
        if self.executor is None:
            self.executor = ProcessPoolExecutor(
                max_workers=1,
                mp_context=worker_context(),
                initializer=start_worker,
                initargs=(os.getpid(), self.lane.preload),
                max_tasks_per_child=self.lane.max_tasks_per_child,
            )
        return self.executor

    def pids(self) -> list[int]:
        processes = getattr(self.executor, "_processes", None) or {}
        return [pid for pid, process in list(processes.items()) if process.is_alive()]

    def discard(self, terminate: bool, *, wait: bool = False) -> None:
        """Drop the slot's executor (killing its process with ``terminate``). ``wait``: also wait for the executor's
        manager thread to end, which releases its queues' semaphores now (``Lane.close``, never from that thread:
        a task's done callback runs on it). Without the wait they are released only when the thread's references
        go or at the interpreter's exit, which a server stopped by SIGTERM never reaches (uvicorn re-raises the
        signal once shut down), and ``multiprocessing``'s resource tracker then warned of 5 leaked semaphores per
        executor (its call queue's 3 and result queue's 2)."""
        executor, self.executor = self.executor, None
        if executor is None:
            return
        if terminate:
            for process in list((getattr(executor, "_processes", None) or {}).values()):
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    process.kill()
        executor.shutdown(wait=wait, cancel_futures=True)


class Lane:
    """``workers`` worker processes and a queue of at most ``max_queued`` tasks in front of them.

    Args:
        name: the kind of work, in messages (``solve``, ``job``, ``render``).
        workers: tasks that run at once (one process each, started on first use).
        max_queued: tasks that may wait; one more raises :class:`LaneFull`.
        max_tasks_per_child: a worker process is replaced after this many tasks (None: never), which
            returns the memory a large task left behind.
        preload: modules every worker process imports when it starts, before its first task.
    """

    def __init__(
        self,
        name: str,
        workers: int,
        max_queued: int,
        *,
        max_tasks_per_child: int | None = None,
        preload: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.max_queued = max_queued
        self.max_tasks_per_child = max_tasks_per_child
        self.preload = preload
        self._lock = threading.RLock()
        self._slots = [_Slot(self) for _ in range(workers)]
        self._queue: deque[Ticket] = deque()
        self._closed = False
        self._reserved = 0

    # --- state ------------------------------------------------------------------------------------

    @property
    def workers(self) -> int:
        return len(self._slots)

    def queued(self) -> int:
        """Tasks waiting for a worker."""
        with self._lock:
            return sum(1 for ticket in self._queue if not ticket.future.cancelled())

    def running(self) -> int:
        """Tasks on a worker now."""
        with self._lock:
            return sum(1 for slot in self._slots if slot.ticket is not None)

    def worker_pids(self) -> list[int]:
        """The live worker processes' ids (tests kill one to check that only its task fails)."""
        with self._lock:
            return [pid for slot in self._slots for pid in slot.pids()]

    def retry_after_s(self) -> int:
        """Seconds until a queued place frees up, estimated from the expected time of the tasks ahead."""
        with self._lock:
            now = time.monotonic()
            return _retry_after(
                [
                    (slot.ticket.started_at or now) + slot.ticket.expected_s
                    for slot in self._slots
                    if slot.ticket is not None
                ]
            )

    # --- work -------------------------------------------------------------------------------------

    def submit(
        self, fn: Callable[..., Any], *args: Any, expected_s: float = 1.0, force: bool = False, reserved: bool = False
    ) -> Ticket:
        """Run ``fn(*args)`` in a worker process (``fn`` and ``args`` picklable); its result comes on
        ``ticket.future``, or :class:`WorkerDied` / :class:`LaneClosed` / what ``fn`` raised.

        Args:
            expected_s: how long the task may take, s (for ``Retry-After``).
            force: queue it even when the queue is full (jobs recovered after a restart).
            reserved: it takes the place held by an earlier :meth:`reserve`.

        Raises:
            LaneFull: the queue holds ``max_queued`` tasks already.
            LaneClosed: the lane is closed.
        """
        ticket = Ticket(fn, args, expected_s)
        with self._lock:
            if self._closed:
                raise LaneClosed(f"the service is shutting down: the {self.name} was not started")
            free = next((slot for slot in self._slots if slot.ticket is None), None)
            if reserved:
                self._reserved -= 1
            elif not force and self._in_use() >= self.workers + self.max_queued:
                raise self._full()
            if free is not None:
                ticket.future.set_running_or_notify_cancel()
                self._start(free, ticket)
                return ticket
            ticket.queued_behind = self.queued() + self.running()
            self._queue.append(ticket)
        return ticket

    def _in_use(self) -> int:
        return self.running() + self.queued() + self._reserved

    def _full(self) -> LaneFull:
        return LaneFull(self.name, self._in_use(), self.workers + self.max_queued, self.retry_after_s())

    def reserve(self) -> None:
        """Hold a place for a task submitted later with ``reserved=True`` (or given back by :meth:`release`).

        Raises:
            LaneFull: no place is free.
            LaneClosed: the lane is closed.
        """
        with self._lock:
            if self._closed:
                raise LaneClosed(f"the service is shutting down: the {self.name} was not accepted")
            if self._in_use() >= self.workers + self.max_queued:
                raise self._full()
            self._reserved += 1

    def release(self) -> None:
        """Give back a place held by :meth:`reserve` and not used."""
        with self._lock:
            self._reserved = max(0, self._reserved - 1)

    def _start(self, slot: _Slot, ticket: Ticket) -> None:
        # Under the lock. A queued ticket cancelled meanwhile is skipped by the caller.
        slot.ticket = ticket
        ticket.started_at = time.monotonic()
        try:
            inner = slot.ensure_executor().submit(ticket.fn, *ticket.args)
        except (BrokenProcessPool, RuntimeError):
            slot.discard(terminate=True)
            inner = slot.ensure_executor().submit(ticket.fn, *ticket.args)
        inner.add_done_callback(lambda done: self._finished(slot, ticket, done))

    def _finished(self, slot: _Slot, ticket: Ticket, inner: Future) -> None:
        with self._lock:
            if slot.ticket is ticket:
                slot.ticket = None
            error: BaseException | None
            if inner.cancelled():
                error = LaneClosed(f"the service shut down while the {self.name} ran")
            else:
                error = inner.exception()
            if isinstance(error, BrokenProcessPool):
                if self._closed:
                    error = LaneClosed(f"the service shut down while the {self.name} ran")
                else:
                    log.warning("a %s worker process died; starting a fresh one for the next task", self.name)
                    slot.discard(terminate=True)
                    error = WorkerDied(
                        f"the worker process died (out of memory or killed) while running this {self.name}"
                    )
            if not self._closed:
                self._start_next(slot)
        if error is None:
            ticket.future.set_result(inner.result())
        else:
            ticket.future.set_exception(error)

    def _start_next(self, slot: _Slot) -> None:
        while self._queue and slot.ticket is None:
            ticket = self._queue.popleft()
            if ticket.future.set_running_or_notify_cancel():
                self._start(slot, ticket)

    def cancel(self, ticket: Ticket) -> bool:
        """Drop a queued ticket (True); a running one is not interrupted (False)."""
        with self._lock:
            if ticket.started_at is None and ticket.future.cancel():
                self._queue = deque(other for other in self._queue if other is not ticket)
                return True
            return False

    def abort(self, ticket: Ticket) -> bool:
        """Drop ``ticket`` if queued, or kill the worker process running it (the ticket then ends with
        :class:`WorkerDied` and the slot starts a fresh process); False when it had ended already."""
        with self._lock:
            if self.cancel(ticket):
                return True
            slot = next((slot for slot in self._slots if slot.ticket is ticket), None)
            if slot is None:
                return False
            pids = slot.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, getattr(signal, "SIGKILL", signal.SIGTERM))
        return True

    def close(self) -> None:
        """Drop the queued tasks and kill the worker processes (running tasks end with :class:`LaneClosed`), waiting
        for each executor to end so that nothing of it is left for the interpreter's exit (:meth:`_Slot.discard`)."""
        with self._lock:
            self._closed = True
            queued, self._queue = list(self._queue), deque()
            slots = list(self._slots)
        for ticket in queued:
            ticket.future.cancel()
        for slot in slots:
            slot.discard(terminate=True, wait=True)
