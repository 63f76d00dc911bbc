"""One configuration → its problem → its schedule (the simulator's judgement) → a plan.

The problem is derived from the model and cluster by :func:`pipesched.optimizer.derive.load_problem`
(``tensor_parallel``, ``data_parallel`` and the pipeline of the configuration; the p2p link is the intra- or
inter-node one by where neighbouring pipeline ranks sit), the schedule is the configuration's family generated
and simulated by :func:`pipesched.optimizer.solve.solve_family` (or the ``auto`` search). With data parallelism
(d > 1) the problem carries the step model's collectives (``costs.unshard``/``reduce_grad``/``optimizer_step``,
``memory.weights``/``gradients`` by :mod:`pipesched.optimizer.cost.collectives`), so the plan's step and peak memory
are the simulator's ``step_time`` and ``peak_memory``; the planner's own data-parallel and optimizer estimates
(:mod:`pipesched.optimizer.planner.prune`) only order and prune configurations before simulation, and are
added to the makespan only where the problem has no collectives (d = 1: the optimizer step).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from pipesched.optimizer.bounds import lower_bound
from pipesched.optimizer.cost.flops import model_flops_per_token as flops_per_token
from pipesched.optimizer.derive import UNENFORCED_MEMORY_BYTES, load_problem
from pipesched.optimizer.families import FamilyDomainError, get_family
from pipesched.optimizer.instance import compile_problem
from pipesched.optimizer.ir import parse_action
from pipesched.optimizer.pattern import step_period_lower_bound
from pipesched.optimizer.planner.launch import LaunchError, LaunchSpec, torchrun_command, torchtitan_launch
from pipesched.optimizer.planner.prune import Estimate, Estimator
from pipesched.optimizer.planner.request import Launch, Plan
from pipesched.optimizer.planner.space import Configuration
from pipesched.optimizer.planner.torchtitan_toml import toml_from_args
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.result import Schedule, build_schedule
from pipesched.optimizer.solve import solve, solve_family
from pipesched.optimizer.units import format_bytes

__all__ = [
    "AUTO_SECONDS_PER_THOUSAND_ACTIONS",
    "Evaluation",
    "SimulationCache",
    "build_problem",
    "evaluate",
    "evaluation_seconds",
    "launch_for",
    "launch_spec",
    "model_flops_per_token",
    "peak_memory_interval",
    "schedule_for",
    "schedule_lower_bound",
]

#: Simulated pipelines by configuration without its sharding and by layer partition: (makespan ms, per-rank
#: activation peak bytes, the schedule). Sharding changes only the static memory, not the schedule.
SimulationCache = dict[tuple[Any, ...], tuple[float, list[float], Schedule]]

#: Seconds ``auto`` takes per 1,000 actions within the planner (a family declares its own in its
#: :class:`~pipesched.optimizer.families.PlannerEstimate`): what the search uses to avoid starting an evaluation
#: that cannot end before the deadline.
AUTO_SECONDS_PER_THOUSAND_ACTIONS = 1.0


def _simulates_collectives(problem: Problem) -> bool:
    """Whether the problem carries data-parallel collective costs for the simulator to place (then its
    ``step_time``, where the schedule has one, replaces the planner's own estimate)."""
    costs = problem.costs
    return costs is not None and getattr(costs, "reduce_grad", None) is not None


def evaluation_seconds(config: Configuration) -> float:
    """Predicted seconds to generate and simulate ``config``'s schedule."""
    actions = 3 * config.num_stages * config.num_microbatches
    if config.method == "auto":
        return AUTO_SECONDS_PER_THOUSAND_ACTIONS * actions / 1000
    estimate = get_family(config.method).planner
    per_thousand = estimate.seconds_per_thousand_actions if estimate is not None else AUTO_SECONDS_PER_THOUSAND_ACTIONS
    return per_thousand * actions / 1000


@dataclass
class Evaluation:
    """What evaluating a configuration gave: a plan, or the reason it has none."""

    configuration: Configuration
    plan: Plan | None
    schedule: Schedule | None
    problem: Problem | None
    reason: str | None
    over_memory: bool = False
    source: Schedule | None = None


def model_flops_per_token(estimator: Estimator) -> float:
    """Training FLOPs per token: 6·N + 12·l·h·s with N the active matrices and the LM head (PaLM, Chowdhery et
    al. 2022, App. B; torchtitan's MFU; :func:`pipesched.optimizer.cost.flops.model_flops_per_token`)."""
    return flops_per_token(estimator.model)


def build_problem(
    estimator: Estimator, config: Configuration, time_limit_s: float = 10.0, *, enforce_memory: bool = True
) -> Problem:
    """The scheduling problem of ``config`` (costs and memory derived).

    Args:
        enforce_memory: False derives the problem as if memory were unbounded (a published run to time: it ran).

    Raises:
        pydantic.ValidationError: the model does not fit the configuration (no partition fits memory).
    """
    model = estimator.model_for(config.micro_batch_size, config.activation_recomputation, config.precision)
    stated = estimator.model.layers_per_stage
    if stated is not None and len(stated) == config.pipeline_parallel * config.stages_per_rank:
        model = model.model_copy(update={"layers_per_stage": stated})  # the request's own split, where it applies
    update: dict[str, Any] = {"p2p_bandwidth_bytes_per_s": estimator.pipeline_bandwidth(config)}
    if not enforce_memory:
        update.update(memory_bytes=UNENFORCED_MEMORY_BYTES, memory_headroom_bytes=0.0)
    cluster = estimator.cluster.model_copy(update=update)
    document: dict[str, Any] = {
        "pipeline": {
            "num_ranks": config.pipeline_parallel,
            "num_microbatches": config.num_microbatches,
            "stages_per_rank": config.stages_per_rank,
            "placement": config.placement,
        },
        "model": model.model_dump(mode="json", exclude_none=True),
        "cluster": cluster.model_dump(mode="json", exclude_none=True),
        "solver": {"method": config.method, "time_limit_s": time_limit_s},
    }
    if config.method != "auto" and not get_family(config.method).runs_split_backward:
        document["split_backward"] = False  # as torch's and Megatron's schedules run it (fused B)
    if config.method != "auto" and not get_family(config.method).flush:
        # PipeDream-2BW: no flush, two weight versions; its time per step is the step_period.
        document["training"] = {"flush": False, "weight_versions": 2}
        document["objective"] = "step_period"
    tensor_parallel = estimator.tensor_parallel(config.tensor_parallel)
    if tensor_parallel is not None:
        document["tensor_parallel"] = tensor_parallel.model_dump(mode="json")
    if config.weight_copies > 1:
        document["data_parallel"] = estimator.data_parallel(config).model_dump(mode="json")
    if config.context_parallel > 1:
        document["context_parallel"] = {"size": config.context_parallel}
    if config.expert_parallel > 1:
        document["expert_parallel"] = {
            "size": config.expert_parallel,
            "overlap": estimator.expert_overlap(config),
            "tensor_parallel": config.expert_tensor_parallel,
        }
    return load_problem(document)


def launch_spec(estimator: Estimator, config: Configuration, layers_per_stage: list[int] | None = None) -> LaunchSpec:
    """The launch spec of ``config`` on the estimator's model, cluster and batch."""
    return LaunchSpec(
        model=estimator.model,
        num_nodes=estimator.cluster.num_nodes,
        gpus_per_node=estimator.cluster.gpus_per_node,
        global_batch_size=estimator.global_batch_size,
        sequence_parallel=estimator.sequence_parallel,
        async_tensor_parallel=estimator.async_tensor_parallel,
        layout=config,
        layers_per_stage=tuple(layers_per_stage) if layers_per_stage else None,
    )


def launch_for(estimator: Estimator, config: Configuration, layers_per_stage: list[int] | None = None) -> Launch:
    """torchtitan's options for ``config`` as a TOML job document and as torchtitan ≥ 0.3's argv (one argument a
    line, the CSV at ``schedule.csv``; :mod:`pipesched.optimizer.planner.torchtitan_toml` maps one to the other),
    and the torchrun line that runs it (:mod:`pipesched.optimizer.planner.launch`); ``pipesched launch`` writes
    the argv with the CSV and a job scheduler's file."""
    spec = launch_spec(estimator, config, layers_per_stage)
    try:
        args = torchtitan_launch(spec).args
    except LaunchError as error:
        return Launch(torchtitan=f"# {error}\n", torchtitan_args="", torchrun="")
    torchrun = torchrun_command(spec, ["-m", "torchtitan.train"]) + " $(cat torchtitan.args)"
    return Launch(torchtitan=toml_from_args(args), torchtitan_args="\n".join(args), torchrun=torchrun)


def peak_memory_interval(estimator: Estimator, peak_memory_bytes: float) -> tuple[float, float] | None:
    """The 80% interval of a plan's peak, bytes: ``peak_memory_bytes`` times exp of the profile's held-out
    ``peak_memory_log_error`` (:mod:`pipesched.optimizer.calibration.peaks`); None where the profile has none."""
    errors = estimator.hardware.profile.peak_memory_log_error
    if errors is None:
        return None
    return float(round(peak_memory_bytes * math.exp(errors[0]))), float(round(peak_memory_bytes * math.exp(errors[1])))


def _plan(
    estimator: Estimator,
    config: Configuration,
    estimate: Estimate,
    makespan_ms: float,
    peak_memory_bytes: float,
    bound_ms: float,
    schedule_id: str | None = None,
    layers_per_stage: list[int] | None = None,
) -> Plan:
    step_ms = makespan_ms + estimate.data_parallel_exposed_ms + estimate.optimizer_step_ms
    num_gpus = estimator.cluster.num_gpus
    tokens = estimator.global_batch_size * estimator.model.seq_length
    tokens_per_s_per_gpu = tokens / (step_ms / 1e3) / num_gpus
    mfu = tokens_per_s_per_gpu * model_flops_per_token(estimator) / estimator.hardware.flops_per_s
    low, high = estimator.hardware.profile.held_out_log_error
    if estimator.model.kernels == "unknown":  # the framework's spread on top of the accelerator's
        software = estimator.hardware.software
        unknown_low, unknown_high = software.unknown_interval(
            estimator.sharding_of(config), estimator.model.kernels_prior
        )
        low, high = min(low, unknown_low), max(high, unknown_high)
        low -= estimator.framework_log_spread(config)  # a ring on PyTorch's FlashAttention-2
    # a context- or expert-parallel layout: at least its class's held-out spread (the check rows, never fitted)
    low, high = estimator.hardware.software.layout_log_error(
        (low, high), config.context_parallel, config.expert_parallel
    )
    return Plan(
        pipeline_parallel=config.pipeline_parallel,
        tensor_parallel=config.tensor_parallel,
        # the plan's degree is d; the weights are sharded over its d·c copies (estimator.data_parallel)
        data_parallel=estimator.data_parallel(config).model_copy(update={"size": config.data_parallel_size}),
        stages_per_rank=config.stages_per_rank,
        placement=config.placement,
        micro_batch_size=config.micro_batch_size,
        num_microbatches=config.num_microbatches,
        activation_recomputation=config.activation_recomputation,
        method=config.method,
        precision=config.precision,
        context_parallel=config.context_parallel,
        expert_parallel=config.expert_parallel,
        expert_tensor_parallel=config.expert_tensor_parallel,
        step_time_ms=round(step_ms, 4),
        tokens_per_s_per_gpu=round(tokens_per_s_per_gpu, 2),
        tokens_per_s_per_gpu_interval=(
            round(tokens_per_s_per_gpu * math.exp(low), 2),
            round(tokens_per_s_per_gpu * math.exp(high), 2),
        ),
        mfu=round(mfu, 4),
        peak_memory_bytes=float(round(peak_memory_bytes)),
        peak_memory_bytes_interval=peak_memory_interval(estimator, peak_memory_bytes),
        lower_bound_ms=round(bound_ms, 4),
        schedule_id=schedule_id,
        launch=launch_for(estimator, config, layers_per_stage),
        pipeline_makespan_ms=round(makespan_ms, 4),
        data_parallel_exposed_ms=round(estimate.data_parallel_exposed_ms, 4),
        optimizer_step_ms=round(estimate.optimizer_step_ms, 4),
    )


def evaluate(
    estimator: Estimator,
    config: Configuration,
    estimate: Estimate,
    *,
    time_limit_s: float = 10.0,
    with_bound: bool = False,
    cache: SimulationCache | None = None,
    enforce_memory: bool = True,
) -> Evaluation:
    """Derive, schedule and simulate ``config``; a plan when it fits, else the reason.

    ``with_bound`` adds the scheduling lower bound of :mod:`pipesched.optimizer.bounds` (on the makespan)
    to the configuration's bound; otherwise the plan's bound is the estimator's (:meth:`Estimator.bound_ms`).
    ``enforce_memory=False`` times a configuration whatever its memory (calibration: a published run ran).
    """
    try:
        problem = build_problem(estimator, config, time_limit_s, enforce_memory=enforce_memory)
    except ValidationError as error:
        message = "; ".join(str(item["msg"]).removeprefix("Value error, ") for item in error.errors())
        return Evaluation(config, None, None, None, f"does not fit: {message}", over_memory=True)
    assert problem.model is not None
    static = problem.static_memory
    key = (
        config.pipeline_parallel,
        config.tensor_parallel,
        config.data_parallel_size,
        config.stages_per_rank,
        config.placement,
        config.micro_batch_size,
        config.num_microbatches,
        config.activation_recomputation,
        config.method,
        config.precision,
        config.context_parallel,
        config.expert_parallel,
        config.expert_tensor_parallel,
        tuple(problem.model.layers_per_stage or ()),
        # where the simulator models the data-parallel collectives, sharding changes the schedule too
        config.sharding if _simulates_collectives(problem) else None,
    )
    if cache is not None and key in cache:
        makespan, activation_peaks, schedule = cache[key]
        peaks = [base + extra for base, extra in zip(static, activation_peaks, strict=True)]
    else:
        try:
            if config.method == "auto":
                schedule = solve(problem)
                if schedule.status == "infeasible":
                    reason = schedule.reason or "infeasible"
                    return Evaluation(config, None, schedule, problem, reason, over_memory=True)
            else:
                schedule = solve_family(problem, config.method, enforce_memory=False)
        except FamilyDomainError as error:
            return Evaluation(config, None, None, problem, f"{config.method} does not apply: {error}")
        assert schedule.makespan is not None
        # Without a flush the time per step is the steady state's period, not one copy's span.
        makespan = schedule.step_period if schedule.step_period is not None else schedule.makespan
        peaks = list(schedule.peak_memory)
        if cache is not None:
            cache[key] = (makespan, [peak - base for peak, base in zip(peaks, static, strict=True)], schedule)
    peak = max(peaks) if peaks else 0.0
    limit = estimator.limit_bytes
    if peak > limit and enforce_memory:
        return Evaluation(
            config,
            None,
            schedule,
            problem,
            f"the {config.method} schedule peaks at {format_bytes(peak)} on a rank, over the {format_bytes(limit)} "
            "a GPU offers",
            over_memory=True,
        )
    simulated_step = getattr(schedule, "step_time", None) if _simulates_collectives(problem) else None
    if simulated_step is not None:  # the simulator's step: collectives and optimizer step included
        estimate = dataclasses.replace(estimate, data_parallel_exposed_ms=0.0, optimizer_step_ms=0.0)
        makespan = float(simulated_step)
    bound = max(estimate.bound_ms, estimator.bound_ms(config))
    if with_bound:  # the step adds the estimates to the makespan, or is the simulator's (they are then 0)
        bound = max(
            bound, schedule_lower_bound(problem, estimate.data_parallel_exposed_ms + estimate.optimizer_step_ms)
        )
    plan = _plan(estimator, config, estimate, makespan, peak, bound, schedule.id, problem.model.layers_per_stage)
    # simulated for another sharding: the same orders, rebuilt on this problem on demand (schedule_for)
    own = schedule if schedule.problem == problem else None
    return Evaluation(config, plan, own, problem, None, source=schedule)


def schedule_lower_bound(problem: Problem, added_ms: float = 0.0) -> float:
    """The scheduling lower bound of ``problem``'s step, ms: on the makespan (:mod:`pipesched.optimizer.bounds`)
    plus ``added_ms`` (the planner's data-parallel and optimizer estimates), or without a flush on the
    step_period (:func:`pipesched.optimizer.pattern.step_period_lower_bound`: work, communication stream and
    memory by Little's law; the collectives and optimizer step are in it)."""
    if not problem.training.flush:
        return step_period_lower_bound(problem)
    return lower_bound(compile_problem(problem, step_actions=False), "makespan") + added_ms


def schedule_for(evaluation: Evaluation) -> Schedule | None:
    """The evaluation's schedule on its own problem (rebuilt when it came from the cache)."""
    if evaluation.schedule is not None or evaluation.problem is None:
        return evaluation.schedule
    source = evaluation.source
    if source is None:
        return None
    orders = [[parse_action(item.action) for item in rank.actions] for rank in source.ranks]
    return build_schedule(
        evaluation.problem,
        orders,
        method=source.method,
        backend=source.backend,
        check_memory=False,
        solve_time_s=source.solve_time_s,
    )
