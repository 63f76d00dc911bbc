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
- Per-head sizes other than h/a (``head_dim``, Qwen3): queries a·d, keys and values n_kv·d, output a·d×h.
- Multi-head latent attention (DeepSeek-AI 2024, "DeepSeek-V2", §2.1.2, Eq. 9–11; DeepSeek-V3 §2.1.1):
  queries h·r_q + r_q·a·(d_nope + d_rope) (or h·a·(d_nope + d_rope) without query compression), keys and
  values h·(r_kv + d_rope) + r_kv·a·(d_nope + d_v), output a·d_v·h; the attention core multiplies
  a·(d_nope + d_rope) wide queries and keys and a·d_v wide values (training runs it uncompressed).
- Mixture of experts (Shazeer et al. 2017; Fedus et al. 2022, Switch; DeepSeek-V3 §2.1.2): a layer holds
  E routed experts and the shared ones, each an FFN of the expert size, plus the E×h router; a token passes
  its top-k routed experts and every shared one, so its FLOPs count k + shared experts and the router
  (the *active* parameters), while memory counts all E. The busiest expert-parallel rank processes
  ``moe_load_imbalance`` times the mean of the routed tokens.
- Context parallelism c (Liu et al. 2023, ring attention; Megatron-LM's ``--context-parallel-size``): each
  rank holds s/c of the sequence, so the token-linear FLOPs divide by c; with causal masks the head-tail
  split (torchtitan's load balancer, Megatron's zig-zag) gives every rank 1/c of the causal attention core.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipesched.optimizer.configs import ModelConfig

__all__ = [
    "PassFlops",
    "active_parameters",
    "attention_core_width",
    "attention_linear_parameters",
    "embedding_parameters",
    "expert_parameters",
    "head_flops",
    "head_parameters",
    "layer_flops",
    "layer_linear_parameters",
    "layer_parameters",
    "model_flops_per_token",
    "model_parameters",
    "norm_parameters",
]


@dataclass(frozen=True)
class PassFlops:
    """Matrix-multiply FLOPs of F, I and W for one microbatch, of the attention core inside F and I, and of a
    mixture-of-experts layer's routed and shared experts inside F."""

    forward: float
    backward_input: float
    backward_weight: float
    attention_forward: float
    attention_backward: float = 0.0
    experts_forward: float = 0.0


def norm_parameters(model: ModelConfig) -> int:
    """One norm: 2h (LayerNorm scale and shift) or h (RMSNorm scale)."""
    return (2 if model.norm == "layernorm" else 1) * model.hidden_size


def _kv_width(model: ModelConfig) -> int:
    return model.head_size * model.key_value_heads


def _query_width(model: ModelConfig) -> int:
    return model.head_size * model.num_attention_heads


def _matrices(model: ModelConfig) -> int:
    return 3 if model.ffn_type == "swiglu" else 2


def attention_linear_parameters(model: ModelConfig) -> int:
    """Weights of one layer's attention projections (no biases, no norms): h·(q + 2k) + q·h with query width
    q = a·d and key/value width k = n_kv·d, or multi-head latent attention's (module docstring)."""
    h = model.hidden_size
    if not model.is_mla:
        q, k = _query_width(model), _kv_width(model)
        return h * (q + 2 * k) + q * h
    a = model.num_attention_heads
    nope, rope, value = model.qk_nope_head_dim or 0, model.qk_rope_head_dim or 0, model.v_head_dim or 0
    kv_rank = model.kv_lora_rank or 0
    qk = a * (nope + rope)
    query = h * qk if model.q_lora_rank is None else h * model.q_lora_rank + model.q_lora_rank * qk
    key_value = h * (kv_rank + rope) + kv_rank * a * (nope + value)
    return query + key_value + a * value * h


def attention_core_width(model: ModelConfig) -> tuple[int, int]:
    """(query/key width, value width) the attention core multiplies per token: a·d each for standard
    attention, a·(d_nope + d_rope) and a·d_v for multi-head latent attention."""
    if model.is_mla:
        a = model.num_attention_heads
        return a * ((model.qk_nope_head_dim or 0) + (model.qk_rope_head_dim or 0)), a * (model.v_head_dim or 0)
    return _query_width(model), _query_width(model)


def _attention_extra_parameters(model: ModelConfig) -> int:
    """Biases of the projections (q + 2k + h) and multi-head latent attention's two latent norms."""
    extra = 0
    if model.bias and not model.is_mla:
        extra += _query_width(model) + 2 * _kv_width(model) + model.hidden_size
    if model.is_mla:
        extra += (model.q_lora_rank or 0) + (model.kv_lora_rank or 0)
    return extra


def _ffn_parameters(model: ModelConfig, inner: int) -> int:
    """One FFN of inner size ``inner``: 2 or 3 matrices h×inner, and biases (inner or 2·inner, + h)."""
    h = model.hidden_size
    biases = ((2 if model.ffn_type == "swiglu" else 1) * inner + h) if model.bias else 0
    return _matrices(model) * h * inner + biases


def expert_parameters(model: ModelConfig) -> int:
    """One expert (routed or shared): an FFN of ``expert_ffn_size``."""
    return _ffn_parameters(model, model.expert_ffn_size)


def layer_linear_parameters(model: ModelConfig, *, moe: bool = False) -> int:
    """Weights (no biases, no norms) a token multiplies in one layer: the attention projections and (2 or 3)·h·f,
    or with ``moe`` its k routed and the shared experts' matrices plus the E×h router (the active matrices)."""
    h = model.hidden_size
    if moe and model.is_moe:
        experts = (model.num_experts_per_token or 1) + model.num_shared_experts
        mlp = experts * _matrices(model) * h * model.expert_ffn_size + (model.num_experts or 0) * h
    else:
        mlp = _matrices(model) * h * model.ffn_size
    return attention_linear_parameters(model) + mlp


def layer_parameters(model: ModelConfig, *, moe: bool = False, active: bool = False) -> int:
    """All parameters of one layer: attention (with biases and latent norms), the FFN (dense, or with ``moe``
    every routed and shared expert plus the router; ``active``: the k routed experts only), two norms."""
    attention = attention_linear_parameters(model) + _attention_extra_parameters(model)
    if moe and model.is_moe:
        routed = (model.num_experts_per_token or 1) if active else (model.num_experts or 0)
        mlp = (routed + model.num_shared_experts) * expert_parameters(model) + (model.num_experts or 0) * (
            model.hidden_size
        )
    else:
        mlp = _ffn_parameters(model, model.ffn_size)
    return attention + mlp + 2 * norm_parameters(model)


def embedding_parameters(model: ModelConfig) -> int:
    """Token table V·h plus, with learned positions, the s·h position table."""
    positions = model.seq_length * model.hidden_size if model.position_embedding == "learned" else 0
    return model.vocab_size * model.hidden_size + positions


def head_parameters(model: ModelConfig, *, separate_copy: bool = True) -> int:
    """Final norm plus the LM head V·h; a tied head counts its V·h only as a ``separate_copy`` (pipelined)."""
    head = model.vocab_size * model.hidden_size if (not model.tie_embeddings or separate_copy) else 0
    return norm_parameters(model) + head


def _layers_parameters(model: ModelConfig, *, active: bool) -> int:
    dense = model.num_layers - model.num_moe_layers
    moe = layer_parameters(model, moe=True, active=active) if model.is_moe else 0
    return dense * layer_parameters(model) + model.num_moe_layers * moe


def model_parameters(model: ModelConfig) -> int:
    """Distinct parameters of the whole model (a tied head counted once, every expert): the published count."""
    return (
        _layers_parameters(model, active=False)
        + embedding_parameters(model)
        + head_parameters(model, separate_copy=False)
    )


def active_parameters(model: ModelConfig) -> int:
    """Parameters one token passes through: :func:`model_parameters` with only the k routed experts of each
    mixture-of-experts layer (the published "activated" count; equal to it for a dense model)."""
    return (
        _layers_parameters(model, active=True)
        + embedding_parameters(model)
        + head_parameters(model, separate_copy=False)
    )


def model_flops_per_token(model: ModelConfig, *, causal: bool = False) -> float:
    """Model FLOPs of one training token (forward and backward, no recomputation): 6 × the active matrices
    of every layer and the LM head, plus the attention core 6·s·(q + v) per layer (PaLM, Chowdhery et al. 2022,
    App. B: 6N + 12·l·h·s at q = v = h), halved with ``causal`` (Megatron-LM's ``num_floating_point_operations``
    since 2025). The embedding lookup counts nothing."""
    dense = model.num_layers - model.num_moe_layers
    matrices = dense * layer_linear_parameters(model) + model.num_moe_layers * layer_linear_parameters(model, moe=True)
    query_key, value = attention_core_width(model)
    core = 6 * model.seq_length * (query_key + value) * model.num_layers
    return 6 * (matrices + model.vocab_size * model.hidden_size) + (core / 2 if causal else core)


def layer_flops(
    model: ModelConfig, tensor_parallel: int = 1, *, moe: bool = False, context_parallel: int = 1
) -> PassFlops:
    """FLOPs of one layer's F, I, W for one microbatch on one of ``tensor_parallel`` × ``context_parallel`` ranks
    (module docstring); ``moe``: a mixture-of-experts layer, its routed experts scaled by ``moe_load_imbalance``
    (the busiest rank's share)."""
    s, b = model.seq_length, model.micro_batch_size
    tokens = s * b
    linear = 2.0 * tokens * layer_linear_parameters(model, moe=moe)
    experts = 0.0
    if moe and model.is_moe:
        expert = _matrices(model) * model.hidden_size * model.expert_ffn_size
        routed = (model.num_experts_per_token or 1) * model.moe_load_imbalance
        linear += 2 * tokens * (model.num_experts_per_token or 1) * expert * (model.moe_load_imbalance - 1.0)
        experts = 2.0 * tokens * (routed + model.num_shared_experts) * expert
    query_key, value = attention_core_width(model)
    attention = 2 * s * s * b * (query_key + value)
    if model.attention == "flash":
        attention_forward, attention_backward = attention / 2, 2.5 * attention / 2
    else:
        attention_forward, attention_backward = attention, 2.0 * attention
    t = tensor_parallel * context_parallel
    return PassFlops(
        forward=(linear + attention_forward) / t,
        backward_input=(linear + attention_backward) / t,
        backward_weight=linear / t,
        attention_forward=attention_forward / t,
        attention_backward=attention_backward / t,
        experts_forward=experts / t,
    )


def head_flops(model: ModelConfig, tensor_parallel: int = 1) -> float:
    """FLOPs of the LM head's logits for one microbatch, each of F, I and W: 2·s·b·h·V / t."""
    return 2 * model.seq_length * model.micro_batch_size * model.hidden_size * model.vocab_size / tensor_parallel
