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
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import astuple, dataclass, field
from typing import Any

from pipesched.optimizer.configs import ModelConfig
from pipesched.optimizer.cost.flops import active_parameters, model_parameters
from pipesched.optimizer.cost.memory import static_bytes_per_parameter_sharded
from pipesched.optimizer.cost.profile import (
    ANY_KERNELS_CLASS,
    MODEL_PARALLEL,
    layout_sharding,
    parallel_class,
    sharding_class,
    unknown_kernels_class,
)
from pipesched.optimizer.field_errors import FieldError, raise_field_errors
from pipesched.optimizer.frameworks import FRAMEWORKS, framework_kernels
from pipesched.optimizer.planner.evaluate import (
    Evaluation,
    SimulationCache,
    evaluate,
    evaluation_seconds,
    schedule_for,
    schedule_lower_bound,
)
from pipesched.optimizer.planner.prune import Estimate, Estimator
from pipesched.optimizer.planner.request import Plan, PlanAnswer, PlanRequest, PlanSearch, Rejected, Searched
from pipesched.optimizer.planner.space import DIMENSIONS, Configuration, enumerate_space
from pipesched.optimizer.progress import SearchContext
from pipesched.optimizer.result import Schedule
from pipesched.optimizer.units import format_bytes

__all__ = [
    "PlanOutcome",
    "PlanProgress",
    "Prepared",
    "estimator_for",
    "out_of_memory_chance",
    "plan",
    "plan_notes",
    "prepare",
    "reserved_limit_bytes",
    "search",
    "space_of",
]

#: The most configurations one request estimates (a 512-GPU 405B request has about 17,000; Qwen3-235B at 131K
#: tokens on 256 GPUs, with context and expert parallelism, about 200,000): a larger space is sampled.
MAX_CONFIGURATIONS = 100_000
#: The most one request may enumerate before it must pin dimensions.
MAX_ENUMERATED = 1_000_000
#: Share of ``search.time_limit_s`` enumerating the space may take (:func:`prepare`): past it the enumeration stops
#: where it is and the answer says so in its notes (idle, 100,000 configurations take about 0.4 s here).
ENUMERATE_SHARE = 0.25
#: Share of ``search.time_limit_s`` the estimates of the enumerated configurations may take (the rest is for
#: simulating them); a space larger than that is sampled (:func:`_estimate_within`).
ESTIMATE_SHARE = 0.4
#: Spaces larger than this are estimated in a seeded random order.
SHUFFLE_ABOVE = 20_000
#: The most rejected configurations ``search.explain`` lists.
MAX_EXPLAINED = 200
#: Configurations whose estimated peak memory exceeds a GPU's limit by at most this share are simulated all the same
#: (the simulated schedule's peak decides; :func:`~pipesched.optimizer.planner.evaluate.evaluate` refuses one over
#: the limit): the estimate is not a bound. It read 77.6 GiB (3.5% over) for Qwen3-30B-A3B on 8 H100s at PP 2 ×
#: EP 4 × DP 4 with DualPipeV, micro-batch 2, full recomputation, which the simulator peaks at 73.3 GiB of the 75
#: GiB a GPU offers, and 11,495 tok/s/GPU: the free search's best had been 10,925 (bench/published_vs_free.py).
#: Of the configurations estimated up to 10% over, 12–44% fitted when simulated (Llama 3.1 8B and Qwen3-30B-A3B on
#: 8 H100s, Nemotron-4 340B on 128). The extra simulations take time from the rest of a time-bound search: 405B on
#: 512 GPUs returned 225 tok/s/GPU (228 before, 225 in docs/PLANNER.md's bench), Nemotron-4 340B 272 at 10%, 274 at
#: 5% (277 before): 5%, which still reaches the Qwen layout. Those within the slack only are simulated after every
#: configuration that fits by the estimate (:func:`prepare`): Nemotron-4 340B 273 → 280 in one session, the Qwen
#: layout still reached, 405B 230, DeepSeek-V3 2,191 (bench/results/published_vs_free_memory_slack.md).
MEMORY_ESTIMATE_SLACK = 0.05
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
    notes: list[str] = field(default_factory=list)


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
    pinned = [name for name in DIMENSIONS if getattr(request.search, name) is not None]
    if _exists(request, {}, ignore_batch=True):
        # the pins agree with each other, not with the batch: name the batch and each pin whose removal lets it through
        per_sequence = request.search.num_microbatches is not None  # then the pinned count multiplies the product
        sizes = sorted(
            {
                config.data_parallel_size * config.micro_batch_size * (config.num_microbatches if per_sequence else 1)
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
        product = "data-parallel size × micro-batch size" + (
            f" × microbatches (search.num_microbatches = {request.search.num_microbatches})" if per_sequence else ""
        )
        errors: list[FieldError] = [
            (
                ("training", "global_batch_size"),
                f"global batch {batch} is not divisible by {product} of any configuration on "
                f"{request.cluster.num_gpus} GPUs (those products: {', '.join(map(str, sizes[:12]))}): use e.g. "
                f"{', '.join(map(str, sorted(nearby)))}",
                batch,
            )
        ]
        return errors + [
            _pin_error(request, name, f" with global batch {batch}", "", " (or change the batch)", ignore_batch=False)
            for name in pinned
            if _exists(request, {name: None}, ignore_batch=False)
        ]
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
    together = ", ".join(f"search.{name} = {getattr(request.search, name)}" for name in pinned)
    others = f" together with the other pins ({together})" if len(pinned) > 1 else ""
    if not culprits:
        return [
            (
                ("search", name),
                f"search.{name} = {getattr(request.search, name)} admits no configuration{others} on "
                f"{request.cluster.num_gpus} GPUs: widen or drop it",
                getattr(request.search, name),
            )
            for name in pinned
        ]
    return [_pin_error(request, name, others, f" ({_degree_reason(request, name)})") for name in culprits]


def _pin_error(
    request: PlanRequest, name: str, context: str, reason: str, tail: str = "", ignore_batch: bool = True
) -> FieldError:
    """Pinned search dimension ``name`` admits no configuration (``context``: beside what; ``reason``: why): the
    values it could take instead."""
    value = getattr(request.search, name)
    return (
        ("search", name),
        f"search.{name} = {value} admits no configuration{context} on {request.cluster.num_gpus} GPUs{reason}: use "
        f"values among {_admitted_values(request, name, ignore_batch=ignore_batch)}, or drop it{tail}",
        value,
    )


def _admitted_values(request: PlanRequest, name: str, ignore_batch: bool = True) -> list[Any]:
    """The values of search dimension ``name`` some configuration takes when it is not pinned (the others are;
    the global batch too unless ``ignore_batch``)."""
    search = request.search.model_copy(update={name: None})
    space = enumerate_space(
        request.model, request.cluster, request.training.global_batch_size, search, ignore_batch=ignore_batch
    )
    return sorted({getattr(config, name) for config in itertools.islice(space, MAX_CONFIGURATIONS)})


def _degree_reason(request: PlanRequest, name: str) -> str:
    """Why a pinned parallel degree fits no configuration, where the GPU count says it: else what was asked."""
    degrees = getattr(request.search, name) or []
    gpus, per_node = request.cluster.num_gpus, request.cluster.gpus_per_node
    if name in ("pipeline_parallel", "tensor_parallel", "data_parallel_size", "context_parallel", "expert_parallel"):
        if all(isinstance(degree, int) and degree > gpus for degree in degrees):
            return f"{' or '.join(map(str, degrees))} is more than the {gpus} GPUs"
        if not any(isinstance(degree, int) and gpus % degree == 0 for degree in degrees):
            return f"{' or '.join(map(str, degrees))} does not divide the {gpus} GPUs"
        if name == "tensor_parallel" and not any(per_node % degree == 0 for degree in degrees):
            return f"tensor parallelism stays within a node of {per_node} GPUs"
    return (
        "given the other pins"
        if sum(getattr(request.search, other) is not None for other in DIMENSIONS) > 1
        else "for this model"
    )


def _no_fit_error(
    request: PlanRequest, estimates: list[tuple[Configuration, Estimate]], estimator: Estimator
) -> FieldError:
    """No configuration fits: the memory a GPU offers (its memory less the headroom kept free, both stated), the
    least any configuration needs, and the GPU memory that would hold it (that need plus the headroom the same
    rule keeps free on such a GPU)."""
    least_config, least = min(estimates, key=lambda item: item[1].peak_memory_bytes)
    limit, headroom = estimator.limit_bytes, estimator.headroom_bytes
    parameters = model_parameters(request.model)
    state = parameters * static_bytes_per_parameter_sharded(
        request.model, "full", 1, gradient_bytes=estimator.gradient_bytes, full_state=estimator.full_state("full")
    )
    gpus = math.ceil(state / max(limit, 1.0))
    nodes = math.ceil(gpus / request.cluster.gpus_per_node)
    loc = _memory_field(request)
    rule = "cluster.memory_headroom_bytes"
    if request.cluster.memory_headroom_bytes is None:
        profile = estimator.hardware.profile
        fraction, context = profile.memory_headroom_fraction, format_bytes(profile.context_bytes)
        rule += f" not given: {fraction:.0%} of the memory + {context}"
    return (
        loc,
        f"no configuration fits the {format_bytes(limit)} a GPU offers "
        f"({format_bytes(estimator.hardware.memory_bytes)} less {format_bytes(headroom)} kept free, {rule}): the "
        f"least any needs is {format_bytes(least.peak_memory_bytes)} per GPU ({_described(least_config)}); the "
        f"model's {parameters / 1e9:.1f}B parameters alone need {format_bytes(state)} of weights, gradients and Adam "
        f"state, at least {gpus} GPUs ({nodes} node{'s' if nodes > 1 else ''}) fully sharded: use GPUs with ≥ "
        f"{_gpu_memory_for(request, estimator, least.peak_memory_bytes)} (that need and the headroom kept free on "
        "them), more nodes, or a smaller global batch or sequence",
        request.cluster.memory_bytes if loc[1] == "memory_bytes" else request.cluster.accelerator,
    )


def _described(config: Configuration) -> str:
    """A configuration's degrees, micro-batches and recomputation in the plan's field terms."""
    degrees = [f"pipeline {config.pipeline_parallel}", f"tensor {config.tensor_parallel}"]
    degrees += [
        f"{name} {value}"
        for name, value in (("context", config.context_parallel), ("expert", config.expert_parallel))
        if value > 1
    ]
    if config.expert_parallel > 1 and config.expert_tensor_parallel > 1:
        degrees.append(f"expert tensor {config.expert_tensor_parallel}")
    return (
        f"{', '.join(degrees)}, data {config.data_parallel_size} {config.sharding}, micro-batch "
        f"{config.micro_batch_size} × {config.num_microbatches}, recomputation {config.activation_recomputation}"
    )


def _gpu_memory_for(request: PlanRequest, estimator: Estimator, need_bytes: float) -> str:
    """The GPU memory whose share a plan may use (less the headroom: ``cluster.memory_headroom_bytes``, else the
    profile's fraction of the memory and context) holds ``need_bytes``, rounded up to 0.01 GiB."""
    if request.cluster.memory_headroom_bytes is not None:
        memory = need_bytes + request.cluster.memory_headroom_bytes
    else:
        memory = estimator.hardware.profile.memory_holding(need_bytes)
    gib = 1024**3
    return f"{math.ceil(memory / gib * 100) / 100:,.2f} GiB"


def _memory_field(request: PlanRequest) -> tuple[str, str]:
    """The field that sets a GPU's memory: ``cluster.memory_bytes`` when given (it overrides the catalogue's
    figure), else ``cluster.accelerator``."""
    explicit = request.cluster.memory_bytes is not None or not request.cluster.accelerator
    return ("cluster", "memory_bytes" if explicit else "accelerator")


def _no_room_error(request: PlanRequest, memory_bytes: float, headroom: float) -> FieldError:
    """A GPU whose memory the headroom takes whole (the schedule's cost model refuses the same)."""
    loc = _memory_field(request)
    return (
        loc,
        f"a GPU's {format_bytes(memory_bytes)} leaves nothing once the headroom (cluster.memory_headroom_bytes) of "
        f"{format_bytes(headroom)} is kept free: give cluster.memory_bytes in bytes (an H100 has 80e9), or a "
        f"headroom below {format_bytes(memory_bytes)}",
        request.cluster.memory_bytes if loc[1] == "memory_bytes" else request.cluster.accelerator,
    )


def estimator_for(request: PlanRequest) -> Estimator:
    """The estimator of ``request``: its model, cluster and global batch, sequence parallelism, tensor-parallel
    overlap and gradient reduction's dtype (what ``prepare`` and a plan's launch files rebuild the plan's problem
    with)."""
    return Estimator(
        _execution(request),
        request.cluster,
        request.training.global_batch_size,
        sequence_parallel=request.search.sequence_parallel,
        async_tensor_parallel=request.training.async_tensor_parallel,
        reduce_dtype=request.training.gradient_reduce_dtype,
    )


def _execution(request: PlanRequest) -> ModelConfig:
    """The model with the training's precision, framework and kernels mode (``training.*`` over ``model.*``; a
    framework's own kernels where none are said: :func:`~pipesched.optimizer.frameworks.framework_kernels`)."""
    training = request.training
    update = {
        name: value
        for name, value in (
            ("precision", training.precision),
            ("kernels", training.kernels),
            ("framework", training.framework),
        )
        if value is not None
    }
    framework = training.framework or request.model.framework
    if framework is not None:
        update["kernels"] = framework_kernels(framework, update.get("kernels", request.model.kernels))
    return request.model.model_copy(update=update) if update else request.model


def _precision_errors(request: PlanRequest, estimator: Estimator) -> list[FieldError]:
    """FP8 asked of an accelerator without FP8 tensor cores."""
    if estimator.hardware.fp8_flops_per_s is not None:
        return []
    asked = [("training", "precision")] if estimator.model.precision == "fp8" else []
    if request.search.precision and "fp8" in request.search.precision:
        asked.append(("search", "precision"))
    return [
        (
            loc,
            f"{estimator.hardware.name} has no FP8 tensor cores: use bf16, or an accelerator with FP8 (H100-SXM, "
            "H100-PCIe, H200, B200, MI300X, MI325X, MI355X, MI350X, L40S)",
            "fp8",
        )
        for loc in asked
    ]


def _one_framework_prior(estimator: Estimator, configurations: list[Configuration]) -> None:
    """Kernels "unknown" over a search whose layouts span several layout classes: every configuration takes the
    frameworks of every published run of the search's sharding classes (``kernels_prior`` "any" over FSDP and
    replicated weights; within one sharding class, that class whether or not a layout has model parallelism), not
    those that publish its own class — the framework a user runs does not change with the layout the planner
    picks, so no layout may be favoured for the frameworks that publish it. A search within one class (a pinned
    layout) keeps that class's prior."""
    model = estimator.model
    if model.kernels != "unknown" or model.kernels_prior is not None:
        return
    classes = {unknown_kernels_class(estimator.sharding_of(c)) for c in configurations}
    if len(classes) > 1:
        shardings = {sharding_class(name) for name in classes}
        prior = shardings.pop() if len(shardings) == 1 else ANY_KERNELS_CLASS
        estimator.model = model.model_copy(update={"kernels_prior": prior})


#: A plan of kernels not said sized as Megatron-Core's (fused kernels: replicated weights with model parallelism)
#: whose default launch is torchtitan's: that runs it on PyTorch's own kernels, whose activations the plan's peak
#: does not bound, and ZeRO-1/2 as FSDP with the weights kept gathered (torchtitan shards optimizer state only with
#: the weights, FSDP2's ``fully_shard``): docs/CALIBRATION.md, "Who can run a layout, for its memory".
_FUSED_LAUNCH_NOTE = (
    "its peak memory is Megatron-Core's (fused kernels): run it with `pipesched launch --target megatron`; the "
    "torchtitan launch runs it on PyTorch's own kernels (ZeRO-1/2 as FSDP), which hold more activation memory than "
    "this plan counts"
)


def _framework_note(estimator: Estimator) -> str:
    """What the plans assumed of the framework named (``model.framework``): its kernels, the bytes per parameter it
    keeps fully sharded, the software-profile fields it runs and the gradient reduction's dtype (said, or its
    default: :attr:`~pipesched.optimizer.frameworks.Framework.gradient_reduce_dtype`)."""
    model = estimator.model
    assert model.framework is not None
    framework = FRAMEWORKS[model.framework]
    state = estimator.full_state("full")
    per_parameter = static_bytes_per_parameter_sharded(
        model, "full", 1, gradient_bytes=estimator.gradient_bytes, full_state=state
    )
    own = " (its own)" if model.kernels == framework.kernels else ""
    runs = ", ".join(f"{name} {value}" for name, value in framework.software.items())
    schedules = f"; it runs the schedules {', '.join(framework.methods)}" if framework.methods is not None else ""
    reduce = f"; gradients reduced in {estimator.reduce_dtype}"
    if estimator.reduce_dtype == framework.gradient_reduce_dtype:
        reduce += f" (its default{': ' + framework.reduce_hint if framework.reduce_hint else ''})"
    return (
        f"training.framework {framework.name} ({framework.title}): {model.kernels} kernels{own}; fully sharded "
        f"state {per_parameter:g} B per parameter over the data-parallel group ({state}); {runs}{schedules}{reduce}"
    )


def out_of_memory_chance(peak_bytes: float, limit_bytes: float, log_error: tuple[float, float]) -> float:
    """How likely a plan's real peak passes ``limit_bytes``, by its 80% interval alone: the share of
    log(real / predicted) above log(limit / peak), linear between the interval's 10th and 90th percentiles
    (``log_error``), 0.9 below it and 0.1 above (a plan's note says which side; no distribution is assumed beyond
    the two percentiles)."""
    low, high = log_error
    margin = math.log(limit_bytes / peak_bytes)
    if margin <= low:
        return 0.9
    if margin >= high:
        return 0.1
    return 0.9 - 0.8 * (margin - low) / (high - low)


def reserved_limit_bytes(estimator: Estimator) -> float:
    """The memory a run's *reserved* peak may reach (bytes): the GPU's less the CUDA context and communication
    buffers the caching allocator does not see (the profile's ``context_bytes``, or a smaller stated
    ``cluster.memory_headroom_bytes``). The peak interval is of the reserved peak (torchtitan's
    ``reserved_bytes.all.peak``, which holds the allocator's cached and fragmented blocks), so it is read against
    this limit, not against memory less the whole headroom, whose fraction is kept for that same fragmentation."""
    return estimator.hardware.memory_bytes - min(estimator.headroom_bytes, estimator.hardware.profile.context_bytes)


def _memory_risk_note(answer_plans: list[Plan], estimator: Estimator) -> str | None:
    """The plans whose reserved-peak interval's high end passes :func:`reserved_limit_bytes`, each with how likely
    by the interval (:func:`out_of_memory_chance`); None when none does. They stay ranked: the point estimate fits
    the memory less the headroom."""
    log_error = estimator.hardware.profile.peak_memory_log_error
    limit = reserved_limit_bytes(estimator)
    risky = [
        (rank, plan)
        for rank, plan in enumerate(answer_plans, 1)
        if log_error is not None and plan.peak_memory_bytes_interval and plan.peak_memory_bytes_interval[1] > limit
    ]
    if not risky or log_error is None:
        return None
    parts = []
    for rank, plan in risky:
        _, high = plan.peak_memory_bytes_interval or (0.0, 0.0)
        chance = out_of_memory_chance(plan.peak_memory_bytes, limit, log_error)
        said = "over 90%" if chance >= 0.9 else f"about {chance:.0%}"
        parts.append(f"{rank} ({format_bytes(plan.peak_memory_bytes)}, reserved up to {format_bytes(high)}: {said})")
    return (
        f"peak memory: the 80% interval of the reserved peak (allocated memory plus the allocator's cache) passes "
        f"the {format_bytes(limit)} the allocator can have ({format_bytes(estimator.hardware.memory_bytes)} less "
        f"the CUDA context) for plan{'s' if len(parts) > 1 else ''} {', '.join(parts)}; the percentages say how "
        "likely each reaches it by the interval (linear between its 10th and 90th percentiles), where PyTorch's "
        "allocator frees its cache and retries (slower steps) or runs out of memory. The predicted peak fits the "
        "memory less the headroom, so each stays ranked; raise cluster.memory_headroom_bytes to rank only plans "
        "whose interval fits"
    )


def plan_notes(answer_plans: list[Plan], estimator: Estimator) -> list[str]:
    """What to know before acting on ``answer_plans``: the best plan's predicted MFU above the highest MFU the
    calibration data measured on this accelerator in its precision, an uncalibrated accelerator, the interval
    of a context- or expert-parallel best plan (its class's), and the plans whose peak interval passes the GPU's
    memory less the headroom (:func:`_memory_risk_note`)."""
    profile = estimator.hardware.profile
    notes = [] if estimator.model.framework is None else [_framework_note(estimator)]
    memory_risk = _memory_risk_note(answer_plans, estimator)
    if memory_risk is not None:
        notes.append(memory_risk)
    if profile.fitted_rows == 0:
        notes.append(
            f"{estimator.hardware.name}: no profile fitted to its own rows ({profile.source}); the interval is wide"
        )
    if answer_plans and estimator.model.kernels == "unknown":
        best = answer_plans[0]
        degrees = (best.tensor_parallel, best.pipeline_parallel, best.context_parallel, best.expert_parallel)
        copies = best.data_parallel.size * best.context_parallel
        sharding = layout_sharding(best.data_parallel.sharding, copies, *degrees)
        shares = estimator.hardware.software.kernels_shares("unknown", sharding, estimator.model.kernels_prior)
        mix = ", ".join(f"{mode} {share:.0%}" for mode, share in shares.items())
        name = unknown_kernels_class(sharding, estimator.model.kernels_prior)
        whose = {"full": "published FSDP runs", "replicated": "published runs with replicated weights"}.get(
            sharding_class(name), "all published runs"
        )
        if name.endswith(MODEL_PARALLEL):
            whose += " with model parallelism"
        notes.append(
            f"training.kernels not said: each figure is the expected time over the frameworks of {whose} ({mix}); "
            "say training.kernels (eager, compiled, fused) for your framework's figure"
        )
        if set(shares) == {"fused"}:
            notes.append(_FUSED_LAUNCH_NOTE)
    if answer_plans:
        best = answer_plans[0]
        layout_class = parallel_class(best.context_parallel, best.expert_parallel)
        errors = estimator.hardware.software.parallel_log_error
        if layout_class in errors:
            low, high = errors[layout_class]
            notes.append(
                f"the best plan is {layout_class}: its 80% interval (tokens_per_s_per_gpu_interval) is at least "
                f"that of the published {layout_class} check runs, log(published / predicted) {low:+.2f} to "
                f"{high:+.2f} (never fitted), united with {estimator.hardware.name}'s held-out interval of dense runs"
            )
        measured = profile.max_measured_mfu.get(best.precision)
        if measured is not None and best.mfu > measured:
            notes.append(
                f"the best plan's predicted MFU {best.mfu:.1%} is above the highest MFU measured on "
                f"{estimator.hardware.name} in {best.precision} in the calibration data ({measured:.1%}): treat "
                "it as optimistic"
            )
    return notes


def prepare(request: PlanRequest) -> Prepared:
    """Enumerate, estimate and prune ``request``'s space; the fitting configurations best estimate first.

    Raises:
        pydantic.ValidationError: no configuration exists (``training.global_batch_size`` or the ``search``
            pins that contradict each other), or none fits memory (``cluster``, with the least memory and
            GPUs that would do).
    """
    started = time.perf_counter()
    estimator = estimator_for(request)
    hardware = estimator.hardware  # resolve the accelerator now: an unknown one is a field error
    if estimator.limit_bytes <= 0:
        raise_field_errors("PlanRequest", [_no_room_error(request, hardware.memory_bytes, estimator.headroom_bytes)])
    raise_field_errors("PlanRequest", _precision_errors(request, estimator))
    configurations, cut = _enumerate_within(request, estimator, started + ENUMERATE_SHARE * request.search.time_limit_s)
    if len(configurations) > MAX_ENUMERATED:
        raise_field_errors(
            "PlanRequest",
            [
                (
                    ("search",),
                    f"more than {MAX_ENUMERATED:,} configurations on {request.cluster.num_gpus:,} GPUs: pin some "
                    "dimensions in search (tensor_parallel, pipeline_parallel, micro_batch_size, method)",
                    None,
                )
            ],
        )
    if not configurations:
        raise_field_errors("PlanRequest", _empty_space_errors(request))
    _one_framework_prior(estimator, configurations)
    enumerated = len(configurations)
    if enumerated > MAX_CONFIGURATIONS:
        configurations = random.Random(0).sample(configurations, MAX_CONFIGURATIONS)
    estimates = _estimate_within(estimator, configurations, started + ESTIMATE_SHARE * request.search.time_limit_s)
    near = estimator.limit_bytes * (1 + MEMORY_ESTIMATE_SLACK)  # the simulator's peak decides up to here
    fitting = [(config, estimate) for config, estimate in estimates if estimate.peak_memory_bytes <= near]
    over = [(config, estimate) for config, estimate in estimates if estimate.peak_memory_bytes > near]
    rejected = [
        Rejected(configuration=config.as_dict(), reason=estimate.reason or "over memory")
        for config, estimate in over[:MAX_EXPLAINED]
    ]
    if not fitting:
        raise_field_errors("PlanRequest", [_no_fit_error(request, estimates, estimator)])
    # those that fit by the estimate first, then those only within the slack (each best estimate first)
    fitting.sort(key=lambda item: (not item[1].fits, item[1].estimate_ms, item[1].peak_memory_bytes))
    searched = Searched(enumerated=enumerated, pruned_memory=len(over), unexplored=enumerated - len(estimates))
    notes = []
    if len(estimates) < len(configurations):  # the estimates' share of the time ran out
        order = "a seeded random sample" if len(configurations) > SHUFFLE_ABOVE else "in the order enumerated"
        notes.append(
            f"the estimates stopped at {ESTIMATE_SHARE:.0%} of search.time_limit_s after {len(estimates):,} of "
            f"{len(configurations):,} configurations ({order}): {len(configurations) - len(estimates):,} were never "
            "estimated or simulated; raise search.time_limit_s or pin dimensions in search (tensor_parallel, "
            "pipeline_parallel, micro_batch_size, method)"
        )
    if cut:
        largest = max(config.tensor_parallel for config in configurations)
        notes.append(
            f"the space's enumeration stopped at {ENUMERATE_SHARE:.0%} of search.time_limit_s after "
            f"{enumerated:,} configurations (tensor_parallel up to {largest}): the rest was never estimated; pin "
            "dimensions in search (tensor_parallel, pipeline_parallel, micro_batch_size, method) or raise "
            "search.time_limit_s"
        )
    return Prepared(request, estimator, fitting, rejected, searched, started, notes)


def _plan_search(request: PlanRequest) -> PlanSearch:
    """``request.search``, its ``method`` the schedules the framework runs where the request pins none
    (:attr:`~pipesched.optimizer.frameworks.Framework.methods`: Megatron's 1F1B and interleaved 1F1B)."""
    name = request.training.framework or request.model.framework
    methods = FRAMEWORKS[name].methods if name is not None else None
    if methods is None or request.search.method is not None:
        return request.search
    return request.search.model_copy(update={"method": list(methods)})


def space_of(request: PlanRequest, estimator: Estimator) -> Iterator[Configuration]:
    """Every configuration ``request`` allows (:func:`enumerate_space`; the framework's schedules,
    :func:`_plan_search`), at the precision of ``estimator``'s model (``training.precision``) where
    ``search.precision`` does not list several."""
    return enumerate_space(
        estimator.model,
        request.cluster,
        request.training.global_batch_size,
        _plan_search(request),
        precision=estimator.model.precision,
    )


def _enumerate_within(request: PlanRequest, estimator: Estimator, deadline: float) -> tuple[list[Configuration], bool]:
    """The request's configurations (:func:`enumerate_space`), at most ``MAX_ENUMERATED`` + 1, and whether the
    deadline (a ``time.perf_counter()`` instant) stopped the enumeration first. At least one configuration is
    enumerated when the space has any; the clock is read every 4,096."""
    space = space_of(request, estimator)
    configurations: list[Configuration] = []
    for config in itertools.islice(space, MAX_ENUMERATED + 1):
        configurations.append(config)
        if len(configurations) % 4096 == 0 and time.perf_counter() >= deadline:
            return configurations, next(space, None) is not None
    return configurations, False


def _estimate_within(
    estimator: Estimator, configurations: list[Configuration], deadline: float
) -> list[tuple[Configuration, Estimate]]:
    """Every configuration's estimate, or, when the deadline comes first, those of a seeded random sample (so a
    large space cut short is not biased to the dimensions enumerated first). At least one is estimated."""
    order = list(configurations)
    if len(order) > SHUFFLE_ABOVE:
        random.Random(0).shuffle(order)
    estimates = []
    for index, config in enumerate(order):
        if index and index % 256 == 0 and time.perf_counter() >= deadline:
            break
        estimates.append((config, estimator.estimate(config)))
    return estimates


def _pipeline_key(config: Configuration) -> tuple[object, ...]:
    """The configuration without its data-parallel sharding: what its schedule's passes depend on."""
    return (*astuple(config)[:3], *astuple(config)[4:])


def _kth(steps: list[float], k: int) -> float:
    return sorted(steps)[k - 1] if len(steps) >= k else math.inf


class _PlanSearch(SearchContext[Evaluation]):
    """One plan search: the shared :class:`~pipesched.optimizer.progress.SearchContext` (clock, deadline, stop
    flag; the incumbent is the best plan) with the evaluations, the rejections and the counts so far."""

    def __init__(
        self,
        prepared: Prepared,
        progress: Callable[[PlanProgress], None] | None,
        should_stop: Callable[[], bool] | None,
    ) -> None:
        limit_s = prepared.request.search.time_limit_s
        super().__init__(prepared.started, prepared.started + limit_s, None, should_stop, stop_at_bound=False)
        self.prepared = prepared
        self.plan_progress = progress
        self.top = prepared.request.search.top
        self.searched = prepared.searched.model_copy()
        self.rejected = list(prepared.rejected)
        self.evaluations: list[Evaluation] = []
        self.first_answer_s: float | None = None
        self.total = len(prepared.candidates)
        self.steps: list[float] = []
        self.cache: SimulationCache = {}
        self.simulated: set[tuple[object, ...]] = set()

    def ranked(self) -> list[Evaluation]:
        """The evaluations with a plan, best step first (then least memory), one per configuration (the auto
        phase may reach a configuration the family phase evaluated); an ``auto`` plan only where it beats every
        named family's plan of its layout (:data:`AUTO_GAIN_TOLERANCE`): auto's portfolio holds those families'
        schedules, so the same step is the same plan listed twice."""
        done = {item.configuration: item for item in self.evaluations if item.plan is not None}
        named: dict[Configuration, float] = {}
        for config, item in done.items():
            if config.method != "auto":
                layout, step = dataclasses.replace(config, method="auto"), item.plan.step_time_ms  # type: ignore[union-attr]
                named[layout] = min(step, named.get(layout, step))
        kept = [
            item
            for config, item in done.items()
            if config.method != "auto" or _faster(item.plan.step_time_ms, named.get(config))  # type: ignore[union-attr]
        ]
        return sorted(kept, key=lambda item: (item.plan.step_time_ms, item.plan.peak_memory_bytes))  # type: ignore[union-attr]

    def report_plans(self, phase: str, evaluated: int) -> None:
        """Send a :class:`PlanProgress` with the best plans so far."""
        if self.plan_progress is None:
            return
        best = self.ranked()[: self.top]
        self.plan_progress(
            PlanProgress(
                phase=phase,
                evaluated=evaluated,
                total=self.total,
                best_step_ms=best[0].plan.step_time_ms if best else None,  # type: ignore[union-attr]
                elapsed_s=self.elapsed(),
                plans=[item.plan for item in best if item.plan is not None],
            )
        )

    def record(self, config: Configuration, evaluation: Evaluation) -> None:
        """Count an evaluation: a plan (its step kept for pruning), or a rejection with its reason."""
        self.searched.solved += 1
        self.evaluations.append(evaluation)
        if evaluation.plan is None:
            if evaluation.over_memory:
                self.searched.pruned_memory += 1
            self.rejected.append(Rejected(configuration=config.as_dict(), reason=evaluation.reason or "no schedule"))
            return
        self.steps.append(evaluation.plan.step_time_ms)
        self.improve(evaluation, evaluation.plan.step_time_ms, evaluation.plan.method)
        if self.first_answer_s is None:
            self.first_answer_s = self.elapsed()

    def evaluate_families(self) -> None:
        """Simulate the candidates best estimate first, pruning by bound, until the families' share of the time
        (the rest is ``auto``'s when the request allows it and some configuration is pipelined)."""
        request, estimator = self.prepared.request, self.prepared.estimator
        candidates = list(self.prepared.candidates)
        # First answer fast: the best-estimated configuration whose schedule is quick to build and that fits by the
        # estimate (not one simulated only because the estimate may be high: MEMORY_ESTIMATE_SLACK) goes first.
        quick = next(
            (
                i
                for i, (config, estimate) in enumerate(candidates)
                if evaluation_seconds(config) <= 2.0 and estimate.fits
            ),
            None,
        )
        if quick:
            candidates.insert(0, candidates.pop(quick))
        auto_share = 0.0
        if _allows_auto(request):
            auto_share = 0.25 if any(config.pipeline_parallel > 1 for config, _ in candidates) else 0.0
        family_deadline = self.started + request.search.time_limit_s * (1 - auto_share)
        self.report_plans("search", 0)
        processed = too_slow = 0
        for config, estimate in candidates:
            if self.should_stop() or (time.perf_counter() >= family_deadline and self.steps):
                break
            processed += 1
            kth = _kth(self.steps, self.top)
            if estimate.bound_ms >= kth or estimator.bound_ms(config) >= kth:  # the quick bound, then the tight one
                self.searched.pruned_bound += 1
                continue
            remaining = self.deadline - time.perf_counter()
            pipeline_key = _pipeline_key(config)
            if pipeline_key not in self.simulated and 2 * evaluation_seconds(config) > remaining:
                too_slow += 1  # its schedule cannot be built before the deadline
                continue
            self.simulated.add(pipeline_key)
            limit = min(max(0.5, remaining), 10.0)
            self.record(config, evaluate(estimator, config, estimate, time_limit_s=limit, cache=self.cache))
            self.report_plans("search", processed)
        self.searched.unexplored += self.total - processed + too_slow

    def evaluate_auto(self) -> None:
        """The ``auto`` schedule search on the best pipelined configurations, with the time left: the best of
        each of the two best layouts (configurations that differ only in their family or their data-parallel
        sharding give auto the same passes: a second would search the same orders again)."""
        if not _allows_auto(self.prepared.request):
            return
        estimator = self.prepared.estimator
        best_of_pipeline: dict[tuple[object, ...], Evaluation] = {}
        for item in self.ranked():
            if item.configuration.pipeline_parallel > 1:
                layout = dataclasses.replace(item.configuration, method="auto")
                best_of_pipeline.setdefault(_pipeline_key(layout), item)
        for item in list(best_of_pipeline.values())[:2]:
            remaining = self.deadline - time.perf_counter()
            config = item.configuration
            if remaining < 2.0 or self.user_stopped():
                break
            if config.num_stages * config.num_microbatches > AUTO_MAX_STAGE_MICROBATCHES or config.method == "auto":
                continue
            auto_config = dataclasses.replace(config, method="auto")
            if any(done.configuration == auto_config for done in self.evaluations):
                continue  # evaluated already (auto was named, or two families of one layout led)
            estimate = estimator.estimate(auto_config)
            if evaluation_seconds(auto_config) > remaining / 2:
                continue
            evaluation = evaluate(estimator, auto_config, estimate, time_limit_s=max(1.0, remaining / 2 - 1.0))
            self.searched.solved += 1
            if evaluation.plan is not None:
                self.evaluations.append(evaluation)
                self.report_plans("auto", self.total)

    def best_plans(self) -> tuple[list[Plan], list[Schedule | None]]:
        """The top plans, each with the scheduling lower bound of its own problem while time is left, and
        their schedules."""
        plans: list[Plan] = []
        schedules: list[Schedule | None] = []
        for item in self.ranked()[: self.top]:
            assert item.plan is not None
            plan = item.plan
            if (
                item.problem is not None
                and time.perf_counter() + evaluation_seconds(item.configuration) < self.deadline
            ):
                added = plan.data_parallel_exposed_ms + plan.optimizer_step_ms
                bound = max(plan.lower_bound_ms, schedule_lower_bound(item.problem, added))
                plan = plan.model_copy(update={"lower_bound_ms": round(bound, 4)})
            plans.append(plan)
            schedules.append(schedule_for(item))  # simulation only: the orders are kept
        return plans, schedules

    def outcome(self) -> PlanOutcome:
        """The answer: the best plans, the counts, the rejections when asked."""
        plans, schedules = self.best_plans()
        if not plans and not self.rejected:
            self.rejected.append(
                Rejected(configuration={}, reason="the time limit ended the search before any evaluation")
            )
        estimator = self.prepared.estimator
        answer = PlanAnswer(
            status="done",
            plans=plans,
            searched=self.searched,
            explain=self.rejected[:MAX_EXPLAINED] if self.prepared.request.search.explain else None,
            elapsed_s=round(self.elapsed(), 3),
            first_answer_s=round(self.first_answer_s, 3) if self.first_answer_s is not None else None,
            error=None if plans else _no_plan_reason(self.rejected, self.searched),
            request=self.prepared.request,
            memory_headroom_bytes=float(round(estimator.headroom_bytes)),
            profile=f"{estimator.hardware.profile.name} ({estimator.hardware.profile.source or 'unfitted'})",
            peak_memory_interval_source=_peak_interval_source(estimator),
            notes=[*self.prepared.notes, *plan_notes(plans, estimator)],
            parameters=float(model_parameters(self.prepared.request.model)),
            active_parameters=float(active_parameters(self.prepared.request.model)),
        )
        self.report_plans("done", self.total)
        return PlanOutcome(answer, schedules)


def _peak_interval_source(estimator: Estimator) -> str | None:
    """The answer's ``peak_memory_interval_source``: the profile's held-out peak errors and where they come from."""
    profile = estimator.hardware.profile
    if profile.peak_memory_log_error is None:
        return None
    low, high = profile.peak_memory_log_error
    return (
        f"{profile.name}'s peak_memory_log_error: log(published / predicted) peak {low:+.3f} (10th percentile) to "
        f"{high:+.3f} (90th), {profile.peak_memory_source or 'its catalogue'}"
    )


#: An ``auto`` plan is listed beside its layout's family plans only when faster than each by more than this
#: (relative).
AUTO_GAIN_TOLERANCE = 1e-6


def _faster(step_ms: float, than_ms: float | None) -> bool:
    return than_ms is None or step_ms < than_ms * (1 - AUTO_GAIN_TOLERANCE)


def _allows_auto(request: PlanRequest) -> bool:
    method = _plan_search(request).method
    return method is None or "auto" in method


def search(
    prepared: Prepared,
    *,
    progress: Callable[[PlanProgress], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> PlanOutcome:
    """Evaluate ``prepared``'s candidates within ``search.time_limit_s`` (counted from :func:`prepare`'s start)
    and rank the plans (module docstring)."""
    plan_search = _PlanSearch(prepared, progress, should_stop)
    plan_search.evaluate_families()
    plan_search.evaluate_auto()
    return plan_search.outcome()


def _no_plan_reason(rejected: list[Rejected], searched: Searched) -> str:
    """Why no plan came back, with the fix that can help: a longer search only where the time limit left
    configurations unexplored."""
    sample = "; ".join(item.reason for item in rejected[:3])
    if searched.unexplored:
        left, fix = f"{searched.unexplored} left when the time ran out", "raise search.time_limit_s or use"
    else:
        left, fix = "none left unexplored", "use more GPUs,"
    return (
        f"no configuration gave a schedule that fits ({searched.solved} simulated, {searched.pruned_memory} over "
        f"memory, {left}): {sample}; {fix} GPUs with more memory, or a smaller global batch or sequence"
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
