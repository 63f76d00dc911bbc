"""``auto`` for the whole training step: the compute order and when each collective runs.

Used when the problem has communication actions or optimizer steps (d > 1, ``costs.optimizer_step``, or a
bidirectional placement's replica synchronisation), or
asks for ``objective: step_time``. Within ``solver.time_limit_s``:

1. **Candidates from the families.** Every applicable family, its collectives placed by the communication
   pass (:mod:`pipesched.optimizer.communication`) at several prefetch distances, each simulated on the real
   problem (gathered weights counted in memory): the first feasible answers, and the guarantee that ``auto``
   is never worse than the best family.
2. **The compute search on a proxy.** The problem without data parallelism, with each rank's static memory
   raised by the gathered weights of all its stages (with sharding ``full`` every stage's weights are gathered
   at once at the turn of any gather-once schedule, so this is exact there), objective ``makespan`` (or
   ``stage_span`` under post-validation), solved by the portfolio of
   :mod:`pipesched.optimizer.solvers.portfolio` (heuristics, CP-SAT, MILP: all compute-only). Its orders get
   the communication pass and are judged on the real problem. CP-SAT does not see the collectives: they are
   placed after it, by the pass.
3. **The answer** is the candidate with the least objective on the real problem, re-simulated.

Lower bound (valid for every schedule, comments in :func:`step_lower_bound`): the compute bound of
:mod:`pipesched.optimizer.bounds` on the relaxed problem (no gathered weights in memory), plus the
communication no schedule can hide: the cheapest first gather before any forward (sharding ``full``), the
cheapest reduction after the step's last backward (d > 1), and the optimizer step after the synchronisation.
"""

from __future__ import annotations

import dataclasses
import time

from pipesched.optimizer.bounds import lower_bound as compute_lower_bound
from pipesched.optimizer.communication import add_communication
from pipesched.optimizer.families import applicable_families
from pipesched.optimizer.instance import Instance, compile_for_orders, compile_problem, compute_instance
from pipesched.optimizer.ir import Orders, compute_only
from pipesched.optimizer.problem import Problem, least_time_limit_s
from pipesched.optimizer.progress import ProgressCallback, SearchContext, StopCheck
from pipesched.optimizer.result import Schedule, infeasible_schedule, schedule_from_simulation
from pipesched.optimizer.simulate import InvalidSchedule, SimulationResult, action_orders, simulate
from pipesched.optimizer.solvers.heuristic import sequential_orders
from pipesched.optimizer.solvers.infeasible import min_memory_limit
from pipesched.optimizer.solvers.portfolio import solve_auto
from pipesched.optimizer.units import format_bytes

__all__ = ["PREFETCH_DISTANCES", "compute_problem", "solve_step", "step_lower_bound"]

PREFETCH_DISTANCES = (1, 0, 2)
"""How many stages ahead the communication pass issues a gather, tried for every candidate order."""


def _compute_objective(problem: Problem) -> str:
    """The compute-only objective standing in for ``problem.objective``."""
    if problem.objective != "step_time":
        return problem.objective
    return "stage_span" if problem.training.post_validation else "makespan"


def _static_adjustment(problem: Problem, *, gathered: bool) -> list[float]:
    """Per rank, bytes to add to static: the gathered (d−1)/d weights of all the rank's stages (``gathered``,
    sharding ``full``), or minus the gradient shards its REDUCE_GRADs free (not ``gathered``, sharding
    ``gradients``/``full``)."""
    assert problem.memory is not None
    adjustment = [0.0] * problem.pipeline.num_ranks
    dp = problem.data_parallel
    if dp is None or dp.size == 1:
        return adjustment
    fraction = (dp.size - 1) / dp.size
    num_stages = problem.pipeline.num_stages
    if gathered and dp.sharding == "full" and problem.memory.weights is not None:
        values, sign = problem.stage_values(problem.memory.weights), 1.0
    elif not gathered and dp.sharding in ("gradients", "full") and problem.memory.gradients is not None:
        values, sign = problem.stage_values(problem.memory.gradients), -1.0
    else:
        return adjustment
    for stage, rank in enumerate(problem.pipeline.stage_to_rank):
        adjustment[rank] += sign * values[stage % num_stages] * fraction
    return adjustment


def compute_problem(problem: Problem, *, gathered_in_static: bool) -> Problem:
    """The compute-only problem behind ``problem``: no data parallelism, no collective or optimizer costs,
    objective makespan (stage_span under post-validation). With ``gathered_in_static`` each rank's static
    memory also holds the gathered (d−1)/d weights of all its stages (sharding ``full``): every schedule of it
    fits the real problem after the communication pass. Without, static drops the gradient shards that
    REDUCE_GRAD frees (sharding ``gradients``/``full``): every real schedule fits it (a relaxation)."""
    assert problem.memory is not None
    data = problem.model_dump(mode="json")
    adjustment = _static_adjustment(problem, gathered=gathered_in_static)
    data["memory"]["static"] = [x + dx for x, dx in zip(problem.static_memory, adjustment, strict=True)]
    data["memory"]["weights"] = None
    data["memory"]["gradients"] = None
    for name in ("unshard", "reduce_grad", "optimizer_step"):
        data["costs"][name] = None
    if problem.pipeline.placement == "bidirectional":
        data["costs"]["reduce_grad"] = 0.0  # the replicas' synchronisation left out (Problem.replicas_synchronise)
    data["data_parallel"] = None
    data["objective"] = _compute_objective(problem)
    data["solver"]["method"] = "auto"
    return Problem.model_validate(data)


def step_lower_bound(problem: Problem, inst: Instance) -> float:
    """A lower bound (ms) on ``problem.objective`` for every schedule with the step's communication.

    * compute: :func:`pipesched.optimizer.bounds.lower_bound` of the compute-only relaxation
      (:func:`compute_problem` without gathered weights, gradient shards freed from the start), on makespan
      (stage_span under post-validation; for objective stage_span itself);
    * + the least ``unshard`` (sharding ``full``): a rank's first pass waits for a gather on its own rank that
      started no earlier than the step (the rank's span);
    * + the least ``reduce_grad`` (d > 1, or synchronising replicas): the step's (each rank's) last pass is a
      last backward (W, or B when fused: every F and I has a successor), and its stage's REDUCE_GRAD follows it;
    * + for ``step_time``, the optimizer step: after the synchronisation every rank's, so the largest; under
      post-validation the rank's own, so the least.
    """
    passes = compute_instance(inst)
    adjustment = _static_adjustment(problem, gathered=False)
    relaxed = dataclasses.replace(passes, static=[x + dx for x, dx in zip(passes.static, adjustment, strict=True)])
    bound = compute_lower_bound(relaxed, _compute_objective(problem))
    if not inst.has_step_actions:
        return bound
    assert problem.costs is not None
    dp = problem.data_parallel
    if dp is not None and dp.sharding == "full" and problem.costs.unshard is not None:
        bound += min(problem.stage_values(problem.costs.unshard))
    if (problem.data_parallel_size > 1 or problem.replicas_synchronise) and problem.costs.reduce_grad is not None:
        bound += min(problem.stage_values(problem.costs.reduce_grad))
    if problem.objective == "step_time":
        steps = problem.rank_values(problem.costs.optimizer_step, 0.0)
        bound += min(steps) if problem.training.post_validation else max(steps)
    return bound


class _StepSearch(SearchContext[tuple[Orders, SimulationResult, Instance]]):
    """One step search: the shared :class:`~pipesched.optimizer.progress.SearchContext` over (orders with their
    collectives, their simulation, the instance their UNSHARD … RESHARD frames compile to) on the real
    problem."""

    def __init__(self, problem: Problem, progress: ProgressCallback | None, should_stop: StopCheck | None) -> None:
        started = time.perf_counter()
        self.inst = compile_problem(problem)
        limit_s = problem.solver.time_limit_s
        # Room to build the answer (~20 µs per action on a busy 2-core machine), as the portfolio leaves.
        margin = min(0.3 * limit_s, 0.1 + 3e-5 * len(self.inst.actions))
        super().__init__(started, started + limit_s - margin, progress, should_stop)
        self.objective = problem.objective

    def offer(
        self, orders: Orders, backend: str, prefetches: tuple[int, ...] = PREFETCH_DISTANCES, gather_runs: bool = False
    ) -> None:
        """Place the collectives at each prefetch distance (:mod:`pipesched.optimizer.communication`), simulate
        on the real problem, keep the best that fits; stop between distances when time runs out."""
        for k, prefetch in enumerate(prefetches):
            if k > 0 and self.should_stop():
                return
            try:
                with self.step():
                    full = add_communication(self.inst, orders, prefetch=prefetch, gather_runs=gather_runs)
                    framed = compile_for_orders(self.inst.problem, full, base=self.inst)
                    sim: SimulationResult = simulate(framed, full, check_memory=False)
            except InvalidSchedule:
                return
            if sim.fits:
                value = sim.objective_value(self.objective)
                self.improve((full, sim, framed), value, backend, f"{backend} (prefetch {prefetch}): {value:.3f} ms")


def solve_step(
    problem: Problem,
    *,
    progress: ProgressCallback | None = None,
    should_stop: StopCheck | None = None,
) -> Schedule:
    """Search the compute order and the collectives' placement for ``problem`` (module docstring).

    Returns:
        The best schedule found, re-simulated, with ``lower_bound`` from :func:`step_lower_bound`; or
        ``infeasible`` with ``min_memory_limit`` (bytes per rank): static + the gathered weights of all the
        rank's stages + one microbatch's activations on the rank.
    """
    search = _StepSearch(problem, progress, should_stop)
    inst = search.inst
    gathered = _static_adjustment(problem, gathered=True)
    # min_memory_limit reads only the forward passes, which the step actions leave as they are.
    need = [x + dx for x, dx in zip(min_memory_limit(inst), gathered, strict=True)]
    over = [r for r, (n, lim) in enumerate(zip(need, inst.limit, strict=True)) if n > lim * (1 + 1e-12) + 1e-9]
    if over:
        rank = over[0]
        return infeasible_schedule(
            problem,
            method="auto",
            backend="bounds",
            reason=(
                f"rank {rank} needs at least {format_bytes(need[rank])} (static, the gathered weights of its stages "
                f"and one microbatch's activations); its limit is {format_bytes(inst.limit[rank])}: raise "
                f"memory.limit to at least {need[rank]:.0f} bytes on rank {rank}"
            ),
            min_memory_limit=need,
            solve_time_s=search.elapsed(),
        )
    # The sequential schedule first, each gather right before its passes: the least memory any schedule holds,
    # an answer whenever one fits (as the portfolio's first candidate). Then every family at the default prefetch
    # (the guarantee: never worse than a family), then the other prefetch distances while time is left.
    passes = compute_instance(inst)
    search.offer(action_orders(passes, sequential_orders(passes)), "sequential", (0,))
    generated: list[tuple[str, Orders, bool]] = []
    for family in applicable_families(problem):
        if generated and search.should_stop():
            break
        try:
            generated.append((f"family:{family.name}", family.generate(problem), family.gather_runs))
        except ValueError:
            continue
        search.offer(generated[-1][1], generated[-1][0], PREFETCH_DISTANCES[:1], generated[-1][2])
    search.raise_bound(step_lower_bound(problem, inst), "step")
    for backend, orders, gather_runs in generated:
        if search.should_stop():
            break
        search.offer(orders, backend, PREFETCH_DISTANCES[1:], gather_runs)
    remaining = search.remaining() - search.step_s  # leave room to place the collectives in its answer
    # the compute-only search only with the time its size is admitted with (else it cannot even answer)
    least = least_time_limit_s(problem.pipeline.num_stages, problem.pipeline.num_microbatches)
    if remaining > max(0.05, least) and not search.should_stop():
        proxy = compute_problem(problem, gathered_in_static=True)
        proxy = proxy.model_copy(update={"solver": proxy.solver.model_copy(update={"time_limit_s": remaining})})
        result = solve_auto(proxy, should_stop=should_stop)
        if result.status != "infeasible":
            search.offer(compute_only(result.orders()), f"compute:{result.backend}")
    if search.best is None:
        return infeasible_schedule(
            problem,
            method="auto",
            backend="step",
            reason="no schedule with the step's collectives fits memory within the time limit: raise memory.limit",
            min_memory_limit=need,
            solve_time_s=search.elapsed(),
        )
    return schedule_from_simulation(
        problem,
        search.best[2],
        search.best[1],
        method="auto",
        backend=search.best_backend,
        lower_bound=search.lower_bound,
        solve_time_s=search.elapsed(),
    )
