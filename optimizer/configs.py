"""Model and cluster descriptions a problem may give instead of ``costs`` and ``memory``.

:mod:`optimizer.costmodel` derives per-stage times and memory from them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ClusterConfig", "ModelConfig"]


class ModelConfig(BaseModel):
    """A GPT-style decoder (Zero Bubble paper, Table 1 notation: h, a, s, b, L, V)."""

    model_config = ConfigDict(extra="forbid")

    num_layers: int = Field(ge=1, description="Transformer layers L.")
    hidden_size: int = Field(ge=1, description="Hidden size h.")
    num_attention_heads: int = Field(ge=1, description="Attention heads a.")
    seq_length: int = Field(ge=1, description="Sequence length s, tokens.")
    vocab_size: int = Field(ge=1, description="Vocabulary size V.")
    micro_batch_size: int = Field(1, ge=1, description="Sequences per microbatch b.")
    dtype: Literal["fp16", "bf16", "fp32"] = Field("bf16", description="Activation and weight dtype.")
    ffn_hidden_size: int | None = Field(None, ge=1, description="FFN inner size; null for 4h.")
    activation_recomputation: Literal["none", "selective", "full"] = Field(
        "none", description="Activation recomputation policy."
    )
    layers_per_stage: list[int] | None = Field(
        None, description="Explicit layers per model stage; null lets pipesched partition."
    )


class ClusterConfig(BaseModel):
    """The accelerators and links (a catalogue name or explicit numbers)."""

    model_config = ConfigDict(extra="forbid")

    accelerator: str | None = Field(None, description='Catalogue name, e.g. "H100-SXM"; null for explicit.')
    memory_bytes: float | None = Field(None, gt=0, description="Accelerator memory, bytes.")
    flops_per_s: float | None = Field(None, gt=0, description="Dense bf16 peak, FLOP/s.")
    efficiency: float = Field(0.5, gt=0, le=1, description="Achieved fraction of peak FLOP/s.")
    p2p_bandwidth_bytes_per_s: float = Field(50e9, gt=0, description="Link bandwidth between ranks, B/s.")
    p2p_latency_ms: float = Field(0.01, ge=0, description="Link latency per transfer, ms.")
    data_parallel_size: int = Field(1, ge=1, description="Data-parallel replicas sharding optimizer state.")
    shard_optimizer_state: bool = Field(False, description="ZeRO-1: shard optimizer state across DP.")
    memory_reserve_bytes: float = Field(2 * 1024**3, ge=0, description="Bytes kept free per rank.")
