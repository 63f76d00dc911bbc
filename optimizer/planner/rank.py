"""The search: enumerate, prune, evaluate the most promising configurations first, rank the plans.

1. :func:`prepare` enumerates the space (:mod:`.space`), estimates every configuration (:mod:`.prune`), drops
   those whose estimated memory exceeds a GPU, and orders the rest by estimated step time. An empty space or
   no configuration that fits is a ``ValidationError`` naming the field to change.
2. :func:`search` simulates them in that order (:mod:`.evaluate`), skipping every configuration whose lower
   bound is no better than the k-th best step found (pruned by bound), until the time limit. Then, with time
   left, the best pipelined configurations are given to the ``auto`` schedule search for a better schedule.
3. The plans come back best first.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass, field

from pipesched.optimizer.cost.flops import model_parameters
from pipesched.optimizer.cost.memory import static_bytes_per_parameter_sharded
from pipesched.optimizer.field_errors import FieldError, raise_field_errors
from pipesched.optimizer.planner.evaluate import (
    Evaluation,
    SimulationCache,
    evaluate,
    evaluation_seconds,
    schedule_for,
    schedule_lower_bound,
)
from pipesched.optimizer.planner.prune import Estimate, Estimator
from pipesched.optimizer.planner.request import Plan, PlanAnswer, PlanRequest, Rejected, Searched
from pipesched.optimizer.planner.space import DIMENSIONS, Configuration, enumerate_space
from pipesched.optimizer.result import Schedule
from pipesched.optimizer.units import format_bytes

__all__ = ["PlanOutcome", "PlanProgress", "Prepared", "plan", "prepare", "search"]

#: The most configurations one request may enumerate (a 512-GPU 405B request has about 8,000).
MAX_CONFIGURATIONS = 100_000
#: The most rejected configurations ``search.explain`` lists.
MAX_EXPLAINED = 200
#: Problems larger than this (stages × microbatches) are not given to the auto search.
AUTO_MAX_STAGE_MICROBATCHES = 2048


@dataclass
class PlanProgress:
    """Where a plan search stands: configurations evaluated of those to evaluate, the best step (ms)."""

    phase: str
    evaluated: int
    total: int
    best_step_ms: float | None
    elapsed_s: float
    plans: list[Plan] = field(default_factory=list)


@dataclass
class Prepared:
    """The pruned, ordered space of a request."""

    request: PlanRequest
    estimator: Estimator
    candidates: list[tuple[Configuration, Estimate]]
    rejected: list[Rejected]
    searched: Searched
    started: float = field(default_factory=time.perf_counter)


@dataclass
class PlanOutcome:
    """The answer and, per returned plan (same order), its schedule."""

    answer: PlanAnswer
    schedules: list[Schedule | None]


def _exists(request: PlanRequest, search_changes: dict[str, None], ignore_batch: bool) -> bool:
    search = request.search.model_copy(update=search_changes)
    space = enumerate_space(
        request.model, request.cluster, request.training.global_batch_size, search, ignore_batch=ignore_batch
    )
    return next(iter(space), None) is not None


def _empty_space_errors(request: PlanRequest) -> list[FieldError]:
    """Why no configuration exists: the batch, or the pins that contradict each other."""
    batch = request.training.global_batch_size
    if _exists(request, {}, ignore_batch=True):
        sizes = sorted(
            {
                config.data_parallel_size * config.micro_batch_size
                for config in itertools.islice(
                    enumerate_space(request.model, request.cluster, batch, request.search, ignore_batch=True),
                    MAX_CONFIGURATIONS,
                )
            }
        )
        nearby = sorted(
            {math.ceil(batch / size) * size for size in sizes} | {max(size, batch // size * size) for size in sizes}
        )
        nearby = sorted(nearby, key=lambda value: abs(value - batch))[:4]
        return [
            (
                ("training", "global_batch_size"),
                f"global batch {batch} is not divisible by data-parallel size × micro-batch size of any "
                f"configuration on {request.cluster.num_gpus} GPUs (those products: "
                f"{', '.join(map(str, sizes[:12]))}): use e.g. {', '.join(map(str, sorted(nearby)))}",
                batch,
            )
        ]
    pinned = [name for name in DIMENSIONS if getattr(request.search, name) is not None]
    culprits = [name for name in pinned if _exists(request, {name: None}, ignore_batch=True)]
    if not pinned:
        return [
            (
                ("cluster",),
                f"no split of {request.cluster.num_gpus} GPUs into tensor × pipeline × data-parallel groups suits "
                f"the model ({request.model.num_layers} layers, {request.model.num_attention_heads} heads)",
                None,
            )
        ]
    named = culprits or pinned
    together = ", ".join(f"search.{name} = {getattr(request.search, name)}" for name in pinned)
    return [
        (
            ("search", name),
            f"search.{name} = {getattr(request.search, name)} admits no configuration together with the other "
            f"pins ({together}) on {request.cluster.num_gpus} GPUs: widen or drop it",
            getattr(request.search, name),
        )
        for name in named
    ]


def _no_fit_error(request: PlanRequest, estimates: list[tuple[Configuration, Estimate]], limit: float) -> FieldError:
    least_config, least = min(estimates, key=lambda item: item[1].peak_memory_bytes)
    parameters = model_parameters(request.model)
    state = parameters * static_bytes_per_parameter_sharded(request.model, "full", 1)
    gpus = math.ceil(state / max(limit, 1.0))
    nodes = math.ceil(gpus / request.cluster.gpus_per_node)
    loc = ("cluster", "accelerator" if request.cluster.accelerator else "memory_bytes")
    return (
        loc,
        f"no configuration fits a GPU's {format_bytes(limit)}: the least any needs is "
        f"{format_bytes(least.peak_memory_bytes)} per GPU (pipeline {least_config.pipeline_parallel}, tensor "
        f"{least_config.tensor_parallel}, data {least_config.data_parallel_size} {least_config.sharding}, "
        f"recomputation {least_config.activation_recomputation}); the model's {parameters / 1e9:.1f}B parameters "
        f"alone need {format_bytes(state)} of weights, gradients and Adam state, at least {gpus} GPUs "
        f"({nodes} nodes) fully sharded: use GPUs with ≥ {format_bytes(least.peak_memory_bytes)}, more nodes, "
        "or a smaller global batch or sequence",
        request.cluster.accelerator or request.cluster.memory_bytes,
    )


def prepare(request: PlanRequest) -> Prepared:
    """Enumerate, estimate and prune ``request``'s space; the fitting configurations best estimate first.

    Raises:
        pydantic.ValidationError: no configuration exists (``training.global_batch_size`` or the ``search``
            pins that contradict each other), or none fits memory (``cluster``, with the least memory and
            GPUs that would do).
    """
    started = time.perf_counter()
    estimator = Estimator(
        request.model,
        request.cluster,
        request.training.global_batch_size,
        sequence_parallel=request.search.sequence_parallel,
    )
    estimator.hardware  # noqa: B018 - resolve the accelerator now: an unknown one is a field error
    configurations = list(
        itertools.islice(
            enumerate_space(request.model, request.cluster, request.training.global_batch_size, request.search),
            MAX_CONFIGURATIONS + 1,
        )
    )
    if len(configurations) > MAX_CONFIGURATIONS:
        raise_field_errors(
            "PlanRequest",
            [
                (
                    ("search",),
                    f"more than {MAX_CONFIGURATIONS:,} configurations on {request.cluster.num_gpus:,} GPUs: pin some "
                    "dimensions in search (tensor_parallel, pipeline_parallel, micro_batch_size, method)",
                    None,
                )
            ],
        )
    if not configurations:
        raise_field_errors("PlanRequest", _empty_space_errors(request))
    estimates = [(config, estimator.estimate(config)) for config in configurations]
    fitting = [(config, estimate) for config, estimate in estimates if estimate.fits]
    rejected = [
        Rejected(configuration=config.as_dict(), reason=estimate.reason or "over memory")
        for config, estimate in estimates
        if not estimate.fits
    ]
    if not fitting:
        raise_field_errors("PlanRequest", [_no_fit_error(request, estimates, estimator.limit_bytes)])
    fitting.sort(key=lambda item: (item[1].estimate_ms, item[1].peak_memory_bytes))
    searched = Searched(enumerated=len(configurations), pruned_memory=len(rejected))
    return Prepared(request, estimator, fitting, rejected, searched, started)


def _kth(steps: list[float], k: int) -> float:
    return sorted(steps)[k - 1] if len(steps) >= k else math.inf


def search(
    prepared: Prepared,
    *,
    progress: Callable[[PlanProgress], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> PlanOutcome:
    """Evaluate ``prepared``'s candidates within ``search.time_limit_s`` (counted from :func:`prepare`'s start)
    and rank the plans (module docstring)."""
    started = prepared.started
    request = prepared.request
    limit_s = request.search.time_limit_s
    deadline = started + limit_s
    top = request.search.top
    estimator = prepared.estimator
    searched = prepared.searched.model_copy()
    rejected = list(prepared.rejected)
    evaluations: list[Evaluation] = []
    first_answer_s: float | None = None
    total = len(prepared.candidates)

    def ranked() -> list[Evaluation]:
        # One plan per configuration: the auto phase may reach a configuration the family phase evaluated.
        done = {item.configuration: item for item in evaluations if item.plan is not None}
        return sorted(done.values(), key=lambda item: (item.plan.step_time_ms, item.plan.peak_memory_bytes))  # type: ignore[union-attr]

    def report(phase: str, evaluated: int) -> None:
        if progress is None:
            return
        best = ranked()[:top]
        progress(
            PlanProgress(
                phase=phase,
                evaluated=evaluated,
                total=total,
                best_step_ms=best[0].plan.step_time_ms if best else None,  # type: ignore[union-attr]
                elapsed_s=time.perf_counter() - started,
                plans=[item.plan for item in best if item.plan is not None],
            )
        )

    def stopped() -> bool:
        return time.perf_counter() >= deadline or (should_stop is not None and should_stop())

    steps: list[float] = []
    cache: SimulationCache = {}
    simulated: set[tuple[object, ...]] = set()
    candidates = list(prepared.candidates)
    # First answer fast: the best-estimated configuration whose schedule is quick to build goes first.
    quick = next((i for i, (config, _) in enumerate(candidates) if evaluation_seconds(config) <= 2.0), None)
    if quick:
        candidates.insert(0, candidates.pop(quick))
    auto_share = 0.0
    if request.search.method is None or "auto" in request.search.method:
        auto_share = 0.25 if any(config.pipeline_parallel > 1 for config, _ in prepared.candidates) else 0.0
    family_deadline = started + limit_s * (1 - auto_share)
    report("search", 0)
    processed = 0
    too_slow = 0
    for config, estimate in candidates:
        if stopped() or (time.perf_counter() >= family_deadline and steps):
            break
        processed += 1
        if estimate.bound_ms >= _kth(steps, top):
            searched.pruned_bound += 1
            continue
        remaining = deadline - time.perf_counter()
        pipeline_key = (*astuple(config)[:3], *astuple(config)[4:])
        if pipeline_key not in simulated and 2 * evaluation_seconds(config) > remaining:
            too_slow += 1  # its schedule cannot be built before the deadline
            continue
        simulated.add(pipeline_key)
        evaluation = evaluate(estimator, config, estimate, time_limit_s=min(max(0.5, remaining), 10.0), cache=cache)
        searched.solved += 1
        evaluations.append(evaluation)
        if evaluation.plan is None:
            if evaluation.over_memory:
                searched.pruned_memory += 1
            rejected.append(Rejected(configuration=config.as_dict(), reason=evaluation.reason or "no schedule"))
        else:
            steps.append(evaluation.plan.step_time_ms)
            if first_answer_s is None:
                first_answer_s = time.perf_counter() - started
        report("search", processed)
    searched.unexplored = total - processed + too_slow

    # The auto schedule search on the best pipelined configurations, with the time left.
    auto_allowed = request.search.method is None or "auto" in request.search.method
    best_pipelined = [item for item in ranked() if item.configuration.pipeline_parallel > 1][:2] if auto_allowed else []
    for item in best_pipelined:
        remaining = deadline - time.perf_counter()
        config = item.configuration
        if remaining < 2.0 or (should_stop is not None and should_stop()):
            break
        if config.num_stages * config.num_microbatches > AUTO_MAX_STAGE_MICROBATCHES or config.method == "auto":
            continue
        auto_config = dataclasses.replace(config, method="auto")
        if any(item.configuration == auto_config for item in evaluations):
            continue  # evaluated already (auto was named, or two families of one layout led)
        estimate = estimator.estimate(auto_config)
        if evaluation_seconds(auto_config) > remaining / 2:
            continue
        evaluation = evaluate(estimator, auto_config, estimate, time_limit_s=max(1.0, remaining / 2 - 1.0))
        searched.solved += 1
        if evaluation.plan is not None:
            evaluations.append(evaluation)
            report("auto", total)

    best = ranked()[:top]
    # Each returned plan gets the scheduling lower bound of its own problem.
    plans: list[Plan] = []
    schedules: list[Schedule | None] = []
    for item in best:
        assert item.plan is not None
        plan_bound = item.plan
        if item.problem is not None and time.perf_counter() + evaluation_seconds(item.configuration) < deadline:
            added = item.plan.data_parallel_exposed_ms + item.plan.optimizer_step_ms
            bound = max(item.plan.lower_bound_ms, schedule_lower_bound(item.problem, added))
            plan_bound = item.plan.model_copy(update={"lower_bound_ms": round(min(bound, item.plan.step_time_ms), 4)})
        plans.append(plan_bound)
        schedules.append(schedule_for(item))  # simulation only: the orders are kept
    if not plans and not rejected:
        rejected.append(Rejected(configuration={}, reason="the time limit ended the search before any evaluation"))
    answer = PlanAnswer(
        status="done",
        plans=plans,
        searched=searched,
        explain=rejected[:MAX_EXPLAINED] if request.search.explain else None,
        elapsed_s=round(time.perf_counter() - started, 3),
        first_answer_s=round(first_answer_s, 3) if first_answer_s is not None else None,
        error=None if plans else _no_plan_reason(rejected, searched),
    )
    report("done", total)
    return PlanOutcome(answer, schedules)


def _no_plan_reason(rejected: list[Rejected], searched: Searched) -> str:
    sample = "; ".join(item.reason for item in rejected[:3])
    return (
        f"no configuration gave a schedule that fits ({searched.solved} simulated, {searched.pruned_memory} over "
        f"memory, {searched.unexplored} left when the time ran out): {sample}; raise search.time_limit_s or use "
        "GPUs with more memory"
    )


def plan(
    request: PlanRequest,
    *,
    progress: Callable[[PlanProgress], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> PlanOutcome:
    """:func:`prepare` then :func:`search`.

    Raises:
        pydantic.ValidationError: as :func:`prepare`.
    """
    return search(prepare(request), progress=progress, should_stop=should_stop)
