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
"""

from __future__ import annotations

from typing import Any

__all__ = ["MODEL_PRESETS", "preset_names"]

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
    "gpt3-175b": {**_GPT, "num_layers": 96, "hidden_size": 12_288, "num_attention_heads": 96, "seq_length": 2048},
    "gpt2": {**_GPT, "num_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "seq_length": 1024},
    "gpt2-medium": {**_GPT, "num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 1024},
    "gpt2-xl": {**_GPT, "num_layers": 48, "hidden_size": 1600, "num_attention_heads": 25, "seq_length": 1024},
}


def preset_names() -> list[str]:
    """The catalogue's preset names."""
    return list(MODEL_PRESETS)
