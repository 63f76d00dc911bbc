"""The ``auto`` search: a portfolio of families, the greedy heuristic and the exact backends.

Order of work within ``solver.time_limit_s`` (``docs/CONTRACT.md``, Problem):

1. Feasibility: if some rank's limit is below the least peak any schedule has
   (:mod:`pipesched.optimizer.solvers.infeasible`), answer ``infeasible`` with ``min_memory_limit``.
2. Lower bound (:mod:`pipesched.optimizer.bounds`).
3. The sequential schedule (always fits when anything fits: a first feasible answer at once), then
   every applicable family whose schedule fits memory (warm starts), and PyTorch's variants of them
   (:mod:`pipesched.optimizer.families._peers`).
4. The Zero Bubble authors' automatic scheduler (:mod:`pipesched.optimizer.solvers.zb_auto`, the source of
   every published ZB-1p/ZB-2p figure) at the problem's limit and on a ladder of lower limits
   (k·p activations per rank, k = 1, 1.5, 2, 3): a schedule that fits less memory fits the limit too,
   so more memory never gives a worse answer.
5. ``heuristic``: greedy variants plus local search (:mod:`pipesched.optimizer.solvers.heuristic`).
6. ``cpsat`` (:class:`pipesched.optimizer.solvers.cpsat.CpSatBackend`), given the best orders as hint and upper
   bound; ``milp`` (:class:`pipesched.optimizer.solvers.milp.MilpBackend`) only on small instances unless
   ``solver.backends`` names it: the exact backends declared in :data:`~pipesched.optimizer.solvers.base.BACKENDS`,
   chosen by their capabilities and imported on first use.

Placement ``"bidirectional"`` (two replicas on different stage chains) skips 4–5: its warm starts are
the families and the capped greedy of :mod:`pipesched.optimizer.families._greedy` at several caps, then CP-SAT's
window search on large instances, then local search.

Every candidate is re-simulated with :func:`pipesched.optimizer.simulate.simulate_indexed`; a backend's own
objective is never used. The answer's ``lower_bound`` is the max of our bounds and the backends'
proven bounds; ``status`` is ``optimal`` when it meets the best objective.
"""

from __future__ import annotations

import dataclasses
import time

from pipesched.optimizer.bounds import lower_bound as compute_lower_bound
from pipesched.optimizer.families import applicable_families
from pipesched.optimizer.families._greedy import capped_greedy_orders, max_reservations
from pipesched.optimizer.families._peers import peer_warm_starts
from pipesched.optimizer.instance import Instance, compile_problem
from pipesched.optimizer.ir import ActionKind
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.progress import (
    Deadline,
    Progress,
    ProgressCallback,
    SearchContext,
    SearchStopped,
    StopCheck,
    active_deadline,
)
from pipesched.optimizer.result import Schedule, build_schedule, infeasible_schedule
from pipesched.optimizer.simulate import InvalidSchedule, action_orders, indexed_orders, simulate_indexed
from pipesched.optimizer.solvers.base import BACKENDS, BackendSpec, BackendStatus, get_backend
from pipesched.optimizer.solvers.heuristic import improve, sequential_orders
from pipesched.optimizer.solvers.infeasible import infeasibility_reason, min_memory_limit
from pipesched.optimizer.solvers.zb_auto import in_zb_auto_domain, zb_auto_orders

__all__ = ["BOUND_SHARE", "LADDER_FACTORS", "solve_auto"]

LADDER_FACTORS = (1.0, 1.5, 2.0, 3.0)
"""Lower memory limits the warm starts also try, in units of num_ranks × a rank's activation."""

BIDIRECTIONAL_CPSAT_MIN_ACTIONS = 512
"""Bidirectional instances with at least this many actions also get CP-SAT's window search."""

BIDIRECTIONAL_CPSAT_SHARE = 0.6
"""The share of the remaining time CP-SAT gets there; local search takes the rest."""

CAPPED_IN_FLIGHT = (2.0, 3.0, 1.5, 4.0, 1.0)
"""In-flight microbatches per rank, in units of num_ranks, that the capped greedy tries on bidirectional
placements (most promising first; each cap also at most the rank's free memory)."""

BOUND_SHARE = 0.3
"""The most of the time left that the lower bound (:mod:`pipesched.optimizer.bounds`) may take."""

FAMILY_COMPILES = 20.0
"""What generating, indexing and simulating one family costs at most, in units of the compile's time (ZB-V's
search measured 15 at 36k actions); a family is skipped when the time left is shorter."""

ZB_AUTO_COMPILES = 15.0
"""The same for one run of the authors' scheduler on one rung of the ladder (measured 13 at 36k actions)."""

GREEDY_COMPILES = 10.0
"""The same for one greedy variant of the heuristic backend, which cannot stop midway."""

OVERRUN_S = 0.5
#: The most one compile is taken to cost per action, s (see ``_Search.compile_s``).
COMPILE_S_PER_ACTION = 2e-5
"""How far past the search deadline a step that cannot stop may be expected to run (out of the 2 s grace the
time limit allows): on small instances the compile's time, the price's unit, is mostly noise."""

ANSWER_COMPILES = 3.0
"""What re-simulating the best orders and building the answer costs, in compiles (measured 2.5)."""

EXACT_COMPILES = 6.0
"""The same for what an exact backend does before it can stop (normalise and simulate the hint, build the
first model)."""

IMPORT_S = 1.0
"""Seconds the first import of an exact backend's library takes (OR-Tools measured 0.5–1.2 s, the latter on a
busy machine)."""


class _Search(SearchContext[list[list[int]]]):
    """One ``auto`` run: the shared :class:`~pipesched.optimizer.progress.SearchContext` over per-rank index
    orders, with the problem, its instance and the compile's time (the price unit of steps that cannot stop)."""

    def __init__(
        self,
        problem: Problem,
        inst: Instance,
        progress: ProgressCallback | None,
        should_stop: StopCheck | None,
        started: float | None = None,
    ) -> None:
        began = time.perf_counter() if started is None else started
        # Seconds the compile took: the unit in which the phases that cannot stop midway are priced. One
        # measurement can be far off (a first import, a collector pause: 0.15 s for 576 actions once made every
        # family look unaffordable at a 2 s limit, leaving the sequential schedule), so it is capped at
        # COMPILE_S_PER_ACTION per action, about 4× what compiling takes here (4–6 µs per action).
        self.compile_s = min(time.perf_counter() - began, COMPILE_S_PER_ACTION * len(inst.actions))
        # Leave room to build the answer (simulation + pydantic objects, ~20 µs per action on a busy
        # 2-core machine, about ANSWER_COMPILES compiles) and for a last search step to notice the deadline.
        limit = problem.solver.time_limit_s
        margin = max(min(0.25 * limit, 0.1 + 1e-4 * len(inst.actions)), ANSWER_COMPILES * self.compile_s)
        super().__init__(began, began + limit - margin, progress, should_stop)
        self.problem = problem
        self.inst = inst
        self.objective = problem.objective

    def can_afford(self, compiles: float) -> bool:
        """Whether a step that cannot stop midway, costing about ``compiles`` × the compile's time, fits in
        the time left (and no stop was asked)."""
        return not self.should_stop() and self.remaining() + OVERRUN_S > compiles * self.compile_s

    def offer(self, orders: list[list[int]], backend: str, message: str = "") -> bool:
        """Re-simulate ``orders``; keep them when they fit memory and beat the incumbent."""
        try:
            sim = simulate_indexed(self.inst, orders, check_memory=False)
        except InvalidSchedule:
            return False
        if not sim.fits:
            return False
        return self.improve([list(row) for row in orders], sim.objective_value(self.objective), backend, message)


def _families(search: _Search) -> None:
    for family in applicable_families(search.problem):
        if not search.can_afford(FAMILY_COMPILES):
            search.report("family", "families skipped: not enough time left for one more")
            return
        try:
            with active_deadline(search.as_deadline()):
                orders = indexed_orders(search.inst, family.generate(search.problem))
        except SearchStopped:
            search.report("family", f"family {family.name} stopped at the deadline")
            return
        except (InvalidSchedule, ValueError):
            continue
        search.offer(orders, f"family:{family.name}", f"family {family.name}")
    for name, peer in peer_warm_starts(search.problem):
        if search.should_stop() or not search.can_afford(FAMILY_COMPILES):
            return
        try:
            orders = indexed_orders(search.inst, peer)
        except InvalidSchedule:
            continue
        search.offer(orders, f"family:{name}", f"PyTorch's variant {name}")


def _ladder(inst: Instance) -> list[Instance]:
    """The instance at its own limit, then at each lower rung of :data:`LADDER_FACTORS`.

    A rung's limit for rank r is static_r + k · num_ranks · (activation of one microbatch through
    r's stages); rungs at or above the real limit are skipped.
    """
    per_rank = [0.0] * inst.num_ranks
    for idx, action in enumerate(inst.actions):
        if action.microbatch == 0 and action.kind == ActionKind.FORWARD:
            per_rank[inst.rank[idx]] += inst.mem_delta[idx]
    rungs = [inst]
    for factor in LADDER_FACTORS:
        limit = [min(real, inst.static[r] + factor * inst.num_ranks * per_rank[r]) for r, real in enumerate(inst.limit)]
        if all(new >= real for new, real in zip(limit, inst.limit, strict=True)):
            continue
        rungs.append(dataclasses.replace(inst, limit=limit))
    return rungs


def _capped_greedy(search: _Search) -> None:
    """The memory-capped list scheduler (:mod:`pipesched.optimizer.families._greedy`, the ``bitpipe`` family's
    generator before it followed the authors' order) at caps of k·num_ranks microbatches per rank (k in
    :data:`CAPPED_IN_FLIGHT`), each at most the rank's free memory: a warm start beside the authors' order
    (which holds at most 2p−1 stage activations per rank and needs an even p dividing m)."""
    inst = search.inst
    p = inst.num_ranks
    try:
        with active_deadline(search.as_deadline()):
            reservation = max_reservations(inst)
    except SearchStopped:
        return
    free = [limit - static for limit, static in zip(inst.limit, inst.static, strict=True)]
    tried: set[tuple[float, ...]] = set()
    for k in CAPPED_IN_FLIGHT:
        caps = tuple(min(free[r], k * p * reservation[r]) for r in range(p))
        if caps in tried or search.should_stop():
            continue
        tried.add(caps)
        try:
            orders = capped_greedy_orders(inst, list(caps), should_stop=search.should_stop)
        except SearchStopped:
            return
        search.offer(indexed_orders(inst, orders), "heuristic", f"capped greedy, {k:g}·p microbatches in flight")


def _zero_bubble_auto(search: _Search) -> None:
    """The authors' scheduler on every rung of the memory ladder (loop, one stage per rank, split)."""
    if not in_zb_auto_domain(search.inst):
        return
    for rung in _ladder(search.inst):
        if not search.can_afford(ZB_AUTO_COMPILES):
            return
        try:
            with active_deadline(search.as_deadline()):
                orders = zb_auto_orders(rung, search.objective)
        except SearchStopped:
            return
        if orders is not None:
            search.offer(orders, "heuristic", "Zero Bubble automatic scheduler")


def solve_auto(
    problem: Problem,
    *,
    progress: ProgressCallback | None = None,
    should_stop: StopCheck | None = None,
) -> Schedule:
    """Search for the best schedule of ``problem`` within ``solver.time_limit_s`` (module docstring).

    Args:
        problem: a validated problem with ``solver.method == "auto"``.
        progress: called with :class:`~pipesched.optimizer.solve.Progress` on every improvement of the best
            objective or of the lower bound (ms).
        should_stop: polled; True ends the search with the best schedule so far.

    Returns:
        A schedule re-simulated by :func:`~pipesched.optimizer.result.build_schedule` with ``status``
        ``optimal`` (gap 0) or ``feasible``, ``lower_bound``, ``gap``, ``backend`` (what found it:
        ``family:<name>``, ``heuristic``, ``sequential``, ``cpsat``, ``milp``) and ``solve_time_s``;
        or ``infeasible`` with a ``reason`` and ``min_memory_limit`` (bytes per rank).

    Placement ``"bidirectional"`` is searched by the sequential schedule, the families (BitPipe), the
    capped greedy at larger caps and local search; its lower bound is :mod:`pipesched.optimizer.bounds` over both
    chains, as for one chain.
    """
    started = time.perf_counter()
    inst = compile_problem(problem)
    search = _Search(problem, inst, progress, should_stop, started)
    reason = infeasibility_reason(inst)
    if reason is not None:
        return infeasible_schedule(
            problem,
            method="auto",
            backend="bounds",
            reason=reason,
            min_memory_limit=min_memory_limit(inst),
            solve_time_s=search.elapsed(),
        )
    allowed = problem.solver.backends
    heuristics = get_backend("heuristic").chosen(allowed, len(inst.actions))
    # The bound gets at most BOUND_SHARE of the time; past it, the weaker parts it reached count.
    bound_deadline = Deadline(time.perf_counter() + BOUND_SHARE * search.remaining(), search.user_stop)
    search.raise_bound(compute_lower_bound(inst, problem.objective, bound_deadline), "bounds")
    search.offer(sequential_orders(inst), "sequential", "one microbatch at a time")
    _families(search)
    if problem.pipeline.placement == "bidirectional":
        _bidirectional(search, heuristics)
        return _answer(search)
    if heuristics:
        _zero_bubble_auto(search)
    exact = [spec for spec in BACKENDS if spec.exact and spec.chosen(allowed, len(inst.actions))]
    if heuristics and search.can_afford(GREEDY_COMPILES):
        _heuristic(search, share=0.4 if exact else 1.0)
    for k, spec in enumerate(exact):
        if not _can_start(search, spec):
            search.report(spec.name, f"{spec.name} skipped: not enough time left to start it")
            break
        budget = search.remaining() / (len(exact) - k)
        if budget <= 0.05:
            break
        _exact(search, spec, budget)
    if heuristics:
        # Time the exact backends left over (or did not need) goes to more local search.
        _local_search(search)
    return _answer(search)


def _bidirectional(search: _Search, heuristics: bool) -> None:
    """Two replicas pass different stages; the authors' scheduler follows one chain, so the warm starts are the
    families and the capped greedy at larger caps. Then CP-SAT's window search on large instances (measured at
    10 s, limits 1–2·p microbatches: 1–7% shorter than local search alone from 512 actions up, up to 6% longer
    below), and local search with the time left."""
    if heuristics:
        _capped_greedy(search)
    cpsat, allowed = get_backend("cpsat"), search.problem.solver.backends
    chosen = len(search.inst.actions) >= BIDIRECTIONAL_CPSAT_MIN_ACTIONS if allowed is None else cpsat.name in allowed
    if chosen and _can_start(search, cpsat):
        _exact(search, cpsat, search.remaining() * (BIDIRECTIONAL_CPSAT_SHARE if heuristics else 1.0))
    if heuristics:
        _local_search(search)


def _heuristic(search: _Search, share: float) -> None:
    """The heuristic backend (greedy variants, then local search) from the incumbent, for ``share`` of the time
    left; its progress reported as the search's."""
    budget = max(0.0, search.remaining() * share)

    def heuristic_progress(update: Progress) -> None:
        search.report("heuristic", update.message)

    with active_deadline(search.as_deadline()):
        result = (
            get_backend("heuristic")
            .load()
            .solve(
                search.inst,
                objective=search.objective,
                time_limit_s=budget,
                hint=search.best,
                upper_bound=search.best_value,
                progress=None if search.progress is None else heuristic_progress,
                should_stop=search.should_stop,
                seed=search.problem.solver.seed,
            )
        )
    if result.orders is not None:
        search.offer(result.orders, "heuristic", result.message)


def _can_start(search: _Search, spec: BackendSpec) -> bool:
    """Whether an exact backend can start: what it does before it can stop, and its library's first import."""
    import_s = 0.0 if spec.imported() else IMPORT_S
    return search.can_afford(EXACT_COMPILES) and search.remaining() + OVERRUN_S > import_s + 0.1


def _exact(search: _Search, spec: BackendSpec, budget: float) -> None:
    """Run exact backend ``spec`` for ``budget`` s from the incumbent (hint and upper bound); keep what it
    finds and proves. A backend that fails is reported and skipped."""
    inst, objective, name = search.inst, search.objective, spec.name
    try:
        result = spec.load().solve(
            inst,
            objective=objective,
            time_limit_s=budget,
            hint=search.best,
            upper_bound=search.best_value if search.best is not None else None,
            progress=None if search.progress is None else _as_search_progress(search),
            should_stop=search.should_stop,
        )
    except Exception as error:
        search.report(name, f"{name} failed: {type(error).__name__}: {error}")
        return
    if result.orders is not None:
        search.offer(result.orders, name, result.message)
    search.raise_bound(result.lower_bound, name)
    if result.status == BackendStatus.OPTIMAL and result.orders is not None and result.lower_bound is None:
        # The backend proved its orders optimal; our re-simulated value of them is at most its own.
        try:
            value = simulate_indexed(inst, result.orders, check_memory=False).objective_value(objective)
            search.raise_bound(min(value, search.best_value), name)
        except InvalidSchedule:
            pass


def _as_search_progress(search: _Search) -> ProgressCallback:
    """A backend's progress reported as the search's: the backend's best beside the search's incumbent and
    bound (a window search proves no bound and reports ``None``; CP-SAT's own bound may be below the search's),
    so the progress a job or the command line shows never loses the bound it had."""
    report = search.progress
    assert report is not None

    def forward(update: Progress) -> None:
        best = update.best_objective
        if search.best is not None:
            best = search.best_value if best is None else min(best, search.best_value)
        bound = search.lower_bound if update.lower_bound is None else max(update.lower_bound, search.lower_bound)
        report(Progress(best, bound, search.elapsed(), update.backend, update.message))

    return forward


def _local_search(search: _Search) -> None:
    """Spend the time left on local search from the incumbent (:func:`~.heuristic.improve`)."""
    if search.should_stop() or search.remaining() <= 0.1 or search.best is None:
        return
    orders, _ = improve(
        search.inst,
        search.best,
        search.objective,
        deadline=search.deadline,
        seed=search.problem.solver.seed + 1,
        should_stop=search.should_stop,
    )
    search.offer(orders, "heuristic", "local search")


def _answer(search: _Search) -> Schedule:
    assert search.best is not None
    return build_schedule(
        search.problem,
        action_orders(search.inst, search.best),
        method="auto",
        backend=search.best_backend,
        lower_bound=search.lower_bound,
        instance=search.inst,
        solve_time_s=search.elapsed(),
    )
