"""The cost model for today's transformers: presets, parameter counts, GQA, SwiGLU, FlashAttention, tensor parallel."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from pipesched.optimizer.configs import ClusterConfig, ModelConfig, TensorParallel
from pipesched.optimizer.cost.collectives import all_gather_ms, all_reduce_ms, reduce_scatter_ms
from pipesched.optimizer.cost.flops import layer_flops, model_parameters
from pipesched.optimizer.cost.memory import layer_activation
from pipesched.optimizer.cost.stages import _tensor_parallel_ms, derive_problem, resolve_hardware, transformer_layer
from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.presets import MODEL_PRESETS
from pipesched.optimizer.problem import Pipeline

GIB = 1024**3


@pytest.mark.parametrize(
    ("preset", "published"),
    [
        ("llama3.1-8b", 8.03e9),  # Llama 3 Herd of Models, Table 3 / model card: 8.03B
        ("llama3.1-70b", 70.6e9),  # 70.6B
        ("llama3.1-405b", 405.9e9),  # 405.9B (model card: 405B, 405.85 counted)
        ("gpt3-175b", 175.0e9),  # Brown et al. 2020, Table 2.1: 175.0B
        ("gpt2", 124e6),  # the released GPT-2 small: 124M
        ("gpt2-xl", 1.56e9),  # GPT-2 XL: 1.5B (1.56B with 64-dim heads)
    ],
)
def test_parameter_counts_match_the_published_ones(preset: str, published: float) -> None:
    count = model_parameters(ModelConfig(preset=preset))
    tolerance = 0.005 if preset.startswith("llama") else 0.01
    assert count == pytest.approx(published, rel=tolerance)


def test_llama_8b_exact_count() -> None:
    # 32·(2·4096² + 2·4096·1024 + 3·4096·14336 + 2·4096) + 2·128256·4096 + 4096
    assert model_parameters(ModelConfig(preset="llama3.1-8b")) == 8_030_261_248


@pytest.mark.parametrize(
    ("preset", "released"),
    [
        ("llama3.1-70b", 70_553_706_496),
        ("llama3.1-405b", 405_853_388_800),
        ("llama2-7b", 6_738_415_616),
        # 32·(2·4096² + 2·4096·1024 + 8·3·4096·14336 + 8·4096 + 2·4096) + 2·32000·4096 + 4096
        ("mixtral-8x7b", 46_702_792_704),
        # Qwen3's per-head query and key RMSNorms (2 · 128 a layer) are not modelled: 48 · 256 short
        ("qwen3-30b-a3b", 30_532_122_624 - 48 * 256),
        # GPT-OSS's router biases (E a layer) and attention sinks (64 a layer) are not modelled
        ("gpt-oss-120b", 116_829_156_672 - 36 * (128 + 64)),
        ("gpt-oss-20b", 20_914_757_184 - 24 * (32 + 64)),
    ],
)
def test_rope_rmsnorm_presets_count_the_released_checkpoints_biases_and_no_others(preset: str, released: int) -> None:
    """Parameter for parameter the released checkpoints' totals (their safetensors on Hugging Face): the Llama,
    Mixtral and Qwen3 presets (RoPE, RMSNorm) carry no biases, as the models do not (``model.bias`` false: with it
    Llama 3.1 70B would count 80 · (8192 + 2·1024 + 8192 + 2·28672 + 8192) more); GPT-OSS carries its attention and
    expert biases (``bias`` true in its config.json's ``attention_bias`` and its experts' ``*_bias`` tensors)."""
    model = ModelConfig(preset=preset)
    assert model_parameters(model) == released
    assert model.bias == preset.startswith("gpt-oss")
    assert model_parameters(model.model_copy(update={"bias": not model.bias})) != released


def test_preset_overrides_and_unknown_preset_lists_the_known_ones() -> None:
    model = ModelConfig(preset="llama3.1-70b", seq_length=4096, micro_batch_size=2)
    assert (model.num_layers, model.hidden_size, model.seq_length, model.micro_batch_size) == (80, 8192, 4096, 2)
    assert model.key_value_heads == 8 and model.ffn_type == "swiglu" and model.attention == "flash"
    with pytest.raises(ValidationError) as excinfo:
        ModelConfig(preset="llama-9000")
    error = excinfo.value.errors()[0]
    assert error["loc"] == ("preset",)
    for name in MODEL_PRESETS:
        assert name in error["msg"]


def test_key_value_heads_must_divide_heads() -> None:
    with pytest.raises(ValidationError) as excinfo:
        ModelConfig(preset="llama3.1-8b", num_key_value_heads=5)
    assert excinfo.value.errors()[0]["loc"] == ("num_key_value_heads",)


def gpt(**fields: Any) -> ModelConfig:
    base = {"num_layers": 4, "hidden_size": 4096, "num_attention_heads": 32, "seq_length": 8192, "vocab_size": 32000}
    return ModelConfig(**{**base, **fields})


def test_defaults_are_korthikanti_34_plus_5as_over_h() -> None:
    model = gpt(seq_length=2048)
    s, h, a = 2048, 4096, 32
    assert layer_activation(model).activation == s * h * (34 + 5 * a * s / h)
    # tensor parallel 8 with sequence parallelism: every term divides by t (§4.2.2)
    assert layer_activation(model, 8, True).activation == pytest.approx(s * h * (34 / 8 + 5 * a * s / (h * 8)))
    # without sequence parallelism: sbh(10 + 24/t + 5as/(ht)) (§4.2.1)
    assert layer_activation(model, 8, False).activation == pytest.approx(s * h * (10 + 24 / 8 + 5 * a * s / (h * 8)))


def test_flash_attention_stores_no_scores_at_8192() -> None:
    eager = layer_activation(gpt(preset="llama3.1-8b", attention="eager"))
    flash = layer_activation(gpt(preset="llama3.1-8b"))
    # eager keeps 5·a·s² bytes of scores: 5·32·8192² = 10 GiB per layer
    assert eager.activation - flash.activation > 9.9 * GIB
    # 1.34 GiB: no s² term, only the softmax statistics (fp32 per head and token)
    assert flash.activation == 8192 * (14 * 4096 + 4 * 1024 + 8 * 14336) + 4 * 32 * 8192
    assert flash.scores == 0


def test_gqa_shrinks_kv_and_swiglu_has_three_matrices() -> None:
    h, f, s = 4096, 14336, 8192
    mha = layer_flops(gpt(ffn_hidden_size=f, ffn_type="swiglu", attention="eager"))
    gqa = layer_flops(gpt(ffn_hidden_size=f, ffn_type="swiglu", attention="eager", num_key_value_heads=8))
    # K and V projections shrink from h×h to h×h/4 each: 2·s·(2·h·(h − h/4)) FLOPs less
    assert mha.forward - gqa.forward == pytest.approx(2 * s * 2 * h * (h - h // 4))
    gelu = layer_flops(gpt(ffn_hidden_size=f, attention="eager"))
    assert mha.forward - gelu.forward == pytest.approx(2 * s * h * f)  # SwiGLU's third matrix
    # flash computes the causal half of the attention core forward, 2.5× of it backward
    flash = layer_flops(gpt(ffn_hidden_size=f, ffn_type="swiglu", attention="flash"))
    assert mha.forward - flash.forward == pytest.approx(2 * s * s * h)
    assert flash.backward_weight == mha.backward_weight


def test_tensor_parallel_splits_flops_memory_parameters_and_adds_collectives() -> None:
    model = ModelConfig(preset="llama3.1-70b")
    cluster_doc = {"accelerator": "H100-SXM", "intra_node_bandwidth_bytes_per_s": 450e9}
    from pipesched.optimizer.configs import ClusterConfig

    cluster = ClusterConfig(**cluster_doc)
    hardware = resolve_hardware(cluster)
    one = transformer_layer(model, hardware, None, cluster)
    eight = transformer_layer(model, hardware, TensorParallel(size=8), cluster)
    assert eight.parameters == pytest.approx(one.parameters / 8, rel=0.001)
    assert eight.activation_bytes == pytest.approx(one.activation_bytes / 8)
    # the split matrix multiplies have an eighth of the FLOPs but run further from peak (the profile's shape term)
    assert one.backward_weight_ms / 8 < eight.backward_weight_ms < 1.2 * one.backward_weight_ms / 8
    # F: its compute plus two all-reduces of s·b·h·2 bytes over 8 GPUs at the achieved NVLink bandwidth
    achieved = 450e9 * hardware.profile.collective_efficiency_intra
    collective = 2 * all_reduce_ms(8192 * 8192 * 2, 8, achieved, cluster.collective_latency_ms)
    assert collective == pytest.approx(2 * 2 * 7 * (0.01 + 1e3 * 8192 * 8192 * 2 / (8 * achieved)))
    compute_ratio = eight.backward_weight_ms / one.backward_weight_ms
    assert eight.forward_ms - collective == pytest.approx(one.forward_ms * compute_ratio, rel=0.1)


def test_float8_tensor_parallelism_gathers_in_fp8() -> None:
    """torchao's Float8 TP (torchtitan) and Transformer Engine's (kernels "fused"): the sequence-parallel
    all-gathers move FP8, the reduce-scatters bf16, so a layer's collectives are 3/4 of bf16's; bf16 layers keep 2
    bytes."""
    cluster = ClusterConfig(accelerator="H100-SXM", intra_node_bandwidth_bytes_per_s=450e9, collective_latency_ms=0)
    hardware = resolve_hardware(cluster)
    tp = TensorParallel(size=8, sequence_parallel=True)
    exposed = {
        (precision, kernels): _tensor_parallel_ms(
            ModelConfig(preset="llama3.1-70b", precision=precision, kernels=kernels), hardware, tp, cluster
        )[0]
        for precision in ("bf16", "fp8")
        for kernels in ("eager", "compiled", "fused")
    }
    bf16 = exposed[("bf16", "eager")]
    assert bf16 > 0
    assert exposed[("fp8", "eager")] == exposed[("fp8", "compiled")] == pytest.approx(0.75 * bf16)
    assert exposed[("fp8", "fused")] == pytest.approx(0.75 * exposed[("bf16", "fused")])
    assert exposed[("bf16", "fused")] == pytest.approx(bf16)
    # without sequence parallelism the all-reduces stay in the model's dtype
    plain = TensorParallel(size=8, sequence_parallel=False)
    fp8 = ModelConfig(preset="llama3.1-70b", precision="fp8", kernels="compiled")
    assert _tensor_parallel_ms(fp8, hardware, plain, cluster)[0] == pytest.approx(bf16)


def test_ring_formulas() -> None:
    assert all_reduce_ms(1e9, 4, 1e9) == pytest.approx(2 * 3 * 1e3 / 4)
    assert reduce_scatter_ms(1e9, 4, 1e9) == all_gather_ms(1e9, 4, 1e9) == pytest.approx(3 * 1e3 / 4)
    assert all_reduce_ms(1e9, 1, 1e9) == 0


def test_problem_with_tensor_parallel_over_http_shape_and_errors_name_the_field() -> None:
    document = {
        "pipeline": {"num_ranks": 4, "num_microbatches": 8},
        "model": {"preset": "llama3.1-8b"},
        "cluster": {"accelerator": "H100-SXM", "num_nodes": 4, "gpus_per_node": 8},
        "tensor_parallel": {"size": 8, "sequence_parallel": True},
    }
    problem = load_problem(document)
    assert problem.tensor_parallel is not None and problem.tensor_parallel.size == 8
    assert problem.model is not None and problem.model.preset == "llama3.1-8b"
    again = load_problem(problem.model_dump(mode="json"))  # the stored problem loads again as it was
    assert again.costs == problem.costs
    with pytest.raises(ValidationError) as excinfo:
        load_problem({**document, "tensor_parallel": {"size": 16}})
    error = excinfo.value.errors()[0]
    assert error["loc"] == ("tensor_parallel", "size")
    assert "1, 2, 4, 8" in error["msg"]


def test_llama_8b_at_8192_fits_with_flash_where_eager_did_not() -> None:
    from pipesched.optimizer.configs import ClusterConfig

    cluster = ClusterConfig(accelerator="H100-SXM")
    pipeline = Pipeline(num_ranks=4, num_microbatches=8)
    flash = derive_problem(ModelConfig(preset="llama3.1-8b"), cluster, pipeline)
    activation = flash.memory.activation
    reserve = flash.hardware.profile.activation_memory_factor if flash.hardware else 1.0
    # ≤ 10 layers of 1.34 GiB (+ head), times the allocator's reserve the profile fits to published peaks
    assert isinstance(activation, list) and max(activation) < 10 * 1.4 * GIB * reserve
    with pytest.raises(ValidationError):  # eager: 11.3 GiB per layer, 90 GiB per stage and microbatch
        derive_problem(ModelConfig(preset="llama3.1-8b", attention="eager"), cluster, pipeline)


def test_attention_backward_runs_at_the_profiles_ratio_of_its_forward() -> None:
    """FlashAttention's backward (10d FLOPs per score, the forward 4d) at ``attention_backward_speed`` of the
    forward's FLOP/s: 128-wide heads, where the head-size factor is 1, so equal FLOPs take 1/0.7 as long."""
    from pipesched.optimizer.configs import ClusterConfig
    from pipesched.optimizer.cost.stages import attention_ms

    h100 = resolve_hardware(ClusterConfig(accelerator="H100-SXM"))
    model = ModelConfig(preset="llama3.1-8b", seq_length=8192, kernels="fused")
    flops = layer_flops(model)
    assert flops.attention_backward == pytest.approx(2.5 * flops.attention_forward)
    forward = attention_ms(flops.attention_forward, model, h100)
    backward = attention_ms(flops.attention_backward, model, h100, backward=True)
    assert h100.software.attention_backward_speed == 0.7
    assert backward / forward == pytest.approx(2.5 / 0.7)


def test_narrow_heads_run_attention_further_from_peak_through_the_exponentials() -> None:
    from pipesched.optimizer.configs import ClusterConfig
    from pipesched.optimizer.cost.timing import attention_head_size_factor

    a100 = resolve_hardware(ClusterConfig(accelerator="A100-80GB"))
    shape = {"num_layers": 24, "hidden_size": 1024, "seq_length": 4096, "vocab_size": 50368}
    wide, narrow = ModelConfig(**shape, num_attention_heads=8), ModelConfig(**shape, num_attention_heads=16)
    # 312 TFLOP/s beside 108 SMs x 16 SFU lanes x 1.41 GHz: 128 FLOPs per exponential; a score costs 4d (forward)
    # or 10d (backward) FLOPs of products plus one exponential: (256 + 128)/256 over (512 + 128)/512 = 1.2
    assert attention_head_size_factor(wide, a100) == pytest.approx(1.0)
    assert attention_head_size_factor(narrow, a100) == pytest.approx(1.2, rel=1e-3)
    assert attention_head_size_factor(narrow, a100, backward=True) == pytest.approx(1.2 / 1.1, rel=1e-3)
    # Hopper's exponentials are scarcer (989 vs 3.9 TFLOP/s): narrow heads lose more there
    h100 = resolve_hardware(ClusterConfig(accelerator="H100-SXM"))
    assert attention_head_size_factor(narrow, h100) > attention_head_size_factor(narrow, a100)
    # multi-head latent attention's 192-wide query/key heads run closer to peak; no stated figure: no change
    mla = ModelConfig(preset="deepseek-v3")
    assert attention_head_size_factor(mla, h100) < 1.0
    assert attention_head_size_factor(narrow, resolve_hardware(ClusterConfig(accelerator="B200"))) == 1.0
    forward = [transformer_layer(model, a100).forward_ms for model in (wide, narrow)]
    assert forward[1] > forward[0]  # same FLOPs, narrower heads
