"""What a running search reports and how it is stopped: shared by the entry point and every backend.

It sits below both :mod:`pipesched.optimizer.solve` (which dispatches) and the solver backends (which report),
so neither imports the other for these types.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

__all__ = [
    "NO_DEADLINE",
    "Deadline",
    "Progress",
    "ProgressCallback",
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
