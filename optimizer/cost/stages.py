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
  its size (ZeRO stages 1–3, :func:`pipesched.optimizer.cost.memory.static_bytes_per_parameter_sharded`).
- Parameters: a layer holds 4h² + 4h (attention) + 2hf + f + h (MLP) + 4h (two layer norms); the embedding
  V·h + s·h (learned positions, first stage); the LM head V·h and the final layer norm 2h (last stage).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pipesched.optimizer.accelerators import accelerator_names, get_accelerator
from pipesched.optimizer.configs import ClusterConfig, ModelConfig, TensorParallel
from pipesched.optimizer.cost.collectives import all_reduce_ms, tensor_parallel_layer_ms
from pipesched.optimizer.cost.flops import (
    embedding_parameters,
    head_parameters,
    layer_flops,
    layer_parameters,
    norm_parameters,
)
from pipesched.optimizer.cost.memory import layer_activation, static_bytes_per_parameter_sharded
from pipesched.optimizer.cost.profile import AcceleratorProfile, SoftwareProfile, active_catalogue, default_profile
from pipesched.optimizer.cost.timing import Hardware, PassTimes, elementwise_ms, gemm_ms, layer_gemm_times
from pipesched.optimizer.field_errors import raise_field_errors
from pipesched.optimizer.partition import PartitionError, partition_layers
from pipesched.optimizer.problem import Costs, DataParallel, Memory, Pipeline
from pipesched.optimizer.units import format_bytes

__all__ = [
    "BACKWARD_INPUT_TRAFFIC_PER_ACTIVATION_BYTE",
    "FORWARD_TRAFFIC_PER_ACTIVATION_BYTE",
    "Block",
    "DerivedProblem",
    "Hardware",
    "derive_costs_and_memory",
    "derive_problem",
    "embedding_block",
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
    """

    forward_ms: float = 0.0
    backward_input_ms: float = 0.0
    backward_weight_ms: float = 0.0
    activation_bytes: float = 0.0
    retained_bytes: float = 0.0
    parameters: float = 0.0

    def times(self, count: int) -> Block:
        """``count`` copies of this block in sequence."""
        return Block(
            self.forward_ms * count,
            self.backward_input_ms * count,
            self.backward_weight_ms * count,
            self.activation_bytes * count,
            self.retained_bytes * count,
            self.parameters * count,
        )

    def __add__(self, other: Block) -> Block:
        return Block(
            self.forward_ms + other.forward_ms,
            self.backward_input_ms + other.backward_input_ms,
            self.backward_weight_ms + other.backward_weight_ms,
            self.activation_bytes + other.activation_bytes,
            self.retained_bytes + other.retained_bytes,
            self.parameters + other.parameters,
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


def resolve_hardware(cluster: ClusterConfig) -> Hardware:
    """The accelerator's figures and profile: the catalogue entry and its calibrated profile (or
    ``cluster.profile``), overridden by explicit numbers (``cluster.efficiency`` overrides the profile's
    bf16 matrix-multiply efficiency).

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
    efficiency = cluster.efficiency if cluster.efficiency is not None else profile.gemm_efficiency
    if cluster.attention_efficiency is not None:
        profile = profile.model_copy(update={"attention_efficiency": cluster.attention_efficiency})
    return Hardware(name, float(memory), float(flops), float(bandwidth), efficiency, fp8, profile, software)


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

    Over the intra-node link at the profile's achieved fraction; with ``async_communication`` it runs beside
    the matrix multiplies and only slows them (``overlap_slowdown``).
    """
    t, _ = _tp(tensor_parallel)
    if t <= 1:
        return 0.0, 0.0
    bandwidth = cluster.intra_node_bandwidth_bytes_per_s if cluster is not None else 450e9
    latency = cluster.collective_latency_ms if cluster is not None else 0.0
    achieved = bandwidth * hardware.profile.collective_efficiency_intra
    total = tensor_parallel_layer_ms(model, t, achieved, latency)
    if tensor_parallel is not None and tensor_parallel.async_communication:
        return hardware.profile.overlap_slowdown * total, total
    return total, total


def _attention_ms(flops: float, model: ModelConfig, hardware: Hardware, *, backward: bool = False) -> float:
    """FlashAttention at the profile's efficiency (its backward at ``attention_backward_speed`` of that), eager
    attention's products at the matrix-multiply rate, ms."""
    if model.attention == "flash":
        speed = hardware.software.attention_backward_speed if backward else 1.0
        return 1e3 * flops / (hardware.flops_per_s * hardware.profile.attention_efficiency * speed)
    return 1e3 * flops / hardware.effective_flops_per_s


#: Extra bytes per element eager PyTorch moves over a fused kernel: RMSNorm written as float casts, a square, a
#: mean, a reciprocal square root and two products (torchtitan's ``RMSNorm``: about 34 bytes per element against
#: a fused kernel's 4); RoPE as complex products with casts (about 20 against 8); SwiGLU's SiLU and product as two
#: kernels (10 against 6).
UNFUSED_BYTES_PER_ELEMENT = {"rmsnorm": 30.0, "rope": 12.0, "swiglu": 4.0}


def _unfused_traffic(model: ModelConfig, tensor_parallel: int, hardware: Hardware) -> float:
    """Bytes eager PyTorch moves beyond fused kernels in one layer's forward (its backward: twice), for the
    operations Llama-style decoders add (:data:`UNFUSED_BYTES_PER_ELEMENT`, scaled by the software's fitted
    ``unfused_traffic``); none when compiled or fused."""
    if model.kernels != "eager":
        return 0.0
    tokens = model.seq_length * model.micro_batch_size
    h, f, t = model.hidden_size, model.ffn_size, tensor_parallel
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
    layer input until the backward, reruns the whole forward inside I and keeps that input until W
    (the transient memory of the recomputation itself is not modelled here). Activation bytes are scaled by the
    profile's ``activation_memory_factor`` (allocator reserve over the tensors, fitted to published peaks).
    """
    t, sequence_parallel = _tp(tensor_parallel)
    flops = layer_flops(model, t)
    memory = layer_activation(model, t, sequence_parallel)
    full_activation = memory.full
    software, mode = hardware.software, model.kernels
    traffic = software.elementwise_traffic[mode]
    gemm, cast_bytes = layer_gemm_times(model, hardware, t)
    cast = elementwise_ms(cast_bytes, hardware)
    kernels = software.kernels_per_layer[mode]
    attention_forward = flops.attention_forward
    attention_backward = flops.backward_input - (flops.forward - attention_forward)
    exposed, communication = _tensor_parallel_ms(model, hardware, tensor_parallel, cluster)
    unfused = _unfused_traffic(model, t, hardware)
    forward_elementwise = elementwise_ms(
        FORWARD_TRAFFIC_PER_ACTIVATION_BYTE * traffic * full_activation + unfused, hardware
    )
    forward = PassTimes(gemm, _attention_ms(attention_forward, model, hardware), forward_elementwise, cast, kernels)
    backward_input = PassTimes(
        gemm,
        _attention_ms(attention_backward, model, hardware, backward=True),
        elementwise_ms(BACKWARD_INPUT_TRAFFIC_PER_ACTIVATION_BYTE * traffic * full_activation + 2 * unfused, hardware),
        cast,
        1.5 * kernels,
    )
    forward_ms = forward.total_ms(hardware, mode) + exposed
    backward_input_ms = backward_input.total_ms(hardware, mode) + exposed
    if model.activation_recomputation == "selective" and model.attention == "flash":
        # torchtitan's op-level policy: half of the matrix multiplies and the elementwise ops they feed rerun
        recomputed_bytes = full_activation - memory.activation
        rerun = PassTimes(
            0.5 * gemm,
            0.0,
            elementwise_ms(FORWARD_TRAFFIC_PER_ACTIVATION_BYTE * traffic * recomputed_bytes, hardware),
            0.5 * cast,
            0.5 * kernels,
        )
        backward_input_ms += rerun.total_ms(hardware, mode) + exposed / 2
    elif model.activation_recomputation == "selective":
        backward_input_ms += _ms(
            flops.attention_forward if memory.scores else 0.0,
            FORWARD_TRAFFIC_PER_ACTIVATION_BYTE * traffic * memory.scores,
            hardware,
        )
    elif model.activation_recomputation == "full":
        backward_input_ms += forward_ms
    del communication
    norms = 2 * norm_parameters(model)
    parameters = (layer_parameters(model) - norms) / t + norms
    reserve = hardware.profile.activation_memory_factor
    return Block(
        forward_ms=forward_ms,
        backward_input_ms=backward_input_ms,
        backward_weight_ms=PassTimes(gemm, 0.0, 0.0, cast, 0.5 * kernels).total_ms(hardware, mode),
        activation_bytes=memory.activation * reserve,
        retained_bytes=memory.retained * reserve,
        parameters=parameters,
    )


def embedding_block(
    model: ModelConfig,
    hardware: Hardware,
    tensor_parallel: TensorParallel | None = None,
    cluster: ClusterConfig | None = None,
) -> Block:
    """Token (+ learned position) embedding on the first stage: memory-bound gather (F) and scatter-add (W).

    F writes s·b·h elements and adds positions (3 passes over s·b·h); I is empty (token ids need no gradient);
    W accumulates s·b·h gradient rows into the fp32 table (read + write, 8 bytes each). Activation: the embedding
    dropout mask, s·b·h bytes. Parameters V·h (+ s·h learned positions), split over the vocabulary by tensor
    parallelism, whose partial outputs are all-reduced (one all-reduce of s·b·h in F).
    """
    t, _ = _tp(tensor_parallel)
    s, b, h, d = model.seq_length, model.micro_batch_size, model.hidden_size, model.dtype_bytes
    tokens = s * b * h
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
) -> Block:
    """Final norm, LM head and cross-entropy loss on the last stage.

    FLOPs: F = 2·s·b·h·V (the logits), I = 2·s·b·h·V (gradient of the head input), W = 2·s·b·h·V, each split by
    tensor parallelism over the vocabulary, one (s·b, V/t, h) matrix multiply each, in bf16 (FP8 recipes keep the
    output layer in bf16). Traffic: F writes the logits and the fp32 softmax ((2d + 4)·s·b·V bytes), I reads the
    softmax and writes the logits' gradient, scaled like the layers' by the kernels mode. Activation: the norm's
    input and output (2·s·b·h·d) plus the fp32 softmax kept for the loss backward (4·s·b·V); W still needs the head
    input and the logits' gradient (s·b·h·d + s·b·V·d). A tied head holds the V·h matrix only as a
    ``separate_copy`` (the last stage of a pipeline keeps a copy, as Megatron does).
    """
    t, _ = _tp(tensor_parallel)
    s, b, h, v, d = model.seq_length, model.micro_batch_size, model.hidden_size, model.vocab_size, model.dtype_bytes
    logits = s * b * v / t
    gemm = gemm_ms(s * b, v / t, h, hardware)
    traffic = hardware.software.elementwise_traffic[model.kernels]
    norm = norm_parameters(model)
    reserve = hardware.profile.activation_memory_factor
    return Block(
        forward_ms=gemm + elementwise_ms(traffic * (2 * d + 4) * logits, hardware),
        backward_input_ms=gemm + elementwise_ms(traffic * (4 + d) * logits, hardware),
        backward_weight_ms=gemm,
        activation_bytes=(2 * s * b * h * d + 4 * logits) * reserve,
        retained_bytes=(s * b * h * d + logits * d) * reserve,
        parameters=(head_parameters(model, separate_copy=separate_copy) - norm) / t + norm,
    )


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
    """

    costs: Costs
    memory: Memory
    layers_per_stage: list[int]
    stages: list[Block] = field(default_factory=list)
    static_bytes: list[float] = field(default_factory=list)
    limit_bytes: float = math.inf
    hardware: Hardware | None = None
    largest_unit: list[float] = field(default_factory=list)


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


def _per_parameter_bytes(model: ModelConfig, data_parallel: DataParallel | None) -> float:
    """Weights, gradients and Adam state per parameter (ZeRO paper, Sec. 3.1 and 5.1; module docstring)."""
    group = data_parallel or DataParallel()
    return static_bytes_per_parameter_sharded(model, group.sharding, group.size)


def _transient_bytes(
    model: ModelConfig, data_parallel: DataParallel | None, parameters: float, largest_unit: float
) -> float:
    """Bytes a sharded stage holds beyond its static state while it computes: the gathered weights (whole
    stage, or two units with ``reshard_after_forward``) and one unit's unsharded fp32 gradients, each (d−1)/d
    (the step model's ``memory.weights``/``memory.gradients``, :mod:`pipesched.optimizer.cost.collectives`)."""
    if data_parallel is None or data_parallel.size <= 1 or data_parallel.sharding not in ("gradients", "full"):
        return 0.0
    d = data_parallel.size
    held = largest_unit * 4.0
    if data_parallel.sharding == "full":
        gathered = min(parameters, 2 * largest_unit) if data_parallel.reshard_after_forward else parameters
        held += gathered * model.dtype_bytes
    return held * (d - 1) / d


def derive_problem(
    model: ModelConfig,
    cluster: ClusterConfig,
    pipeline: Pipeline,
    *,
    tensor_parallel: TensorParallel | None = None,
    data_parallel: DataParallel | None = None,
) -> DerivedProblem:
    """Costs, memory and the stage partition for ``model`` on ``cluster`` with ``pipeline``'s stages.

    ``tensor_parallel`` splits every block's FLOPs, activations and parameters (Megatron, see
    :mod:`pipesched.optimizer.cost`) and adds its collectives to F and I; ``data_parallel`` (when given) sets
    the static bytes per parameter by its ``sharding`` (ZeRO-1/2/3: the sharded state only); the gathered
    weights and one FSDP unit's unsharded gradients are not static (the step model's ``memory.weights``/
    ``gradients``, filled by :func:`pipesched.optimizer.derive.load_problem`): the partition counts them as
    held while a stage computes.

    Stage 0 holds the embedding, the last stage the head; ``model.layers_per_stage`` fixes the partition,
    otherwise :func:`pipesched.optimizer.partition.partition_layers` minimises the slowest stage's F+I+W time subject to
    every rank fitting static memory plus one microbatch's activations of each of its stages.

    Returns:
        A :class:`DerivedProblem`: per-stage ``costs`` (ms) with ``p2p`` = latency + s·b·h·dtype bytes /
        bandwidth, per-stage ``memory.activation``/``retained_for_weight`` (bytes), per-rank ``memory.static``
        (bytes) and ``memory.limit`` = accelerator memory − the headroom (:func:`headroom_bytes`).

    Raises:
        pydantic.ValidationError: unknown accelerator (``cluster.accelerator``), fewer layers than stages
            (``model.num_layers``), a bad ``model.layers_per_stage``, or weights/optimizer state alone
            exceeding a rank's memory (``cluster``), each with the numbers and the fix.
    """

    hardware = resolve_hardware(cluster)
    num_stages, num_ranks = pipeline.num_stages, pipeline.num_ranks
    raise_field_errors(
        "Problem",
        _check_layers_per_stage(model, num_stages) + _check_tensor_parallel(model, cluster, tensor_parallel),
    )
    blocks = _StageBlocks(
        model,
        data_parallel,
        num_stages,
        layer=transformer_layer(model, hardware, tensor_parallel, cluster),
        embedding=embedding_block(model, hardware, tensor_parallel, cluster),
        head=head_block(model, hardware, tensor_parallel, separate_copy=num_stages > 1),
        per_parameter=_per_parameter_bytes(model, data_parallel),
    )
    headroom = headroom_bytes(cluster, hardware)
    limit = hardware.memory_bytes - headroom
    holders = pipeline.stage_holders()
    _check_room(blocks, cluster, hardware, headroom, num_ranks, copies=max(len(ranks) for ranks in holders))
    layers_per_stage = _layers_per_stage(blocks, cluster, holders, num_ranks, limit)
    stages = [blocks.block(stage, count) for stage, count in enumerate(layers_per_stage)]
    static = [0.0] * num_ranks
    for stage, block in enumerate(stages):
        for rank in holders[stage]:
            static[rank] += block.parameters * blocks.per_parameter
    costs = Costs(
        forward=[round(block.forward_ms, 6) for block in stages],
        backward_input=[round(block.backward_input_ms, 6) for block in stages],
        backward_weight=[round(block.backward_weight_ms, 6) for block in stages],
        p2p=round(_p2p_ms(model, cluster, tensor_parallel), 6),
    )
    memory = Memory(
        activation=[float(round(block.activation_bytes)) for block in stages],
        retained_for_weight=[float(round(block.retained_bytes)) for block in stages],
        limit=float(round(limit)),
        static=[float(round(value)) for value in static],
    )
    units = [blocks.largest_unit(stage, count) for stage, count in enumerate(layers_per_stage)]
    return DerivedProblem(costs, memory, layers_per_stage, stages, static, limit, hardware, units)


@dataclass(frozen=True)
class _StageBlocks:
    """A stage of ``count`` layers as one block: the layers, plus the embedding on stage 0 and the head on the
    last; with its memory while it computes (static state, transient gathered weights, one microbatch)."""

    model: ModelConfig
    data_parallel: DataParallel | None
    num_stages: int
    layer: Block
    embedding: Block
    head: Block
    per_parameter: float

    def block(self, stage: int, count: int) -> Block:
        """Times, activations and parameters of the stage."""
        block = self.layer.times(count)
        if stage == 0:
            block = block + self.embedding
        if stage == self.num_stages - 1:
            block = block + self.head
        return block

    def largest_unit(self, stage: int, count: int) -> float:
        """Parameters of the stage's largest FSDP unit (a layer, the embedding, the head)."""
        units = [self.layer.parameters] if count else []
        if stage == 0:
            units.append(self.embedding.parameters)
        if stage == self.num_stages - 1:
            units.append(self.head.parameters)
        return max(units, default=0.0)

    def memory(self, stage: int, count: int) -> float:
        """Bytes the stage holds while it computes one microbatch."""
        block = self.block(stage, count)
        transient = _transient_bytes(self.model, self.data_parallel, block.parameters, self.largest_unit(stage, count))
        return block.parameters * self.per_parameter + transient + block.activation_bytes


def _check_room(
    blocks: _StageBlocks, cluster: ClusterConfig, hardware: Hardware, headroom: float, num_ranks: int, *, copies: int
) -> None:
    """The headroom leaves memory, and the weights, gradients and optimizer state fit the ranks at all.

    Raises:
        pydantic.ValidationError: on ``cluster.memory_headroom_bytes`` or the accelerator, with the ranks needed.
    """
    per_parameter, model = blocks.per_parameter, blocks.model
    limit = hardware.memory_bytes - headroom
    total_static = sum(blocks.block(stage, 0).parameters for stage in range(blocks.num_stages)) * per_parameter
    total_static += model.num_layers * blocks.layer.parameters * per_parameter
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
) -> list[int]:
    """``model.layers_per_stage`` when given, else :func:`partition_layers` (slowest stage least, every rank
    within its limit).

    Raises:
        pydantic.ValidationError: no partition fits (on the accelerator, with the fixes).
    """
    model = blocks.model
    if model.layers_per_stage is not None:
        return list(model.layers_per_stage)
    try:
        return partition_layers(
            model.num_layers,
            blocks.num_stages,
            stage_time=lambda stage, count: blocks.block(stage, count).compute_ms,
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


def _p2p_ms(model: ModelConfig, cluster: ClusterConfig, tensor_parallel: TensorParallel | None) -> float:
    """One activation (or its gradient) between pipeline ranks: latency + s·b·h·dtype bytes / bandwidth, ms;
    with sequence parallelism each tensor-parallel rank sends its sequence shard."""
    t, sequence_parallel = _tp(tensor_parallel)
    p2p_bytes = 1.0 * model.seq_length * model.micro_batch_size * model.hidden_size * model.dtype_bytes
    if sequence_parallel:
        p2p_bytes /= t
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
