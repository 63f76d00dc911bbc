"""Exact search with OR-Tools CP-SAT: the backend over the model of :mod:`pipesched.optimizer.solvers.cpsat_model`.

Small instances are solved whole (optimality, infeasibility and the solver's bound are claimed); larger
ones with a warm start go to the large-neighbourhood search of :mod:`pipesched.optimizer.solvers.lns`, which
re-optimises windows of the incumbent with the same model.
"""

from __future__ import annotations

import math
import time

from ortools.sat.python import cp_model

from pipesched.optimizer.instance import Instance
from pipesched.optimizer.progress import ProgressCallback, StopCheck
from pipesched.optimizer.solvers.base import BackendResult, BackendStatus
from pipesched.optimizer.solvers.cpsat_model import (  # the model's helpers, re-exported here
    OBJECTIVES,
    OrderModel,
    choose_tick_ms,
    fifo_normalise,
    fits,
    reachable_masks,
    run_model,
    scaled_instance,
    ticks_to_lower_bound_ms,
)
from pipesched.optimizer.solvers.lns import LnsBackend

__all__ = [
    "CpSatBackend",
    "choose_tick_ms",
    "fifo_normalise",
    "reachable_masks",
    "scaled_instance",
    "ticks_to_lower_bound_ms",
]


class CpSatBackend:
    """CP-SAT search over per-rank orders (see the module docstring for the model).

    Small instances (at most ``exact_max_actions`` actions) are solved with the whole model, which
    proves optimality or infeasibility and reports the solver's bound. Larger ones with a warm start
    go to the large-neighbourhood search of :mod:`pipesched.optimizer.solvers.lns` (no bound claimed).

    Args:
        num_workers: CP-SAT search workers (the service machines have 2 cores).
        exact_max_actions: the largest instance solved with the whole model.
    """

    name = "cpsat"

    def __init__(self, *, num_workers: int = 2, exact_max_actions: int = 400) -> None:
        self.num_workers = num_workers
        self.exact_max_actions = exact_max_actions

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
        """Minimise ``objective`` (``"makespan"`` or ``"stage_span"``, ms); see :class:`Backend` (``seed`` unused).

        Raises:
            ValueError: an unknown objective.
        """
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        incumbent = fifo_normalise(inst, hint) if hint is not None else None
        if incumbent is not None and len(inst.actions) > self.exact_max_actions and fits(inst, incumbent):
            return LnsBackend(num_workers=self.num_workers).solve(
                inst,
                objective=objective,
                time_limit_s=time_limit_s,
                hint=incumbent,
                progress=progress,
                should_stop=should_stop,
            )
        return self.solve_exact(
            inst,
            objective=objective,
            time_limit_s=time_limit_s,
            incumbent=incumbent,
            upper_bound=upper_bound,
            progress=progress,
            should_stop=should_stop,
        )

    def solve_exact(
        self,
        inst: Instance,
        *,
        objective: str,
        time_limit_s: float,
        incumbent: list[list[int]] | None = None,
        upper_bound: float | None = None,
        progress: ProgressCallback | None = None,
        should_stop: StopCheck | None = None,
    ) -> BackendResult:
        """The whole model: orders, and the proven bound converted to ms (module docstring)."""
        started = time.perf_counter()
        # The cut is loose by the rounding slack so that the hint (whose float value is the upper
        # bound) stays feasible in the tick model.
        model = OrderModel(inst, objective, incumbent=incumbent, upper_bound_ms=upper_bound)
        build_s = time.perf_counter() - started
        solver, status = run_model(
            model,
            time_limit_s=time_limit_s - build_s,
            num_workers=self.num_workers,
            progress=progress,
            should_stop=should_stop,
            started=started,
        )
        stats = {
            "build_s": round(build_s, 4),
            "wall_s": round(time.perf_counter() - started, 4),
            "branches": float(solver.num_branches),
            "conflicts": float(solver.num_conflicts),
            "order_literals": float(len(model.before)),
        }
        claims = model.exact_memory
        optimal_claim = claims and not model.span_relaxed
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            orders = model.orders(solver)
            bound = model.lower_bound_ms(solver.best_objective_bound) if claims else None
            optimal = status == cp_model.OPTIMAL and optimal_claim
            return BackendResult(
                status=BackendStatus.OPTIMAL if optimal else BackendStatus.FEASIBLE,
                orders=orders,
                lower_bound=bound,
                message=f"CP-SAT {solver.status_name(status).lower()} "
                f"({solver.objective_value * model.tick_ms:.3f} ms in the model, tick {model.tick_ms:g} ms)",
                stats=stats,
            )
        if status == cp_model.INFEASIBLE and claims:
            if upper_bound is not None:
                return BackendResult(
                    status=BackendStatus.UNKNOWN,
                    message="CP-SAT: nothing better than the upper bound exists",
                    lower_bound=upper_bound,
                    stats=stats,
                )
            return BackendResult(
                status=BackendStatus.INFEASIBLE,
                message="CP-SAT proved that no order meets the memory limits",
                stats=stats,
            )
        bound = None
        if claims and status == cp_model.UNKNOWN and math.isfinite(solver.best_objective_bound):
            bound = model.lower_bound_ms(solver.best_objective_bound)
        if incumbent is not None and fits(inst, incumbent):
            return BackendResult(
                status=BackendStatus.FEASIBLE,
                orders=incumbent,
                lower_bound=bound,
                message=f"CP-SAT found nothing better than the hint within {time_limit_s:g} s",
                stats=stats,
            )
        return BackendResult(
            status=BackendStatus.UNKNOWN,
            lower_bound=bound,
            message=f"CP-SAT {solver.status_name(status).lower()} within {time_limit_s:g} s",
            stats=stats,
        )
