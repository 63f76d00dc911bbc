"""The interface every search backend implements, its result, and the registry of backends.

A backend works on a compiled :class:`~pipesched.optimizer.instance.Instance` and returns per-rank orders of
action indices. It never reports times or objective values that anyone trusts: the portfolio
re-simulates every order with :func:`pipesched.optimizer.simulate.simulate_indexed` and keeps only what passes.

:data:`BACKENDS` declares each backend once with what it can do (:class:`BackendSpec`); the portfolio
(:mod:`pipesched.optimizer.solvers.portfolio`) chooses among them by these capabilities, and
``solver.backends`` names them. Adding a backend is its module and one entry there.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from pipesched.optimizer.instance import Instance
from pipesched.optimizer.progress import ProgressCallback, StopCheck

__all__ = ["BACKENDS", "Backend", "BackendResult", "BackendSpec", "BackendStatus", "backend_names", "get_backend"]


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
        seed: int = 0,
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
            seed: for the randomised steps of a backend that has any.
        """
        ...


@dataclass(frozen=True)
class BackendSpec:
    """One search backend, declared once, and what it can do.

    Attributes:
        name: what ``solver.backends`` and a schedule's ``backend`` call it.
        module: the module holding its class, imported on first use (the exact ones load OR-Tools or PuLP).
        class_name: its :class:`Backend` class there.
        description: one line.
        exact: proves optimality, infeasibility and lower bounds (on instances it solves whole).
        interruptible: polls ``should_stop`` while it runs (else only before it starts).
        needs_hint: improves a warm start and finds none by itself.
        selectable: a name ``solver.backends`` may give (else another backend runs it).
        default_max_actions: without ``solver.backends`` it runs only on instances of at most this many actions.
    """

    name: str
    module: str
    class_name: str
    description: str
    exact: bool = False
    interruptible: bool = True
    needs_hint: bool = False
    selectable: bool = True
    default_max_actions: int | None = None

    def load(self) -> Backend:
        """A new instance of the backend (its module imported now if not yet)."""
        backend_class: type[Backend] = getattr(importlib.import_module(self.module), self.class_name)
        return backend_class()

    def imported(self) -> bool:
        """Whether its module (and library) is imported already: starting it then costs no import time."""
        return self.module in sys.modules

    def chosen(self, allowed: list[str] | None, num_actions: int) -> bool:
        """Whether it runs: named in ``solver.backends`` (``allowed``), or by default on an instance this size."""
        if allowed is not None:
            return self.name in allowed
        return self.selectable and (self.default_max_actions is None or num_actions <= self.default_max_actions)


_SOLVERS = "pipesched.optimizer.solvers"

#: Every backend, in the order the portfolio runs them.
BACKENDS: tuple[BackendSpec, ...] = (
    BackendSpec(
        "heuristic", f"{_SOLVERS}.heuristic", "HeuristicBackend", "Greedy list scheduling variants, then local search."
    ),
    BackendSpec(
        "cpsat",
        f"{_SOLVERS}.cpsat",
        "CpSatBackend",
        "OR-Tools CP-SAT over per-rank orders: whole on small instances, windows of the incumbent on large ones.",
        exact=True,
    ),
    BackendSpec(
        "milp",
        f"{_SOLVERS}.milp",
        "MilpBackend",
        "The Zero Bubble paper's MILP (App. G) with HiGHS or CBC.",
        exact=True,
        interruptible=False,
        default_max_actions=60,
    ),
    BackendSpec(
        "cpsat-lns",
        f"{_SOLVERS}.lns",
        "LnsBackend",
        "Large-neighbourhood search: CP-SAT re-optimises windows of the incumbent (cpsat runs it on large instances).",
        needs_hint=True,
        selectable=False,
    ),
)


def backend_names() -> tuple[str, ...]:
    """The names ``solver.backends`` accepts."""
    return tuple(spec.name for spec in BACKENDS if spec.selectable)


def get_backend(name: str) -> BackendSpec:
    """The backend called ``name``.

    Raises:
        KeyError: with the known names.
    """
    for spec in BACKENDS:
        if spec.name == name:
            return spec
    raise KeyError(f"unknown backend {name!r}: choose one of {', '.join(spec.name for spec in BACKENDS)}")
