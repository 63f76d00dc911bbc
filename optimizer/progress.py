"""What a running search reports and how it is stopped: shared by the entry point and every backend.

It sits below both :mod:`pipesched.optimizer.solve` (which dispatches) and the solver backends (which report),
so neither imports the other for these types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Progress", "ProgressCallback", "StopCheck"]


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
