"""The interface every search backend implements, and its result.

A backend works on a compiled :class:`~pipesched.optimizer.instance.Instance` and returns per-rank orders of
action indices. It never reports times or objective values that anyone trusts: the portfolio
re-simulates every order with :func:`pipesched.optimizer.simulate.simulate_indexed` and keeps only what passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from pipesched.optimizer.instance import Instance
from pipesched.optimizer.progress import ProgressCallback, StopCheck

__all__ = ["Backend", "BackendResult", "BackendStatus"]


class BackendStatus(StrEnum):
    """What a backend established."""

    OPTIMAL = "optimal"  # its orders are optimal for the objective (within its model)
    FEASIBLE = "feasible"  # it has orders, optimality not proven
    INFEASIBLE = "infeasible"  # proved that no schedule meets the memory limits
    UNKNOWN = "unknown"  # neither orders nor proof within the time limit


@dataclass
class BackendResult:
    """A backend's answer.

    Attributes:
        status: see :class:`BackendStatus`.
        orders: per-rank action indices in execution order, or ``None``.
        lower_bound: a proven lower bound on the objective in ms, or ``None``.
        message: a short human-readable note (e.g. why it stopped).
        stats: free-form numbers for benchmarks (nodes, iterations, …).
    """

    status: BackendStatus
    orders: list[list[int]] | None = None
    lower_bound: float | None = None
    message: str = ""
    stats: dict[str, float] = field(default_factory=dict)


class Backend(Protocol):
    """A search backend (CP-SAT, MILP, heuristic)."""

    name: str

    def solve(
        self,
        inst: Instance,
        *,
        objective: str,
        time_limit_s: float,
        hint: list[list[int]] | None = None,
        upper_bound: float | None = None,
        progress: ProgressCallback | None = None,
        should_stop: StopCheck | None = None,
    ) -> BackendResult:
        """Search for orders minimising ``objective`` (``"makespan"`` or ``"stage_span"``) in ms.

        Args:
            inst: the compiled problem (durations ms, latencies ms, memory deltas and limits bytes).
            objective: what to minimise.
            time_limit_s: wall-clock budget, s.
            hint: a known feasible order to start from (warm start).
            upper_bound: the objective of the best known schedule, ms.
            progress: called on each improvement of the incumbent or the bound.
            should_stop: polled; True means return the best found now.
        """
        ...
