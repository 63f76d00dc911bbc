"""Catalogue of model presets: ``model: {"preset": "llama3.1-8b", ...overrides}``.

A preset is a dict of :class:`~pipesched.optimizer.configs.ModelConfig` fields; the fields given beside
``preset`` override it. Expansion happens before validation (``ModelConfig``'s ``mode="before"`` validator),
so a stored model carries both the preset name and every field it stands for.

Sources (architecture hyper-parameters as published):

- Llama 3.1 8B / 70B / 405B: Meta, "The Llama 3 Herd of Models" (arXiv 2407.21783), Table 3 (layers, model
  dimension, FFN dimension, attention heads, key/value heads 8, vocabulary 128,000 → the tokenizer's 128,256
  entries, RoPE, SwiGLU, RMSNorm, no biases, untied embeddings). Sequence length 8192: the pre-training
  context of §3.4.1 and torchtitan's ``training.seq_len`` default.
- GPT-3 175B: Brown et al. 2020 (arXiv 2005.14165), Table 2.1 (96 layers, d_model 12288, 96 heads, context
  2048); GPT-2 BPE vocabulary 50,257, learned positions, tied embeddings, GeLU FFN of 4·d_model, biases.
- GPT-2 (124M), GPT-2 medium (355M), GPT-2 XL (1.5B): Radford et al. 2019, Table 2 (layers, d_model), with
  64-dimensional heads as released; context 1024, tied embeddings.
- Llama 2 7B: Touvron et al. 2023 (arXiv 2307.09288), Table 1 and the released ``config.json`` (32 layers,
  4096, 32 heads without grouping, FFN 11,008, vocabulary 32,000, context 4096).

Mixture-of-experts presets (``num_experts`` …; the published total and active parameter counts they must meet
are in ``PUBLISHED_PARAMETERS``), from each model's released ``config.json`` on Hugging Face:

- DeepSeek-V3: DeepSeek-AI, "DeepSeek-V3 Technical Report" (arXiv 2412.19437), §2.1 and §4.2: 61 layers,
  hidden 7168, 128 heads of multi-head latent attention (query rank 1536, key/value rank 512, per-head 128 +
  64 rotary for queries/keys, 128 for values), the first 3 layers dense (FFN 18,432), then 256 routed experts
  of 2048 with 8 per token and 1 shared expert, vocabulary 129,280, pre-training sequence 4K; 671B total,
  37B active (the multi-token-prediction module's 14B not counted, as the report counts it).
- Mixtral 8x7B: Jiang et al. 2024 (arXiv 2401.04088), Table 1: 32 layers, 4096, 32 heads, 8 key/value heads,
  8 experts of 14,336 with 2 per token, vocabulary 32,000; 46.7B total, 12.9B active (§2.1). Sequence 4096,
  the NeMo / Megatron benchmarks' length.
- Mixtral 8x22B: Mistral AI's release (``config.json``): 56 layers, 6144, 48 heads, 8 key/value heads, 8 experts
  of 16,384 with 2 per token, vocabulary 32,768; 141B total, 39B active (Mistral AI, "Cheaper, Better, Faster,
  Stronger", 2024).
- Qwen3-30B-A3B and Qwen3-235B-A22B: Qwen team, "Qwen3 Technical Report" (arXiv 2505.09388), Table 2: 48 / 94
  layers, 32 / 64 query heads and 4 key/value heads of 128, 128 experts with 8 per token and no shared expert,
  hidden 2048 / 4096, expert FFN 768 / 1536, vocabulary 151,936, untied; 30.5B / 235B total, 3.3B / 22B active.
  Sequence 4096 (pre-training stages 1–2 and the NeMo benchmarks).
- GPT-OSS 120B and 20B: OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card" (arXiv 2508.10925), Table 1 and the
  released ``config.json``: 36 / 24 layers, hidden 2880, 64 query heads and 8 key/value heads of 64, 128 / 32
  experts of 2880 with 4 per token, biases in attention and experts, vocabulary 201,088; 116.8B / 20.9B total,
  5.1B / 3.6B active as the card counts them, without the token embedding (0.58B; pipesched's
  ``active_parameters`` counts it, as the other publishers do, and gives 5.7B / 4.2B). Every other layer
  attends within a 128-token window and each head has a learned sink; both are left out. At 4096 tokens the
  causal attention core is 10.5% / 10.0% of the model FLOPs; a kernel that skips the tiles outside the window
  would do 44-47% less of it (about 5% of the model FLOPs). The published runs ran it fused: Megatron Bridge through
  Transformer Engine's cuDNN attention (``softmax_type="learnable"``, TE >= 2.8 with cuDNN >= 9.13.1; its 25.11,
  26.02 and 26.04 containers ship TE 2.9 / 2.12 / 2.14 with cuDNN 9.13.1 / 9.18.0 / 9.20.0), NeMo AutoModel
  through PyTorch's FlexAttention with the window as a block mask.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MODEL_PRESETS", "PUBLISHED_PARAMETERS", "preset_names"]

_LLAMA3: dict[str, Any] = {
    "vocab_size": 128_256,
    "seq_length": 8192,
    "num_key_value_heads": 8,
    "ffn_type": "swiglu",
    "attention": "flash",
    "position_embedding": "rope",
    "norm": "rmsnorm",
    "bias": False,
    "tie_embeddings": False,
}
_GPT: dict[str, Any] = {
    "vocab_size": 50_257,
    "ffn_type": "gelu",
    "position_embedding": "learned",
    "norm": "layernorm",
    "bias": True,
    "tie_embeddings": True,
}

#: Preset name → ModelConfig fields.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "llama3.1-8b": {
        **_LLAMA3,
        "num_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "ffn_hidden_size": 14_336,
    },
    "llama3.1-70b": {
        **_LLAMA3,
        "num_layers": 80,
        "hidden_size": 8192,
        "num_attention_heads": 64,
        "ffn_hidden_size": 28_672,
    },
    "llama3.1-405b": {
        **_LLAMA3,
        "num_layers": 126,
        "hidden_size": 16_384,
        "num_attention_heads": 128,
        "ffn_hidden_size": 53_248,
    },
    "llama2-7b": {
        **_LLAMA3,
        "vocab_size": 32_000,
        "seq_length": 4096,
        "num_key_value_heads": None,
        "num_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "ffn_hidden_size": 11_008,
    },
    "deepseek-v3": {
        **_LLAMA3,
        "vocab_size": 129_280,
        "seq_length": 4096,
        "num_key_value_heads": None,
        "num_layers": 61,
        "hidden_size": 7168,
        "num_attention_heads": 128,
        "ffn_hidden_size": 18_432,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "num_experts": 256,
        "num_experts_per_token": 8,
        "moe_ffn_hidden_size": 2048,
        "num_shared_experts": 1,
        "first_dense_layers": 3,
    },
    "mixtral-8x7b": {
        **_LLAMA3,
        "vocab_size": 32_000,
        "seq_length": 4096,
        "num_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "ffn_hidden_size": 14_336,
        "num_experts": 8,
        "num_experts_per_token": 2,
    },
    "mixtral-8x22b": {
        **_LLAMA3,
        "vocab_size": 32_768,
        "seq_length": 4096,
        "num_layers": 56,
        "hidden_size": 6144,
        "num_attention_heads": 48,
        "ffn_hidden_size": 16_384,
        "num_experts": 8,
        "num_experts_per_token": 2,
    },
    "qwen3-30b-a3b": {
        **_LLAMA3,
        "vocab_size": 151_936,
        "seq_length": 4096,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_layers": 48,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "ffn_hidden_size": 6144,
        "num_experts": 128,
        "num_experts_per_token": 8,
        "moe_ffn_hidden_size": 768,
    },
    "qwen3-235b-a22b": {
        **_LLAMA3,
        "vocab_size": 151_936,
        "seq_length": 4096,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_layers": 94,
        "hidden_size": 4096,
        "num_attention_heads": 64,
        "ffn_hidden_size": 12_288,
        "num_experts": 128,
        "num_experts_per_token": 8,
        "moe_ffn_hidden_size": 1536,
    },
    "gpt-oss-120b": {
        **_LLAMA3,
        "vocab_size": 201_088,
        "seq_length": 4096,
        "bias": True,
        "head_dim": 64,
        "num_layers": 36,
        "hidden_size": 2880,
        "num_attention_heads": 64,
        "ffn_hidden_size": 2880,
        "num_experts": 128,
        "num_experts_per_token": 4,
    },
    "gpt-oss-20b": {
        **_LLAMA3,
        "vocab_size": 201_088,
        "seq_length": 4096,
        "bias": True,
        "head_dim": 64,
        "num_layers": 24,
        "hidden_size": 2880,
        "num_attention_heads": 64,
        "ffn_hidden_size": 2880,
        "num_experts": 32,
        "num_experts_per_token": 4,
    },
    "gpt3-175b": {**_GPT, "num_layers": 96, "hidden_size": 12_288, "num_attention_heads": 96, "seq_length": 2048},
    "gpt2": {**_GPT, "num_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "seq_length": 1024},
    "gpt2-medium": {**_GPT, "num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 1024},
    "gpt2-xl": {**_GPT, "num_layers": 48, "hidden_size": 1600, "num_attention_heads": 25, "seq_length": 1024},
}


#: Published (total, active) parameter counts of the mixture-of-experts presets (module docstring sources).
PUBLISHED_PARAMETERS: dict[str, tuple[float, float]] = {
    "deepseek-v3": (671e9, 37e9),
    "mixtral-8x7b": (46.7e9, 12.9e9),
    "mixtral-8x22b": (141e9, 39e9),
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "qwen3-235b-a22b": (235e9, 22e9),
}


def preset_names() -> list[str]:
    """The catalogue's preset names."""
    return list(MODEL_PRESETS)
