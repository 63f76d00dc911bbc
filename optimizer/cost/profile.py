"""Accelerator profiles: how close to its datasheet an accelerator runs each kind of work.

A profile refines a catalogue entry (:mod:`pipesched.optimizer.accelerators`: dense bf16/fp8 peaks, HBM
bandwidth and capacity) with a few efficiencies, each a fraction of a datasheet figure, fitted to published
training runs (``calibration/data``, fitted by ``bench/calibration_bench.py`` into ``calibration/profiles.json``)
or to a user's own runs (``pipesched calibrate``). Where each enters the time of a pass is
:mod:`pipesched.optimizer.cost.timing`; the parameters:

- ``gemm_efficiency`` / ``fp8_gemm_efficiency``: the fraction of the dense bf16 / fp8 peak a large matrix
  multiply reaches.
- ``gemm_shape_dimension`` d½ (elements): the cost of a small dimension. An (M, N, K) multiply takes
  2MNK / (peak · efficiency) · (1 + d½·(1/M + 1/N + 1/K)): the roofline's memory term (Williams, Waterman &
  Patterson 2009) written as a dimension, so a small hidden size or a tensor-parallel split (N/t, K/t) runs
  further from peak; at FP8 the term doubles (twice the FLOP/s for the same bytes per element moved).
- ``attention_efficiency``: FlashAttention's fraction of the bf16 peak (its FLOPs in
  :mod:`pipesched.optimizer.cost.flops`; Dao 2023 reports 50–73% of peak forward on A100/H100).
- ``memory_efficiency``: the fraction of HBM bandwidth elementwise kernels (norms, activations, RoPE, the
  optimizer step, FP8 casts) reach.
- ``collective_efficiency_intra`` / ``_inter``: achieved NCCL bus bandwidth as a fraction of the cluster's
  nominal per-GPU link (NVLink inside a node, the network between nodes). nccl-tests (PERFORMANCE.md) report
  about 360–480 GB/s bus bandwidth on NVLink 4 (450 GB/s per direction) and 40–48 GB/s on a 400 Gb/s NIC.
- ``overlap_slowdown``: compute running beside a data-parallel collective is slowed by this fraction of the
  collective's time (the two share SMs and memory bandwidth).
- ``activation_memory_factor``: allocator reserve (fragmentation, workspaces) over the modelled activations,
  fitted to published peak memory.
- ``memory_headroom_fraction`` and ``context_bytes``: the default ``cluster.memory_headroom_bytes`` =
  fraction · capacity + context (CUDA context, NCCL buffers).

Software (the same on every accelerator, :class:`SoftwareProfile`): the elementwise traffic of eager PyTorch,
``torch.compile`` and hand-fused kernels relative to Megatron's fused kernels, kernels per layer pass and the
CPU time of each (eager dispatch), and the bytes an FP8 cast moves per element; for kernels not said
("unknown"), the share of each mode among the published runs of a layout's class (its data-parallel sharding,
and whether it has model parallelism) and that class's interval; and the interval of a plan with context or expert
parallelism (``parallel_log_error``, by :data:`PARALLEL_CLASSES`).

``held_out_log_error`` (the 10th and 90th percentile of log(published / predicted) over the leave-one-out
fits) gives every plan its 80% interval; ``peak_memory_log_error`` (the same percentiles of log(published /
predicted) peak memory, each published peak predicted with ``activation_memory_factor`` refitted without it) the
80% interval of every plan's peak; ``max_measured_mfu`` the highest MFU in the calibration data.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipesched.optimizer.field_errors import StrictModel

__all__ = [
    "ANY_KERNELS_CLASS",
    "KERNELS",
    "MODEL_PARALLEL",
    "PARALLEL_CLASSES",
    "RUN_KERNELS",
    "SHARDING_CLASSES",
    "UNKNOWN_KERNELS_CLASSES",
    "AcceleratorProfile",
    "ProfileCatalogue",
    "SoftwareProfile",
    "active_catalogue",
    "builtin_catalogue",
    "default_profile",
    "layout_sharding",
    "load_catalogue",
    "parallel_class",
    "sharding_class",
    "unknown_kernels_class",
    "use_catalogue",
]

GIB = 1024**3

#: How elementwise work runs: eager PyTorch ops, ``torch.compile`` (Inductor fuses them), hand-fused kernels, or
#: not said ("unknown": the expected time over the frameworks that publish runs of the plan's data-parallel
#: sharding, :func:`unknown_kernels_class`).
KERNELS = ("unknown", "eager", "compiled", "fused")
Kernels = Literal["unknown", "eager", "compiled", "fused"]
#: The kernels modes a framework runs (every one but "unknown").
RUN_KERNELS = ("eager", "compiled", "fused")
#: The default of each per-mode factor (``SoftwareProfile``); a catalogue that lacks a mode takes it from here.
_DEFAULTS: dict[str, dict[str, float]] = {
    "elementwise_traffic": {"eager": 1.0, "compiled": 1.0, "fused": 1.0},
    "kernels_per_layer": {"eager": 40.0, "compiled": 14.0, "fused": 12.0},
    "cpu_us_per_kernel": {"eager": 10.0, "compiled": 4.0, "fused": 4.0},
    "fp8_cast_bytes_per_element": {"eager": 5.0, "compiled": 3.0, "fused": 3.0},
}
#: Classes of layouts by their data-parallel sharding alone (:func:`unknown_kernels_class`): a request's
#: ``kernels_prior`` names one, and a catalogue without the model-parallel classes falls back to them.
SHARDING_CLASSES = ("full", "replicated")
#: Tag of a layout with model parallelism (tensor, pipeline, context or expert degree > 1), :func:`layout_sharding`.
MODEL_PARALLEL = "model-parallel"
#: Classes of layouts by who publishes runs of them (:func:`unknown_kernels_class`): each sharding class, and its
#: layouts with model parallelism, which fewer frameworks run (Composer has no pipeline or context parallelism;
#: torchtitan's DDP refused a second mesh dimension).
UNKNOWN_KERNELS_CLASSES = (*SHARDING_CLASSES, *(f"{name}+{MODEL_PARALLEL}" for name in SHARDING_CLASSES))


#: Classes of a layout for its interval (:func:`parallel_class`): expert parallelism (EP > 1, with or without
#: context parallelism), context parallelism (CP > 1, EP 1); any other layout is dense and takes its accelerator's.
PARALLEL_CLASSES = ("expert-parallel", "context-parallel")


def parallel_class(context_parallel: int, expert_parallel: int) -> str | None:
    """The class of a layout for its interval (:data:`PARALLEL_CLASSES`): "expert-parallel" where
    ``expert_parallel`` > 1, "context-parallel" where ``context_parallel`` > 1, ``None`` (dense) otherwise."""
    if expert_parallel > 1:
        return "expert-parallel"
    return "context-parallel" if context_parallel > 1 else None


#: Kernels "unknown" over a search whose layouts span both classes: every published run (each class one vote).
ANY_KERNELS_CLASS = "any"


def layout_sharding(sharding: str | None, copies: int, *model_degrees: int) -> str | None:
    """The data-parallel sharding that names a layout's class for kernels "unknown": ``sharding`` where ``copies``
    (d·c GPUs holding the same weights) > 1, ``None`` (no data parallelism) otherwise; where any of
    ``model_degrees`` (the layout's tensor, pipeline, context and expert degrees) is > 1, tagged
    ``"<sharding>+model-parallel"`` (``"model-parallel"`` without data parallelism), which
    :func:`unknown_kernels_class` reads."""
    base = sharding if copies > 1 else None
    if max(model_degrees, default=1) <= 1:
        return base
    return f"{base}+{MODEL_PARALLEL}" if base else MODEL_PARALLEL


def unknown_kernels_class(sharding: str | None, prior: str | None = None) -> str:
    """The class of a layout for kernels "unknown", by its data-parallel sharding (:func:`layout_sharding`): "full"
    (FSDP / ZeRO-3: the weights sharded and gathered per unit, PyTorch's FSDP: torchtitan, llm-foundry, NeMo
    AutoModel, Megatron's FSDP) or "replicated" (every rank holds the weights: DDP, ZeRO-1/2, Megatron's
    distributed optimizer, which torchtitan does not run; ``None``: no data parallelism), each with
    "+model-parallel" where the layout has tensor, pipeline, context or expert parallelism, which fewer frameworks
    publish: MosaicML's runs (Composer: no pipeline or context parallelism) are data parallel only, and torchtitan's
    DDP refused a second mesh dimension (``parallelize_llama`` through 2025: "DDP has not supported > 1D
    parallelism"), so every published replicated-weight layout with model parallelism is Megatron's or NeMo's.
    ``prior`` (the model's ``kernels_prior``), when given, is the class whatever the layout: a search over layouts
    of several classes counts the runs of their sharding class, or of both ("any"), so that no layout is favoured
    for the frameworks that publish it."""
    if prior is not None:
        return prior
    tagged = sharding is not None and sharding.endswith(MODEL_PARALLEL)
    base = sharding.removesuffix(MODEL_PARALLEL).removesuffix("+") if sharding is not None else None
    name = "full" if base == "full" else "replicated"
    return f"{name}+{MODEL_PARALLEL}" if tagged else name


def sharding_class(name: str) -> str:
    """The sharding class of a class of :data:`UNKNOWN_KERNELS_CLASSES` (itself, less its model-parallel tag)."""
    return name.removesuffix(f"+{MODEL_PARALLEL}")


class SoftwareProfile(StrictModel):
    """Factors of the framework, shared by every accelerator (module docstring)."""

    elementwise_traffic: dict[str, float] = Field(
        default_factory=lambda: dict(_DEFAULTS["elementwise_traffic"]),
        description="Elementwise bytes moved relative to Megatron's fused kernels (the Zero Bubble paper's "
        "profiles), by kernels mode (kernels 'unknown' blend the modes: pipesched.optimizer.cost.stages.blended).",
    )
    kernels_per_layer: dict[str, float] = Field(
        default_factory=lambda: dict(_DEFAULTS["kernels_per_layer"]),
        description="Kernels one decoder layer launches in its forward (backward: twice as many), by kernels mode.",
    )
    cpu_us_per_kernel: dict[str, float] = Field(
        default_factory=lambda: dict(_DEFAULTS["cpu_us_per_kernel"]),
        description="CPU time to issue one kernel (µs); a layer pass takes at least kernels × this.",
    )
    attention_kernel_speed: dict[str, float] = Field(
        default_factory=lambda: {"current": 1.0, "flash-attn-2023": 1.0},
        description="FlashAttention's speed relative to today's kernels (FlashAttention-2/3, cuDNN) by the "
        "kernel a calibration row ran: 'flash-attn-2023' for MosaicML's 2023 runs; 'KERNEL/ACCELERATOR' for "
        "that kernel on one accelerator generation (the 2023 kernels were written for Ampere: FlashAttention-3, "
        "Shah et al. 2024, §1 and §4.1, measures FlashAttention-2 at about 35% of the H100's bf16 peak against "
        "70-75% for kernels using Hopper's WGMMA and TMA).",
    )
    pytorch_sdpa_backend: Literal["flash", "cudnn"] = Field(
        "flash",
        description="The kernel eager and compiled PyTorch's scaled_dot_product_attention runs on Hopper: 'flash' "
        "(FlashAttention-2, as the published torchtitan and llm-foundry runs ran it: the 'flash-attn-2023' speed on "
        "the accelerator) or 'cudnn' (cuDNN's Hopper kernels at today's speed: torch 2.11's default on an H100, "
        "measured by bench/device_step_bench.py, bench/results/device/; a calibration row that ran them says "
        "software.attention_kernel 'cudnn').",
    )
    pytorch_cross_entropy: Literal["fp32", "fused"] = Field(
        "fp32",
        description="How eager and compiled PyTorch stacks compute the loss (pipesched.optimizer.cost.memory, "
        "CROSS_ENTROPY_BYTES): 'fp32' (F.cross_entropy on the logits cast to fp32, torchtitan's "
        "torchtitan/components/loss.py: 4 bytes per logit held, 8 more in its backward) or 'fused' (flash-attn's "
        "CrossEntropyLoss, llm-foundry's default loss_fn: 2 and 2); a calibration row of software.framework "
        "'composer' states 'fused'. Megatron's fused plans run its vocab-parallel cross-entropy.",
    )
    pytorch_compiled_loss: bool = Field(
        True,
        description="Whether a compiled plan's loss is compiled too, where the loss is 'fp32' and not split over "
        "tensor-parallel ranks (pipesched.optimizer.cost.memory, CROSS_ENTROPY_BYTES 'compiled': 2 bytes per logit "
        "held, 2 more in its backward): torchtitan compiles it with the model (torchtitan/components/loss.py, "
        "--training.compile from April 2025 and v0.1.0, --compile.components ['model', 'loss'] by default from "
        "v0.2.0); a calibration row of torchtitan 9dec370 (Dec 2024), whose train.py left the loss eager, says "
        "software.compiled_loss false.",
    )
    fused_fsdp_state: Literal["zero3", "bf16_parameters"] = Field(
        "zero3",
        description="What a fully sharded (sharding 'full') run with hand-fused kernels keeps per parameter "
        "(pipesched.optimizer.cost.memory.FULL_SHARDING_STATES): 'zero3' (Megatron-FSDP's optim_grads_params, as "
        "Megatron Bridge runs it: 16-bit and fp32 weights, the gradient buffer and two fp32 moments, 2 + 4 + g + 8 "
        "bytes over d) or 'bf16_parameters' (PyTorch FSDP2 over a model built in bf16 with Transformer Engine "
        "kernels, NeMo AutoModel's mixture-of-experts models: 2 + 2 + 4); a calibration row of software.framework "
        "'automodel' states the latter. Eager and compiled PyTorch shard the fp32 parameters (4 + 4 + 8). Not "
        "fitted: a plan with fused kernels assumes Megatron-FSDP's.",
    )
    unfused_traffic: float = Field(
        1.0,
        gt=0,
        description="Scale of the extra bytes eager PyTorch moves for RMSNorm, RoPE and SwiGLU "
        "(pipesched.optimizer.cost.stages.UNFUSED_BYTES_PER_ELEMENT).",
    )
    async_tensor_parallel_hidden: float = Field(
        0.9,
        gt=0,
        le=1,
        description="Fraction of the tensor-parallel collectives AsyncTP hides behind the matrix multiplies, net "
        "of what the overlapped transfers cost the multiplies (no overlap_slowdown on top: PyTorch's AsyncTP and "
        "Transformer Engine's userbuffers move these bytes with copy engines or a few SMs, not NCCL's kernels). "
        "It decomposes each all-gather → matmul and matmul → reduce-scatter into t chunks (Wang et al. 2022, "
        "'Overlap communication with dependent computation via decomposition', §3), so the first gather and "
        "the last reduction chunk stay exposed and the smaller chunked multiplies run further from peak; "
        "torchtitan measures 1.06-1.16× end-to-end from it on Llama 3.1 70B (benchmarks/, Dec 2024 and June 2025).",
    )
    fused_activation_memory_factor: float = Field(
        1.0,
        gt=0,
        le=4,
        description="Stored activations over the modelled ones with hand-fused kernels (Megatron-LM, NeMo, "
        "Transformer Engine): Korthikanti et al. 2022 (§4) derived the modelled activations from Megatron's "
        "fused implementation and measured them within a few percent. At 1.0, with what Megatron-Core's fused "
        "SwiGLU and Transformer Engine's FP8 inputs do not store (pipesched.optimizer.cost.memory), all 25 fitted "
        "fused published runs fit their GPU (21 before those were modelled; 18 at the eager factor of 1.75).",
    )
    attention_backward_speed: float = Field(
        0.7,
        gt=0,
        le=1,
        description="FlashAttention's backward FLOP/s relative to its forward's: FlashAttention-2 (Dao 2023, §4) "
        "and -3 (Shah et al. 2024, §4.1) reach about 70% of their forward's throughput in the backward. torch "
        "2.11 on an H100 measured 0.83 (cuDNN) and 0.86 (FlashAttention-2) for 128-wide causal heads at 8,192 "
        "tokens (bench/results/device/rows_breakdown_sdpa.json); refitted with it, the published long-sequence "
        "runs moved further off (bench/results/attention_backward_tried.md), so 0.7 stays.",
    )
    moe_layer_host_ms: float = Field(
        3.0,
        ge=0,
        description="Host (CPU) time of one mixture-of-experts layer's forward, ms; its input-gradient backward "
        "takes 1.5 times it and its weight-gradient backward 0.5 times (as the kernels they launch). The token "
        "dispatcher must learn each expert's token count before it sizes the all-to-all and the grouped expert "
        "GEMMs (Megatron-Core's alltoall dispatcher and torchtitan's expert parallelism copy the counts to the host: "
        "a device-to-host sync every MoE layer), so the CPU cannot run ahead of the GPU there and the layer's pass "
        "takes at least the host's time to issue router, permutation, expert GEMMs (Transformer Engine's grouped "
        "linear launches one GEMM per local expert) and combine. Megatron Bridge's CUDA-graph guide names such "
        "launch-bound MoE steps; fitted to the published micro-batch-1 MoE runs (bench/cpep_bench.py --fit-host, "
        "held out one source at a time).",
    )
    moe_dispatcher: Literal["hierarchical", "all-to-all"] = Field(
        "hierarchical",
        description="How a mixture-of-experts layer's tokens reach experts on other nodes: 'hierarchical' "
        "(DeepEP, Megatron-Core's flex dispatcher: once per remote node, then over NVLink; DeepSeek-V3 report "
        "§3.2.2) or 'all-to-all' (Megatron-Core's alltoall dispatcher: one NCCL all-to-all, each of the k copies "
        "on its own). Not fitted: a published run states it (its recipe's moe_token_dispatcher_type); a plan "
        "assumes the hierarchical dispatch of the current recipes (pipesched.optimizer.cost.experts).",
    )
    moe_dispatch_efficiency_inter: dict[str, float] = Field(
        default_factory=dict,
        description="Achieved per-GPU network bandwidth of a mixture-of-experts dispatcher's cross-node leg, as a "
        "fraction of the cluster's nominal inter-node link, by moe_dispatcher ('hierarchical', 'all-to-all'); a "
        "dispatcher not listed (the shipped default: none) runs at the accelerator profile's "
        "collective_efficiency_inter, as every collective does. For a user's catalogue that measured its own "
        "dispatchers. Published figures on one 400 Gb/s CX7 NIC per GPU (50 GB/s): DeepEP's normal kernels 0.87 "
        "(deepseek-ai/DeepEP docs/legacy.md, H800, DeepSeek-V3 setting: 58/57 GB/s dispatch/combine at EP 32, 51/50 "
        "at EP 64, counted once per node a token reaches, its own included, so (N - 1)/N of it crosses the wire), an "
        "NCCL all-to-all 0.92 with large messages (46 GB/s alltoall_perf bus bandwidth on 2 DGX H100, deepseek-ai/"
        "DeepEP issue 3) and 0.47 with 8 MiB per rank over 64 H800s (NVIDIA/nccl issue 1531). Tried on the check "
        "rows, not shipped: bench/results/dispatcher_bandwidth.md.",
    )
    moe_all_to_all_overlap: bool = Field(
        False,
        description="The framework runs one microbatch's MoE all-to-alls beside another microbatch's compute in "
        "the 1F1B steady state (Megatron-Core's --overlap-moe-expert-parallel-comm, Megatron Bridge's "
        "moe_a2a_overlap; DualPipe does it by construction): a pass then exposes only what its all-to-alls exceed "
        "of its own compute (ExpertParallel.overlap). Not fitted: a published run states it; a plan assumes it "
        "only where its schedule overlaps microbatches.",
    )
    fsdp_backward_prefetch: Literal["BACKWARD_PRE", "BACKWARD_POST"] = Field(
        "BACKWARD_PRE",
        description="When FSDP gathers the next unit's weights in the backward (PyTorch's BackwardPrefetch): "
        "'BACKWARD_PRE' before the current unit's gradient computation, so the gather runs beside it (FSDP2's "
        "implicit prefetch, torchtitan; Megatron's parameter gathers); 'BACKWARD_POST' after it, beside only the "
        "current unit's reduction, so every unit's backward waits for its own gather (PyTorch FSDP1 docs: 'enables "
        "less overlap but requires less memory'; MosaicML Composer's default, composer/trainer/dist_strategy.py "
        "v0.13-v0.18). Not fitted: a published run states it; a plan assumes BACKWARD_PRE "
        "(pipesched.optimizer.cost.overlap).",
    )
    fsdp_gradient_sync: Literal["every_microbatch", "last_microbatch"] = Field(
        "every_microbatch",
        description="When fully sharded data parallelism without a pipeline reduce-scatters the gradients of a step "
        "of several microbatches: 'every_microbatch' (PyTorch FSDP1/FSDP2 unless told otherwise, sharded gradients "
        "cannot be accumulated unsharded; MosaicML Composer, which applies no_sync to DDP only, "
        "composer/trainer/dist_strategy.py ddp_sync_context v0.13-v0.16; Megatron-FSDP's optim_grads_params, "
        "megatron_fsdp.py grad_reduce_every_bprop, Megatron Bridge's FSDP recipes) or 'last_microbatch' (FSDP2's "
        "set_requires_gradient_sync(False) or FSDP1's no_sync on all but the last microbatch, e.g. NeMo AutoModel's "
        "get_sync_ctx; Megatron-FSDP's no_shard and optim): one reduction a step, the stage's whole unsharded "
        "gradient held until it. Pipelines and replicated weights reduce once a step either way. Not fitted: a "
        "published run states it; a plan assumes every_microbatch (pipesched.optimizer.cost.overlap).",
    )
    fp8_cast_bytes_per_element: dict[str, float] = Field(
        default_factory=lambda: dict(_DEFAULTS["fp8_cast_bytes_per_element"]),
        description="Bytes an FP8 cast moves per element: absolute-max read (2) when not fused, bf16 read (2), "
        "fp8 write (1); kernels 'unknown' take each mode's at the layout class's shares "
        "(pipesched.optimizer.cost.stages.blended). 'fused' is fitted: Transformer Engine writes the FP8 input "
        "from its LayerNorm-Linear and activation kernels (no separate cast) and casts each weight once per step "
        "for every microbatch (its FP8 weight cache), so it moves far fewer than 3 bytes per element.",
    )
    unknown_kernels_shares: dict[str, dict[str, float]] = Field(
        default_factory=lambda: {name: dict.fromkeys(RUN_KERNELS, 1 / 3) for name in UNKNOWN_KERNELS_CLASSES},
        description="Kernels 'unknown' (the framework not said): by layout class (unknown_kernels_class), the share "
        "of each kernels mode among the published runs of that class, every source-and-accelerator group of the "
        "calibration data one vote (pipesched.optimizer.calibration.catalogue.unknown_kernels_shares). A pass "
        "takes the expected time over the modes, Σ share · time (pipesched.optimizer.cost.stages.blended).",
    )
    unknown_kernels_log_error: dict[str, tuple[float, float]] = Field(
        default_factory=lambda: dict.fromkeys(UNKNOWN_KERNELS_CLASSES, (-0.3, 0.3)),
        description="By layout class, the 10th and 90th percentile of log(published / predicted) over the "
        "calibration rows of that class predicted with kernels 'unknown', every source-and-accelerator group "
        "weighing the same: a plan of unknown kernels gets at least this interval.",
    )

    parallel_log_error: dict[str, tuple[float, float]] = Field(
        default_factory=dict,
        description="By layout class (PARALLEL_CLASSES: 'expert-parallel', 'context-parallel'), the weighted 10th "
        "and 90th percentile of log(published / predicted) over the context/expert-parallel check rows of that "
        "class (never fitted; every source-and-accelerator group weighing the same: "
        "pipesched.optimizer.calibration.catalogue.parallel_log_errors): a plan of that class gets at least this "
        "interval, its union with the accelerator's. A class missing here (a catalogue written before) adds "
        "nothing.",
    )

    @field_validator("unknown_kernels_log_error", mode="before")
    @classmethod
    def _one_interval_for_every_class(cls, value: object) -> object:
        """A catalogue written with one interval for every layout (a pair) gives it to each class."""
        if isinstance(value, (list, tuple)):
            return dict.fromkeys(UNKNOWN_KERNELS_CLASSES, tuple(value))
        return value

    @model_validator(mode="after")
    def _every_mode(self) -> SoftwareProfile:
        """A catalogue written before a kernels mode existed takes that mode's default factors."""
        for name, defaults in _DEFAULTS.items():
            table = getattr(self, name)
            for mode, value in defaults.items():
                table.setdefault(mode, value)
        return self

    def kernels_shares(self, kernels: str, sharding: str | None, prior: str | None = None) -> dict[str, float]:
        """The share of each kernels mode a pass of ``kernels`` runs with, for a layout of ``sharding``: the mode
        itself, or for "unknown" the class's :attr:`unknown_kernels_shares` (:func:`unknown_kernels_class` with
        ``prior``; class "any": the mean of the classes' shares, each class one vote), zero shares left out."""
        if kernels != "unknown":
            return {kernels: 1.0}
        name = unknown_kernels_class(sharding, prior)
        if name == ANY_KERNELS_CLASS:
            classes = [self.unknown_kernels_shares[one] for one in SHARDING_CLASSES]
            shares = {mode: sum(each.get(mode, 0.0) for each in classes) / len(classes) for mode in RUN_KERNELS}
        else:
            shares = self.unknown_kernels_shares.get(name) or self.unknown_kernels_shares[sharding_class(name)]
        return {mode: share for mode, share in shares.items() if share > 0}

    def unknown_interval(self, sharding: str | None, prior: str | None = None) -> tuple[float, float]:
        """:attr:`unknown_kernels_log_error` of the class of ``sharding`` (or ``prior``); class "any": the union
        of the classes' intervals."""
        name = unknown_kernels_class(sharding, prior)
        if name != ANY_KERNELS_CLASS:
            return self.class_log_error(name)
        intervals = [self.unknown_kernels_log_error[one] for one in SHARDING_CLASSES]
        return min(low for low, _ in intervals), max(high for _, high in intervals)

    def class_log_error(self, name: str) -> tuple[float, float]:
        """:attr:`unknown_kernels_log_error` of the layout class ``name``; a catalogue without the model-parallel
        classes gives their sharding class's."""
        errors = self.unknown_kernels_log_error
        return errors.get(name) or errors[sharding_class(name)]

    def layout_log_error(
        self, interval: tuple[float, float], context_parallel: int, expert_parallel: int
    ) -> tuple[float, float]:
        """``interval`` (log(published / predicted), 10th and 90th percentile) united with the
        :attr:`parallel_log_error` of the layout's class (:func:`parallel_class`); a dense layout, or a class the
        catalogue has no interval for, keeps ``interval``."""
        name = parallel_class(context_parallel, expert_parallel)
        if name is None or name not in self.parallel_log_error:
            return interval
        low, high = self.parallel_log_error[name]
        return min(interval[0], low), max(interval[1], high)

    def attention_speed(self, kernel: str, accelerator: str) -> float:
        """:attr:`attention_kernel_speed` of ``kernel`` on ``accelerator`` (its own entry, else the kernel's)."""
        speeds = self.attention_kernel_speed
        return speeds.get(f"{kernel}/{accelerator}", speeds.get(kernel, 1.0))


class AcceleratorProfile(StrictModel):
    """The efficiencies of one accelerator (module docstring); ``accelerator`` names its catalogue entry."""

    name: str = Field(description="Profile name: the catalogue name for built-in profiles.")
    accelerator: str | None = Field(None, description="Catalogue entry whose peaks and memory it refines.")
    gemm_efficiency: float = Field(0.75, gt=0, le=1)
    fp8_gemm_efficiency: float = Field(0.6, gt=0, le=1)
    gemm_shape_dimension: float = Field(0.0, ge=0, description="d½, elements (module docstring).")
    attention_efficiency: float = Field(0.5, gt=0, le=1)
    power_limited_peak: dict[str, float] = Field(
        default_factory=dict,
        description="Fraction of the datasheet's bf16 and FP8 peaks the accelerator sustains under a power limit "
        "below its TDP, by the limit in W (e.g. '500'): a capped GPU lowers its clock under dense tensor-core work; "
        "fitted where a calibration source ran capped GPUs (calibration rows' power_limit_w).",
    )
    memory_efficiency: float = Field(0.8, gt=0, le=1)
    collective_efficiency_intra: float = Field(0.8, gt=0, le=1)
    collective_efficiency_inter: float = Field(0.85, gt=0, le=1)
    overlap_slowdown: float = Field(0.0, ge=0, le=1)
    activation_memory_factor: float = Field(1.0, gt=0, le=4)
    memory_headroom_fraction: float = Field(0.05, ge=0, lt=1)
    context_bytes: float = Field(1.0 * GIB, ge=0)
    held_out_log_error: tuple[float, float] = Field(
        (-0.2, 0.2), description="10th and 90th percentile of log(published / predicted), held out."
    )
    peak_memory_log_error: tuple[float, float] | None = Field(
        None,
        description="10th and 90th percentile of log(published / predicted) peak memory, each published peak "
        "predicted with activation_memory_factor refitted without it (leave one out); null: none known (no interval "
        "on a plan's peak).",
    )
    peak_memory_source: str = Field("", description="Where peak_memory_log_error comes from: rows, bench.")
    max_measured_mfu: dict[str, float] = Field(
        default_factory=dict, description="Highest MFU in the calibration data, by precision."
    )
    fitted_rows: int = Field(0, ge=0, description="Calibration rows of this accelerator the fit used.")
    source: str = Field("", description="Where the figures come from.")

    def headroom_bytes(self, memory_bytes: float) -> float:
        """Default memory kept free on a GPU of ``memory_bytes``: fraction · capacity + context."""
        return self.memory_headroom_fraction * memory_bytes + self.context_bytes

    def memory_holding(self, usable_bytes: float) -> float:
        """The GPU memory whose share left after :meth:`headroom_bytes` is ``usable_bytes`` (its inverse):
        (usable + context) / (1 − fraction)."""
        return (usable_bytes + self.context_bytes) / (1 - self.memory_headroom_fraction)


class ProfileCatalogue(StrictModel):
    """Profiles by name, and the software factors they were fitted with."""

    software: SoftwareProfile = Field(default_factory=SoftwareProfile)
    profiles: dict[str, AcceleratorProfile] = Field(default_factory=dict)
    fitted: str = Field("", description="How and when the catalogue was fitted.")

    def get(self, name: str) -> AcceleratorProfile | None:
        """The profile named ``name`` (case-insensitive), or None."""
        for key, profile in self.profiles.items():
            if key.lower() == name.lower():
                return profile
        return None


def load_catalogue(path: str | Path) -> ProfileCatalogue:
    """A catalogue file (``calibration/profiles.json`` or ``pipesched calibrate``'s output).

    A file holding one profile (``{"name": …, "gemm_efficiency": …}``) is read as a catalogue of that profile.

    Raises:
        OSError, json.JSONDecodeError, pydantic.ValidationError: unreadable or malformed file.
    """
    document = json.loads(Path(path).read_text())
    if "profiles" not in document and "name" in document:
        profile = AcceleratorProfile.model_validate(document)
        return ProfileCatalogue(profiles={profile.name: profile})
    return ProfileCatalogue.model_validate(document)


@cache
def builtin_catalogue() -> ProfileCatalogue:
    """The profiles shipped with pipesched (``calibration/profiles.json``; empty when it is missing)."""
    entry = resources.files("pipesched.optimizer.cost.calibration") / "profiles.json"
    if not entry.is_file():
        return ProfileCatalogue()
    return ProfileCatalogue.model_validate(json.loads(entry.read_text()))


_OVERRIDE: ContextVar[ProfileCatalogue | None] = ContextVar("pipesched_profile_catalogue", default=None)


def active_catalogue() -> ProfileCatalogue:
    """The catalogue in force: :func:`use_catalogue`'s, else the built-in one."""
    override = _OVERRIDE.get()
    return override if override is not None else builtin_catalogue()


@contextmanager
def use_catalogue(catalogue: ProfileCatalogue) -> Iterator[ProfileCatalogue]:
    """Derive costs with ``catalogue`` in place of the built-in profiles (the fit tries candidates this way)."""
    token = _OVERRIDE.set(catalogue)
    try:
        yield catalogue
    finally:
        _OVERRIDE.reset(token)


def default_profile(accelerator: str | None) -> AcceleratorProfile:
    """The built-in profile of a catalogue accelerator, else the unfitted default (the model as before
    calibration: one matrix-multiply efficiency of 0.75, no shape term, attention at that efficiency)."""
    if accelerator is not None:
        profile = active_catalogue().get(accelerator)
        if profile is not None:
            return profile
    return AcceleratorProfile(
        name=accelerator or "explicit",
        accelerator=accelerator,
        gemm_efficiency=0.75,
        fp8_gemm_efficiency=0.75,
        attention_efficiency=0.75,
        memory_efficiency=1.0,
        collective_efficiency_intra=1.0,
        collective_efficiency_inter=1.0,
        context_bytes=2.0 * GIB,
        memory_headroom_fraction=0.0,
        source="unfitted default (2 GiB headroom)",
    )
