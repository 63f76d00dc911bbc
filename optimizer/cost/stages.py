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
  moments = 18 B/param (fp32 training: 4 + 4 + 8 = 16). ``shard_optimizer_state`` divides the master weights
  and moments by ``data_parallel_size`` (ZeRO stage 1).
- Parameters: a layer holds 4h² + 4h (attention) + 2hf + f + h (MLP) + 4h (two layer norms); the embedding
  V·h + s·h (learned positions, first stage); the LM head V·h and the final layer norm 2h (last stage).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipesched.optimizer.accelerators import accelerator_names, get_accelerator
from pipesched.optimizer.configs import ClusterConfig, ContextParallel, ExpertParallel, ModelConfig, TensorParallel
from pipesched.optimizer.cost.collectives import all_reduce_ms, tensor_parallel_layer_ms
from pipesched.optimizer.cost.context import ring_attention
from pipesched.optimizer.cost.experts import expert_groups, expert_traffic
from pipesched.optimizer.cost.flops import (
    PassFlops,
    embedding_parameters,
    expert_parameters,
    head_flops,
    head_parameters,
    layer_flops,
    layer_parameters,
    norm_parameters,
)
from pipesched.optimizer.cost.memory import LayerActivation, layer_activation, static_bytes_per_parameter_sharded
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
    "resolve_hardware",
    "static_bytes_per_parameter",
    "transformer_layer",
]

#: Bytes the forward's elementwise kernels move through device memory per byte of stored activation
#: (fitted to the Zero Bubble paper's Table 6 A100 profiles, see the module docstring).
FORWARD_TRAFFIC_PER_ACTIVATION_BYTE = 4.73
#: The same for the input-gradient backward I.
BACKWARD_INPUT_TRAFFIC_PER_ACTIVATION_BYTE = 4.10

_Errors = list[tuple[tuple[str | int, ...], str, Any]]


@dataclass(frozen=True)
class Hardware:
    """Resolved accelerator figures: memory (bytes), peak dense FLOP/s, memory bandwidth (bytes/s), the fraction of
    the peak the matrix multiplies reach (``efficiency``) and the one FlashAttention's core reaches
    (``attention_efficiency``; Shah et al. 2024, "FlashAttention-3", abstract and §4.1: FlashAttention-2 at about
    35% of an H100's bf16 peak, FlashAttention-3 up to 75% in its forward). Its default, 0.3, is read off the
    published long-sequence runs of ``optimizer/cost/calibration/data`` where the attention core is most of the
    work: NeMo's Llama 2 7B at 128K–1M tokens (cuDNN attention) fit 0.35 within 8%, torchtitan's context-parallel
    Llama 3.1 runs (PyTorch SDPA) 0.2–0.3 (``bench/cpep_bench.py``)."""

    name: str
    memory_bytes: float
    flops_per_s: float
    memory_bandwidth_bytes_per_s: float
    efficiency: float
    attention_efficiency: float = 0.3

    @property
    def effective_flops_per_s(self) -> float:
        """FLOP/s the matrix multiplies achieve: peak × efficiency."""
        return self.flops_per_s * self.efficiency


@dataclass(frozen=True)
class Block:
    """Times (ms), memory (bytes) and parameters of one block (a layer, the embedding, the head) for one microbatch.

    ``activation_bytes`` is allocated by F; ``retained_bytes`` of it is still held after I until W.
    ``parameters`` counts everything the rank holds, ``expert_parameters`` the routed experts among them (sharded
    over the expert-data-parallel group rather than the data-parallel one).
    """

    forward_ms: float = 0.0
    backward_input_ms: float = 0.0
    backward_weight_ms: float = 0.0
    activation_bytes: float = 0.0
    retained_bytes: float = 0.0
    parameters: float = 0.0
    expert_parameters: float = 0.0

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
        )

    @property
    def compute_ms(self) -> float:
        """F + I + W, ms."""
        return self.forward_ms + self.backward_input_ms + self.backward_weight_ms


def resolve_hardware(cluster: ClusterConfig) -> Hardware:
    """The accelerator's figures: the catalogue entry, overridden by explicit numbers.

    Raises:
        pydantic.ValidationError: ``cluster.accelerator`` unknown (the message lists the catalogue), or no
            accelerator and some of memory_bytes / flops_per_s / memory_bandwidth_bytes_per_s missing.
    """

    memory, flops, bandwidth = cluster.memory_bytes, cluster.flops_per_s, cluster.memory_bandwidth_bytes_per_s
    name = cluster.accelerator or "explicit"
    if cluster.accelerator is not None:
        try:
            entry = get_accelerator(cluster.accelerator)
        except KeyError:
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
            raise  # unreachable: raise_field_errors raised
        name = entry.name
        memory = memory if memory is not None else entry.memory_bytes
        flops = flops if flops is not None else entry.flops_per_s
        bandwidth = bandwidth if bandwidth is not None else entry.memory_bandwidth_bytes_per_s
    errors: _Errors = [
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
    return Hardware(name, float(memory), float(flops), float(bandwidth), cluster.efficiency)


def _ms(flops: float, traffic_bytes: float, hardware: Hardware) -> float:
    return 1e3 * (flops / hardware.effective_flops_per_s + traffic_bytes / hardware.memory_bandwidth_bytes_per_s)


def _attention_ms(flops: float, hardware: Hardware) -> float:
    """FlashAttention's core at ``hardware.attention_efficiency`` of the peak, ms."""
    return 1e3 * flops / (hardware.flops_per_s * hardware.attention_efficiency)


def _pass_ms(flops: float, attention_flops: float, traffic_bytes: float, hardware: Hardware) -> float:
    """A pass whose ``flops`` include ``attention_flops`` of FlashAttention core (timed by
    :func:`_attention_ms`), the rest matrix multiplies, plus its elementwise traffic, ms."""
    return _ms(flops - attention_flops, traffic_bytes, hardware) + _attention_ms(attention_flops, hardware)


def _tp(tensor_parallel: TensorParallel | None) -> tuple[int, bool]:
    if tensor_parallel is None:
        return 1, True
    return tensor_parallel.size, tensor_parallel.sequence_parallel


def _cp(context_parallel: ContextParallel | None) -> int:
    return context_parallel.size if context_parallel is not None else 1


def _ep(expert_parallel: ExpertParallel | None) -> tuple[int, bool]:
    if expert_parallel is None:
        return 1, False
    return expert_parallel.size, expert_parallel.overlap


def _layer_parameters(model: ModelConfig, t: int, ep: int, moe: bool) -> tuple[float, float]:
    """(parameters on one rank, routed-expert parameters among them) of one layer: the matrices split t ways
    (norms and the router replicated), the routed experts E/ep per rank, whole when ep > 1
    (:mod:`pipesched.optimizer.cost.experts`)."""
    norms = 2 * norm_parameters(model)
    if not (moe and model.is_moe):
        return (layer_parameters(model) - norms) / t + norms, 0.0
    groups = expert_groups(model, t, ep)
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
) -> tuple[float, float, float]:
    """Exposed context- and expert-parallel communication of one layer's F and I, and the expert all-to-alls
    among F's, ms (:mod:`pipesched.optimizer.cost.context`, :mod:`pipesched.optimizer.cost.experts`)."""
    ep, overlap = _ep(expert_parallel)
    if cluster is None or (c <= 1 and (ep <= 1 or not moe)):
        return 0.0, 0.0, 0.0
    forward = backward = experts = 0.0
    if c > 1:
        ring = ring_attention(
            model,
            cluster,
            t,
            c,
            attention_forward_ms=_attention_ms(flops.attention_forward, hardware),
            attention_backward_ms=_attention_ms(flops.attention_backward, hardware),
        )
        forward, backward = ring.forward_exposed_ms, ring.backward_input_exposed_ms
    if ep > 1 and moe and model.is_moe:
        traffic = expert_traffic(model, cluster, expert_groups(model, t, ep), t, c)
        if overlap:  # the other microbatch's pass hides up to its own length
            experts = max(0.0, traffic.forward_ms - _ms(flops.forward, 0.0, hardware))
            backward += max(0.0, traffic.backward_input_ms - _ms(flops.backward_input, 0.0, hardware))
        else:
            experts = traffic.forward_ms
            backward += traffic.backward_input_ms
        forward += experts
    return forward, backward, experts


def _recomputation_ms(
    model: ModelConfig,
    hardware: Hardware,
    flops: PassFlops,
    memory: LayerActivation,
    forward_ms: float,
    communication_ms: float,
    experts_communication_ms: float = 0.0,
) -> float:
    """What recomputation adds to a layer's I, ms (:func:`transformer_layer`). Selective on a
    mixture-of-experts layer reruns its whole expert block (:func:`pipesched.optimizer.cost.memory.layer_activation`):
    the experts' forward and its dispatch and combine (``experts_communication_ms``)."""
    if model.activation_recomputation == "selective" and model.attention == "flash":
        # torchtitan's op-level policy: half of the matrix multiplies and the elementwise ops they feed rerun
        linear_forward = flops.forward - flops.attention_forward - flops.experts_forward
        recomputed_bytes = memory.full - memory.activation
        return (
            _ms(
                0.5 * linear_forward + flops.experts_forward,
                FORWARD_TRAFFIC_PER_ACTIVATION_BYTE * recomputed_bytes,
                hardware,
            )
            + communication_ms / 2
            + experts_communication_ms
        )
    if model.activation_recomputation == "selective":
        return _ms(
            flops.attention_forward if memory.scores else 0.0,
            FORWARD_TRAFFIC_PER_ACTIVATION_BYTE * memory.scores,
            hardware,
        )
    if model.activation_recomputation == "full":
        return forward_ms
    return 0.0


def transformer_layer(
    model: ModelConfig,
    hardware: Hardware,
    tensor_parallel: TensorParallel | None = None,
    cluster: ClusterConfig | None = None,
    *,
    moe: bool = False,
    context_parallel: ContextParallel | None = None,
    expert_parallel: ExpertParallel | None = None,
) -> Block:
    """One transformer layer for one microbatch on one tensor-parallel rank (see the module docstring).

    FLOPs from :func:`pipesched.optimizer.cost.flops.layer_flops`, activation bytes from
    :func:`pipesched.optimizer.cost.memory.layer_activation`, tensor-parallel communication from
    :func:`pipesched.optimizer.cost.collectives.tensor_parallel_layer_ms` over ``cluster``'s intra-node link
    (added to F and I: Megatron does not overlap it).

    Recomputation: ``selective`` drops the attention scores (eager attention) and reruns the attention core
    inside I; with FlashAttention it is torchtitan's op-level policy (:mod:`pipesched.optimizer.cost.memory`),
    rerunning half of the forward's matrix multiplies and the elementwise ops inside I; ``full`` keeps only the
    layer input until the backward, reruns the whole forward inside I and keeps that input until W
    (the transient memory of the recomputation itself is not modelled here).

    ``moe``: a mixture-of-experts layer of ``model`` (its active experts' FLOPs, every expert's parameters);
    ``context_parallel`` shards the sequence (FLOPs and activations ÷ c, ring attention's exposed transfers
    added to F and I); ``expert_parallel`` shards the routed experts and adds the exposed all-to-alls to F and I.
    With expert parallelism the experts run whole on each rank, so tensor parallelism's collectives cover the
    attention half only.
    """
    t, sequence_parallel = _tp(tensor_parallel)
    c = _cp(context_parallel)
    ep, _ = _ep(expert_parallel)
    flops = layer_flops(model, t, moe=moe, context_parallel=c)
    memory = layer_activation(model, t, sequence_parallel, moe=moe, context_parallel=c)
    full_activation = memory.full
    forward_traffic = FORWARD_TRAFFIC_PER_ACTIVATION_BYTE * full_activation
    backward_input_traffic = BACKWARD_INPUT_TRAFFIC_PER_ACTIVATION_BYTE * full_activation
    communication_ms = 0.0
    if t > 1:
        bandwidth = cluster.intra_node_bandwidth_bytes_per_s if cluster is not None else 450e9
        latency = cluster.collective_latency_ms if cluster is not None else 0.0
        communication_ms = tensor_parallel_layer_ms(model, t, bandwidth, latency) / c
        if moe and model.is_moe and ep > 1:
            communication_ms /= 2  # the experts run whole: only attention's collectives remain
    forward_extra, backward_extra, experts_forward = _parallel_communication_ms(
        model, cluster, hardware, flops, t, c, expert_parallel, moe
    )
    flash = model.attention == "flash"
    forward_ms = (
        _pass_ms(flops.forward, flops.attention_forward if flash else 0.0, forward_traffic, hardware)
        + communication_ms
        + forward_extra
    )
    backward_input_ms = (
        _pass_ms(flops.backward_input, flops.attention_backward if flash else 0.0, backward_input_traffic, hardware)
        + communication_ms
        + backward_extra
    )
    backward_input_ms += _recomputation_ms(
        model, hardware, flops, memory, forward_ms, communication_ms, experts_forward
    )
    parameters, local_experts = _layer_parameters(model, t, ep, moe)
    return Block(
        forward_ms=forward_ms,
        backward_input_ms=backward_input_ms,
        backward_weight_ms=_ms(flops.backward_weight, 0.0, hardware),
        activation_bytes=memory.activation,
        retained_bytes=memory.retained,
        parameters=parameters,
        expert_parameters=local_experts,
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
        communication_ms = all_reduce_ms(tokens * d, t, bandwidth)
    return Block(
        forward_ms=_ms(0.0, 3 * tokens * d / t, hardware) + communication_ms,
        backward_input_ms=0.0,
        backward_weight_ms=_ms(0.0, (8 * tokens + tokens * d) / t, hardware),
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
) -> Block:
    """Final norm, LM head and cross-entropy loss on the last stage.

    FLOPs: F = 2·s·b·h·V (the logits), I = 2·s·b·h·V (gradient of the head input), W = 2·s·b·h·V, each split by
    tensor parallelism over the vocabulary. Traffic: F writes the logits and the fp32 softmax ((2d + 4)·s·b·V
    bytes), I reads the softmax and writes the logits' gradient. Activation: the norm's input and output
    (2·s·b·h·d) plus the fp32 softmax kept for the loss backward (4·s·b·V); W still needs the head input and the
    logits' gradient (s·b·h·d + s·b·V·d). A tied head holds the V·h matrix only as a ``separate_copy`` (the
    last stage of a pipeline keeps a copy, as Megatron does). ``context_parallel`` c: each rank computes the
    logits of s/c tokens.
    """
    t, _ = _tp(tensor_parallel)
    b, h, v, d = model.micro_batch_size, model.hidden_size, model.vocab_size, model.dtype_bytes
    s = model.seq_length / context_parallel
    logits = s * b * v / t
    flops = head_flops(model, t) / context_parallel
    norm = norm_parameters(model)
    return Block(
        forward_ms=_ms(flops, (2 * d + 4) * logits, hardware),
        backward_input_ms=_ms(flops, (4 + d) * logits, hardware),
        backward_weight_ms=_ms(flops, 0.0, hardware),
        activation_bytes=2 * s * b * h * d + 4 * logits,
        retained_bytes=s * b * h * d + logits * d,
        parameters=(head_parameters(model, separate_copy=separate_copy) - norm) / t + norm,
    )


def static_bytes_per_parameter(model: ModelConfig, cluster: ClusterConfig) -> float:
    """Bytes per parameter for weights, gradients and Adam state (ZeRO paper, Sec. 3.1; module docstring).

    Mixed precision (fp16/bf16): 2 weights + 4 fp32 gradients + 12 optimizer (fp32 master, m, v) = 18.
    fp32: 4 + 4 + 8 = 16. With ``shard_optimizer_state`` the optimizer part is divided by ``data_parallel_size``.
    """
    if model.dtype == "fp32":
        weights, gradients, optimizer = 4.0, 4.0, 8.0
    else:
        weights, gradients, optimizer = float(model.dtype_bytes), 4.0, 12.0
    if cluster.shard_optimizer_state:
        optimizer /= cluster.data_parallel_size
    return weights + gradients + optimizer


@dataclass
class DerivedProblem:
    """What :func:`derive_problem` derived.

    Attributes:
        costs, memory: the contract's sections (ms, bytes).
        layers_per_stage: transformer layers per model stage.
        stages: per model stage, the summed :class:`Block` (times ms, bytes, parameters).
        static_bytes: per rank, weights + gradients + optimizer state.
        limit_bytes: per rank, accelerator memory minus the reserve.
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


def _per_parameter_bytes(model: ModelConfig, cluster: ClusterConfig, data_parallel: DataParallel | None) -> float:
    if data_parallel is None:
        return static_bytes_per_parameter(model, cluster)
    return static_bytes_per_parameter_sharded(model, data_parallel.sharding, data_parallel.size)


def _per_expert_parameter_bytes(
    model: ModelConfig,
    cluster: ClusterConfig,
    data_parallel: DataParallel | None,
    tensor_parallel: TensorParallel | None,
    expert_parallel: ExpertParallel | None,
) -> float:
    """Static bytes per routed-expert parameter: sharded over the expert-data-parallel group
    (:meth:`~pipesched.optimizer.cost.experts.ExpertGroups.data_parallel`) rather than the data-parallel one."""
    ep, _ = _ep(expert_parallel)
    if data_parallel is None or not model.is_moe:
        return _per_parameter_bytes(model, cluster, data_parallel)
    t, _ = _tp(tensor_parallel)
    group = expert_groups(model, t, ep).data_parallel(t, 1, data_parallel.size)
    return static_bytes_per_parameter_sharded(model, data_parallel.sharding, group)


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


@dataclass(frozen=True)
class _StageBlocks:
    """The blocks a stage is made of: dense and mixture-of-experts layers, the embedding and the head."""

    dense: Block
    moe: Block
    embedding: Block
    head: Block
    first_dense_layers: int
    num_stages: int

    def layers(self, first_layer: int, count: int) -> Block:
        """Layers ``first_layer`` … ``first_layer + count − 1`` (the first ``first_dense_layers`` dense)."""
        dense = max(0, min(count, self.first_dense_layers - first_layer))
        return self.dense.times(dense) + self.moe.times(count - dense)

    def stage(self, stage: int, count: int, first_layer: int | None = None) -> Block:
        """Stage ``stage`` with ``count`` layers from ``first_layer`` (unknown while partitioning: stage 0 starts
        at layer 0, every other stage is taken to hold mixture-of-experts layers only, the heavier kind)."""
        if first_layer is None:
            first_layer = 0 if stage == 0 else self.first_dense_layers
        block = self.layers(first_layer, count)
        if stage == 0:
            block = block + self.embedding
        if stage == self.num_stages - 1:
            block = block + self.head
        return block

    def largest_unit(self, stage: int, count: int) -> float:
        """Parameters of the stage's largest FSDP unit (a layer, the embedding, the head)."""
        units = [max(self.dense.parameters, self.moe.parameters)] if count else []
        if stage == 0:
            units.append(self.embedding.parameters)
        if stage == self.num_stages - 1:
            units.append(self.head.parameters)
        return max(units, default=0.0)


def _stage_blocks(
    model: ModelConfig,
    cluster: ClusterConfig,
    hardware: Hardware,
    num_stages: int,
    tensor_parallel: TensorParallel | None,
    context_parallel: ContextParallel | None,
    expert_parallel: ExpertParallel | None,
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
        )

    c = _cp(context_parallel)
    dense = layer(False)
    return _StageBlocks(
        dense=dense,
        moe=layer(True) if model.is_moe else dense,
        embedding=embedding_block(model, hardware, tensor_parallel, cluster, context_parallel=c),
        head=head_block(model, hardware, tensor_parallel, separate_copy=num_stages > 1, context_parallel=c),
        first_dense_layers=model.first_dense_layers if model.is_moe else model.num_layers,
        num_stages=num_stages,
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
        expert_groups(model, t, ep).data_parallel(t, 1, d)
    except ValueError as error:
        errors.append((("expert_parallel", "size"), str(error), ep))
    return errors


def _static_bytes(block: Block, dense_bytes: float, expert_bytes: float) -> float:
    return (block.parameters - block.expert_parameters) * dense_bytes + block.expert_parameters * expert_bytes


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
    the static bytes per parameter by its ``sharding`` (ZeRO-1/2/3: the sharded state only), in place of
    ``cluster.data_parallel_size``/``shard_optimizer_state``; the gathered weights and one FSDP unit's unsharded
    gradients are not static (the step model's ``memory.weights``/``gradients``, filled by
    :func:`pipesched.optimizer.derive.load_problem`): the partition counts them as held while a stage computes.
    ``data_parallel.size`` counts every copy of a stage's weights: with ``context_parallel`` c that is d·c.
    ``context_parallel`` shards each sequence (:class:`~pipesched.optimizer.configs.ContextParallel`);
    ``expert_parallel`` shards the routed experts, their state sharded over the expert-data-parallel group
    (:mod:`pipesched.optimizer.cost.experts`).

    Stage 0 holds the embedding, the last stage the head; ``model.layers_per_stage`` fixes the partition,
    otherwise :func:`pipesched.optimizer.partition.partition_layers` minimises the slowest stage's F+I+W time subject to
    every rank fitting static memory plus one microbatch's activations of each of its stages.

    Returns:
        A :class:`DerivedProblem`: per-stage ``costs`` (ms) with ``p2p`` = latency + s·b·h·dtype bytes /
        bandwidth (÷ t with sequence parallelism, ÷ c), per-stage ``memory.activation``/``retained_for_weight``
        (bytes), per-rank ``memory.static`` (bytes) and ``memory.limit`` = accelerator memory −
        ``cluster.memory_reserve_bytes``.

    Raises:
        pydantic.ValidationError: unknown accelerator (``cluster.accelerator``), fewer layers than stages
            (``model.num_layers``), a bad ``model.layers_per_stage``, a context or expert degree that does not
            divide (``context_parallel.size``, ``expert_parallel.size``), or weights/optimizer state alone
            exceeding a rank's memory (``cluster``), each with the numbers and the fix.
    """

    hardware = resolve_hardware(cluster)
    num_stages, num_ranks = pipeline.num_stages, pipeline.num_ranks
    raise_field_errors(
        "Problem",
        _check_layers_per_stage(model, num_stages)
        + _check_tensor_parallel(model, cluster, tensor_parallel)
        + _check_context_expert(model, tensor_parallel, data_parallel, context_parallel, expert_parallel),
    )
    t, sequence_parallel = _tp(tensor_parallel)
    blocks = _stage_blocks(model, cluster, hardware, num_stages, tensor_parallel, context_parallel, expert_parallel)
    per_parameter = _per_parameter_bytes(model, cluster, data_parallel)
    per_expert_parameter = _per_expert_parameter_bytes(model, cluster, data_parallel, tensor_parallel, expert_parallel)
    limit = hardware.memory_bytes - cluster.memory_reserve_bytes
    holders = pipeline.stage_holders()

    def stage_memory(stage: int, count: int) -> float:
        block = blocks.stage(stage, count)
        transient = _transient_bytes(model, data_parallel, block.parameters, blocks.largest_unit(stage, count))
        return _static_bytes(block, per_parameter, per_expert_parameter) + transient + block.activation_bytes

    total_static = sum(_static_bytes(blocks.stage(stage, 0), per_parameter, 0.0) for stage in range(num_stages))
    total_static += _static_bytes(blocks.layers(0, model.num_layers), per_parameter, per_expert_parameter)
    _check_static_fits(
        cluster, hardware, total_static * max(len(ranks) for ranks in holders) / num_ranks, per_parameter, num_ranks
    )
    layers_per_stage = _partition(model, cluster, blocks, num_stages, stage_memory, holders, num_ranks, limit)
    firsts = [sum(layers_per_stage[:stage]) for stage in range(num_stages)]
    stages = [blocks.stage(stage, count, firsts[stage]) for stage, count in enumerate(layers_per_stage)]
    static = [0.0] * num_ranks
    for stage, block in enumerate(stages):
        for rank in holders[stage]:
            static[rank] += _static_bytes(block, per_parameter, per_expert_parameter)
    p2p_ms = _p2p_ms(model, cluster, t if sequence_parallel else 1, _cp(context_parallel))
    costs = Costs(
        forward=[round(block.forward_ms, 6) for block in stages],
        backward_input=[round(block.backward_input_ms, 6) for block in stages],
        backward_weight=[round(block.backward_weight_ms, 6) for block in stages],
        p2p=round(p2p_ms, 6),
    )
    memory = Memory(
        activation=[float(round(block.activation_bytes)) for block in stages],
        retained_for_weight=[float(round(block.retained_bytes)) for block in stages],
        limit=float(round(limit)),
        static=[float(round(value)) for value in static],
    )
    units = [blocks.largest_unit(stage, count) for stage, count in enumerate(layers_per_stage)]
    return DerivedProblem(costs, memory, layers_per_stage, stages, static, limit, hardware, units)


def _p2p_ms(model: ModelConfig, cluster: ClusterConfig, sequence_shards: int, context_parallel: int) -> float:
    """One activation (or gradient) transfer between stages: latency + s·b·h·dtype bytes over the link, each
    tensor-parallel rank sending its sequence shard (sequence parallelism) and each context-parallel rank its
    part of the sequence, ms."""
    p2p_bytes = 1.0 * model.seq_length * model.micro_batch_size * model.hidden_size * model.dtype_bytes
    p2p_bytes /= sequence_shards * context_parallel
    return cluster.p2p_latency_ms + 1e3 * p2p_bytes / cluster.p2p_bandwidth_bytes_per_s


def _check_static_fits(
    cluster: ClusterConfig, hardware: Hardware, needed: float, per_parameter: float, num_ranks: int
) -> None:
    """Raise when the reserve leaves nothing, or the weights and optimizer state alone exceed a rank."""
    limit = hardware.memory_bytes - cluster.memory_reserve_bytes
    if limit <= 0:
        raise_field_errors(
            "Problem",
            [
                (
                    ("cluster", "memory_reserve_bytes"),
                    f"the {format_bytes(cluster.memory_reserve_bytes)} reserve leaves nothing of the accelerator's "
                    f"{format_bytes(hardware.memory_bytes)} ({hardware.name}): give a reserve below "
                    f"{format_bytes(hardware.memory_bytes)}",
                    cluster.memory_reserve_bytes,
                )
            ],
        )
    if needed <= limit:
        return
    ranks_needed = math.ceil(needed * num_ranks / limit)
    loc: tuple[str | int, ...] = ("cluster", "accelerator" if cluster.accelerator else "memory_bytes")
    shard_hint = (
        " or shard optimizer state (cluster.shard_optimizer_state with data_parallel_size > 1)"
        if not cluster.shard_optimizer_state or cluster.data_parallel_size == 1
        else ""
    )
    raise_field_errors(
        "Problem",
        [
            (
                loc,
                f"weights, gradients and optimizer state need {format_bytes(needed)} per rank "
                f"({per_parameter:g} B/param over {num_ranks} ranks), has {format_bytes(limit)} "
                f"({hardware.name}, {format_bytes(hardware.memory_bytes)} minus the "
                f"{format_bytes(cluster.memory_reserve_bytes)} reserve): use ≥ {ranks_needed} ranks"
                f"{shard_hint}",
                cluster.accelerator or cluster.memory_bytes,
            )
        ],
    )


def _partition(
    model: ModelConfig,
    cluster: ClusterConfig,
    blocks: _StageBlocks,
    num_stages: int,
    stage_memory: Callable[[int, int], float],
    holders: list[list[int]],
    num_ranks: int,
    limit: float,
) -> list[int]:
    """``model.layers_per_stage``, or :func:`partition_layers`' split (a field error when none fits)."""
    if model.layers_per_stage is not None:
        return list(model.layers_per_stage)
    try:
        return partition_layers(
            model.num_layers,
            num_stages,
            stage_time=lambda stage, count: blocks.stage(stage, count).compute_ms,
            stage_memory=stage_memory,
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
