"""What a running search reports and how it is stopped: shared by the entry point, every search and backend.

It sits below both :mod:`pipesched.optimizer.solve` (which dispatches) and the solver backends (which report),
so neither imports the other for these types. :class:`SearchContext` is the one state of a running search
(clock, deadline, stop flag, incumbent, bound, progress), used by the flushed portfolio
(:mod:`pipesched.optimizer.solvers.portfolio`), the no-flush search (:mod:`pipesched.optimizer.solvers.no_flush`),
the step search (:mod:`pipesched.optimizer.solvers.step`) and the planner (:mod:`pipesched.optimizer.planner.rank`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = [
    "NO_DEADLINE",
    "Deadline",
    "Progress",
    "ProgressCallback",
    "SearchContext",
    "SearchStopped",
    "StopCheck",
    "active_deadline",
    "check_deadline",
]


@dataclass(frozen=True)
class Progress:
    """A search's state: best objective found (ms, ``None`` before the first), lower bound (ms), elapsed s."""

    best_objective: float | None
    lower_bound: float | None
    elapsed_s: float
    backend: str = ""
    message: str = ""


#: Called with a :class:`Progress` whenever the incumbent or the bound improves.
ProgressCallback = Callable[[Progress], None]
#: Polled by a search; returning True ends it early with the best found so far.
StopCheck = Callable[[], bool]


class SearchStopped(Exception):
    """Raised inside a search step when its :class:`Deadline` passed or its stop flag was raised."""


@dataclass(frozen=True)
class Deadline:
    """A ``time.perf_counter()`` instant and an optional stop flag, polled together by every search phase.

    ``Deadline.after(2.0, stop)`` expires 2 s from now or as soon as ``stop()`` returns True; ``None`` for
    ``at`` never expires on time alone.
    """

    at: float | None = None
    stop: StopCheck | None = None

    @classmethod
    def after(cls, seconds: float, stop: StopCheck | None = None) -> Deadline:
        """A deadline ``seconds`` from now (s)."""
        return cls(time.perf_counter() + seconds, stop)

    def remaining(self) -> float:
        """Seconds left (≥ 0; ``inf`` without a time)."""
        if self.at is None:
            return float("inf")
        return max(0.0, self.at - time.perf_counter())

    def expired(self) -> bool:
        """True once the time passed or the stop flag is raised."""
        if self.at is not None and time.perf_counter() >= self.at:
            return True
        return self.stop is not None and bool(self.stop())

    def check(self) -> None:
        """Raise :class:`SearchStopped` when :meth:`expired`."""
        if self.expired():
            raise SearchStopped


#: A deadline that never expires.
NO_DEADLINE = Deadline()


_ACTIVE: ContextVar[Deadline | None] = ContextVar("pipesched_active_deadline", default=None)


@contextmanager
def active_deadline(deadline: Deadline) -> Iterator[Deadline]:
    """Make ``deadline`` the one :func:`check_deadline` polls inside the block (for steps whose signature
    carries no stop flag, such as a family's ``generate``)."""
    token = _ACTIVE.set(deadline)
    try:
        yield deadline
    finally:
        _ACTIVE.reset(token)


def check_deadline() -> None:
    """Raise :class:`SearchStopped` when the active deadline (see :func:`active_deadline`) expired; no-op
    without one. Cheap enough for a step of an inner loop (a context lookup and a clock read)."""
    deadline = _ACTIVE.get()
    if deadline is not None:
        deadline.check()


#: What a search keeps as its incumbent: per-rank index orders, a pattern's timing, a simulated step…
Candidate = TypeVar("Candidate")


@dataclass
class SearchContext(Generic[Candidate]):
    """One running search: its clock, deadline, stop flag, incumbent, lower bound and progress reports.

    Attributes:
        started: ``time.perf_counter()`` when the search began (the clock's zero).
        deadline: the ``time.perf_counter()`` instant by which its last step must end (the time limit less
            the room its answer takes to build).
        progress: called with a :class:`Progress` on each improvement of the incumbent or the bound.
        user_stop: the caller's stop flag, polled with the clock.
        best: the incumbent (``None`` before the first), worth ``best_value`` (ms), found by ``best_backend``.
        lower_bound: the best proven bound (ms); the search stops once the incumbent meets it.
        step_s: the longest step seen that cannot stop midway (s): none starts that would end past the deadline.
    """

    started: float
    deadline: float
    progress: ProgressCallback | None = None
    user_stop: StopCheck | None = None
    best: Candidate | None = None
    best_value: float = math.inf
    best_backend: str = ""
    lower_bound: float = 0.0
    step_s: float = 0.0
    stop_at_bound: bool = field(default=True, repr=False)

    @classmethod
    def start(
        cls,
        time_limit_s: float,
        margin_s: float = 0.0,
        *,
        started: float | None = None,
        progress: ProgressCallback | None = None,
        should_stop: StopCheck | None = None,
    ) -> SearchContext[Candidate]:
        """A search of ``time_limit_s`` from ``started`` (default now) whose steps end ``margin_s`` early."""
        began = time.perf_counter() if started is None else started
        return cls(began, began + time_limit_s - margin_s, progress, should_stop)

    def elapsed(self) -> float:
        """Seconds since the search began."""
        return time.perf_counter() - self.started

    def remaining(self) -> float:
        """Seconds left before the deadline (≥ 0)."""
        return max(0.0, self.deadline - time.perf_counter())

    def user_stopped(self) -> bool:
        """Whether the caller asked to stop."""
        return self.user_stop is not None and bool(self.user_stop())

    def should_stop(self) -> bool:
        """True when the next step would end past the deadline, the caller asked to stop, or the incumbent
        meets the lower bound (nothing better exists)."""
        if time.perf_counter() + self.step_s >= self.deadline or self.user_stopped():
            return True
        return self.stop_at_bound and self.best is not None and self.best_value <= self.lower_bound + 1e-9

    def as_deadline(self) -> Deadline:
        """The deadline and stop flag as a :class:`Deadline` (for :func:`active_deadline`)."""
        return Deadline(self.deadline, self.user_stop)

    @contextmanager
    def step(self) -> Iterator[None]:
        """Time a step that cannot stop midway into :attr:`step_s`."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.step_s = max(self.step_s, time.perf_counter() - began)

    def report(self, backend: str, message: str) -> None:
        """Send a :class:`Progress` (best value, bound, elapsed) to the callback, if any."""
        if self.progress is not None:
            best = None if self.best is None else self.best_value
            self.progress(Progress(best, self.lower_bound, self.elapsed(), backend, message))

    def improve(self, candidate: Candidate, value: float, backend: str, message: str = "") -> bool:
        """Keep ``candidate`` (worth ``value`` ms) when it beats the incumbent; report it."""
        if value < self.best_value - 1e-9:
            self.best, self.best_value, self.best_backend = candidate, value, backend
            self.report(backend, message or f"{backend}: {value:.3f} ms")
            return True
        return False

    def raise_bound(self, bound: float | None, backend: str) -> None:
        """Raise the lower bound to ``bound`` (ms), never above the incumbent; report it."""
        if bound is not None and math.isfinite(bound) and bound > self.lower_bound + 1e-9:
            self.lower_bound = min(bound, self.best_value) if self.best is not None else bound
            self.report(backend, f"lower bound {self.lower_bound:.3f} ms")
