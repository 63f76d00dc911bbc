"""The CP-SAT model of per-rank orders under memory limits (the backend is :mod:`pipesched.optimizer.solvers.cpsat`).

Model (data → variables → constraints → objective → solve → report, CP-SAT Primer style):

* one fixed-size interval per action (``start_F_s3_mb12``), ``add_no_overlap`` per rank;
* precedence with p2p latency from :attr:`Instance.preds` (the one place dependencies live);
* FIFO per stage and kind (``F0`` before ``F1``, ``I0`` before ``I1``, ``W0`` before ``W1``): a valid
  symmetry break because microbatches are identical — every microbatch passing a stage has the same
  costs — so relabelling the k-th pass of a kind on a stage as microbatch k never delays anything
  (Zero Bubble paper, arXiv 2401.10241, App. G). :func:`fifo_normalise` applies the same
  relabelling to warm starts;
* memory by ORDER, not by time: a rank's actions never overlap, so the bytes held at the start of an
  F are ``static + Σ deltas of the rank's actions before it + its own activation``. One Boolean
  ``before_X_Y`` per pair (F, other action) on a rank, fixed wherever the dependency graph or FIFO
  decides it, monotone by FIFO, and one linear constraint per F. This replaces the reservoir
  constraint over times that was too weak at scale (with a memory limit it found no
  feasible schedule of the 1.5B p=8 m=24 setting in 10 s);
* objective ``makespan`` (max end, all starts ≥ 0) or ``stage_span`` (max over ranks of last end −
  first start, the first action pinned to its release as the simulator times it, so a rank cannot
  shorten its span by starting late), with the portfolio's upper bound as a cut and the warm start
  as a full hint (every start and every order literal);
* redundant: each rank is busy for its total compute between its first start and its last end.

Times: durations and latencies are floored to whole ticks of :func:`choose_tick_ms` (1 ms, or their
gcd, when costs are whole ms; 1 µs for costs with three decimals). Flooring maps every float schedule
to a tick schedule with the same per-rank orders (so the same memory) and an objective no larger, up
to one tick for ``stage_span``; hence ``bound_ticks · tick`` (makespan, or exact ticks) and
``(bound_ticks − 1) · tick`` (stage span with floored costs) are valid lower bounds for the float
problem. Orders are re-simulated with the float simulator by the portfolio; each floored action loses
less than 1 µs, so a claimed optimum is exact up to (actions on a critical path) µs.

Memory bytes are used exactly when integral (true for every problem from the contract's byte
counts); otherwise they are rounded conservatively (allocations up, the limit down) and the backend
makes no optimality, infeasibility or bound claim.

The same model serves the large-neighbourhood search (:mod:`pipesched.optimizer.solvers.lns`): given an
incumbent, only a contiguous segment of each rank's order is free (optionally only some of its
actions, e.g. the W's); the actions before it keep their simulated times (constants) and the ones
after it keep their order.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import time
from collections import defaultdict
from collections.abc import Sequence

from ortools.sat.python import cp_model

from pipesched.optimizer.instance import Instance
from pipesched.optimizer.ir import ActionKind
from pipesched.optimizer.progress import Progress, ProgressCallback, StopCheck
from pipesched.optimizer.simulate import InvalidSchedule, simulate_indexed

__all__ = [
    "OBJECTIVES",
    "TICKS_PER_MS",
    "OrderModel",
    "fifo_normalise",
    "fits",
    "reachable_masks",
    "run_model",
    "scaled_instance",
    "ticks_to_lower_bound_ms",
]

TICKS_PER_MS = 1000
"""Finest model time resolution: one tick is at most 1 µs."""

OBJECTIVES = ("makespan", "stage_span")


def choose_tick_ms(inst: Instance) -> tuple[float, bool]:
    """The model's tick in ms and whether every duration and latency is a whole number of ticks.

    Coarse ticks keep CP-SAT's domains small: costs given in whole ms get a 1 ms tick (or their gcd),
    costs with three decimals a 1 µs tick. Costs finer than 1 µs are floored to it (not exact).
    """
    values = [d for d in inst.duration if d > 0] + [lat for row in inst.preds for _, lat in row if lat > 0]
    for tick in (1.0, 0.1, 0.01, 1.0 / TICKS_PER_MS):
        counts = [v / tick for v in values]
        if all(abs(c - round(c)) < 1e-6 for c in counts):
            divisor = 0
            for c in counts:
                divisor = math.gcd(divisor, round(c))
            return tick * max(divisor, 1), True
    return 1.0 / TICKS_PER_MS, False


def scaled_instance(inst: Instance, tick_ms: float) -> Instance:
    """A copy of ``inst`` with durations and latencies floored to whole ticks (see module docstring)."""

    def ticks(value: float) -> float:
        return float(math.floor(value / tick_ms + 1e-6))

    duration = [ticks(d) for d in inst.duration]
    preds = [[(k, ticks(lat)) for k, lat in row] for row in inst.preds]
    succs = [[(k, ticks(lat)) for k, lat in row] for row in inst.succs]
    return dataclasses.replace(inst, duration=duration, preds=preds, succs=succs)


def ticks_to_lower_bound_ms(bound_ticks: float, objective: str, tick_ms: float, exact_time: bool) -> float:
    """Convert a proven bound of the tick model to a valid bound of the float problem, ms.

    With exact ticks every left-justified schedule has whole-tick times, so the bound carries over;
    with floored costs a stage span may shrink by up to one tick (module docstring).
    """
    ticks = math.ceil(bound_ticks - 1e-6)
    if objective == "stage_span" and not exact_time:
        ticks -= 1
    return max(0.0, ticks * tick_ms)


def fifo_normalise(inst: Instance, orders: Sequence[Sequence[int]]) -> list[list[int]]:
    """Relabel microbatches so each kind runs in microbatch order on each stage.

    The k-th pass of a kind on a stage becomes the pass of the k-th microbatch of that stage. With
    identical microbatches this never delays any action (each k-th pass still finds k inputs ready)
    and keeps every rank's memory profile, so the result is at least as good as ``orders``.

    Args:
        orders: per-rank action indices of ``inst``.

    Returns:
        Per-rank action indices in FIFO order.
    """
    members: dict[tuple[int, ActionKind], list[int]] = defaultdict(list)
    for idx, action in enumerate(inst.actions):
        members[(action.stage, action.kind)].append(idx)
    for key in members:
        members[key].sort(key=lambda i: inst.actions[i].microbatch)
    used: dict[tuple[int, ActionKind], int] = defaultdict(int)
    result = []
    for row in orders:
        new_row = []
        for idx in row:
            action = inst.actions[idx]
            key = (action.stage, action.kind)
            new_row.append(members[key][used[key]])
            used[key] += 1
        result.append(new_row)
    return result


def _action_name(inst: Instance, idx: int) -> str:
    action = inst.actions[idx]
    return f"{action.kind.value}_s{action.stage}_mb{action.microbatch}"


def _memory_integral(inst: Instance) -> bool:
    values = [*inst.mem_delta, *inst.static, *(x for x in inst.limit if math.isfinite(x))]
    return all(abs(v - round(v)) < 1e-9 and abs(v) < 2**53 for v in values)


def reachable_masks(inst: Instance, targets: list[int]) -> list[int]:
    """For every action index, a bitmask over ``targets`` (bit k = ``targets[k]``) of the targets that
    must run after it: reachable through dependencies or the FIFO order of a stage's passes."""
    n = len(inst.actions)
    bit = {idx: 1 << k for k, idx in enumerate(targets)}
    succs: list[list[int]] = [[s for s, _ in row] for row in inst.succs]
    groups: dict[tuple[int, ActionKind], list[int]] = defaultdict(list)
    for idx, action in enumerate(inst.actions):
        groups[(action.stage, action.kind)].append(idx)
    for members in groups.values():
        members.sort(key=lambda i: inst.actions[i].microbatch)
        for a, b in itertools.pairwise(members):
            succs[a].append(b)
    indegree = [0] * n
    for row in succs:
        for s in row:
            indegree[s] += 1
    stack = [i for i in range(n) if indegree[i] == 0]
    topo = []
    while stack:
        i = stack.pop()
        topo.append(i)
        for s in succs[i]:
            indegree[s] -= 1
            if indegree[s] == 0:
                stack.append(s)
    reach = [0] * n
    for i in reversed(topo):
        mask = 0
        for s in succs[i]:
            mask |= reach[s] | bit.get(s, 0)
        reach[i] = mask
    return reach


class OrderModel:
    """CP-SAT model of per-rank orders; all actions free, or one segment per rank (LNS).

    Args:
        inst: the compiled problem.
        objective: ``"makespan"`` or ``"stage_span"``.
        incumbent: per-rank FIFO orders to hint (and to fix outside ``segments``), or ``None``.
        segments: per rank ``(lo, hi)`` positions in ``incumbent`` that are free; ``None`` frees all.
        floating: with ``segments``, the segment actions that may move; the others keep their
            relative order from ``incumbent`` (e.g. float the W's over a fixed F/I skeleton).
            ``None``: every segment action may move.
        upper_bound_ms: the objective must be at most this (a cut), or ``None``.
        secondary: also minimise the sum over ranks of the per-rank objective (LNS plateaus).

    Attributes:
        model: the ``cp_model.CpModel``.
        exact_memory: whether bytes were integral (else the memory rounding is conservative).
    """

    def __init__(
        self,
        inst: Instance,
        objective: str,
        *,
        incumbent: list[list[int]] | None = None,
        segments: list[tuple[int, int]] | None = None,
        floating: set[int] | None = None,
        upper_bound_ms: float | None = None,
        secondary: bool = False,
    ) -> None:
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        if segments is not None and incumbent is None:
            raise ValueError("segments need an incumbent order to fix the rest of each rank's order")
        self.inst = inst
        self.objective = objective
        self.tick_ms, self.exact_time = choose_tick_ms(inst)
        self.ticks = scaled_instance(inst, self.tick_ms)
        self.incumbent = incumbent
        self.upper_bound_ms = upper_bound_ms
        self.secondary = secondary
        self.span_relaxed = False  # set when a rank's first action is not unique (stage span)
        n = len(inst.actions)
        self.exact_memory = _memory_integral(inst)
        # Data: which actions are constants (prefix), free (segment) or chained (suffix).
        self.fixed_start: dict[int, int] = {}
        self.free: list[list[int]] = []
        self.suffix: list[list[int]] = []
        if segments is None:
            self.free = [list(row) for row in inst.rank_actions]
            self.suffix = [[] for _ in inst.rank_actions]
        else:
            assert incumbent is not None
            sim = simulate_indexed(self.ticks, incumbent, check_memory=False)
            for rank, (lo, hi) in enumerate(segments):
                row = incumbent[rank]
                for idx in row[:lo]:
                    self.fixed_start[idx] = round(sim.start[idx])
                self.free.append(list(row[lo:hi]))
                self.suffix.append(list(row[hi:]))
        self.segments = segments
        self.floating = floating
        self.incumbent_position: dict[int, int] = {}
        if incumbent is not None:
            for row in incumbent:
                for k, idx in enumerate(row):
                    self.incumbent_position[idx] = k
        self.prefix_count = [0 if segments is None else lo for lo, _ in (segments or [(0, 0)] * inst.num_ranks)]
        self.model = cp_model.CpModel()
        self.start: dict[int, cp_model.IntVar] = {}
        self.interval: dict[int, cp_model.IntervalVar] = {}
        self.before: dict[tuple[int, int], cp_model.IntVar | bool] = {}
        self.objective_var: cp_model.IntVar | None = None
        self.horizon = int(
            sum(self.ticks.duration) + sum(max((lat for _, lat in p), default=0) for p in self.ticks.preds)
        )
        self.horizon = max(self.horizon, 1)
        self._n = n
        self._build_model()

    # --- build ---------------------------------------------------------------------------------

    def _build_model(self) -> None:
        targets = [i for row in self.free for i in row]
        self._position = {idx: k for k, idx in enumerate(targets)}
        self._reachable = reachable_masks(self.inst, targets)
        self._add_variables()
        self._add_constraints()
        self._add_objective()
        if self.incumbent is not None:
            self._add_hints(self.incumbent)

    def _end_const(self, idx: int) -> int:
        return self.fixed_start[idx] + int(self.ticks.duration[idx])

    def _add_variables(self) -> None:
        ticks = self.ticks
        for rank in range(self.inst.num_ranks):
            prefix_end = 0
            if self.prefix_count[rank] and self.incumbent is not None:
                prefix_end = self._end_const(self.incumbent[rank][self.prefix_count[rank] - 1])
            for idx in self.free[rank] + self.suffix[rank]:
                release = prefix_end
                for pred, latency in ticks.preds[idx]:
                    if pred in self.fixed_start:
                        release = max(release, self._end_const(pred) + int(latency))
                name = _action_name(self.inst, idx)
                start = self.model.new_int_var(release, self.horizon, f"start_{name}")
                self.start[idx] = start
                self.interval[idx] = self.model.new_fixed_size_interval_var(
                    start, int(ticks.duration[idx]), f"interval_{name}"
                )

    def _add_constraints(self) -> None:
        self._add_precedences()
        self._add_fifo()
        self._add_no_overlap()
        self._add_memory()

    def _add_precedences(self) -> None:
        ticks = self.ticks
        for idx, start in self.start.items():
            for pred, latency in ticks.preds[idx]:
                if pred in self.start:
                    self.model.add(start >= self.start[pred] + int(ticks.duration[pred]) + int(latency))

    def _add_fifo(self) -> None:
        """Microbatch order per (stage, kind) among the free actions; chain order in each suffix."""
        groups: dict[tuple[int, ActionKind], list[int]] = defaultdict(list)
        for row in self.free:
            for idx in row:
                action = self.inst.actions[idx]
                groups[(action.stage, action.kind)].append(idx)
        for members in groups.values():
            members.sort(key=lambda i: self.inst.actions[i].microbatch)
            for a, b in itertools.pairwise(members):
                self.model.add(self.start[b] >= self.start[a] + int(self.ticks.duration[a]))
        if self.floating is not None:
            for row in self.free:
                skeleton = [i for i in row if i not in self.floating]
                for a, b in itertools.pairwise(skeleton):
                    self.model.add(self.start[b] >= self.start[a] + int(self.ticks.duration[a]))
        for rank, row in enumerate(self.suffix):
            for a, b in itertools.pairwise(row):
                self.model.add(self.start[b] >= self.start[a] + int(self.ticks.duration[a]))
            if row:
                for idx in self.free[rank]:
                    self.model.add(self.start[row[0]] >= self.start[idx] + int(self.ticks.duration[idx]))

    def _add_no_overlap(self) -> None:
        for row in self.free:
            if len(row) > 1:
                self.model.add_no_overlap([self.interval[i] for i in row])

    def _add_memory(self) -> None:
        """At the start of each free F: static + prefix + Σ before·delta + own activation ≤ limit."""
        inst = self.inst
        limited = [r for r in range(inst.num_ranks) if math.isfinite(inst.limit[r])]
        if not limited:
            return
        exact = self.exact_memory

        def alloc(v: float) -> int:
            return round(v) if exact else math.ceil(v)

        reach, position = self._reachable, self._position
        for rank in limited:
            row = self.free[rank]
            base = inst.static[rank]
            if self.incumbent is not None:
                base += sum(inst.mem_delta[i] for i in self.incumbent[rank][: self.prefix_count[rank]])
            limit = math.floor(inst.limit[rank] + 1e-9) if exact else math.floor(inst.limit[rank])
            forwards = [i for i in row if inst.actions[i].kind == ActionKind.FORWARD]
            for f in forwards:
                terms = []
                constant = alloc(base) + alloc(inst.mem_delta[f])
                for other in row:
                    if other == f or inst.mem_delta[other] == 0:
                        continue
                    literal = self._before(other, f, reach, position)
                    delta = alloc(inst.mem_delta[other])
                    if literal is True:
                        constant += delta
                    elif literal is not False:
                        terms.append(delta * literal)
                if not terms:
                    if constant > limit:
                        self.model.add_bool_or([])  # infeasible: this F cannot fit in any order
                    continue
                self.model.add(sum(terms) + constant <= limit)

    def _before(self, a: int, b: int, reach: list[int], position: dict[int, int]) -> cp_model.IntVar | bool:
        """Literal "a runs before b" (same rank), fixed when the DAG or FIFO decides it."""
        if self.floating is not None and a not in self.floating and b not in self.floating:
            return self.incumbent_position[a] < self.incumbent_position[b]
        if reach[a] >> position[b] & 1:
            return True
        if reach[b] >> position[a] & 1:
            return False
        key = (a, b) if a < b else (b, a)
        literal = self.before.get(key)
        if literal is None:
            lo, hi = key
            literal = self.model.new_bool_var(f"before_{_action_name(self.inst, lo)}_{_action_name(self.inst, hi)}")
            dur = self.ticks.duration
            self.model.add(self.start[hi] >= self.start[lo] + int(dur[lo])).only_enforce_if(literal)
            self.model.add(self.start[lo] >= self.start[hi] + int(dur[hi])).only_enforce_if(~literal)
            self.before[key] = literal
            self._add_monotone(lo, hi, literal)
        assert not isinstance(literal, bool)
        return literal if a < b else ~literal  # type: ignore[return-value]

    def _add_monotone(self, lo: int, hi: int, literal: cp_model.IntVar) -> None:
        """FIFO monotonicity: if X_k before Y_j then X_{k-1} before Y_j and X_k before Y_{j+1}."""
        inst = self.inst
        # Link to neighbours already created (cheap, local): same pair of (stage, kind) groups.
        a, b = inst.actions[lo], inst.actions[hi]
        for da, db in ((-1, 0), (0, 1), (1, 0), (0, -1)):
            try:
                na = inst.action_id(a.stage, a.kind, a.microbatch + da)
                nb = inst.action_id(b.stage, b.kind, b.microbatch + db)
            except KeyError:
                continue
            key = (na, nb) if na < nb else (nb, na)
            other = self.before.get(key)
            if other is None or isinstance(other, bool):
                continue
            other_lit = other if na < nb else ~other
            # lo before hi, with lo' earlier in lo's FIFO (da=-1) or hi' later in hi's (db=+1): implied.
            if (da, db) in ((-1, 0), (0, 1)):
                self.model.add_implication(literal, other_lit)
            else:
                self.model.add_implication(other_lit, literal)

    def _extremes(self, row: list[int]) -> tuple[list[int], list[int]]:
        """Actions of ``row`` that may run first (no ancestor in ``row``) and last (no descendant)."""
        mask = 0
        for idx in row:
            mask |= 1 << self._position[idx]
        firsts = [i for i in row if not any(self._reachable[j] >> self._position[i] & 1 for j in row if j != i)]
        lasts = [i for i in row if not self._reachable[i] & mask]
        return firsts, lasts

    def _add_as_soon_as_possible(self, idx: int) -> None:
        """A rank's first action starts when its inputs arrive, as in the simulator.

        The simulator times every order as soon as possible, so a rank cannot shorten its stage span
        by starting late; without this the model would optimise a relaxation of the simulated span.
        """
        terms: list[cp_model.LinearExprT] = []
        for pred, latency in self.ticks.preds[idx]:
            if pred in self.fixed_start:
                terms.append(self._end_const(pred) + int(latency))
            else:
                terms.append(self.start[pred] + int(self.ticks.duration[pred]) + int(latency))
        if terms:
            self.model.add_max_equality(self.start[idx], terms)
        else:
            self.model.add(self.start[idx] == 0)

    def _add_objective(self) -> None:
        obj = self.model.new_int_var(0, self.horizon, "objective")
        rank_terms: list[cp_model.LinearExprT] = []
        for rank in range(self.inst.num_ranks):
            row_free, row_suffix = self.free[rank], self.suffix[rank]
            first_candidates, last_candidates = self._extremes(row_free)
            if row_suffix:
                last_candidates = [row_suffix[-1]]
            last: cp_model.LinearExprT
            if not last_candidates:
                assert self.incumbent is not None
                last = self._end_const(self.incumbent[rank][-1])
            elif len(last_candidates) == 1:
                only = last_candidates[0]
                last = self.start[only] + int(self.ticks.duration[only])
            else:
                last = self.model.new_int_var(0, self.horizon, f"last_end_r{rank}")
                for idx in last_candidates:
                    self.model.add(last >= self.start[idx] + int(self.ticks.duration[idx]))
            first: cp_model.LinearExprT
            if self.prefix_count[rank] and self.incumbent is not None:
                first = self.fixed_start[self.incumbent[rank][0]]
            elif len(first_candidates) == 1:
                first = self.start[first_candidates[0]]
                if self.objective == "stage_span":
                    self._add_as_soon_as_possible(first_candidates[0])
            else:
                self.span_relaxed = self.objective == "stage_span"
                first = self.model.new_int_var(0, self.horizon, f"first_start_r{rank}")
                for idx in first_candidates:
                    self.model.add(first <= self.start[idx])
            # Redundant: a rank is busy for at least its compute between its first start and last end.
            busy = sum(int(self.ticks.duration[i]) for i in self.inst.rank_actions[rank])
            self.model.add(last - first >= busy)
            rank_term = last if self.objective == "makespan" else last - first
            rank_terms.append(rank_term)
            self.model.add(obj >= rank_term)
        if self.upper_bound_ms is not None:
            self.model.add(obj <= math.ceil(self.upper_bound_ms / self.tick_ms + 1e-6) + 1)
        self.objective_var = obj
        if self.secondary:
            # Plateau escape for the neighbourhood search: among equal objectives, prefer less
            # total per-rank span (makespan: earlier rank ends). Weight num_ranks on the objective.
            self.model.minimize(obj * self.inst.num_ranks + cp_model.LinearExpr.sum(rank_terms))
        else:
            self.model.minimize(obj)

    def _add_hints(self, orders: list[list[int]]) -> None:
        sim = simulate_indexed(self.ticks, orders, check_memory=False)
        for idx, var in self.start.items():
            self.model.add_hint(var, round(sim.start[idx]))
        for (lo, hi), literal in self.before.items():
            if not isinstance(literal, bool):
                self.model.add_hint(literal, sim.start[lo] < sim.start[hi])
        if self.objective_var is not None:
            value = sim.makespan if self.objective == "makespan" else sim.stage_span
            self.model.add_hint(self.objective_var, round(value))

    def lower_bound_ms(self, bound_ticks: float) -> float:
        """A proven bound of this model in ms, valid for the float problem."""
        return ticks_to_lower_bound_ms(bound_ticks, self.objective, self.tick_ms, self.exact_time)

    # --- solve and report ------------------------------------------------------------------------

    def orders(self, solver: cp_model.CpSolver | cp_model.CpSolverSolutionCallback) -> list[list[int]]:
        """Per-rank orders read from the solver's current solution."""
        result = []
        for rank in range(self.inst.num_ranks):
            prefix = self.incumbent[rank][: self.prefix_count[rank]] if self.incumbent is not None else []
            free = sorted(
                self.free[rank],
                key=lambda i: (
                    solver.value(self.start[i]),
                    int(self.ticks.duration[i]),
                    self.inst.actions[i].microbatch,
                ),
            )
            result.append(list(prefix) + free + list(self.suffix[rank]))
        return result


class _Progress(cp_model.CpSolverSolutionCallback):
    def __init__(
        self,
        model: OrderModel,
        started: float,
        progress: ProgressCallback | None,
        should_stop: StopCheck | None,
        backend: str,
    ) -> None:
        super().__init__()
        self._model = model
        self._started = started
        self._progress = progress
        self._should_stop = should_stop
        self._backend = backend
        self.solutions = 0

    def on_solution_callback(self) -> None:
        self.solutions += 1
        if self._progress is not None:
            bound = self.best_objective_bound if self._model.segments is None else None
            self._progress(
                Progress(
                    best_objective=self.objective_value * self._model.tick_ms,
                    lower_bound=None if bound is None else self._model.lower_bound_ms(bound),
                    elapsed_s=time.perf_counter() - self._started,
                    backend=self._backend,
                    message=f"solution {self.solutions}",
                )
            )
        if self._should_stop is not None and self._should_stop():
            self.stop_search()


def run_model(
    model: OrderModel,
    *,
    time_limit_s: float,
    num_workers: int = 2,
    progress: ProgressCallback | None = None,
    should_stop: StopCheck | None = None,
    backend: str = "cpsat",
    started: float | None = None,
) -> tuple[cp_model.CpSolver, cp_model.CpSolverStatus]:
    """Solve ``model``; a watcher thread polls ``should_stop`` every 50 ms and stops the search.

    Returns:
        The solver (for values and bounds) and its status code.
    """
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = num_workers
    solver.parameters.max_time_in_seconds = max(0.01, time_limit_s)
    callback = _Progress(model, started or time.perf_counter(), progress, should_stop, backend)
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.05):
            if should_stop is not None and should_stop():
                solver.stop_search()
                return

    watcher = threading.Thread(target=watch, daemon=True) if should_stop is not None else None
    if watcher is not None:
        watcher.start()
    try:
        status = solver.solve(model.model, callback)
    finally:
        done.set()
        if watcher is not None:
            watcher.join()
    return solver, status


def fits(inst: Instance, orders: list[list[int]]) -> bool:
    try:
        simulate_indexed(inst, orders)
    except InvalidSchedule:
        return False
    return True
