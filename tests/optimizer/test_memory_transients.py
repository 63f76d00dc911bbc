"""The passes' transients the memory model holds beside the per-layer count (issue 24): the loss's logits by how the
framework computes the cross-entropy, a recomputed layer, and what hand-fused kernels do not store."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from pipesched.optimizer.configs import ClusterConfig, ModelConfig
from pipesched.optimizer.cost.memory import CROSS_ENTROPY_BYTES, layer_activation
from pipesched.optimizer.cost.stages import head_block, resolve_hardware, transformer_layer
from pipesched.optimizer.derive import load_problem

LLAMA_8B: dict[str, Any] = {"preset": "llama3.1-8b", "seq_length": 8192, "micro_batch_size": 1}


def model(**fields: Any) -> ModelConfig:
    return ModelConfig.model_validate({**LLAMA_8B, **fields})


def test_the_losss_transient_follows_the_cross_entropy_implementation() -> None:
    hardware = resolve_hardware(ClusterConfig(accelerator="H100-SXM"))
    reserve = hardware.profile.activation_memory_factor
    logits = 8192 * 128256
    eager = head_block(model(kernels="eager"), hardware)
    # torchtitan's F.cross_entropy(logits.float()): the fp32 gradients of log-softmax's output and input, 8 B each
    assert eager.transient_bytes == pytest.approx(8 * logits * reserve)
    assert eager.transient_bytes > 8e9  # Llama 3's 128k vocabulary at 8k tokens: the loss alone is ~13 GB at its peak
    fused = head_block(model(kernels="fused"), hardware)  # Megatron-Core's vocab-parallel cross-entropy, in place
    assert fused.transient_bytes == pytest.approx(CROSS_ENTROPY_BYTES["vocab_parallel"][1] * logits)
    flash_attn = hardware.software.model_copy(update={"pytorch_cross_entropy": "fused"})  # llm-foundry's loss
    composer = head_block(model(kernels="eager"), replace(hardware, software=flash_attn))
    assert composer.transient_bytes == pytest.approx(2 * logits * reserve)
    assert composer.activation_bytes < eager.activation_bytes  # the bf16 logits saved, not the fp32 log-softmax
    unknown = head_block(model(kernels="unknown"), hardware)  # a plan that fits fits whatever the framework
    assert unknown.transient_bytes == pytest.approx(max(eager.transient_bytes, fused.transient_bytes))


def test_a_recomputed_layer_is_a_transient_of_its_backward() -> None:
    hardware = resolve_hardware(ClusterConfig(accelerator="H100-SXM"))
    for recompute in ("none", "selective", "full"):
        config = model(kernels="eager", activation_recomputation=recompute)
        memory = layer_activation(config)
        layer = transformer_layer(config, hardware)
        reserve = hardware.profile.activation_memory_factor
        assert layer.transient_bytes == pytest.approx((memory.full - memory.activation) * reserve)
        assert (layer.transient_bytes > 0) == (recompute != "none")


def test_hand_fused_kernels_store_less_and_move_as_much() -> None:
    eager, fused = layer_activation(model(kernels="eager")), layer_activation(model(kernels="fused"))
    tokens, f, h = 8192, 14336, 4096
    assert eager.full == fused.full  # the elementwise traffic is the same
    assert eager.activation - fused.activation == pytest.approx(2 * f * tokens)  # fused SwiGLU keeps its input only
    fp8 = layer_activation(model(kernels="fused", precision="fp8"))
    # Transformer Engine saves FP8 GEMM inputs: the two norms' outputs, the projection's and fc2's inputs at 1 byte
    assert fused.activation - fp8.activation == pytest.approx((2 * h + h + f) * tokens)


def test_the_rank_holding_the_loss_counts_its_transient_in_static_memory() -> None:
    def static(vocab_size: int) -> list[float]:
        document = {
            "pipeline": {"num_ranks": 2, "num_microbatches": 4},
            "model": {**LLAMA_8B, "vocab_size": vocab_size, "kernels": "eager", "layers_per_stage": [16, 16]},
            "cluster": {"accelerator": "H200"},
        }
        problem = load_problem(document)
        return problem.static_memory

    small, large = static(32000), static(128256)
    reserve = resolve_hardware(ClusterConfig(accelerator="H200")).profile.activation_memory_factor
    weights = 18 * 4096 * (128256 - 32000)  # the embedding on rank 0, the head on rank 1: 18 B a parameter
    assert large[0] - small[0] == pytest.approx(weights, rel=1e-6)
    assert large[1] - small[1] == pytest.approx(weights + 8 * 8192 * (128256 - 32000) * reserve, rel=1e-6)
