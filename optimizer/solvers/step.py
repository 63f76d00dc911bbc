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
import math
import time

from pipesched.optimizer.bounds import lower_bound as compute_lower_bound
from pipesched.optimizer.communication import add_communication
from pipesched.optimizer.families import applicable_families
from pipesched.optimizer.instance import Instance, compile_for_orders, compile_problem, compute_instance, stage_to_rank
from pipesched.optimizer.ir import Orders, compute_only
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.progress import Progress, ProgressCallback, StopCheck
from pipesched.optimizer.result import Schedule, infeasible_schedule, schedule_from_simulation
from pipesched.optimizer.simulate import InvalidSchedule, SimulationResult, simulate
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
    for stage, rank in enumerate(stage_to_rank(problem)):
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


class _Best:
    def __init__(self) -> None:
        self.orders: Orders | None = None
        self.instance: Instance | None = None
        self.simulation: SimulationResult | None = None
        self.value = math.inf
        self.backend = ""
        self.eval_s = 0.0  # the longest one candidate took (pass + simulation), s


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
    started = time.perf_counter()
    limit_s = problem.solver.time_limit_s
    inst = compile_problem(problem)
    objective = problem.objective
    best = _Best()
    bound: float | None = None

    def elapsed() -> float:
        return time.perf_counter() - started

    def report(message: str) -> None:
        if progress is not None:
            value = None if best.orders is None else best.value
            progress(Progress(value, bound, elapsed(), best.backend or "step", message))

    # Room to build the answer (~20 µs per action on a busy 2-core machine), as the portfolio leaves.
    deadline = limit_s - min(0.3 * limit_s, 0.1 + 3e-5 * len(inst.actions))

    def stop() -> bool:
        """Whether another candidate would overrun the deadline (or the caller asks to stop)."""
        return elapsed() + best.eval_s >= deadline or (should_stop is not None and should_stop())

    def offer(
        orders: Orders, backend: str, prefetches: tuple[int, ...] = PREFETCH_DISTANCES, gather_runs: bool = False
    ) -> None:
        for k, prefetch in enumerate(prefetches):
            if k > 0 and stop():
                return
            began = time.perf_counter()
            try:
                full = add_communication(inst, orders, prefetch=prefetch, gather_runs=gather_runs)
                framed = compile_for_orders(problem, full, base=inst)
                sim: SimulationResult = simulate(framed, full, check_memory=False)
            except InvalidSchedule:
                return
            finally:
                best.eval_s = max(best.eval_s, time.perf_counter() - began)
            if not sim.fits:
                continue
            value = sim.objective_value(objective)
            if value < best.value - 1e-9:
                best.orders, best.simulation, best.value, best.backend = full, sim, value, backend
                best.instance = framed
                report(f"{backend} (prefetch {prefetch}): {value:.3f} ms")

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
            solve_time_s=elapsed(),
        )
    # Every family at the default prefetch first (the guarantee: never worse than a family), then the other
    # prefetch distances while time is left.
    generated: list[tuple[str, Orders, bool]] = []
    for family in applicable_families(problem):
        if generated and stop():
            break
        try:
            generated.append((f"family:{family.name}", family.generate(problem), family.gather_runs))
        except ValueError:
            continue
        offer(generated[-1][1], generated[-1][0], PREFETCH_DISTANCES[:1], generated[-1][2])
    bound = step_lower_bound(problem, inst)
    report("lower bound")
    for backend, orders, gather_runs in generated:
        if stop():
            break
        offer(orders, backend, PREFETCH_DISTANCES[1:], gather_runs)
    remaining = deadline - elapsed() - best.eval_s  # leave room to place the collectives in its answer
    if remaining > 0.05 and not (should_stop is not None and should_stop()):
        proxy = compute_problem(problem, gathered_in_static=True)
        proxy = proxy.model_copy(update={"solver": proxy.solver.model_copy(update={"time_limit_s": remaining})})
        result = solve_auto(proxy, should_stop=should_stop)
        if result.status != "infeasible":
            offer(compute_only(result.orders()), f"compute:{result.backend}")
    if best.orders is None:
        return infeasible_schedule(
            problem,
            method="auto",
            backend="step",
            reason="no schedule with the step's collectives fits memory within the time limit: raise memory.limit",
            min_memory_limit=need,
            solve_time_s=elapsed(),
        )
    assert best.simulation is not None and best.instance is not None
    return schedule_from_simulation(
        problem,
        best.instance,
        best.simulation,
        method="auto",
        backend=best.backend,
        lower_bound=bound,
        solve_time_s=elapsed(),
    )
