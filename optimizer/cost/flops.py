"""Parameters and matrix-multiply FLOPs of a decoder layer, the embedding and the head.

One microbatch of b sequences of s tokens; a multiply-add counts 2 FLOPs. Notation: h hidden size, a
attention heads, k = h·n_kv/a the key/value width (grouped-query attention, Ainslie et al. 2023), f the FFN
inner size, V the vocabulary, t the tensor-parallel degree.

- Linear layers (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters using
  Megatron-LM", §5.1 / Eq. 3 derivation): forward FLOPs = 2 · tokens · parameters of the weight matrices:
  attention projections h·(h + 2k) (Q, K, V) + h·h (output); FFN 2·h·f (GeLU) or 3·h·f (SwiGLU, Shazeer 2020:
  gate, up, down). With k = h and f = 4h this is the Zero Bubble paper's (Table 1) 24·s·b·h².
- Attention core: Q·Kᵀ and P·V, 2·2·s²·b·h forward (Zero Bubble Table 1's 4s²bh); the input-gradient backward
  is twice the forward (four matrix products), plus one product (Q·Kᵀ recomputed) under FlashAttention
  (Dao 2023, FlashAttention-2, Alg. 2): 2.5 × forward. FlashAttention skips the fully masked blocks of a
  causal mask, so it computes half of these; eager attention computes them all.
- Weight gradients W equal the forward's linear-layer FLOPs (one product per weight matrix).
- Tensor parallelism (Shoeybi et al. 2019, Megatron-LM, §3): every linear layer and the attention heads are
  split t ways, so all of the above divides by t; norms are replicated (their parameters counted on every
  rank).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipesched.optimizer.configs import ModelConfig

__all__ = [
    "PassFlops",
    "embedding_parameters",
    "head_flops",
    "head_parameters",
    "layer_flops",
    "layer_linear_parameters",
    "layer_parameters",
    "model_parameters",
    "norm_parameters",
]


@dataclass(frozen=True)
class PassFlops:
    """Matrix-multiply FLOPs of F, I and W for one microbatch, and of the attention core inside F."""

    forward: float
    backward_input: float
    backward_weight: float
    attention_forward: float


def norm_parameters(model: ModelConfig) -> int:
    """One norm: 2h (LayerNorm scale and shift) or h (RMSNorm scale)."""
    return (2 if model.norm == "layernorm" else 1) * model.hidden_size


def _kv_width(model: ModelConfig) -> int:
    return model.head_size * model.key_value_heads


def layer_linear_parameters(model: ModelConfig) -> int:
    """Weights (no biases, no norms) of one layer's matrices: h·(2h + 2k) + (2 or 3)·h·f."""
    h, f, k = model.hidden_size, model.ffn_size, _kv_width(model)
    matrices = 3 if model.ffn_type == "swiglu" else 2
    return h * (2 * h + 2 * k) + matrices * h * f


def layer_parameters(model: ModelConfig) -> int:
    """All parameters of one layer: the matrices, biases (h + 2k + h attention; f or 2f, + h FFN), two norms."""
    h, f, k = model.hidden_size, model.ffn_size, _kv_width(model)
    biases = 0
    if model.bias:
        biases = (2 * h + 2 * k) + (2 * f if model.ffn_type == "swiglu" else f) + h
    return layer_linear_parameters(model) + biases + 2 * norm_parameters(model)


def embedding_parameters(model: ModelConfig) -> int:
    """Token table V·h plus, with learned positions, the s·h position table."""
    positions = model.seq_length * model.hidden_size if model.position_embedding == "learned" else 0
    return model.vocab_size * model.hidden_size + positions


def head_parameters(model: ModelConfig, *, separate_copy: bool = True) -> int:
    """Final norm plus the LM head V·h; a tied head counts its V·h only as a ``separate_copy`` (pipelined)."""
    head = model.vocab_size * model.hidden_size if (not model.tie_embeddings or separate_copy) else 0
    return norm_parameters(model) + head


def model_parameters(model: ModelConfig) -> int:
    """Distinct parameters of the whole model (a tied head counted once): the published parameter count."""
    return (
        model.num_layers * layer_parameters(model)
        + embedding_parameters(model)
        + head_parameters(model, separate_copy=False)
    )


def layer_flops(model: ModelConfig, tensor_parallel: int = 1) -> PassFlops:
    """FLOPs of one layer's F, I, W for one microbatch on one of ``tensor_parallel`` ranks (module docstring)."""
    s, b, h = model.seq_length, model.micro_batch_size, model.hidden_size
    tokens = s * b
    linear = 2 * tokens * layer_linear_parameters(model)
    attention = 4 * s * s * b * h
    if model.attention == "flash":
        attention_forward, attention_backward = attention / 2, 2.5 * attention / 2
    else:
        attention_forward, attention_backward = attention, 2.0 * attention
    t = tensor_parallel
    return PassFlops(
        forward=(linear + attention_forward) / t,
        backward_input=(linear + attention_backward) / t,
        backward_weight=linear / t,
        attention_forward=attention_forward / t,
    )


def head_flops(model: ModelConfig, tensor_parallel: int = 1) -> float:
    """FLOPs of the LM head's logits for one microbatch, each of F, I and W: 2·s·b·h·V / t."""
    return 2 * model.seq_length * model.micro_batch_size * model.hidden_size * model.vocab_size / tensor_parallel
