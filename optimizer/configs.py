"""Model and cluster descriptions a problem may give instead of ``costs`` and ``memory``.

:mod:`pipesched.optimizer.cost.stages` derives per-stage times and memory from them, and
:mod:`pipesched.optimizer.partition` splits the layers into stages.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from pipesched.optimizer.field_errors import NumbersModel, raise_field_errors
from pipesched.optimizer.frameworks import framework_kernels, framework_name, framework_names
from pipesched.optimizer.presets import MODEL_PRESETS

__all__ = [
    "DTYPE_BYTES",
    "ClusterConfig",
    "ContextParallel",
    "ExpertParallel",
    "FrameworkName",
    "ModelConfig",
    "TensorParallel",
]

#: Bytes per element of each dtype.
DTYPE_BYTES: dict[str, int] = {"fp16": 2, "bf16": 2, "fp32": 4}

#: A training framework of :data:`pipesched.optimizer.frameworks.FRAMEWORKS` by its name or an alias, read as its name.
FrameworkName = Annotated[
    str, AfterValidator(framework_name), WithJsonSchema({"type": "string", "enum": framework_names()})
]

#: A per-head size of multi-head latent attention, as ``head_dim``: 1 to 2¹⁶.
HeadSize = Annotated[int, Field(ge=1, le=65_536)]
#: A compression rank of multi-head latent attention, below ``hidden_size``'s bound: 1 to 2²⁰.
LoraRank = Annotated[int, Field(ge=1, le=1_048_576)]


class ModelConfig(NumbersModel):
    """A decoder-only transformer (Zero Bubble paper, Table 1 notation: h, a, s, b, L, V).

    Stage 0 also holds the embedding, the last stage the final norm, the LM head and the loss. The defaults
    describe a GPT: GeLU FFN of 4h, learned positions, eager attention (scores stored), one key/value head per
    query head, biases and layer norms, untied embeddings. ``preset`` fills every field from
    :data:`pipesched.optimizer.presets.MODEL_PRESETS`; fields given beside it override the preset's.

    Raises:
        pydantic.ValidationError: an unknown ``preset`` (the message lists the known ones),
            ``num_attention_heads`` not dividing ``hidden_size``, ``num_key_value_heads`` not dividing
            ``num_attention_heads``.
    """

    model_config = ConfigDict(extra="forbid")

    BOUND_REASONS: ClassVar[dict[str, str]] = {
        "num_layers": "100,000 layers, 794 times Llama 3.1 405B's 126",
        "hidden_size": "2²⁰, 64 times Llama 3.1 405B's 16,384",
        "num_attention_heads": "2¹⁶, 512 times Llama 3.1 405B's 128",
        "num_key_value_heads": "as num_attention_heads, which they divide",
        "seq_length": "2²⁴ tokens, 128 times Llama 3.1's 131,072-token context",
        "vocab_size": "2²⁴, 131 times Llama 3's 128,256",
        "micro_batch_size": "2²⁰ sequences a microbatch, past any GPU's memory at any length",
        "ffn_hidden_size": "2²⁴, 315 times Llama 3.1 405B's 53,248",
        "moe_ffn_hidden_size": "as ffn_hidden_size",
        "head_dim": "2¹⁶, 256 times the largest in use (256)",
        "num_experts": "2¹⁶, 256 times DeepSeek-V3's 256",
        "num_experts_per_token": "1,024, 128 times DeepSeek-V3's top-8",
        "num_shared_experts": "1,024 shared experts (DeepSeek-V3 has 1)",
        "first_dense_layers": "as num_layers, which bounds it",
        "q_lora_rank": "as hidden_size, which a compression rank stays below",
        "kv_lora_rank": "as hidden_size, which a compression rank stays below",
        "qk_nope_head_dim": "as head_dim",
        "qk_rope_head_dim": "as head_dim",
        "v_head_dim": "as head_dim",
        "moe_load_imbalance": "1 is balanced; 64 sends the busiest rank 64 times its share, past any learned router",
    }

    preset: str | None = Field(
        None, description='Catalogue name filling the other fields, e.g. "llama3.1-8b"; fields beside it override.'
    )
    num_layers: int = Field(ge=1, le=100_000, description="Transformer layers L.")
    hidden_size: int = Field(ge=1, le=1_048_576, description="Hidden size h (at most 2²⁰).")
    num_attention_heads: int = Field(ge=1, le=65_536, description="Attention heads a.")
    seq_length: int = Field(ge=1, le=16_777_216, description="Sequence length s, tokens (at most 2²⁴).")
    vocab_size: int = Field(ge=1, le=16_777_216, description="Vocabulary size V (at most 2²⁴).")
    micro_batch_size: int = Field(1, ge=1, le=1_048_576, description="Sequences per microbatch b.")
    dtype: Literal["fp16", "bf16", "fp32"] = Field("bf16", description="Activation and weight dtype.")
    ffn_hidden_size: int | None = Field(
        None, ge=1, le=16_777_216, description="FFN inner size (the MLP's hidden width); null for 4h."
    )
    num_key_value_heads: int | None = Field(
        None, ge=1, le=65_536, description="Key/value heads (grouped-query attention); null for num_attention_heads."
    )
    ffn_type: Literal["gelu", "swiglu"] = Field(
        "gelu", description='"gelu": two FFN matrices h×f; "swiglu": three (gate, up, down).'
    )
    head_dim: int | None = Field(
        None, ge=1, le=65_536, description="Per-head size of queries, keys and values; null for h / a (Qwen3: 128)."
    )
    num_experts: int | None = Field(
        None,
        ge=1,
        le=65_536,
        description="Routed experts of each mixture-of-experts layer; null for a dense model (every FFN dense).",
    )
    num_experts_per_token: int | None = Field(
        None, ge=1, le=1024, description="Experts each token is routed to (top-k); needed with num_experts."
    )
    moe_ffn_hidden_size: int | None = Field(
        None, ge=1, le=16_777_216, description="Inner size of one expert's FFN; null for ffn_hidden_size."
    )
    num_shared_experts: int = Field(
        0, ge=0, le=1024, description="Experts every token passes through besides its routed ones (DeepSeek)."
    )
    first_dense_layers: int = Field(
        0,
        ge=0,
        le=100_000,
        description="Leading layers with a dense FFN of ffn_hidden_size instead of experts (DeepSeek-V3: 3).",
    )
    moe_load_imbalance: float = Field(
        1.0,
        ge=1.0,
        le=64.0,
        description="Tokens the busiest expert-parallel rank receives over the mean (1: balanced, as the "
        "force-balanced NeMo and Megatron benchmarks; learned routers run about 1.1-1.3).",
    )
    q_lora_rank: LoraRank | None = Field(
        None, description="Multi-head latent attention: rank of the query compression; null for none."
    )
    kv_lora_rank: LoraRank | None = Field(
        None,
        description="Multi-head latent attention (DeepSeek-V2/V3): rank of the joint key/value compression; null "
        "for standard (grouped-query) attention.",
    )
    qk_nope_head_dim: HeadSize | None = Field(
        None, description="Multi-head latent attention: per-head query/key size without rotary embedding."
    )
    qk_rope_head_dim: HeadSize | None = Field(
        None, description="Multi-head latent attention: per-head query/key size carrying rotary embedding."
    )
    v_head_dim: HeadSize | None = Field(None, description="Multi-head latent attention: per-head value size.")
    attention: Literal["flash", "eager"] = Field(
        "eager",
        description='"eager" stores the a·s² softmax scores and dropout mask; "flash" (FlashAttention) stores '
        "none of them and recomputes the scores in the backward.",
    )
    position_embedding: Literal["learned", "rope"] = Field(
        "learned", description='"learned": an s×h position table on the first stage; "rope": no parameters.'
    )
    tie_embeddings: bool = Field(
        False, description="The LM head shares the embedding's V×h matrix (a copy on the last stage when pipelined)."
    )
    norm: Literal["layernorm", "rmsnorm"] = Field(
        "layernorm", description='"layernorm": scale and shift (2h parameters); "rmsnorm": scale only (h).'
    )
    bias: bool = Field(True, description="Linear layers carry biases (GPT) or not (Llama).")
    activation_recomputation: Literal["none", "selective", "full"] = Field(
        "none",
        description='"none"; "selective" recomputes the attention core (drops 5as per token); "full" keeps '
        "only each layer's input and reruns its forward in the backward.",
    )
    precision: Literal["bf16", "fp8"] = Field(
        "bf16",
        description='Matrix multiplies of the decoder layers: "bf16", or "fp8" (FP8 inputs and weights with bf16 '
        "elsewhere, as torchao's Float8Linear and Transformer Engine's current scaling).",
    )
    kernels: Literal["unknown", "eager", "compiled", "fused"] = Field(
        "unknown",
        description='How elementwise work runs: "eager" PyTorch (torchtitan\'s default), "compiled" '
        '(torch.compile), "fused" (hand-fused kernels: Megatron-LM, Transformer Engine), or "unknown" (the '
        "default: the framework is not said; each pass takes the expected time over the frameworks that publish "
        "runs of the plan's data-parallel sharding, and the interval widens to that class's spread).",
    )
    kernels_prior: Literal["full", "replicated", "any"] | None = Field(
        None,
        description='With kernels "unknown": whose published runs the expected time counts. "full" (FSDP layouts: '
        'mostly eager PyTorch), "replicated" (DDP, ZeRO-1/2, no data parallelism: mostly hand-fused), "any" (both '
        "classes, each one vote). null: the class of the layout's own sharding and, where it has tensor, pipeline, "
        "context or expert parallelism, of the published runs with model parallelism in that class. The planner "
        'sets "any" when its search spans layouts of both sharding classes, the sharding class when it spans '
        "layouts with and without model parallelism in one, so that no layout is favoured for the frameworks that "
        "publish it.",
    )
    layers_per_stage: list[int] | None = Field(
        None,
        description="Layers per model stage (one entry per stage, summing to num_layers); null lets pipesched "
        "partition. A derived problem records the chosen partition here.",
    )
    framework: FrameworkName | None = Field(
        None,
        exclude_if=lambda value: value is None,
        description="The training framework that runs it (torchtitan, megatron, automodel, composer; "
        "pipesched.optimizer.frameworks): its kernels where kernels is not said, and what it keeps and overlaps that "
        "no other field states (FSDP's sharded state, backward prefetch and gradient sync, the loss). null "
        "(default): not said, the software profile's defaults. A plan sets it from training.framework.",
    )

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("preset") is None:
            return data
        name = data["preset"]
        if not isinstance(name, str) or name.lower() not in MODEL_PRESETS:
            raise_field_errors(
                "ModelConfig",
                [
                    (
                        ("preset",),
                        f"unknown model preset {name!r}: use one of {', '.join(MODEL_PRESETS)}, or give the "
                        "model's fields (num_layers, hidden_size, …) without a preset",
                        name,
                    )
                ],
            )
        return {**MODEL_PRESETS[name.lower()], **data, "preset": name.lower()}

    @property
    def key_value_heads(self) -> int:
        """Key/value heads: ``num_key_value_heads`` or ``num_attention_heads``."""
        return self.num_key_value_heads if self.num_key_value_heads is not None else self.num_attention_heads

    @property
    def head_size(self) -> int:
        """Per-head size: ``head_dim``, or h / a."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        """Whether the model has mixture-of-experts layers (``num_experts`` given)."""
        return self.num_experts is not None

    @property
    def num_moe_layers(self) -> int:
        """Layers with experts: all but ``first_dense_layers`` for a mixture-of-experts model, else 0."""
        return self.num_layers - self.first_dense_layers if self.is_moe else 0

    @property
    def expert_ffn_size(self) -> int:
        """One expert's FFN inner size: ``moe_ffn_hidden_size`` or the dense ``ffn_size``."""
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn_size

    @property
    def is_mla(self) -> bool:
        """Whether attention is multi-head latent attention (``kv_lora_rank`` given)."""
        return self.kv_lora_rank is not None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has experts."""
        return self.is_moe and layer >= self.first_dense_layers

    @property
    def ffn_size(self) -> int:
        """The FFN inner size: ``ffn_hidden_size`` or ``4 * hidden_size``."""
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def dtype_bytes(self) -> int:
        """Bytes per activation/weight element."""
        return DTYPE_BYTES[self.dtype]

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        errors: list[tuple[tuple[str | int, ...], str, Any]] = []
        if self.hidden_size % self.num_attention_heads:
            divisors = [a for a in range(1, min(self.hidden_size, 256) + 1) if self.hidden_size % a == 0]
            nearby = sorted(divisors, key=lambda a: abs(a - self.num_attention_heads))[:4]
            errors.append(
                (
                    ("num_attention_heads",),
                    f"{self.num_attention_heads} attention heads do not divide hidden_size {self.hidden_size} "
                    f"(head size {self.hidden_size / self.num_attention_heads:g}): use a divisor such as "
                    f"{', '.join(str(a) for a in sorted(nearby))}",
                    self.num_attention_heads,
                )
            )
        kv = self.key_value_heads
        if kv > self.num_attention_heads or self.num_attention_heads % kv:
            heads = self.num_attention_heads
            divisors = [d for d in range(1, min(heads, 1024) + 1) if heads % d == 0][:12]
            errors.append(
                (
                    ("num_key_value_heads",),
                    f"{kv} key/value heads do not divide {self.num_attention_heads} attention heads: use a divisor "
                    f"of num_attention_heads such as {', '.join(str(d) for d in divisors)}",
                    kv,
                )
            )
        errors += self._moe_errors() + self._mla_errors()
        raise_field_errors("ModelConfig", errors)
        return self

    @model_validator(mode="after")
    def _framework_kernels(self) -> ModelConfig:
        """A named framework's kernels where ``kernels`` is not said; a ``kernels`` it does not run is refused,
        naming both fields."""
        if self.framework is None:
            return self
        try:
            kernels = framework_kernels(self.framework, self.kernels)
        except ValueError as error:
            raise_field_errors("ModelConfig", [(("kernels",), str(error), self.kernels)])
            raise  # unreachable: raise_field_errors raised
        if kernels != self.kernels:
            object.__setattr__(self, "kernels", kernels)
        return self

    def _moe_errors(self) -> list[tuple[tuple[str | int, ...], str, Any]]:
        errors: list[tuple[tuple[str | int, ...], str, Any]] = []
        if self.num_experts is None:
            given = [
                name for name in ("num_experts_per_token", "moe_ffn_hidden_size") if getattr(self, name) is not None
            ] + [name for name in ("num_shared_experts", "first_dense_layers") if getattr(self, name)]
            errors += [
                ((name,), f"{name} describes mixture-of-experts layers: give num_experts too, or drop it", None)
                for name in given
            ]
            return errors
        k = self.num_experts_per_token
        if k is None:
            errors.append(
                (
                    ("num_experts_per_token",),
                    f"num_experts {self.num_experts} needs num_experts_per_token (top-k routing), e.g. 2 for Mixtral "
                    "or 8 for DeepSeek-V3",
                    None,
                )
            )
        elif k > self.num_experts:
            errors.append(
                (
                    ("num_experts_per_token",),
                    f"{k} experts per token exceed the {self.num_experts} experts: use at most {self.num_experts}",
                    k,
                )
            )
        if self.first_dense_layers >= self.num_layers:
            errors.append(
                (
                    ("first_dense_layers",),
                    f"first_dense_layers {self.first_dense_layers} leaves none of the {self.num_layers} layers with "
                    f"experts: use fewer than {self.num_layers}, or drop num_experts for a dense model",
                    self.first_dense_layers,
                )
            )
        return errors

    def _mla_errors(self) -> list[tuple[tuple[str | int, ...], str, Any]]:
        names = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if self.kv_lora_rank is None:
            stray = [name for name in (*names, "q_lora_rank") if getattr(self, name) is not None]
            return [
                ((name,), f"{name} describes multi-head latent attention: give kv_lora_rank too, or drop it", None)
                for name in stray
            ]
        return [
            (
                (name,),
                f"multi-head latent attention (kv_lora_rank {self.kv_lora_rank}) needs {name} (DeepSeek-V3: "
                "qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128)",
                None,
            )
            for name in names
            if getattr(self, name) is None
        ]


#: The slowest link a cluster may name, B/s (1 MB/s): below it a collective's time overflows the estimates
#: (1e-300 B/s made every configuration's time infinite, reported as "over memory").
MIN_LINK_BYTES_PER_S = 1e6
#: The slowest accelerator a cluster may name, FLOP/s (1 GFLOP/s), and the least achieved fraction of it: below
#: them a pass's time overflows (5e-324 FLOP/s at 5e-324 efficiency divided by zero).
MIN_FLOPS_PER_S = 1e9
MIN_EFFICIENCY = 1e-3
#: The largest memory, peak and bandwidth a cluster may name (1e30): beyond, sums overflow to inf.
MAX_HARDWARE_VALUE = 1e30
#: The largest link latency a cluster may name, ms (1 s per message; NVLink and InfiniBand take 0.001-0.01 ms):
#: unbounded, inf made every step infinite.
MAX_LATENCY_MS = 1000.0


class ClusterConfig(NumbersModel):
    """The accelerators and links: a catalogue name (:mod:`pipesched.optimizer.accelerators`) or explicit numbers.

    Explicit ``memory_bytes``, ``flops_per_s`` or ``memory_bandwidth_bytes_per_s`` override the
    catalogue's figures; without an accelerator name all three are required.
    """

    model_config = ConfigDict(extra="forbid")

    BOUND_REASONS: ClassVar[dict[str, str]] = {
        "memory_bytes": "bytes; an H100 has 8.6e10, and beyond 1e30 the sums overflow",
        "memory_headroom_bytes": "bytes kept free; beyond 1e30 the sums overflow",
        "memory_bandwidth_bytes_per_s": "B/s; an H100 has 3.35e12, below 1 MB/s a step's time overflows",
        "p2p_bandwidth_bytes_per_s": "B/s; below 1 MB/s a transfer's time overflows the estimates",
        "intra_node_bandwidth_bytes_per_s": "B/s; NVLink is 4.5e11, below 1 MB/s a collective's time overflows",
        "inter_node_bandwidth_bytes_per_s": "B/s; a 400 Gb/s NIC is 5e10, below 1 MB/s a collective's time overflows",
        "p2p_latency_ms": "ms; links take 0.001-0.01 ms, 1 s a message is no link",
        "collective_latency_ms": "ms; links take 0.001-0.01 ms, 1 s a ring step is no link",
        "num_nodes": "100,000 hosts, 48 times Llama 3.1 405B's 2,048 (16,384 GPUs)",
        "gpus_per_node": "1,024 accelerators a host (a GB200 NVL72 NVLink domain has 72)",
        "efficiency": "a fraction of the peak",
        "attention_efficiency": "a fraction of the peak",
    }

    @model_validator(mode="before")
    @classmethod
    def _refuse_moved_fields(cls, data: Any) -> Any:
        """The data-parallel group is the problem's ``data_parallel`` section, not a cluster field."""
        if isinstance(data, dict):
            raise_field_errors(
                "ClusterConfig",
                [
                    (
                        (name,),
                        f"cluster.{name} is not a cluster field: the data-parallel group is the problem's "
                        'data_parallel section, e.g. {"size": 8, "sharding": "optimizer"} for ZeRO-1 over 8 copies',
                        data[name],
                    )
                    for name in ("data_parallel_size", "shard_optimizer_state")
                    if name in data
                ],
            )
        return data

    accelerator: str | None = Field(None, description='Catalogue name, e.g. "H100-SXM"; null for explicit.')
    memory_bytes: float | None = Field(None, gt=0, le=MAX_HARDWARE_VALUE, description="Accelerator memory, bytes.")
    flops_per_s: float | None = Field(None, gt=0, description="Dense bf16 peak, FLOP/s (at least 1e9).")
    memory_bandwidth_bytes_per_s: float | None = Field(
        None,
        ge=MIN_LINK_BYTES_PER_S,
        le=MAX_HARDWARE_VALUE,
        description="Device memory bandwidth, bytes/s (elementwise kernels are bound by it).",
    )
    efficiency: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Achieved fraction of the bf16 peak in large matrix multiplies; null: the accelerator "
        "profile's (0.75 without one).",
    )
    attention_efficiency: float | None = Field(
        None,
        gt=0,
        le=1,
        description="FlashAttention's achieved fraction of the bf16 peak; null: the accelerator profile's.",
    )
    profile: str | None = Field(
        None,
        description="A calibrated accelerator profile by name (built in: the accelerator's own; or one made by "
        "`pipesched calibrate` and registered with POST /v1/profiles or `--profile`); null: the accelerator's.",
    )
    p2p_bandwidth_bytes_per_s: float = Field(
        50e9, ge=MIN_LINK_BYTES_PER_S, le=MAX_HARDWARE_VALUE, description="Link bandwidth between ranks, B/s."
    )
    p2p_latency_ms: float = Field(0.01, ge=0, le=MAX_LATENCY_MS, description="Link latency per transfer, ms.")
    memory_headroom_bytes: float | None = Field(
        None,
        ge=0,
        le=MAX_HARDWARE_VALUE,
        description="Bytes kept free per GPU (CUDA context, NCCL buffers, allocator fragmentation); null: the "
        "profile's default (5% of the memory + 1 GiB for calibrated accelerators, 2 GiB otherwise).",
    )
    num_nodes: int = Field(1, ge=1, le=100_000, description="Hosts in the cluster.")
    gpus_per_node: int = Field(
        8, ge=1, le=1024, description="Accelerators per host (one tensor-parallel group at most)."
    )
    intra_node_bandwidth_bytes_per_s: float = Field(
        450e9,
        ge=MIN_LINK_BYTES_PER_S,
        le=MAX_HARDWARE_VALUE,
        description="Per-GPU bandwidth inside a host (NVLink: 450e9 per direction on H100 SXM), B/s.",
    )
    inter_node_bandwidth_bytes_per_s: float = Field(
        50e9,
        ge=MIN_LINK_BYTES_PER_S,
        le=MAX_HARDWARE_VALUE,
        description="Per-GPU bandwidth between hosts (a 400 Gb/s NIC per GPU: 50e9), B/s.",
    )
    collective_latency_ms: float = Field(
        0.01, ge=0, le=MAX_LATENCY_MS, description="Latency of one ring step of a collective, ms."
    )

    @field_validator("flops_per_s")
    @classmethod
    def _flops_in_range(cls, value: float | None) -> float | None:
        if value is not None and not MIN_FLOPS_PER_S <= value <= MAX_HARDWARE_VALUE:
            raise ValueError(
                f"{value:g} FLOP/s is out of range: give the accelerator's dense bf16 peak in FLOP/s, between "
                f"{MIN_FLOPS_PER_S:g} and {MAX_HARDWARE_VALUE:g} (e.g. 9.895e14 for an H100-SXM), or name it in "
                "cluster.accelerator"
            )
        return value

    @field_validator("efficiency", "attention_efficiency")
    @classmethod
    def _efficiency_in_range(cls, value: float | None) -> float | None:
        if value is not None and value < MIN_EFFICIENCY:
            raise ValueError(
                f"{value:g} is below {MIN_EFFICIENCY:g}: give the achieved fraction of the peak (0.3-0.8 on "
                "today's GPUs), or leave it null for the accelerator profile's"
            )
        return value

    @property
    def num_gpus(self) -> int:
        """GPUs in the cluster: ``num_nodes × gpus_per_node``."""
        return self.num_nodes * self.gpus_per_node


class TensorParallel(NumbersModel):
    """Megatron tensor parallelism inside a node (contract, Problem: ``tensor_parallel``).

    ``size`` GPUs split every layer's matrices (attention by heads, the FFN by columns then rows) and the
    vocabulary; ``sequence_parallel`` also splits the layer norms and dropouts along the sequence (Korthikanti
    et al. 2022, §4.2.2), turning each all-reduce into a reduce-scatter plus an all-gather.
    """

    model_config = ConfigDict(extra="forbid")

    size: int = Field(1, ge=1, le=1024, description="Tensor-parallel degree t (GPUs per layer, within a node).")
    sequence_parallel: bool = Field(True, description="Split norms and dropouts along the sequence too.")
    async_communication: bool = Field(
        False,
        description="Overlap the tensor-parallel collectives with the matrix multiplies (torchtitan's AsyncTP, "
        "Transformer Engine's communication overlap) instead of running them between them.",
    )


class ContextParallel(NumbersModel):
    """Context parallelism: the sequence of every microbatch sharded over ``size`` GPUs (contract, Plan:
    ``context_parallel``; Megatron-LM ``--context-parallel-size``, torchtitan
    ``parallelism.context_parallel_degree``).

    Attention runs as ring attention (Liu et al. 2023): each rank keeps its queries and passes its key/value
    block around the group, c − 1 steps each overlapped with one block's attention, and the causal mask is
    balanced head-tail (each rank holds chunks i and 2c − 1 − i of 2c). Activations and every token-linear
    FLOP divide by c; the weights do not (they are replicated over the group, so the data-parallel group of
    the weights is d·c). :mod:`pipesched.optimizer.cost.context` has the formulas.
    """

    model_config = ConfigDict(extra="forbid")

    size: int = Field(1, ge=1, le=1024, description="Context-parallel degree c (GPUs sharing one sequence).")


class ExpertParallel(NumbersModel):
    """Expert parallelism: the routed experts of every mixture-of-experts layer sharded over ``size`` GPUs
    (contract, Plan: ``expert_parallel``; Megatron-LM ``--expert-model-parallel-size``, torchtitan
    ``parallelism.expert_parallel_degree``).

    The group is carved out of the ranks that hold the same attention shard (Megatron's MoE parallel folding:
    ``size`` × ``tensor_parallel`` divides tensor × context × data-parallel GPUs), each expert split over
    ``tensor_parallel`` of them (expert tensor parallelism e_t; unset: 1 when ``size`` > 1, the published recipes'
    choice), and each MoE layer sends its tokens to their experts and back with two all-to-alls per pass, with an
    all-gather and a reduce-scatter of them over the e_t GPUs of one expert where e_t > 1.
    :mod:`pipesched.optimizer.cost.experts` has the formulas.
    """

    model_config = ConfigDict(extra="forbid")

    size: int = Field(1, ge=1, le=65_536, description="Expert-parallel degree (GPUs sharing one layer's experts).")
    overlap: bool = Field(
        False,
        description="The all-to-alls run beside another microbatch's compute (DualPipe, DeepSeek-V3 §3.2.1; "
        "Megatron's --overlap-moe-expert-parallel-comm) instead of on the critical path.",
    )
    tensor_parallel: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="Expert tensor parallelism e_t: GPUs splitting one routed expert (Megatron-LM "
        "--expert-tensor-parallel-size, which defaults to the tensor-parallel size when not given). Unset: 1 when "
        "size > 1, the tensor-parallel size otherwise.",
    )
