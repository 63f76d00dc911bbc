"""Model and cluster descriptions a problem may give instead of ``costs`` and ``memory``.

:mod:`pipesched.optimizer.costmodel` derives per-stage times and memory from them, and
:mod:`pipesched.optimizer.partition` splits the layers into stages.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipesched.optimizer.validation import raise_field_errors

__all__ = ["DTYPE_BYTES", "ClusterConfig", "ModelConfig"]

#: Bytes per element of each dtype.
DTYPE_BYTES: dict[str, int] = {"fp16": 2, "bf16": 2, "fp32": 4}


class ModelConfig(BaseModel):
    """A GPT-style decoder (Zero Bubble paper, Table 1 notation: h, a, s, b, L, V).

    Stage 0 also holds the embedding, the last stage the final layer norm, the LM head and the loss.

    Raises:
        pydantic.ValidationError: ``num_attention_heads`` not dividing ``hidden_size``.
    """

    model_config = ConfigDict(extra="forbid")

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
    activation_recomputation: Literal["none", "selective", "full"] = Field(
        "none",
        description='"none"; "selective" recomputes the attention core (drops 5as per token); "full" keeps '
        "only each layer's input and reruns its forward in the backward.",
    )
    layers_per_stage: list[int] | None = Field(
        None,
        description="Layers per model stage (one entry per stage, summing to num_layers); null lets pipesched "
        "partition. A derived problem records the chosen partition here.",
    )

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
        raise_field_errors("ModelConfig", errors)
        return self


class ClusterConfig(BaseModel):
    """The accelerators and links: a catalogue name (:mod:`pipesched.optimizer.accelerators`) or explicit numbers.

    Explicit ``memory_bytes``, ``flops_per_s`` or ``memory_bandwidth_bytes_per_s`` override the
    catalogue's figures; without an accelerator name all three are required.
    """

    model_config = ConfigDict(extra="forbid")

    accelerator: str | None = Field(None, description='Catalogue name, e.g. "H100-SXM"; null for explicit.')
    memory_bytes: float | None = Field(None, gt=0, description="Accelerator memory, bytes.")
    flops_per_s: float | None = Field(None, gt=0, description="Dense bf16 peak, FLOP/s.")
    memory_bandwidth_bytes_per_s: float | None = Field(
        None, gt=0, description="Device memory bandwidth, bytes/s (elementwise kernels are bound by it)."
    )
    efficiency: float = Field(
        0.75, gt=0, le=1, description="Achieved fraction of peak FLOP/s in the matrix multiplies."
    )
    p2p_bandwidth_bytes_per_s: float = Field(50e9, gt=0, description="Link bandwidth between ranks, B/s.")
    p2p_latency_ms: float = Field(0.01, ge=0, description="Link latency per transfer, ms.")
    data_parallel_size: int = Field(1, ge=1, description="Data-parallel replicas sharding optimizer state.")
    shard_optimizer_state: bool = Field(
        False, description="ZeRO-1: shard the fp32 master weights and Adam state over data_parallel_size."
    )
    memory_reserve_bytes: float = Field(
        2 * 1024**3, ge=0, description="Bytes kept free per rank (CUDA context, allocator fragmentation)."
    )
