"""Exact search as a mixed-integer program (PuLP, with HiGHS or CBC), for small instances.

The formulation of the Zero Bubble paper (arXiv 2401.10241, App. G):

* continuous start times ``start_F_s3_mb12`` (ms, float costs used as they are, no rounding);
* precedence with p2p latency from :attr:`Instance.preds`, FIFO per stage and kind (valid for
  identical microbatches; see :mod:`pipesched.optimizer.solvers.cpsat`);
* one binary ``before_X_Y`` per pair of actions on a rank whose order neither the dependencies nor
  FIFO decide, with big-M disjunctions ``start_Y ≥ end_X − M·(1 − before)`` and the converse;
* memory as a prefix sum over the order: at the start of each F,
  ``static + own activation + Σ delta_X · before_X_F ≤ limit``;
* objective makespan (max end, starts ≥ 0) or stage span (max over ranks of last end − first start).

The warm start is passed as initial values (HiGHS: ``setSolution``; CBC: ``warmStart``). HiGHS
reports its dual bound, which becomes the lower bound; CBC's bound is reported only at optimality.
The model has O(actions² per rank) binaries: meant for at most ``max_actions`` actions.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# OR-Tools first: it bundles its own HiGHS under the same library name as highspy, and PuLP loads
# highspy on import. Whichever of the two loads second fails; loaded first, OR-Tools keeps working and
# PuLP's failed highspy import is swallowed (HiGHS itself runs in a child process, see _solve_highs).
import ortools.sat.python.cp_model  # noqa: F401  (import order matters, see above)
import pulp

from pipesched.optimizer.instance import Instance
from pipesched.optimizer.ir import ActionKind
from pipesched.optimizer.progress import Progress, ProgressCallback, StopCheck
from pipesched.optimizer.simulate import InvalidSchedule, simulate_indexed
from pipesched.optimizer.solvers.base import BackendResult, BackendStatus
from pipesched.optimizer.solvers.cpsat_model import fifo_normalise, reachable_masks

__all__ = ["MILP_SOLVERS", "MilpBackend"]

MILP_SOLVERS = ("highs", "cbc")
"""Solvers the backend can drive: HiGHS through highspy (in a child process), CBC through PuLP's binary."""

_OBJECTIVES = ("makespan", "stage_span")

_HIGHS_CHILD = """
import json, math, sys
import highspy
request = json.loads(open(sys.argv[1]).read())
h = highspy.Highs()
h.setOptionValue("output_flag", False)
h.setOptionValue("time_limit", float(request["time_limit_s"]))
h.setOptionValue("threads", int(request["threads"]))
h.setOptionValue("mip_rel_gap", 0.0)  # "optimal" means proven, not within HiGHS's default 0.01 %
h.readModel(request["mps"])
names = list(h.getLp().col_names_)
if request["initial"] is not None:
    solution = highspy.HighsSolution()
    solution.col_value = [request["initial"].get(name, 0.0) for name in names]
    solution.value_valid = True
    h.setSolution(solution)
h.run()
status = h.getModelStatus()
info = h.getInfo()
has_values = info.primal_solution_status == 2
values = dict(zip(names, h.getSolution().col_value)) if has_values else None
bound = info.mip_dual_bound
out = {
    "infeasible": status == highspy.HighsModelStatus.kInfeasible,
    "optimal": status == highspy.HighsModelStatus.kOptimal,
    "values": values,
    "bound": bound if math.isfinite(bound) else None,
}
open(request["out"], "w").write(json.dumps(out))
"""
_TOLERANCE_MS = 1e-6


def _name(inst: Instance, idx: int) -> str:
    action = inst.actions[idx]
    return f"{action.kind.value}_s{action.stage}_mb{action.microbatch}"


class _MilpModel:
    """The PuLP problem: data → variables → constraints → objective."""

    def __init__(self, inst: Instance, objective: str, upper_bound: float | None) -> None:
        self.inst = inst
        self.objective = objective
        self.upper_bound = upper_bound
        self.big_m = sum(inst.duration) + sum(max((lat for _, lat in row), default=0.0) for row in inst.preds)
        self.problem = pulp.LpProblem("pipeline_orders", pulp.LpMinimize)
        self.start: dict[int, pulp.LpVariable] = {}
        self.before: dict[tuple[int, int], pulp.LpVariable] = {}
        targets = list(range(len(inst.actions)))
        self.reach = reachable_masks(inst, targets)
        self.span = self.problem.add_variable("objective", lowBound=0)
        self.firsts: dict[int, pulp.LpVariable] = {}
        self.span_relaxed = False  # a rank's first action is not pinned to its release (stage span)
        self._build_model()

    def _build_model(self) -> None:
        self._add_variables()
        self._add_constraints()
        self._add_objective()

    def _add_variables(self) -> None:
        for idx in range(len(self.inst.actions)):
            self.start[idx] = self.problem.add_variable(f"start_{_name(self.inst, idx)}", lowBound=0)

    def _runs_before(self, a: int, b: int) -> bool | None:
        if self.reach[a] >> b & 1:
            return True
        if self.reach[b] >> a & 1:
            return False
        return None

    def _add_constraints(self) -> None:
        inst, start, prob = self.inst, self.start, self.problem
        for idx, preds in enumerate(inst.preds):
            for pred, latency in preds:
                prob += start[idx] >= start[pred] + inst.duration[pred] + latency
        groups: dict[tuple[int, ActionKind], list[int]] = {}
        for idx, action in enumerate(inst.actions):
            groups.setdefault((action.stage, action.kind), []).append(idx)
        for members in groups.values():
            members.sort(key=lambda i: inst.actions[i].microbatch)
            for a, b in itertools.pairwise(members):
                prob += start[b] >= start[a] + inst.duration[a]
        for row in inst.rank_actions:
            for k, a in enumerate(row):
                for b in row[k + 1 :]:
                    if self._runs_before(a, b) is not None:
                        continue
                    lo, hi = min(a, b), max(a, b)
                    var = self.problem.add_variable(f"before_{_name(inst, lo)}_{_name(inst, hi)}", cat="Binary")
                    self.before[(lo, hi)] = var
                    prob += start[hi] >= start[lo] + inst.duration[lo] - self.big_m * (1 - var)
                    prob += start[lo] >= start[hi] + inst.duration[hi] - self.big_m * var
        for rank, row in enumerate(inst.rank_actions):
            if not math.isfinite(inst.limit[rank]):
                continue
            for f in row:
                if inst.actions[f].kind != ActionKind.FORWARD:
                    continue
                constant = inst.static[rank] + inst.mem_delta[f]
                terms = []
                for other in row:
                    if other == f or inst.mem_delta[other] == 0:
                        continue
                    fixed = self._runs_before(other, f)
                    if fixed is True:
                        constant += inst.mem_delta[other]
                    elif fixed is None:
                        var = self.before[(min(other, f), max(other, f))]
                        terms.append(inst.mem_delta[other] * (var if other < f else 1 - var))
                prob += pulp.lpSum(terms) + constant <= inst.limit[rank], f"memory_{_name(inst, f)}"

    def _add_objective(self) -> None:
        inst, start, prob = self.inst, self.start, self.problem
        for rank, row in enumerate(inst.rank_actions):
            mask = sum(1 << i for i in row)
            lasts = [i for i in row if not self.reach[i] & mask]
            firsts = [i for i in row if not any(self.reach[j] >> i & 1 for j in row if j != i)]
            first = self.problem.add_variable(f"first_start_r{rank}", lowBound=0)
            self.firsts[rank] = first
            for idx in firsts:
                prob += first <= start[idx]
            if self.objective == "stage_span":
                # The simulator starts a rank's first action as soon as its input arrives, so a rank
                # cannot shorten its span by starting late (else the model is a relaxation).
                preds = inst.preds[firsts[0]] if len(firsts) == 1 else []
                if len(firsts) == 1 and len(preds) <= 1:
                    release = sum(start[p] + inst.duration[p] + latency for p, latency in preds)
                    prob += start[firsts[0]] == release
                    prob += first == start[firsts[0]]
                else:
                    self.span_relaxed = True
            for idx in lasts:
                end = start[idx] + inst.duration[idx]
                prob += self.span >= (end if self.objective == "makespan" else end - first)
            prob += self.span >= inst.compute[rank]
        if self.upper_bound is not None:
            prob += self.span <= self.upper_bound + 1e-6
        prob += self.span

    def set_initial(self, orders: list[list[int]]) -> None:
        """Initial values from a (FIFO) order simulated with the float simulator."""
        sim = simulate_indexed(self.inst, orders, check_memory=False)
        for idx, var in self.start.items():
            var.setInitialValue(sim.start[idx])
        for (lo, hi), var in self.before.items():
            var.setInitialValue(1 if sim.start[lo] < sim.start[hi] else 0)
        for rank, var in self.firsts.items():
            row = orders[rank]
            var.setInitialValue(sim.start[row[0]] if row else 0.0)
        self.span.setInitialValue(sim.makespan if self.objective == "makespan" else sim.stage_span)

    def orders(self) -> list[list[int]]:
        """Per-rank orders from the solution's start times (ties by the order binaries' intent)."""
        result = []
        for row in self.inst.rank_actions:
            result.append(
                sorted(row, key=lambda i: (round(self.start[i].value() or 0.0, 6), self.inst.actions[i].microbatch))
            )
        return result


class MilpBackend:
    """The Zero Bubble paper's MILP (App. G) solved with HiGHS or CBC through PuLP.

    Args:
        solver: ``"highs"`` (default; in process, warm start and dual bound) or ``"cbc"``.
        threads: solver threads.
        max_actions: larger instances are refused with status UNKNOWN (the model is quadratic).

    Raises:
        ValueError: an unknown solver name.
    """

    name = "milp"

    def __init__(self, *, solver: str = "highs", threads: int = 2, max_actions: int = 150) -> None:
        if solver not in MILP_SOLVERS:
            raise ValueError(f"solver must be one of {MILP_SOLVERS}, got {solver!r}")
        self.solver = solver
        self.threads = threads
        self.max_actions = max_actions

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
        """Minimise ``objective`` (ms); see :class:`~pipesched.optimizer.solvers.base.Backend` (``seed`` unused).

        The MILP cannot be interrupted: ``should_stop`` is polled only before it starts.

        Raises:
            ValueError: an unknown objective.
        """
        if objective not in _OBJECTIVES:
            raise ValueError(f"objective must be one of {_OBJECTIVES}, got {objective!r}")
        started = time.perf_counter()
        if len(inst.actions) > self.max_actions:
            return BackendResult(
                status=BackendStatus.UNKNOWN,
                message=f"MILP skipped: {len(inst.actions)} actions exceed max_actions={self.max_actions}",
            )
        if should_stop is not None and should_stop():
            return BackendResult(status=BackendStatus.UNKNOWN, message="MILP stopped before it started")
        model = _MilpModel(inst, objective, upper_bound)
        if hint is not None:
            model.set_initial(fifo_normalise(inst, hint))
        limit = max(0.1, time_limit_s - (time.perf_counter() - started))
        if self.solver == "highs":
            solved, optimal, bound = self._solve_highs(model, limit, warm=hint is not None, should_stop=should_stop)
        else:
            solved, optimal, bound = self._solve_cbc(model, limit, warm=hint is not None)
        stats = {"binaries": float(len(model.before)), "wall_s": round(time.perf_counter() - started, 4)}
        if solved:
            return self._solution(model, optimal, bound, stats, progress, started)
        if model.problem.status == pulp.LpStatusInfeasible:
            if upper_bound is not None:
                return BackendResult(
                    status=BackendStatus.UNKNOWN,
                    lower_bound=upper_bound,
                    message=f"MILP ({self.solver}): nothing better than the upper bound exists",
                    stats=stats,
                )
            return BackendResult(
                status=BackendStatus.INFEASIBLE,
                message=f"MILP ({self.solver}) proved that no order meets the memory limits",
                stats=stats,
            )
        return self._nothing_better(inst, hint, bound, time_limit_s, stats)

    def _solution(
        self,
        model: _MilpModel,
        optimal: bool,
        bound: float | None,
        stats: dict[str, float],
        progress: ProgressCallback | None,
        started: float,
    ) -> BackendResult:
        """The solver's orders: OPTIMAL (its value a bound) or FEASIBLE with its dual bound."""
        value = float(model.span.value() or 0.0)
        optimal = optimal and not model.span_relaxed
        lower = value if optimal else bound
        if progress is not None:
            progress(Progress(value, lower, time.perf_counter() - started, "milp", f"{self.solver} solution"))
        return BackendResult(
            status=BackendStatus.OPTIMAL if optimal else BackendStatus.FEASIBLE,
            orders=model.orders(),
            lower_bound=None if lower is None else max(0.0, lower - _TOLERANCE_MS),
            message=f"MILP ({self.solver}) {'optimal' if optimal else 'feasible'}: {value:.3f} ms",
            stats=stats,
        )

    def _nothing_better(
        self,
        inst: Instance,
        hint: list[list[int]] | None,
        bound: float | None,
        time_limit_s: float,
        stats: dict[str, float],
    ) -> BackendResult:
        """No solution in time: the hint (FEASIBLE) when it runs, else UNKNOWN; the dual bound either way."""
        lower = None if bound is None else max(0.0, bound - _TOLERANCE_MS)
        if hint is not None:
            incumbent = fifo_normalise(inst, hint)
            try:
                simulate_indexed(inst, incumbent)
            except InvalidSchedule:
                pass
            else:
                return BackendResult(
                    status=BackendStatus.FEASIBLE,
                    orders=incumbent,
                    lower_bound=lower,
                    message=f"MILP ({self.solver}) found nothing better than the hint within {time_limit_s:g} s",
                    stats=stats,
                )
        return BackendResult(
            status=BackendStatus.UNKNOWN,
            lower_bound=lower,
            message=f"MILP ({self.solver}) found nothing within {time_limit_s:g} s",
            stats=stats,
        )

    def _solve_highs(
        self, model: _MilpModel, time_limit_s: float, *, warm: bool, should_stop: StopCheck | None
    ) -> tuple[bool, bool, float | None]:
        """Run HiGHS in a child process; returns (has solution, optimal, dual bound ms).

        A child process because OR-Tools bundles its own HiGHS library under the same soname as
        highspy's: whichever loads first breaks the other in one process. It also lets
        ``should_stop`` end the solve (the child is terminated; nothing is returned then).
        """
        lp = model.problem
        with tempfile.TemporaryDirectory(prefix="pipesched_milp_") as folder:
            mps = Path(folder) / "model.mps"
            out_path = Path(folder) / "solution.json"
            lp.writeMPS(str(mps))
            request = {
                "mps": str(mps),
                "time_limit_s": time_limit_s,
                "threads": self.threads,
                "initial": {var.name: float(var.varValue or 0.0) for var in lp.variables()} if warm else None,
                "out": str(out_path),
            }
            (Path(folder) / "request.json").write_text(json.dumps(request))
            child = subprocess.Popen(
                [sys.executable, "-c", _HIGHS_CHILD, str(Path(folder) / "request.json")],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            deadline = time.perf_counter() + time_limit_s + 30.0
            while child.poll() is None:
                if (should_stop is not None and should_stop()) or time.perf_counter() > deadline:
                    child.kill()
                    child.wait()
                    return False, False, None
                time.sleep(0.02)
            if child.returncode != 0:
                error = child.stderr.read().decode() if child.stderr else ""
                raise RuntimeError(f"HiGHS child process failed: {error[-2000:]}")
            result = json.loads(out_path.read_text())
        if result["infeasible"]:
            lp.status = pulp.LpStatusInfeasible
            return False, False, None
        if result["values"] is not None:
            for var in lp.variables():
                var.varValue = result["values"].get(var.name, 0.0)
        bound = result["bound"]
        return result["values"] is not None, result["optimal"], bound

    def _solve_cbc(self, model: _MilpModel, time_limit_s: float, *, warm: bool) -> tuple[bool, bool, float | None]:
        """Run CBC (PuLP's bundled binary); returns (has solution, optimal, bound ms: unknown)."""
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, threads=self.threads, warmStart=warm, gapRel=0.0)
        model.problem.solve(solver)
        has_solution = model.problem.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
        optimal = model.problem.sol_status == pulp.LpSolutionOptimal
        return has_solution, optimal, None
