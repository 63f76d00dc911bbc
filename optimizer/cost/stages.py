"""Derive per-stage costs (ms) and memory (bytes) from a model and a cluster.

The formulas for today's decoders (grouped-query attention, SwiGLU, FlashAttention, RoPE, tied embeddings,
tensor parallelism) live in :mod:`pipesched.optimizer.cost` (``flops``, ``memory``, ``collectives``), each with
its source; with a GPT's defaults they reduce to the Zero Bubble paper's formulas below.

Sources and model:

- FLOPs per transformer layer, Zero Bubble paper (Qi et al., ICLR 2024, arXiv 2401.10241), Table 1, counting a
  multiply-add as 2 FLOPs: F = s·b·h·(24h + 4s), I = s·b·h·(24h + 8s), W = s·b·h·24h. With an FFN of inner
  size f instead of 4h: F = s·b·(8h² + 4hf + 4sh), I = s·b·(8h² + 4hf + 8sh), W = s·b·(8h² + 4hf).
- Activation memory per layer, same Table 1 (fp16, no recomputation): M_B = s·b·(34h + 5as) bytes allocated by F,
  M_W = 32·s·b·h bytes still needed by W after I. The split by module (Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models", Sec. 4.1: attention 11sbh + 5as²b, MLP 19sbh, layer
  norms 4sbh) gives, for an FFN of size f, M_B = s·b·(18h + 4f + 5as) and M_W = s·b·(16h + 4f) (linear-layer
  inputs 6sbh + 2sbf plus output gradients 10sbh + 2sbf). Other dtypes scale by bytes/2.
- Time of a pass = matrix-multiply FLOPs / (peak FLOP/s × ``cluster.efficiency``) + elementwise traffic / memory
  bandwidth. The elementwise kernels (layer norm, GeLU, softmax, dropout, bias adds) of F move about
  ``FORWARD_TRAFFIC_PER_ACTIVATION_BYTE`` bytes per byte of stored activation, those of I
  ``BACKWARD_INPUT_TRAFFIC_PER_ACTIVATION_BYTE``; W is matrix multiplies only. The two factors were fitted by
  least squares to the paper's profiled A100 times (Table 6, ``bench/data/zb_paper_settings.json``), with
  the paper's four models together (one pair of factors for all); the fit puts the matrix-multiply
  efficiency at 0.79 and reproduces T_I/T_F and T_W/T_F of all four models within 4%. FLOPs alone would give
  T_W/T_F ≈ 0.93 for the 1.5B model where the profile shows 0.50.
- Static memory per parameter, mixed precision with Adam (Rajbhandari et al. 2020, ZeRO, Sec. 3.1, plus fp32
  main gradients as in Megatron-LM): 2 B weights + 4 B fp32 gradients + 4 B fp32 master weights + 8 B Adam
  moments = 18 B/param (fp32 training: 4 + 4 + 8 = 16). The problem's ``data_parallel`` sharding divides them by
  its size (ZeRO stages 1–3, :func:`pipesched.optimizer.cost.memory.static_bytes_per_parameter_sharded`); fully
  sharded, what a rank keeps is the stack's (:func:`full_sharding_state`: PyTorch FSDP's fp32 parameters,
  Megatron-FSDP's ZeRO-3 buffers, a bf16 model's).
- Parameters: a layer holds 4h² + 4h (attention) + 2hf + f + h (MLP) + 4h (two layer norms); the embedding
  V·h + s·h (learned positions, first stage); the LM head V·h and the final layer norm 2h (last stage).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from pipesched.optimizer.accelerators import accelerator_names, get_accelerator
from pipesched.optimizer.configs import ClusterConfig, ContextParallel, ExpertParallel, ModelConfig, TensorParallel
from pipesched.optimizer.cost.collectives import all_reduce_ms, tensor_parallel_layer_ms
from pipesched.optimizer.cost.context import pytorch_attention_speed, ring_attention
from pipesched.optimizer.cost.experts import expert_groups, expert_tensor_degree, expert_traffic
from pipesched.optimizer.cost.flops import (
    PassFlops,
    embedding_parameters,
    expert_parameters,
    head_parameters,
    layer_flops,
    layer_parameters,
    norm_parameters,
)
from pipesched.optimizer.cost.memory import (
    LayerActivation,
    cross_entropy_bytes,
    layer_activation,
    static_bytes_per_parameter_sharded,
)
from pipesched.optimizer.cost.profile import (
    AcceleratorProfile,
    SoftwareProfile,
    active_catalogue,
    default_profile,
    layout_sharding,
)
from pipesched.optimizer.cost.timing import (
    Hardware,
    PassTimes,
    attention_head_size_factor,
    elementwise_ms,
    gemm_ms,
    gemms_ms,
    layer_gemm_times,
)
from pipesched.optimizer.field_errors import raise_field_errors
from pipesched.optimizer.frameworks import FRAMEWORK_SOFTWARE
from pipesched.optimizer.partition import LayerTie, PartitionError, layer_tie, partition_layers
from pipesched.optimizer.problem import Costs, DataParallel, Memory, Pipeline
from pipesched.optimizer.units import format_bytes

__all__ = [
    "BACKWARD_INPUT_TRAFFIC_PER_ACTIVATION_BYTE",
    "FORWARD_TRAFFIC_PER_ACTIVATION_BYTE",
    "Block",
    "DerivedProblem",
    "Hardware",
    "activation_reserve",
    "attention_ms",
    "blended",
    "derive_costs_and_memory",
    "derive_problem",
    "embedding_block",
    "full_sharding_state",
    "head_block",
    "headroom_bytes",
    "register_profile",
    "registered_profiles",
    "resolve_hardware",
    "transformer_layer",
]

#: Bytes the forward's elementwise kernels move through device memory per byte of stored activation
#: (fitted to the Zero Bubble paper's Table 6 A100 profiles, see the module docstring).
FORWARD_TRAFFIC_PER_ACTIVATION_BYTE = 4.73
#: The same for the input-gradient backward I.
BACKWARD_INPUT_TRAFFIC_PER_ACTIVATION_BYTE = 4.10

_Errors = list[tuple[tuple[str | int, ...], str, Any]]


@dataclass(frozen=True)
class Block:
    """Times (ms), memory (bytes) and parameters of one block (a layer, the embedding, the head) for one microbatch.

    ``activation_bytes`` is allocated by F; ``retained_bytes`` of it is still held after I until W.
    ``transient_bytes``: the most one of its passes allocates and frees on top of what is held (a recomputed
    layer's other activations, the loss's fp32 logits and their gradients); blocks in sequence run one pass at a
    time, so their transient is the largest, not the sum. ``parameters`` counts everything the rank holds,
    ``expert_parameters`` the routed experts among them (sharded over the expert-data-parallel group rather than
    the data-parallel one).
    """

    forward_ms: float = 0.0
    backward_input_ms: float = 0.0
    backward_weight_ms: float = 0.0
    activation_bytes: float = 0.0
    retained_bytes: float = 0.0
    parameters: float = 0.0
    expert_parameters: float = 0.0
    transient_bytes: float = 0.0

    def times(self, count: int) -> Block:
        """``count`` copies of this block in sequence."""
        return Block(
            self.forward_ms * count,
            self.backward_input_ms * count,
            self.backward_weight_ms * count,
            self.activation_bytes * count,
            self.retained_bytes * count,
            self.parameters * count,
            self.expert_parameters * count,
            self.transient_bytes if count else 0.0,
        )

    def __add__(self, other: Block) -> Block:
        return Block(
            self.forward_ms + other.forward_ms,
            self.backward_input_ms + other.backward_input_ms,
            self.backward_weight_ms + other.backward_weight_ms,
            self.activation_bytes + other.activation_bytes,
            self.retained_bytes + other.retained_bytes,
            self.parameters + other.parameters,
            self.expert_parameters + other.expert_parameters,
            max(self.transient_bytes, other.transient_bytes),
        )

    @property
    def compute_ms(self) -> float:
        """F + I + W, ms."""
        return self.forward_ms + self.backward_input_ms + self.backward_weight_ms


#: Profiles registered by name for this process (``pipesched calibrate`` output given to ``--profile`` or
#: ``POST /v1/profiles``), looked up before the built-in ones by ``cluster.profile``.
_REGISTERED: dict[str, AcceleratorProfile] = {}


def register_profile(profile: AcceleratorProfile) -> None:
    """Make ``profile`` selectable by ``cluster.profile`` (its ``name``, case-insensitive) in this process."""
    _REGISTERED[profile.name.lower()] = profile


def registered_profiles() -> list[AcceleratorProfile]:
    """The profiles :func:`register_profile` made selectable, in registration order."""
    return list(_REGISTERED.values())


def _profile_errors(cluster: ClusterConfig) -> tuple[AcceleratorProfile | None, _Errors]:
    name = cluster.profile
    if name is None:
        return None, []
    profile = _REGISTERED.get(name.lower()) or active_catalogue().get(name)
    if profile is not None:
        stated, own = cluster.accelerator, profile.accelerator
        if stated is not None and own is not None and stated.lower() != own.lower():
            message = (
                f"profile {profile.name!r} was calibrated on {own}, but cluster.accelerator is {stated}: drop "
                f"cluster.accelerator (the profile's {own} is used), or name a profile of {stated} (built in: "
                f"{stated}; or `pipesched calibrate` your {stated} runs)"
            )
            return None, [(("cluster", "profile"), message, name)]
        return profile, []
    known = sorted({*active_catalogue().profiles, *(p.name for p in _REGISTERED.values())})
    message = (
        f"unknown profile {name!r}: use one of {', '.join(known)}, or register one made by `pipesched calibrate` "
        "(POST /v1/profiles, or --profile FILE on the command line)"
    )
    return None, [(("cluster", "profile"), message, name)]


def _unknown_accelerator(cluster: ClusterConfig) -> None:
    raise_field_errors(
        "ClusterConfig",
        [
            (
                ("cluster", "accelerator"),
                f"unknown accelerator {cluster.accelerator!r}: use one of {', '.join(accelerator_names())}, "
                "or give memory_bytes, flops_per_s and memory_bandwidth_bytes_per_s instead",
                cluster.accelerator,
            )
        ],
    )


def resolve_hardware(cluster: ClusterConfig, framework: str | None = None) -> Hardware:
    """The accelerator's figures and profile: the catalogue entry and its calibrated profile (or
    ``cluster.profile``), overridden by explicit numbers (``cluster.efficiency`` overrides the profile's
    bf16 matrix-multiply efficiency); with a ``framework`` (``model.framework``) the software profile carries what
    it runs (:data:`~pipesched.optimizer.frameworks.FRAMEWORK_SOFTWARE`).

    Raises:
        pydantic.ValidationError: ``cluster.accelerator`` or ``cluster.profile`` unknown (the message lists the
            known ones), or no accelerator and some of memory_bytes / flops_per_s / memory_bandwidth_bytes_per_s
            missing.
    """

    memory, flops, bandwidth = cluster.memory_bytes, cluster.flops_per_s, cluster.memory_bandwidth_bytes_per_s
    named, errors = _profile_errors(cluster)
    raise_field_errors("ClusterConfig", errors)
    accelerator = cluster.accelerator or (named.accelerator if named is not None else None)
    name = accelerator or "explicit"
    fp8: float | None = None
    per_exponential: float | None = None
    if accelerator is not None:
        try:
            entry = get_accelerator(accelerator)
        except KeyError:
            _unknown_accelerator(cluster)
            raise  # unreachable: raise_field_errors raised
        name = entry.name
        memory = memory if memory is not None else entry.memory_bytes
        flops = flops if flops is not None else entry.flops_per_s
        bandwidth = bandwidth if bandwidth is not None else entry.memory_bandwidth_bytes_per_s
        fp8 = entry.fp8_flops_per_s * (flops / entry.flops_per_s) if entry.fp8_flops_per_s is not None else None
        per_exponential = entry.flops_per_exponential
    errors = [
        (
            ("cluster", field_name),
            f"cluster.{field_name} is needed when no catalogue accelerator is named: give it, or set "
            f"cluster.accelerator to one of {', '.join(accelerator_names())}",
            None,
        )
        for field_name, value in (
            ("memory_bytes", memory),
            ("flops_per_s", flops),
            ("memory_bandwidth_bytes_per_s", bandwidth),
        )
        if value is None
    ]
    raise_field_errors("ClusterConfig", errors)
    assert memory is not None and flops is not None and bandwidth is not None
    profile = named if named is not None else default_profile(accelerator)
    calibrated = named is not None or (accelerator is not None and active_catalogue().get(accelerator) is not None)
    software = active_catalogue().software if calibrated else _UNFITTED_SOFTWARE
    if framework is not None:
        software = software.model_copy(update=FRAMEWORK_SOFTWARE[framework])
    efficiency = cluster.efficiency if cluster.efficiency is not None else profile.gemm_efficiency
    if cluster.attention_efficiency is not None:
        profile = profile.model_copy(update={"attention_efficiency": cluster.attention_efficiency})
    return Hardware(
        name, float(memory), float(flops), float(bandwidth), efficiency, fp8, profile, software, per_exponential
    )


#: The software factors of an uncalibrated accelerator: the cost model as fitted to the Zero Bubble paper's
#: Megatron profiles (module docstring), no launch bound.
_UNFITTED_SOFTWARE = SoftwareProfile(
    cpu_us_per_kernel={"eager": 0.0, "compiled": 0.0, "fused": 0.0}, attention_backward_speed=1.0
)


def headroom_bytes(cluster: ClusterConfig, hardware: Hardware) -> float:
    """Bytes kept free per GPU: ``cluster.memory_headroom_bytes``, else the profile's default (5% of the
    memory + the CUDA context for calibrated accelerators, 2 GiB otherwise)."""
    if cluster.memory_headroom_bytes is not None:
        return float(cluster.memory_headroom_bytes)
    return hardware.profile.headroom_bytes(hardware.memory_bytes)


def _ms(flops: float, traffic_bytes: float, hardware: Hardware) -> float:
    """Legacy helper: ``flops`` at the bf16 matrix-multiply rate plus ``traffic_bytes`` at memory speed, ms."""
    return 1e3 * flops / hardware.effective_flops_per_s + elementwise_ms(traffic_bytes, hardware)


def _tp(tensor_parallel: TensorParallel | None) -> tuple[int, bool]:
    if tensor_parallel is None:
        return 1, True
    return tensor_parallel.size, tensor_parallel.sequence_parallel


def _tensor_parallel_ms(
    model: ModelConfig, hardware: Hardware, tensor_parallel: TensorParallel | None, cluster: ClusterConfig | None
) -> tuple[float, float]:
    """(exposed, total) tensor-parallel communication of one layer's F (equally I), ms.

    Over the intra-node link at the profile's achieved fraction; with ``async_communication`` the software's
    ``async_tensor_parallel_hidden`` share of it (net of what it costs the multiplies it overlaps) runs beside
    the matrix multiplies, the rest stays exposed. FP8 layers with sequence parallelism gather in FP8, whichever
    stack runs them: PyTorch's (kernels ``eager`` or ``compiled``: torchao's Float8) and Transformer Engine's
    (``fused``: Megatron-Core, NeMo)
    (:func:`~pipesched.optimizer.cost.collectives.tensor_parallel_layer_ms`).
    """
    t, sequence_parallel = _tp(tensor_parallel)
    if t <= 1:
        return 0.0, 0.0
    bandwidth = cluster.intra_node_bandwidth_bytes_per_s if cluster is not None else 450e9
    latency = cluster.collective_latency_ms if cluster is not None else 0.0
    achieved = bandwidth * hardware.profile.collective_efficiency_intra
    float8 = sequence_parallel and model.precision == "fp8"
    total = tensor_parallel_layer_ms(model, t, achieved, latency, float8_gathers=float8)
    if tensor_parallel is not None and tensor_parallel.async_communication:
        hidden = hardware.software.async_tensor_parallel_hidden
        return (1 - hidden) * total, total
    return total, total


def attention_ms(flops: float, model: ModelConfig, hardware: Hardware, *, backward: bool = False) -> float:
    """FlashAttention at the profile's efficiency (its backward at ``attention_backward_speed`` of that; under
    PyTorch's FlashAttention-2 at :func:`~pipesched.optimizer.cost.context.pytorch_attention_speed` of it; heads
    other than 128 wide scaled by :func:`~pipesched.optimizer.cost.timing.attention_head_size_factor`), eager
    attention's products at the matrix-multiply rate, ms."""
    if model.attention == "flash":
        speed = hardware.software.attention_backward_speed if backward else 1.0
        speed *= pytorch_attention_speed(model, hardware)
        head_size = attention_head_size_factor(model, hardware, backward=backward)
        return 1e3 * flops * head_size / (hardware.flops_per_s * hardware.profile.attention_efficiency * speed)
    return 1e3 * flops / hardware.effective_flops_per_s


def activation_reserve(model: ModelConfig, hardware: Hardware) -> float:
    """What the allocator holds per modelled activation byte: the profile's ``activation_memory_factor``,
    fitted to torchtitan's reserved peaks (eager and compiled PyTorch keep unfused intermediates and the caching
    allocator fragments); the software's ``fused_activation_memory_factor`` with hand-fused kernels —
    Megatron-Core's activations are what Korthikanti et al. (2022, §6) count and measure, and published Megatron
    layouts run where the eager factor would not fit them (Megatron Bridge's Qwen3-235B-A22B recipe on 256 H100s:
    TP 2, PP 8 × 4 virtual stages, EP 32, no recomputation). Kernels "unknown" hold the larger of the modes'
    (:func:`blended`): a plan that fits then fits whatever the framework."""
    if model.kernels == "fused":
        return hardware.software.fused_activation_memory_factor
    return hardware.profile.activation_memory_factor


def _cp(context_parallel: ContextParallel | None) -> int:
    return context_parallel.size if context_parallel is not None else 1


def _ep(expert_parallel: ExpertParallel | None) -> tuple[int, bool]:
    if expert_parallel is None:
        return 1, False
    return expert_parallel.size, expert_parallel.overlap


def _etp(expert_parallel: ExpertParallel | None) -> int | None:
    """The stated expert tensor parallelism e_t (``None``: :func:`~pipesched.optimizer.cost.experts.expert_groups`'
    default)."""
    return expert_parallel.tensor_parallel if expert_parallel is not None else None


def _layer_parameters(model: ModelConfig, t: int, ep: int, moe: bool, e_t: int | None = None) -> tuple[float, float]:
    """(parameters on one rank, routed-expert parameters among them) of one layer: the matrices split t ways
    (norms and the router replicated), the routed experts E/ep per rank, 1/e_t of each
    (:mod:`pipesched.optimizer.cost.experts`)."""
    norms = 2 * norm_parameters(model)
    if not (moe and model.is_moe):
        return (layer_parameters(model) - norms) / t + norms, 0.0
    groups = expert_groups(model, t, ep, e_t)
    router = (model.num_experts or 0) * model.hidden_size
    routed = (model.num_experts or 0) * expert_parameters(model)
    split = layer_parameters(model, moe=True) - norms - router - routed
    local_experts = groups.experts_per_rank * expert_parameters(model) / groups.expert_tensor_parallel
    return split / t + norms + router + local_experts, local_experts


def _parallel_communication_ms(
    model: ModelConfig,
    cluster: ClusterConfig | None,
    hardware: Hardware,
    flops: PassFlops,
    t: int,
    c: int,
    expert_parallel: ExpertParallel | None,
    moe: bool,
) -> tuple[float, float]:
    """Exposed context- and expert-parallel communication of one layer's F and I, ms
    (:mod:`pipesched.optimizer.cost.context`, :mod:`pipesched.optimizer.cost.experts`), on the links at the
    profile's achieved fractions; a MoE dispatcher's cross-node leg at its own where the software profile lists it
    (``moe_dispatch_efficiency_inter``)."""
    ep, overlap = _ep(expert_parallel)
    if cluster is None or (c <= 1 and (ep <= 1 or not moe)):
        return 0.0, 0.0
    profile = hardware.profile
    intra = cluster.intra_node_bandwidth_bytes_per_s * profile.collective_efficiency_intra
    inter = cluster.inter_node_bandwidth_bytes_per_s * profile.collective_efficiency_inter
    forward = backward = 0.0
    if c > 1:
        ring = ring_attention(
            model,
            cluster,
            t,
            c,
            attention_forward_ms=attention_ms(flops.attention_forward, model, hardware),
            attention_backward_ms=attention_ms(flops.attention_backward, model, hardware, backward=True),
            bandwidth_bytes_per_s=intra if t * c <= cluster.gpus_per_node else inter,
        )
        forward = ring.forward_exposed_ms + elementwise_ms(ring.forward_merge_bytes, hardware)
        backward = ring.backward_input_exposed_ms + elementwise_ms(ring.backward_input_merge_bytes, hardware)
    if ep > 1 and moe and model.is_moe:
        groups = expert_groups(model, t, ep, _etp(expert_parallel))
        dispatcher = hardware.software.moe_dispatcher
        dispatch_inter = hardware.software.moe_dispatch_efficiency_inter.get(
            dispatcher, profile.collective_efficiency_inter
        )
        traffic = expert_traffic(
            model,
            cluster,
            groups,
            t,
            c,
            intra_bandwidth_bytes_per_s=intra,
            inter_bandwidth_bytes_per_s=cluster.inter_node_bandwidth_bytes_per_s * dispatch_inter,
            hierarchical=dispatcher == "hierarchical",
        )
        if overlap:  # the other microbatch's pass hides up to its own length
            forward += max(0.0, traffic.forward_ms - _ms(flops.forward, 0.0, hardware))
            backward += max(0.0, traffic.backward_input_ms - _ms(flops.backward_input, 0.0, hardware))
        else:
            forward += traffic.forward_ms
            backward += traffic.backward_input_ms
    return forward, backward


def _recomputation_ms(
    model: ModelConfig,
    hardware: Hardware,
    flops: PassFlops,
    memory: LayerActivation,
    forward_ms: float,
    exposed_ms: float,
    gemm: tuple[float, float, float],
) -> float:
    """What recomputation adds to a layer's I, ms (:func:`transformer_layer`). ``gemm``: the forward's matrix
    multiplies (ms), their FP8 casts (ms) and multi-head latent attention's up-projections among them (ms).
    Selective on a mixture-of-experts model is Megatron's recipe
    (:func:`pipesched.optimizer.cost.memory.megatron_selective_bytes`): the norms and activation functions
    rerun over the bytes they dropped, and MLA's up-projections."""
    software, mode = hardware.software, model.kernels
    traffic = software.elementwise_traffic[mode]
    kernels = software.kernels_per_layer[mode]
    recomputed_bytes = memory.full - memory.activation
    if model.activation_recomputation == "selective" and model.is_moe:
        rerun = PassTimes(
            gemm[2],
            0.0,
            elementwise_ms(FORWARD_TRAFFIC_PER_ACTIVATION_BYTE * traffic * recomputed_bytes, hardware),
            0.0,
            0.25 * kernels,
        )
        return rerun.total_ms(hardware, mode)
    if model.activation_recomputation == "selective" and model.attention == "flash":
        # torchtitan's op-level policy: half of the matrix multiplies and the elementwise ops they feed rerun
        total, cast, _ = gemm
        rerun = PassTimes(
            0.5 * total,
            0.0,
            elementwise_ms(FORWARD_TRAFFIC_PER_ACTIVATION_BYTE * traffic * recomputed_bytes, hardware),
            0.5 * cast,
            0.5 * kernels,
        )
        return rerun.total_ms(hardware, mode) + exposed_ms / 2
    if model.activation_recomputation == "selective":
        return _ms(
            flops.attention_forward if memory.scores else 0.0,
            FORWARD_TRAFFIC_PER_ACTIVATION_BYTE * traffic * memory.scores,
            hardware,
        )
    if model.activation_recomputation == "full":
        return forward_ms
    return 0.0


def _layer_gemm(
    model: ModelConfig, hardware: Hardware, t: int, c: int, ep: int, moe: bool, e_t: int | None = None
) -> tuple[float, float, float]:
    """(forward matrix multiplies ms, their FP8 casts ms, multi-head latent attention's up-projections ms) of
    one layer (:func:`pipesched.optimizer.cost.timing.layer_gemms`)."""
    gemm, cast_bytes = layer_gemm_times(
        model, hardware, t, moe=moe, context_parallel=c, expert_parallel=ep, expert_tensor_parallel=e_t
    )
    up_projections = 0.0
    if model.is_mla:
        tokens = model.seq_length * model.micro_batch_size / c
        a, nope = model.num_attention_heads, model.qk_nope_head_dim or 0
        rope, value = model.qk_rope_head_dim or 0, model.v_head_dim or 0
        shapes = [(tokens, a * (nope + value) / t, float(model.kv_lora_rank or 0))]
        if model.q_lora_rank is not None:
            shapes.append((tokens, a * (nope + rope) / t, float(model.q_lora_rank)))
        up_projections, _ = gemms_ms(shapes, model, hardware)
    return gemm, elementwise_ms(cast_bytes, hardware), up_projections


#: Extra bytes per element eager PyTorch moves over a fused kernel: RMSNorm written as float casts, a square, a
#: mean, a reciprocal square root and two products (torchtitan's ``RMSNorm``: about 34 bytes per element against
#: a fused kernel's 4); RoPE as complex products with casts (about 20 against 8); SwiGLU's SiLU and product as two
#: kernels (10 against 6).
UNFUSED_BYTES_PER_ELEMENT = {"rmsnorm": 30.0, "rope": 12.0, "swiglu": 4.0}


def _unfused_traffic(
    model: ModelConfig, tensor_parallel: int, hardware: Hardware, *, context_parallel: int = 1, moe: bool = False
) -> float:
    """Bytes eager PyTorch moves beyond fused kernels in one layer's forward (its backward: twice), for the
    operations Llama-style decoders add (:data:`UNFUSED_BYTES_PER_ELEMENT`, scaled by the software's fitted
    ``unfused_traffic``); none when compiled or fused (kernels "unknown" blend the modes: :func:`blended`).
    A rank holds s·b/c tokens; a mixture-of-experts layer's SwiGLU runs over its active experts' width
    (k·imbalance routed plus the shared)."""
    if model.kernels != "eager":
        return 0.0
    tokens = model.seq_length * model.micro_batch_size / context_parallel
    h, f, t = model.hidden_size, model.ffn_size, tensor_parallel
    if moe and model.is_moe:
        active = (model.num_experts_per_token or 1) * model.moe_load_imbalance + model.num_shared_experts
        f = int(active * model.expert_ffn_size)
    k = model.head_size * model.key_value_heads
    elements = 0.0
    if model.norm == "rmsnorm":
        elements += UNFUSED_BYTES_PER_ELEMENT["rmsnorm"] * 2 * h / t
    if model.position_embedding == "rope":
        elements += UNFUSED_BYTES_PER_ELEMENT["rope"] * (h + k) / t
    if model.ffn_type == "swiglu":
        elements += UNFUSED_BYTES_PER_ELEMENT["swiglu"] * f / t
    return tokens * elements * hardware.software.unfused_traffic


def transformer_layer(
    model: ModelConfig,
    hardware: Hardware,
    tensor_parallel: TensorParallel | None = None,
    cluster: ClusterConfig | None = None,
    *,
    moe: bool = False,
    context_parallel: ContextParallel | None = None,
    expert_parallel: ExpertParallel | None = None,
    sharding: str | None = None,
) -> Block:
    """One transformer layer for one microbatch on one tensor-parallel rank (see the module docstring).

    Times from :mod:`pipesched.optimizer.cost.timing` (matrix multiplies by shape and precision, FlashAttention,
    elementwise traffic by kernels mode, FP8 casts, the launch bound), FLOPs from
    :func:`pipesched.optimizer.cost.flops.layer_flops`, activation bytes from
    :func:`pipesched.optimizer.cost.memory.layer_activation`, tensor-parallel communication over ``cluster``'s
    intra-node link (added to F and I: Megatron does not overlap it; AsyncTP does, ``async_communication``).

    Recomputation: ``selective`` drops the attention scores (eager attention) and reruns the attention core
    inside I; with FlashAttention it is torchtitan's op-level policy (:mod:`pipesched.optimizer.cost.memory`),
    rerunning half of the forward's matrix multiplies and the elementwise ops inside I; ``full`` keeps only the
    layer input until the backward, reruns the whole forward inside I and keeps that input until W; the
    recomputed layer's activations beyond those kept are the block's ``transient_bytes`` (they live through its
    I only). Activation bytes are scaled by the profile's ``activation_memory_factor`` (allocator reserve over the
    tensors, fitted to published peaks) with eager or compiled kernels (:func:`activation_reserve`).

    ``moe``: a mixture-of-experts layer of ``model`` (its active experts' FLOPs, every expert's parameters);
    ``context_parallel`` shards the sequence (FLOPs and activations ÷ c, ring attention's exposed transfers
    added to F and I); ``expert_parallel`` shards the routed experts and adds the exposed all-to-alls to F and I.
    With expert parallelism the experts run whole on each rank, so tensor parallelism's collectives cover the
    attention half only. Kernels "unknown": the expected layer over the frameworks that run the layout's
    data-parallel ``sharding`` (:func:`blended`; ``None``: no data parallelism).
    """
    if model.kernels == "unknown":
        said = partial(
            transformer_layer,
            hardware=hardware,
            tensor_parallel=tensor_parallel,
            cluster=cluster,
            moe=moe,
            context_parallel=context_parallel,
            expert_parallel=expert_parallel,
        )
        return blended(said, model, hardware, sharding)
    t, sequence_parallel = _tp(tensor_parallel)
    c = _cp(context_parallel)
    ep, _ = _ep(expert_parallel)
    flops = layer_flops(model, t, moe=moe, context_parallel=c)
    e_t = expert_tensor_degree(t, ep, _etp(expert_parallel)) if moe and model.is_moe else 1
    memory = layer_activation(model, t, sequence_parallel, moe=moe, context_parallel=c, expert_tensor_parallel=e_t)
    software, mode = hardware.software, model.kernels
    traffic = software.elementwise_traffic[mode]
    gemm = _layer_gemm(model, hardware, t, c, ep, moe, _etp(expert_parallel))
    kernels = software.kernels_per_layer[mode]
    exposed, _ = _tensor_parallel_ms(model, hardware, tensor_parallel, cluster)
    exposed /= c
    if moe and model.is_moe and ep > 1:
        exposed /= 2  # the experts run whole: only attention's collectives remain
    forward_extra, backward_extra = _parallel_communication_ms(
        model, cluster, hardware, flops, t, c, expert_parallel, moe
    )
    unfused = _unfused_traffic(model, t, hardware, context_parallel=c, moe=moe)
    forward_elementwise = elementwise_ms(
        FORWARD_TRAFFIC_PER_ACTIVATION_BYTE * traffic * memory.full + unfused, hardware
    )
    forward = PassTimes(
        gemm[0],
        attention_ms(flops.attention_forward, model, hardware),
        forward_elementwise,
        gemm[1],
        kernels,
    )
    backward_input = PassTimes(
        gemm[0],
        attention_ms(flops.attention_backward, model, hardware, backward=True),
        elementwise_ms(BACKWARD_INPUT_TRAFFIC_PER_ACTIVATION_BYTE * traffic * memory.full + 2 * unfused, hardware),
        gemm[1],
        1.5 * kernels,
    )
    host = software.moe_layer_host_ms if moe and model.is_moe else 0.0
    forward_ms = max(forward.total_ms(hardware, mode) + exposed + forward_extra, host)
    backward_input_ms = max(backward_input.total_ms(hardware, mode) + exposed + backward_extra, 1.5 * host)
    backward_input_ms += _recomputation_ms(model, hardware, flops, memory, forward_ms, exposed, gemm)
    parameters, local_experts = _layer_parameters(model, t, ep, moe, _etp(expert_parallel))
    reserve = activation_reserve(model, hardware)
    return Block(
        forward_ms=forward_ms,
        backward_input_ms=backward_input_ms,
        backward_weight_ms=max(PassTimes(gemm[0], 0.0, 0.0, gemm[1], 0.5 * kernels).total_ms(hardware, mode), host / 2),
        activation_bytes=memory.activation * reserve,
        retained_bytes=memory.retained * reserve,
        parameters=parameters,
        expert_parameters=local_experts,
        transient_bytes=(memory.full - memory.activation) * reserve,
    )


def blended(
    make: Callable[[ModelConfig], Block], model: ModelConfig, hardware: Hardware, sharding: str | None
) -> Block:
    """``make(model)``, or with kernels "unknown" the expected block over the frameworks that run the layout: the
    times Σ share · time over the kernels modes (the software's ``kernels_shares`` for the layout's class,
    ``sharding`` as :func:`~pipesched.optimizer.cost.profile.layout_sharding` gives it, or of the model's
    ``kernels_prior``: the share of each mode among the published runs of that class), the memory the largest of
    those modes' (a plan that fits then fits whichever of those frameworks runs it; a mode no published run of the
    class ran neither times nor sizes it). The expected time, not the expected speed: a pass's time is what its
    share of the runs spends."""
    if model.kernels != "unknown":
        return make(model)
    shares = hardware.software.kernels_shares("unknown", sharding, model.kernels_prior)
    blocks = {mode: make(model.model_copy(update={"kernels": mode})) for mode in shares}
    total = sum(shares.values())

    def expected(name: str) -> float:
        return sum(share * getattr(blocks[mode], name) for mode, share in shares.items()) / total

    largest = max(blocks.values(), key=lambda block: block.activation_bytes)
    return Block(
        forward_ms=expected("forward_ms"),
        backward_input_ms=expected("backward_input_ms"),
        backward_weight_ms=expected("backward_weight_ms"),
        activation_bytes=largest.activation_bytes,
        retained_bytes=max(block.retained_bytes for block in blocks.values()),
        parameters=largest.parameters,
        expert_parameters=largest.expert_parameters,
        transient_bytes=max(block.transient_bytes for block in blocks.values()),
    )


def embedding_block(
    model: ModelConfig,
    hardware: Hardware,
    tensor_parallel: TensorParallel | None = None,
    cluster: ClusterConfig | None = None,
    *,
    context_parallel: int = 1,
) -> Block:
    """Token (+ learned position) embedding on the first stage: memory-bound gather (F) and scatter-add (W).

    F writes s·b·h elements and adds positions (3 passes over s·b·h); I is empty (token ids need no gradient);
    W accumulates s·b·h gradient rows into the fp32 table (read + write, 8 bytes each). Activation: the embedding
    dropout mask, s·b·h bytes. Parameters V·h (+ s·h learned positions), split over the vocabulary by tensor
    parallelism, whose partial outputs are all-reduced (one all-reduce of s·b·h in F). ``context_parallel`` c:
    each rank embeds s/c of the tokens.
    """
    t, _ = _tp(tensor_parallel)
    s, b, h, d = model.seq_length, model.micro_batch_size, model.hidden_size, model.dtype_bytes
    tokens = s * b * h / context_parallel
    communication_ms = 0.0
    if t > 1:
        bandwidth = cluster.intra_node_bandwidth_bytes_per_s if cluster is not None else 450e9
        communication_ms = all_reduce_ms(tokens * d, t, bandwidth * hardware.profile.collective_efficiency_intra)
    return Block(
        forward_ms=elementwise_ms(3 * tokens * d / t, hardware) + communication_ms,
        backward_input_ms=0.0,
        backward_weight_ms=elementwise_ms((8 * tokens + tokens * d) / t, hardware),
        activation_bytes=tokens / t,
        retained_bytes=0.0,
        parameters=embedding_parameters(model) / t,
    )


def head_block(
    model: ModelConfig,
    hardware: Hardware,
    tensor_parallel: TensorParallel | None = None,
    *,
    separate_copy: bool = True,
    context_parallel: int = 1,
    sharding: str | None = None,
) -> Block:
    """Final norm, LM head and cross-entropy loss on the last stage.

    FLOPs: F = 2·s·b·h·V (the logits), I = 2·s·b·h·V (gradient of the head input), W = 2·s·b·h·V, each split by
    tensor parallelism over the vocabulary, one (s·b, V/t, h) matrix multiply each, in bf16 (FP8 recipes keep the
    output layer in bf16). Traffic: F writes the logits and the fp32 softmax ((2d + 4)·s·b·V bytes), I reads the
    softmax and writes the logits' gradient, scaled like the layers' by the kernels mode. Activation: the norm's
    input and output (2·s·b·h·d) plus what the cross-entropy keeps of the logits for its backward, its passes'
    fp32 copies and gradients the block's ``transient_bytes``
    (:func:`~pipesched.optimizer.cost.memory.cross_entropy_bytes` of :func:`cross_entropy_of`); W still needs the
    head input and the logits' gradient (s·b·h·d + s·b·V·d). A tied head holds the V·h matrix only as a
    ``separate_copy`` (the last stage of a pipeline keeps a copy, as Megatron does). ``context_parallel`` c: each
    rank computes the logits of s/c tokens.
    ``sharding``: kernels "unknown" as in :func:`transformer_layer`.
    """
    if model.kernels == "unknown":
        return blended(
            lambda of: head_block(
                of, hardware, tensor_parallel, separate_copy=separate_copy, context_parallel=context_parallel
            ),
            model,
            hardware,
            sharding,
        )
    t, _ = _tp(tensor_parallel)
    b, h, v, d = model.micro_batch_size, model.hidden_size, model.vocab_size, model.dtype_bytes
    s = model.seq_length / context_parallel
    logits = s * b * v / t
    gemm = gemm_ms(s * b, v / t, h, hardware)
    traffic = hardware.software.elementwise_traffic[model.kernels]
    norm = norm_parameters(model)
    reserve = activation_reserve(model, hardware)
    held, transient = cross_entropy_bytes(cross_entropy_of(model, hardware, t))
    return Block(
        forward_ms=gemm + elementwise_ms(traffic * (2 * d + 4) * logits, hardware),
        backward_input_ms=gemm + elementwise_ms(traffic * (4 + d) * logits, hardware),
        backward_weight_ms=gemm,
        activation_bytes=(2 * s * b * h * d + held * logits) * reserve,
        retained_bytes=(s * b * h * d + logits * d) * reserve,
        parameters=(head_parameters(model, separate_copy=separate_copy) - norm) / t + norm,
        transient_bytes=transient * logits * reserve,
    )


def cross_entropy_of(model: ModelConfig, hardware: Hardware, tensor_parallel: int = 1) -> str:
    """How the loss is computed (:data:`~pipesched.optimizer.cost.memory.CROSS_ENTROPY_BYTES`): Megatron-Core's
    ``vocab_parallel`` with hand-fused kernels, else the software profile's ``pytorch_cross_entropy`` (torchtitan's
    ``fp32`` for a plan; a calibration row of llm-foundry states flash-attn's ``fused``), which a compiled plan
    compiles with its layers (``compiled``: the profile's ``pytorch_compiled_loss``, torchtitan's practice from
    April 2025). Over ``tensor_parallel`` > 1 ranks torchtitan's loss-parallel cross-entropy saves its fp32
    log-probabilities explicitly, so it stays ``fp32``."""
    if model.kernels == "fused":
        return "vocab_parallel"
    implementation = hardware.software.pytorch_cross_entropy
    compiled = model.kernels == "compiled" and hardware.software.pytorch_compiled_loss and tensor_parallel == 1
    return "compiled" if compiled and implementation == "fp32" else implementation


@dataclass
class DerivedProblem:
    """What :func:`derive_problem` derived.

    Attributes:
        costs, memory: the contract's sections (ms, bytes).
        layers_per_stage: transformer layers per model stage.
        stages: per model stage, the summed :class:`Block` (times ms, bytes, parameters).
        static_bytes: per rank, weights + gradients + optimizer state.
        limit_bytes: per rank, accelerator memory minus the headroom.
        hardware: the resolved accelerator.
        largest_unit: per model stage, parameters of its largest FSDP unit (a transformer block, the token
            embedding, or the final norm with the head: torchtitan's ``fully_shard`` units).
        transient_bytes: per rank, the largest pass transient of its stages (:func:`rank_transient_bytes`),
            counted in ``static_bytes`` and ``memory.static``.
        tie: when the partition chose among time-tied splits (:class:`~pipesched.optimizer.partition.LayerTie`;
            ``layers_per_stage`` is its model-order choice), the tie; ``None`` for a split given or without a tie.
        fits: whether a split fits every rank by the partition's memory bound (static + one microbatch of each
            of its stages within ``limit_bytes``).
        full_state: how fully sharded state is kept (:func:`full_sharding_state`), for the step model's static.
    """

    costs: Costs
    memory: Memory
    layers_per_stage: list[int]
    stages: list[Block] = field(default_factory=list)
    static_bytes: list[float] = field(default_factory=list)
    limit_bytes: float = math.inf
    hardware: Hardware | None = None
    largest_unit: list[float] = field(default_factory=list)
    transient_bytes: list[float] = field(default_factory=list)
    tie: LayerTie | None = None
    fits: Callable[[list[int]], bool] | None = None
    full_state: str = "zero3"


def _check_layers_per_stage(model: ModelConfig, num_stages: int) -> _Errors:
    errors: _Errors = []
    if model.num_layers < num_stages and model.layers_per_stage is None:
        errors.append(
            (
                ("model", "num_layers"),
                f"{model.num_layers} layers cannot fill {num_stages} stages: use ≤ {model.num_layers} stages "
                "(num_ranks × stages_per_rank), more layers, or an explicit model.layers_per_stage",
                model.num_layers,
            )
        )
    layers = model.layers_per_stage
    if layers is not None:
        loc: tuple[str | int, ...] = ("model", "layers_per_stage")
        if len(layers) != num_stages:
            errors.append(
                (loc, f"layers_per_stage has {len(layers)} entries but the pipeline has {num_stages} stages", layers)
            )
        elif sum(layers) != model.num_layers:
            errors.append(
                (loc, f"layers_per_stage sums to {sum(layers)} but model.num_layers is {model.num_layers}", layers)
            )
        else:
            for stage, count in enumerate(layers):
                if count < 0 or (count == 0 and 0 < stage < num_stages - 1):
                    errors.append(
                        (
                            (*loc, stage),
                            f"stage {stage} gets {count} layers: every stage needs ≥ 1 layer (the first and last "
                            "may have 0, holding only the embedding or the head)",
                            count,
                        )
                    )
    return errors


def _check_tensor_parallel(
    model: ModelConfig, cluster: ClusterConfig, tensor_parallel: TensorParallel | None
) -> _Errors:
    if tensor_parallel is None or tensor_parallel.size == 1:
        return []
    t = tensor_parallel.size
    valid = [
        d
        for d in range(1, cluster.gpus_per_node + 1)
        if cluster.gpus_per_node % d == 0
        and model.num_attention_heads % d == 0
        and model.key_value_heads % d == 0
        and model.ffn_size % d == 0
    ]
    problems = []
    if t > cluster.gpus_per_node:
        problems.append(f"exceeds cluster.gpus_per_node {cluster.gpus_per_node} (tensor parallelism stays in a node)")
    if model.num_attention_heads % t or model.key_value_heads % t:
        problems.append(
            f"does not divide the {model.num_attention_heads} attention heads "
            f"and {model.key_value_heads} key/value heads"
        )
    if model.ffn_size % t:
        problems.append(f"does not divide ffn_hidden_size {model.ffn_size}")
    if not problems:
        return []
    return [
        (
            ("tensor_parallel", "size"),
            f"tensor_parallel {t} {' and '.join(problems)}: use {', '.join(str(d) for d in valid)}",
            t,
        )
    ]


def full_sharding_state(
    model: ModelConfig, software: SoftwareProfile, sharding: str | None = None, *, gradient_bytes: float = 4.0
) -> str:
    """How the stack that runs ``model``'s kernels keeps fully sharded state (a key of
    :data:`~pipesched.optimizer.cost.memory.FULL_SHARDING_STATES`): eager and compiled PyTorch shard the model's
    fp32 parameters (``fp32_parameters``: torchtitan, llm-foundry), hand-fused kernels keep the software profile's
    ``fused_fsdp_state`` (Megatron-FSDP's ``zero3`` for a plan; NeMo AutoModel's bf16 model for its rows); kernels
    "unknown" the largest of the modes that run the layout (``sharding``: its class key,
    :func:`~pipesched.optimizer.cost.profile.layout_sharding`; ``gradient_bytes``: the reduction's), as
    :func:`blended` sizes memory, so a plan that fits fits whichever of them runs it."""
    if model.kernels == "unknown":
        states = [
            full_sharding_state(model.model_copy(update={"kernels": mode}), software)
            for mode in software.kernels_shares("unknown", sharding, model.kernels_prior)
        ]
        return max(
            states,
            key=lambda state: static_bytes_per_parameter_sharded(
                model, "full", 1, gradient_bytes=gradient_bytes, full_state=state
            ),
        )
    if model.kernels == "fused":
        return software.fused_fsdp_state
    return "fp32_parameters"


def _per_parameter_bytes(model: ModelConfig, data_parallel: DataParallel | None, full_state: str) -> float:
    """Weights, gradients and Adam state per parameter (ZeRO paper, Sec. 3.1 and 5.1; module docstring)."""
    group = data_parallel or DataParallel()
    return static_bytes_per_parameter_sharded(
        model, group.sharding, group.size, gradient_bytes=_gradient_bytes(group), full_state=full_state
    )


def _gradient_bytes(data_parallel: DataParallel) -> float:
    """Bytes per element of the gradient buffer: the reduction's dtype (``data_parallel.reduce_dtype``)."""
    return 4.0 if data_parallel.reduce_dtype == "fp32" else 2.0


def _per_expert_parameter_bytes(
    model: ModelConfig,
    data_parallel: DataParallel | None,
    tensor_parallel: TensorParallel | None,
    expert_parallel: ExpertParallel | None,
    full_state: str,
) -> float:
    """Static bytes per routed-expert parameter: sharded over the expert-data-parallel group
    (:meth:`~pipesched.optimizer.cost.experts.ExpertGroups.data_parallel`) rather than the data-parallel one."""
    ep, _ = _ep(expert_parallel)
    if data_parallel is None or not model.is_moe:
        return _per_parameter_bytes(model, data_parallel, full_state)
    t, _ = _tp(tensor_parallel)
    group = expert_groups(model, t, ep, _etp(expert_parallel)).data_parallel(t, 1, data_parallel.size)
    return static_bytes_per_parameter_sharded(
        model, data_parallel.sharding, group, gradient_bytes=_gradient_bytes(data_parallel), full_state=full_state
    )


def _transient_bytes(
    model: ModelConfig, data_parallel: DataParallel | None, parameters: float, largest_unit: float
) -> float:
    """Bytes a sharded stage holds beyond its static state while it computes: the gathered weights (whole
    stage, or two units with ``reshard_after_forward``) and one unit's unsharded gradients in the reduction's dtype
    (:mod:`pipesched.optimizer.cost.collectives`: Accumulated gradients), each (d−1)/d
    (the step model's ``memory.weights``/``memory.gradients``, :mod:`pipesched.optimizer.cost.collectives`)."""
    if data_parallel is None or data_parallel.size <= 1 or data_parallel.sharding not in ("gradients", "full"):
        return 0.0
    d = data_parallel.size
    held = largest_unit * _gradient_bytes(data_parallel)
    if data_parallel.sharding == "full":
        gathered = min(parameters, 2 * largest_unit) if data_parallel.reshard_after_forward else parameters
        held += gathered * model.dtype_bytes
    return held * (d - 1) / d


@dataclass(frozen=True)
class _StageBlocks:
    """A stage of ``count`` layers as one block: the layers (the first ``first_dense_layers`` dense, the rest
    mixture-of-experts), plus the embedding on stage 0 and the head on the last; with its memory while it
    computes (static state, transient gathered weights, one microbatch)."""

    model: ModelConfig
    data_parallel: DataParallel | None
    num_stages: int
    dense: Block
    moe: Block
    embedding: Block
    head: Block
    per_parameter: float
    per_expert_parameter: float
    first_dense_layers: int
    full_state: str = "zero3"

    def layers(self, first_layer: int, count: int) -> Block:
        """Layers ``first_layer`` … ``first_layer + count − 1``."""
        dense = max(0, min(count, self.first_dense_layers - first_layer))
        return self.dense.times(dense) + self.moe.times(count - dense)

    def block(self, stage: int, count: int, first_layer: int | None = None) -> Block:
        """Times, activations and parameters of the stage, its ``count`` layers from ``first_layer`` (unknown
        while partitioning: stage 0 starts at layer 0, every other stage is taken to hold mixture-of-experts
        layers only, the heavier kind)."""
        if first_layer is None:
            first_layer = 0 if stage == 0 else self.first_dense_layers
        block = self.layers(first_layer, count)
        if stage == 0:
            block = block + self.embedding
        if stage == self.num_stages - 1:
            block = block + self.head
        return block

    def static_bytes(self, block: Block) -> float:
        """Weights, gradients and optimizer state of ``block``: routed experts at their own sharding."""
        experts = block.expert_parameters
        return (block.parameters - experts) * self.per_parameter + experts * self.per_expert_parameter

    def largest_unit(self, stage: int, count: int) -> float:
        """Parameters of the stage's largest FSDP unit (a layer, the embedding, the head)."""
        units = [max(self.dense.parameters, self.moe.parameters)] if count else []
        if stage == 0:
            units.append(self.embedding.parameters)
        if stage == self.num_stages - 1:
            units.append(self.head.parameters)
        return max(units, default=0.0)

    def memory(self, stage: int, count: int) -> float:
        """Bytes the stage holds while it computes one microbatch."""
        block = self.block(stage, count)
        transient = _transient_bytes(self.model, self.data_parallel, block.parameters, self.largest_unit(stage, count))
        return self.static_bytes(block) + transient + block.activation_bytes + block.transient_bytes


def _full_state(
    model: ModelConfig, hardware: Hardware, data_parallel: DataParallel | None, sharding: str | None
) -> str:
    """:func:`full_sharding_state` of the problem's model and data parallelism (``sharding``: its class key)."""
    gradient_bytes = _gradient_bytes(data_parallel or DataParallel())
    return full_sharding_state(model, hardware.software, sharding, gradient_bytes=gradient_bytes)


def _layout_sharding(
    data_parallel: DataParallel | None,
    degrees: tuple[TensorParallel | None, int, ContextParallel | None, ExpertParallel | None],
) -> str | None:
    """The layout's class key for kernels "unknown" (:func:`~pipesched.optimizer.cost.profile.layout_sharding`) from
    its data parallelism and its (tensor, pipeline ranks, context, expert) parallelism."""
    tensor, pipeline, context, expert = degrees
    model_degrees = (_tp(tensor)[0], pipeline, _cp(context), _ep(expert)[0])
    if data_parallel is None:
        return layout_sharding(None, 1, *model_degrees)
    return layout_sharding(data_parallel.sharding, data_parallel.size, *model_degrees)


def _stage_blocks(
    model: ModelConfig,
    cluster: ClusterConfig,
    hardware: Hardware,
    num_stages: int,
    tensor_parallel: TensorParallel | None,
    data_parallel: DataParallel | None,
    context_parallel: ContextParallel | None,
    expert_parallel: ExpertParallel | None,
    sharding: str | None,
) -> _StageBlocks:

    def layer(moe: bool) -> Block:
        return transformer_layer(
            model,
            hardware,
            tensor_parallel,
            cluster,
            moe=moe,
            context_parallel=context_parallel,
            expert_parallel=expert_parallel,
            sharding=sharding,
        )

    c = _cp(context_parallel)
    dense = layer(False)
    state = _full_state(model, hardware, data_parallel, sharding)
    head = head_block(
        model, hardware, tensor_parallel, separate_copy=num_stages > 1, context_parallel=c, sharding=sharding
    )
    return _StageBlocks(
        model,
        data_parallel,
        num_stages,
        dense=dense,
        moe=layer(True) if model.is_moe else dense,
        embedding=embedding_block(model, hardware, tensor_parallel, cluster, context_parallel=c),
        head=head,
        per_parameter=_per_parameter_bytes(model, data_parallel, state),
        per_expert_parameter=_per_expert_parameter_bytes(model, data_parallel, tensor_parallel, expert_parallel, state),
        first_dense_layers=model.first_dense_layers if model.is_moe else model.num_layers,
        full_state=state,
    )


def _check_context_expert(
    model: ModelConfig,
    tensor_parallel: TensorParallel | None,
    data_parallel: DataParallel | None,
    context_parallel: ContextParallel | None,
    expert_parallel: ExpertParallel | None,
) -> _Errors:
    """Context parallelism splits the sequence in 2c balanced chunks; expert parallelism needs experts that
    divide and a stage's GPUs to carve its group from (:mod:`pipesched.optimizer.cost.experts`)."""
    errors: _Errors = []
    c = _cp(context_parallel)
    if c > 1 and model.seq_length % (2 * c):
        sizes = [d for d in (1, 2, 4, 8, 16, 32, 64) if model.seq_length % (2 * d) == 0]
        errors.append(
            (
                ("context_parallel", "size"),
                f"context_parallel {c} cannot split seq_length {model.seq_length} into {2 * c} equal chunks (head-tail "
                f"load balancing): use {', '.join(map(str, sizes))}",
                c,
            )
        )
    ep, _ = _ep(expert_parallel)
    if ep == 1:
        return errors
    t, _ = _tp(tensor_parallel)
    d = data_parallel.size if data_parallel is not None else 1
    try:
        if not model.is_moe:
            raise ValueError("a dense model has no experts to shard: drop expert_parallel or give num_experts")
        expert_groups(model, t, ep, _etp(expert_parallel)).data_parallel(t, 1, d)
    except ValueError as error:
        errors.append((("expert_parallel", "size"), str(error), ep))
    return errors


def derive_problem(
    model: ModelConfig,
    cluster: ClusterConfig,
    pipeline: Pipeline,
    *,
    tensor_parallel: TensorParallel | None = None,
    data_parallel: DataParallel | None = None,
    context_parallel: ContextParallel | None = None,
    expert_parallel: ExpertParallel | None = None,
) -> DerivedProblem:
    """Costs, memory and the stage partition for ``model`` on ``cluster`` with ``pipeline``'s stages.

    ``tensor_parallel`` splits every block's FLOPs, activations and parameters (Megatron, see
    :mod:`pipesched.optimizer.cost`) and adds its collectives to F and I; ``data_parallel`` (when given) sets
    the static bytes per parameter by its ``sharding`` (ZeRO-1/2/3: the sharded state only); the gathered
    weights and one FSDP unit's unsharded gradients are not static (the step model's ``memory.weights``/
    ``gradients``, filled by :func:`pipesched.optimizer.derive.load_problem`): the partition counts them as
    held while a stage computes.
    ``data_parallel.size`` counts every copy of a stage's weights: with ``context_parallel`` c that is d·c.
    ``context_parallel`` shards each sequence (:class:`~pipesched.optimizer.configs.ContextParallel`);
    ``expert_parallel`` shards the routed experts, their state sharded over the expert-data-parallel group
    (:mod:`pipesched.optimizer.cost.experts`).

    Stage 0 holds the embedding, the last stage the head; ``model.layers_per_stage`` fixes the partition,
    otherwise :func:`pipesched.optimizer.partition.partition_layers` minimises the slowest stage's F+I+W time subject to
    every rank fitting static memory plus one microbatch's activations of each of its stages (a time tie to the
    latest stages; the tie in ``tie``, for the schedule to settle: :func:`pipesched.optimizer.derive.load_problem`).

    Returns:
        A :class:`DerivedProblem`: per-stage ``costs`` (ms) with ``p2p`` = latency + s·b·h·dtype bytes /
        bandwidth (÷ t with sequence parallelism, ÷ c), per-stage ``memory.activation``/``retained_for_weight``
        (bytes), per-rank ``memory.static`` (bytes) and ``memory.limit`` = accelerator memory − the headroom
        (:func:`headroom_bytes`).

    Raises:
        pydantic.ValidationError: unknown accelerator (``cluster.accelerator``), fewer layers than stages
            (``model.num_layers``), a bad ``model.layers_per_stage``, a context or expert degree that does not
            divide (``context_parallel.size``, ``expert_parallel.size``), or weights/optimizer state alone
            exceeding a rank's memory (``cluster``), each with the numbers and the fix.
    """

    hardware = resolve_hardware(cluster, model.framework)
    num_stages, num_ranks = pipeline.num_stages, pipeline.num_ranks
    raise_field_errors(
        "Problem",
        _check_layers_per_stage(model, num_stages)
        + _check_tensor_parallel(model, cluster, tensor_parallel)
        + _check_context_expert(model, tensor_parallel, data_parallel, context_parallel, expert_parallel),
    )
    blocks = _stage_blocks(
        model,
        cluster,
        hardware,
        num_stages,
        tensor_parallel,
        data_parallel,
        context_parallel,
        expert_parallel,
        _layout_sharding(data_parallel, (tensor_parallel, num_ranks, context_parallel, expert_parallel)),
    )
    headroom = headroom_bytes(cluster, hardware)
    limit = hardware.memory_bytes - headroom
    holders = pipeline.stage_holders()
    _check_room(blocks, cluster, hardware, headroom, num_ranks, copies=max(len(ranks) for ranks in holders))
    layers_per_stage, tie = _layers_per_stage(blocks, cluster, holders, num_ranks, limit)
    firsts = [sum(layers_per_stage[:stage]) for stage in range(num_stages)]
    stages = [blocks.block(stage, count, firsts[stage]) for stage, count in enumerate(layers_per_stage)]
    static = [0.0] * num_ranks
    for stage, block in enumerate(stages):
        for rank in holders[stage]:
            static[rank] += blocks.static_bytes(block)
    transient = rank_transient_bytes(stages, holders, num_ranks)
    static = [value + extra for value, extra in zip(static, transient, strict=True)]
    costs = Costs(
        forward=[round(block.forward_ms, 6) for block in stages],
        backward_input=[round(block.backward_input_ms, 6) for block in stages],
        backward_weight=[round(block.backward_weight_ms, 6) for block in stages],
        p2p=round(_p2p_ms(model, cluster, tensor_parallel, _cp(context_parallel)), 6),
    )
    memory = Memory(
        activation=[float(round(block.activation_bytes)) for block in stages],
        retained_for_weight=[float(round(block.retained_bytes)) for block in stages],
        limit=float(round(limit)),
        static=[float(round(value)) for value in static],
    )
    units = [blocks.largest_unit(stage, count) for stage, count in enumerate(layers_per_stage)]

    def fits(split: list[int]) -> bool:
        held = [0.0] * num_ranks
        for stage, count in enumerate(split):
            for rank in holders[stage]:
                held[rank] += blocks.memory(stage, count)
        return max(held) <= limit

    return DerivedProblem(
        costs, memory, layers_per_stage, stages, static, limit, hardware, units, transient, tie, fits, blocks.full_state
    )


def rank_transient_bytes(stages: list[Block], holders: list[list[int]], num_ranks: int) -> list[float]:
    """Per rank, the largest ``transient_bytes`` of its stages' passes (one pass runs at a time). The step model has
    no per-pass allocation, so ``memory.static`` counts it: a bound, reached when the pass runs at the rank's
    activation peak (the last layer's recomputation and the loss run there under every schedule)."""
    transient = [0.0] * num_ranks
    for stage, block in enumerate(stages):
        for rank in holders[stage]:
            transient[rank] = max(transient[rank], block.transient_bytes)
    return transient


def _check_room(
    blocks: _StageBlocks, cluster: ClusterConfig, hardware: Hardware, headroom: float, num_ranks: int, *, copies: int
) -> None:
    """The headroom leaves memory, and the weights, gradients and optimizer state fit the ranks at all.

    Raises:
        pydantic.ValidationError: on ``cluster.memory_headroom_bytes`` or the accelerator, with the ranks needed.
    """
    per_parameter, model = blocks.per_parameter, blocks.model
    limit = hardware.memory_bytes - headroom
    total_static = sum(blocks.static_bytes(blocks.block(stage, 0)) for stage in range(blocks.num_stages))
    total_static += blocks.static_bytes(blocks.layers(0, model.num_layers))
    if limit <= 0:
        raise_field_errors(
            "Problem",
            [
                (
                    ("cluster", "memory_headroom_bytes"),
                    f"the {format_bytes(headroom)} headroom leaves nothing of the accelerator's "
                    f"{format_bytes(hardware.memory_bytes)} ({hardware.name}): give a headroom below "
                    f"{format_bytes(hardware.memory_bytes)}",
                    headroom,
                )
            ],
        )
    if total_static * copies / num_ranks <= limit:
        return
    needed = total_static * copies / num_ranks
    ranks_needed = math.ceil(total_static * copies / limit)
    data_parallel = blocks.data_parallel
    shard_hint = (
        ' or shard optimizer state over data-parallel copies (data_parallel {"size": d, "sharding": "optimizer"})'
        if data_parallel is None or data_parallel.size == 1 or data_parallel.sharding == "none"
        else ""
    )
    raise_field_errors(
        "Problem",
        [
            (
                ("cluster", "accelerator" if cluster.accelerator else "memory_bytes"),
                f"weights, gradients and optimizer state need {format_bytes(needed)} per rank "
                f"({per_parameter:g} B/param over {num_ranks} ranks), has {format_bytes(limit)} "
                f"({hardware.name}, {format_bytes(hardware.memory_bytes)} minus the "
                f"{format_bytes(headroom)} headroom): use ≥ {ranks_needed} ranks{shard_hint}",
                cluster.accelerator or cluster.memory_bytes,
            )
        ],
    )


def _layers_per_stage(
    blocks: _StageBlocks, cluster: ClusterConfig, holders: list[list[int]], num_ranks: int, limit: float
) -> tuple[list[int], LayerTie | None]:
    """``model.layers_per_stage`` when given (no tie), else :func:`~pipesched.optimizer.partition.partition_layers`
    (slowest stage least, every rank within its limit; a time tie to the latest stages) and its tie
    (:func:`~pipesched.optimizer.partition.layer_tie`).

    Raises:
        pydantic.ValidationError: no partition fits (on the accelerator, with the fixes).
    """
    model = blocks.model
    if model.layers_per_stage is not None:
        return list(model.layers_per_stage), None

    def stage_time(stage: int, count: int) -> float:
        return blocks.block(stage, count).compute_ms

    try:
        split = partition_layers(
            model.num_layers,
            blocks.num_stages,
            stage_time=stage_time,
            stage_memory=blocks.memory,
            stage_ranks=holders,
            num_ranks=num_ranks,
            limit=limit,
        )
    except PartitionError as error:
        raise_field_errors(
            "Problem",
            [
                (
                    ("cluster", "accelerator" if cluster.accelerator else "memory_bytes"),
                    f"{error}; each rank has {format_bytes(limit)}: use more ranks, a smaller "
                    "micro_batch_size, activation recomputation, or shard optimizer state",
                    cluster.accelerator or cluster.memory_bytes,
                )
            ],
        )
        raise
    return split, layer_tie(split, stage_time)


def _p2p_ms(
    model: ModelConfig, cluster: ClusterConfig, tensor_parallel: TensorParallel | None, context_parallel: int = 1
) -> float:
    """One activation (or its gradient) between pipeline ranks: latency + s·b·h·dtype bytes / bandwidth, ms;
    with sequence parallelism each tensor-parallel rank sends its sequence shard, and each context-parallel rank
    its part of the sequence."""
    t, sequence_parallel = _tp(tensor_parallel)
    p2p_bytes = 1.0 * model.seq_length * model.micro_batch_size * model.hidden_size * model.dtype_bytes
    if sequence_parallel:
        p2p_bytes /= t
    p2p_bytes /= context_parallel
    return cluster.p2p_latency_ms + 1e3 * p2p_bytes / cluster.p2p_bandwidth_bytes_per_s


def derive_costs_and_memory(
    model: ModelConfig,
    cluster: ClusterConfig,
    pipeline: Pipeline,
    *,
    tensor_parallel: TensorParallel | None = None,
    data_parallel: DataParallel | None = None,
) -> tuple[Costs, Memory]:
    """Per-stage F/I/W times (ms) and memory (bytes) for ``model`` on ``cluster`` (see :func:`derive_problem`)."""
    derived = derive_problem(model, cluster, pipeline, tensor_parallel=tensor_parallel, data_parallel=data_parallel)
    return derived.costs, derived.memory
