"""A calibration row predicted as the planner predicts a plan of the same layout.

:func:`configuration` turns the row's layout into the planner's :class:`Configuration`, :func:`estimator` its
model and cluster into the planner's :class:`Estimator`; :func:`predict` evaluates that configuration exactly as
:func:`pipesched.optimizer.planner.rank.search` does (derived costs, the family's schedule, the simulator's
step) and returns the predicted tokens/s per GPU and peak memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pipesched.optimizer.configs import ClusterConfig, ModelConfig
from pipesched.optimizer.cost.calibration.measurements import Measurement
from pipesched.optimizer.cost.experts import expert_tensor_degree
from pipesched.optimizer.cost.profile import active_catalogue, use_catalogue
from pipesched.optimizer.cost.stages import resolve_hardware
from pipesched.optimizer.derive import tie_judging_untimed
from pipesched.optimizer.families import get_family
from pipesched.optimizer.frameworks import FRAMEWORK_SOFTWARE
from pipesched.optimizer.planner.evaluate import evaluate
from pipesched.optimizer.planner.prune import Estimator
from pipesched.optimizer.planner.space import Configuration, methods_for

__all__ = [
    "FRAMEWORK_SOFTWARE",
    "Prediction",
    "configuration",
    "estimator",
    "kernels_mode",
    "power_limited",
    "predict",
]


def kernels_mode(row: Measurement) -> str:
    """How the row's elementwise work ran: ``fused`` (hand-fused kernels), ``compiled`` or ``eager``."""
    if row.software.fused_kernels:
        return "fused"
    return "compiled" if row.software.compile else "eager"


def configuration(row: Measurement) -> Configuration:
    """The planner's configuration of the row's layout."""
    layout, run = row.layout, row.training
    if layout.pipeline_parallel > 1 and layout.schedule is not None:
        method = layout.schedule
    else:  # no pipeline: the family the planner runs for plain gradient accumulation
        method = methods_for(1, "loop", 1)[0]
    placement = get_family(method).placements[0]
    return Configuration(
        pipeline_parallel=layout.pipeline_parallel,
        tensor_parallel=layout.tensor_parallel,
        data_parallel_size=layout.data_parallel,
        sharding=layout.sharding if layout.data_parallel * layout.context_parallel > 1 else "none",
        stages_per_rank=layout.stages_per_rank,
        placement=placement,
        micro_batch_size=run.micro_batch_size,
        num_microbatches=run.num_microbatches,
        activation_recomputation=run.activation_recomputation,
        method=method,
        precision=run.precision,
        context_parallel=layout.context_parallel,
        expert_parallel=layout.expert_parallel,
        expert_tensor_parallel=_expert_tensor_degree(row),
    )


def _expert_tensor_degree(row: Measurement) -> int:
    """The row's expert tensor degree e_t as the planner's configuration carries it: as stated, else 1 with
    expert parallelism, the tensor degree without it, 1 for a dense model
    (:func:`pipesched.optimizer.planner.space.expert_tensor_degrees`)."""
    layout = row.layout
    if layout.expert_tensor_parallel is None and not _model(row).is_moe:
        return 1
    return expert_tensor_degree(layout.tensor_parallel, layout.expert_parallel, layout.expert_tensor_parallel)


def _model(row: Measurement, kernels: str | None = None) -> ModelConfig:
    fields: dict[str, Any] = row.model.model_dump(exclude_none=True)
    fields.update(precision=row.training.precision, kernels=kernels or kernels_mode(row))
    if row.layers_per_stage is not None:  # the run's own split (Megatron's rules), kept for its layout
        fields["layers_per_stage"] = row.layers_per_stage
    return ModelConfig.model_validate(fields)


def power_limited(cluster: ClusterConfig, power_limit_w: float | None) -> ClusterConfig:
    """``cluster`` with its bf16 peak (``flops_per_s``, FP8 in proportion) the one its accelerator sustains under
    ``power_limit_w`` (the profile's ``power_limited_peak``: 1 where not fitted); unchanged without a limit or
    where the cluster states its own peak."""
    if power_limit_w is None or cluster.flops_per_s is not None:
        return cluster
    hardware = resolve_hardware(cluster)
    sustained = hardware.profile.power_limited_peak.get(f"{power_limit_w:g}", 1.0)
    return cluster.model_copy(update={"flops_per_s": hardware.flops_per_s * sustained})


def _cluster(row: Measurement, profile: str | None, kernels: str) -> ClusterConfig:
    """The row's cluster, its peak the sustained one under a stated power limit (``power_limit_w``); a stated
    attention kernel slows its attention where the kernels mode does not already
    (eager and compiled PyTorch run FlashAttention-2:
    :func:`~pipesched.optimizer.cost.context.pytorch_attention_speed`)."""
    fields: dict[str, Any] = {"accelerator": row.accelerator, **row.cluster}
    if profile is not None:
        fields["profile"] = profile
    cluster = power_limited(ClusterConfig.model_validate(fields), row.power_limit_w)
    speed = active_catalogue().software.attention_speed(row.software.attention_kernel, row.accelerator)
    if speed != 1.0 and kernels == "fused" and cluster.attention_efficiency is None:
        base = resolve_hardware(cluster).profile.attention_efficiency
        cluster = cluster.model_copy(update={"attention_efficiency": min(1.0, base * speed)})
    return cluster


def estimator(row: Measurement, profile: str | None = None, kernels: str | None = None) -> Estimator:
    """The planner's estimator for the row's model and cluster (``profile``: a ``cluster.profile`` name;
    ``kernels``: a kernels mode in place of the row's own, e.g. "unknown")."""
    model = _model(row, kernels)
    return Estimator(
        model,
        _cluster(row, profile, model.kernels),
        row.training.global_batch_size,
        sequence_parallel=row.layout.sequence_parallel,
        async_tensor_parallel=row.software.async_tensor_parallel,
        reduce_dtype=row.software.gradient_reduce_dtype,
    )


@dataclass(frozen=True)
class Prediction:
    """What the planner predicts for a row: tokens/s per GPU, peak memory (bytes), step (ms), MFU; or why not."""

    tokens_per_s_per_gpu: float | None
    peak_memory_bytes: float | None
    step_time_ms: float | None
    mfu: float | None
    reason: str | None = None


@contextmanager
def run_software(row: Measurement, kernels: str | None = None) -> Iterator[None]:
    """The active catalogue with what the row's framework did that no request states: FSDP's backward prefetch
    (``software.fsdp_backward_prefetch``, e.g. MosaicML Composer's BACKWARD_POST), when FSDP reduces the gradients
    (``software.fsdp_gradient_sync``, e.g. NeMo AutoModel's once a step) and the attention kernel PyTorch
    ran (``software.attention_kernel`` "cudnn": the software profile's ``pytorch_sdpa_backend``), whether a compiled
    run compiled its loss (``software.compiled_loss``: ``pytorch_compiled_loss``), over what its
    framework runs (:data:`~pipesched.optimizer.frameworks.FRAMEWORK_SOFTWARE`: llm-foundry's loss and prefetch,
    "composer"; NeMo AutoModel's bf16 model under FSDP and its gradient sync, "automodel"; a field the row states
    wins). With ``kernels``
    given (the framework ignored, as for a layout given without one) the planner's defaults stay."""
    catalogue = active_catalogue()
    stated: dict[str, str | bool] = dict(FRAMEWORK_SOFTWARE.get(row.software.framework, {}))
    stated.update(
        (name, getattr(row.software, name))
        for name in ("fsdp_backward_prefetch", "fsdp_gradient_sync")
        if name in row.software.model_fields_set or name not in stated
    )
    if row.software.attention_kernel == "cudnn":
        stated["pytorch_sdpa_backend"] = "cudnn"
    if row.software.compiled_loss is not None:
        stated["pytorch_compiled_loss"] = row.software.compiled_loss
    software = catalogue.software
    if kernels is not None or all(getattr(software, field) == value for field, value in stated.items()):
        yield
        return
    with use_catalogue(catalogue.model_copy(update={"software": software.model_copy(update=stated)})):
        yield


def predict(
    row: Measurement, profile: str | None = None, *, time_limit_s: float = 10.0, kernels: str | None = None
) -> Prediction:
    """The row's layout evaluated by the planner (module docstring); memory is not enforced (a published run
    ran), so a prediction above the GPU's memory is still given. ``kernels`` replaces the row's kernels mode (and
    the row's framework settings, :func:`run_software`, with the planner's). A partition's time tie is judged in
    full (:func:`~pipesched.optimizer.derive.tie_judging_untimed`): the prediction does not depend on the
    machine's load."""
    with run_software(row, kernels), tie_judging_untimed():
        est = estimator(row, profile, kernels)
        config = configuration(row)
        estimate = est.estimate(config)
        evaluation = evaluate(est, config, estimate, time_limit_s=time_limit_s, enforce_memory=False)
    plan = evaluation.plan
    if plan is None:
        return Prediction(None, None, None, None, evaluation.reason)
    return Prediction(plan.tokens_per_s_per_gpu, plan.peak_memory_bytes, plan.step_time_ms, plan.mfu)
