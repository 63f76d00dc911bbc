"""Every preset `pipesched launch` hands to torchtitan builds that preset's model, not merely args that parse.

For each entry of ``TORCHTITAN_CONFIGS`` a plan layout on its GPUs is launched; torchtitan 0.3.0's own
``ConfigManager`` reads the argv (the written config module on ``sys.path``), ``ParallelDims`` takes its degrees on
the plan's world size, and the model its ``model_spec`` builds is built as torchtitan's trainer builds it, on the meta
device (no memory): its parameters, every expert counted and the routed top-k only, within 3% of the ``parameters``
and ``active_parameters`` a plan answer states for the preset (``optimizer/planner/rank.py``: ``model_parameters`` and
``active_parameters`` of the request's model).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from pipesched.optimizer.configs import ModelConfig
from pipesched.optimizer.cost.flops import active_parameters, model_parameters
from pipesched.optimizer.planner.launch import TORCHTITAN_CONFIGS, LaunchError, torchtitan_launch
from pipesched.optimizer.planner.space import Configuration
from tests.api.test_new_user_u23 import launch_spec, layout, parse_with_torchtitan

#: Largest relative difference between torchtitan's count and the plan answer's.
TOLERANCE = 0.03

#: Preset → (nodes of 8 GPUs, layout): each a best plan of the new-user audit or one of its shape.
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "llama3.1-8b": (1, {}),
    "llama3.1-70b": (8, {"pipeline_parallel": 4, "tensor_parallel": 4, "context_parallel": 2, "data_parallel_size": 2}),
    "llama3.1-405b": (
        128,
        {"pipeline_parallel": 16, "tensor_parallel": 8, "context_parallel": 2, "sharding": "full"},
    ),
    "deepseek-v3": (
        128,
        {"pipeline_parallel": 8, "expert_parallel": 32, "data_parallel_size": 64, "sharding": "full"},
    ),
    "qwen3-30b-a3b": (1, {"expert_parallel": 8, "num_microbatches": 1}),
    "qwen3-235b-a22b": (
        128,
        {"pipeline_parallel": 16, "expert_parallel": 16, "data_parallel_size": 32, "sharding": "full"},
    ),
    "gpt-oss-120b": (
        8,
        {"pipeline_parallel": 4, "tensor_parallel": 1, "expert_parallel": 16, "data_parallel_size": 16},
    ),
    "gpt-oss-20b": (1, {"pipeline_parallel": 2, "tensor_parallel": 1, "expert_parallel": 4}),
    "mixtral-8x7b": (
        8,
        {
            "pipeline_parallel": 4,
            "tensor_parallel": 1,
            "expert_parallel": 8,
            "data_parallel_size": 16,
            "sharding": "optimizer",
            "stages_per_rank": 2,
            "placement": "v",
        },
    ),
    "mixtral-8x22b": (
        128,
        {
            "pipeline_parallel": 4,
            "tensor_parallel": 2,
            "expert_parallel": 8,
            "data_parallel_size": 128,
            "stages_per_rank": 8,
        },
    ),
}


def torchtitan_counts(config: Any) -> tuple[int, int]:
    """(total, active) parameters of the model ``config.model_spec`` builds on the meta device: active counts each
    mixture-of-experts layer's routed experts at ``top_k / num_experts`` of their weights (torchtitan's router)."""
    import torch

    spec = config.model_spec
    with torch.device("meta"):
        model = spec.model.build()
    total = sum(parameter.numel() for parameter in model.parameters())
    idle = 0.0
    for block_config, block in zip(spec.model.layers, model.layers.values(), strict=True):
        moe = getattr(block, "moe", None)
        if moe is None:
            continue
        routed = sum(parameter.numel() for parameter in moe.routed_experts.parameters())
        router = block_config.moe.router
        idle += routed * (1 - router.top_k / router.num_experts)
    return total, round(total - idle)


def launched(preset: str, tmp_path: Path, precision: str = "bf16") -> tuple[Any, int, Configuration]:
    """The preset's layout launched for torchtitan and parsed by its ConfigManager: (config, GPUs, layout)."""
    nodes, changes = LAYOUTS[preset]
    config = layout(**{"precision": precision, "micro_batch_size": 1, "num_microbatches": 16, **changes})
    spec = launch_spec(preset, nodes, 16 * config.data_parallel_size, config)
    launch = torchtitan_launch(spec)
    if launch.config_source is not None:
        (tmp_path / "pipesched_torchtitan.py").write_text(launch.config_source)
    return parse_with_torchtitan(launch.args, tmp_path), nodes * 8, config


def test_every_mapped_preset_has_a_layout_here() -> None:
    assert set(LAYOUTS) == set(TORCHTITAN_CONFIGS)


@pytest.mark.parametrize("preset", sorted(TORCHTITAN_CONFIGS))
def test_torchtitan_builds_the_presets_model_with_the_plans_degrees(preset: str, tmp_path: Path) -> None:
    """GPT-OSS 20B / 120B, Qwen3-235B-A22B and Mixtral 8x7B / 8x22B were refused ("no config function in torchtitan
    0.3"); the others had been checked only for parsing: a function of another flavor would have passed."""
    parallel_dims = pytest.importorskip("torchtitan.distributed.parallel_dims")
    config, gpus, plan = launched(preset, tmp_path)
    parallelism = config.parallelism
    for name in ("pipeline_parallel", "tensor_parallel", "context_parallel", "expert_parallel"):
        assert getattr(parallelism, f"{name}_degree") == getattr(plan, name), name
    dims = parallel_dims.ParallelDims.from_config(parallelism, gpus)  # raises unless the degrees fill the GPUs
    expert_mesh = dims.dp_shard * dims.cp * dims.tp / dims.ep
    assert expert_mesh == int(expert_mesh) >= 1
    config._validate_cuda_graphs()  # torchtitan's trainer refuses CUDA graphs under PP and EP's host-syncing dispatch
    assert config.model_spec.model.max_seq_len == TORCHTITAN_CONFIGS[preset].max_seq_len  # its RoPE's, as built
    config.model_spec.model.update_from_config(config=config)  # the trainer's: TP divides the heads, seq_len ≤ RoPE's
    assert config.model_spec.flavor == TORCHTITAN_CONFIGS[preset].flavor
    model = ModelConfig.model_validate({"preset": preset})
    total, active = torchtitan_counts(config)
    assert total == pytest.approx(model_parameters(model), rel=TOLERANCE)
    assert active == pytest.approx(active_parameters(model), rel=TOLERANCE)


@pytest.mark.parametrize("preset", sorted(TORCHTITAN_CONFIGS))
def test_the_mapped_attention_backend_is_the_one_torchtitans_function_builds(preset: str, tmp_path: Path) -> None:
    attention = pytest.importorskip("torchtitan.models.common.attention")
    config, _, _ = launched(preset, tmp_path)
    varlen = any(config.model_spec.model.traverse(attention.VarlenAttention.Config))
    flex = any(config.model_spec.model.traverse(attention.FlexAttention.Config))
    assert (varlen, flex) == ((True, False) if TORCHTITAN_CONFIGS[preset].attention == "varlen" else (False, True))


def test_a_gpt_oss_plan_with_context_parallelism_is_refused_naming_the_fix() -> None:
    """torchtitan's GPT-OSS functions attend with varlen attention, and torchtitan 0.3 raises NotImplementedError
    wrapping it for context parallelism when the job starts: the args had been written as for any other plan."""
    nodes, changes = LAYOUTS["gpt-oss-20b"]
    spec = launch_spec("gpt-oss-20b", nodes, 64, layout(**{**changes, "context_parallel": 2, "expert_parallel": 2}))
    with pytest.raises(LaunchError, match=r"varlen attention.*search.context_parallel \[1\]"):
        torchtitan_launch(spec)


def test_a_plan_longer_than_torchtitans_rope_is_refused_naming_the_longest() -> None:
    """deepseek_v3_671b builds its RoPE for 16,384 tokens and torchtitan's trainer refuses a longer seq_len (a
    ValueError when the job starts); Llama 3.1's functions take 131,072."""
    nodes, changes = LAYOUTS["deepseek-v3"]
    spec = launch_spec("deepseek-v3", nodes, 4096, layout(**changes))
    longer = dataclasses.replace(spec, model=spec.model.model_copy(update={"seq_length": 32_768}))
    with pytest.raises(LaunchError, match="at most 16384 and its trainer refuses"):
        torchtitan_launch(longer)
    nodes, changes = LAYOUTS["llama3.1-8b"]
    spec = launch_spec("llama3.1-8b", nodes, 64, layout(**changes))
    torchtitan_launch(dataclasses.replace(spec, model=spec.model.model_copy(update={"seq_length": 131_072})))


def test_qwen3_235b_takes_the_30b_recipe_with_its_own_flavor_vocabulary_and_assets(tmp_path: Path) -> None:
    """torchtitan 0.3 registers Qwen3's 235B-A22B flavor but no function builds it: the written module starts from
    qwen3_30b_a3b (its loss sized for the same 151,936-token vocabulary) and names the 235B's assets."""
    config, _, _ = launched("qwen3-235b-a22b", tmp_path)
    assert config.model_spec.name == "qwen3" and config.model_spec.flavor == "235B-A22B"
    assert config.loss.loss_fn.global_vocab_size == config.model_spec.model.vocab_size == 151_936
    assert config.hf_assets_path == "./assets/hf/Qwen3-235B-A22B"
    assert "Qwen3-30B-A3B" not in repr(config.hf_assets_path)


def test_an_fp8_deepseek_plan_runs_torchtitans_float8_function() -> None:
    """An FP8 DeepSeek-V3 plan had been refused ("precision wrappers for llama3 configs only"); torchtitan ships
    deepseek_v3_671b_float8 (Float8 linear layers and grouped experts, the router and head in bf16)."""
    nodes, changes = LAYOUTS["deepseek-v3"]
    spec = launch_spec("deepseek-v3", nodes, 4096, layout(precision="fp8", **changes))
    launch = torchtitan_launch(spec)
    assert launch.config_source is None
    assert launch.args[:4] == ["--module", "deepseek_v3", "--config", "deepseek_v3_671b_float8"]


@pytest.mark.parametrize("preset", ["llama3.1-70b", "deepseek-v3", "llama3.1-405b"])
def test_fp8_plans_build_float8_models_of_the_presets_size(
    preset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With torchao (not in the dev extra: torchtitan's Float8 converter refuses a machine without an SM89+ GPU
    when the config function runs, so an FP8 launch never parses on a CPU) and the converter's GPU check answered
    as an H100 would, the FP8 configs build Float8 linear layers (and DeepSeek's Float8 grouped experts) of the
    preset's size."""
    pytest.importorskip("torchao")
    float8 = pytest.importorskip("torchtitan.components.quantization.float8")
    monkeypatch.setattr(float8, "has_cuda_capability", lambda major, minor: (major, minor) <= (9, 0))
    config, _, _ = launched(preset, tmp_path, precision="fp8")
    import torch

    with torch.device("meta"):
        kinds = {type(module).__name__ for module in config.model_spec.model.build().modules()}
    assert "Float8Linear" in kinds and ("Float8GroupedExperts" in kinds) is (preset == "deepseek-v3")
    model = ModelConfig.model_validate({"preset": preset})
    total, active = torchtitan_counts(config)
    assert total == pytest.approx(model_parameters(model), rel=TOLERANCE)
    assert active == pytest.approx(active_parameters(model), rel=TOLERANCE)


@pytest.mark.parametrize("preset", ["qwen3-235b-a22b", "gpt-oss-20b", "qwen3-30b-a3b", "mixtral-8x7b"])
def test_an_fp8_plan_of_a_model_without_a_float8_function_names_the_fix(preset: str) -> None:
    nodes, changes = LAYOUTS[preset]
    spec = launch_spec(preset, nodes, 64, layout(precision="fp8", **changes))
    with pytest.raises(
        LaunchError, match=r"has no Float8 config function for its .*pin search.precision to \['bf16'\]"
    ):
        torchtitan_launch(spec)


def test_a_compiled_deepseek_plan_compiles_the_model_not_only_the_loss(tmp_path: Path) -> None:
    """deepseek_v3_671b compiles its loss only (``components=["loss"]``): ``--compile.enable`` alone had left the
    model eager under a plan whose prediction assumed compiled kernels."""
    nodes, changes = LAYOUTS["deepseek-v3"]
    for kernels, model_compiled in (("compiled", True), ("eager", False)):
        spec = launch_spec("deepseek-v3", nodes, 4096, layout(**changes), kernels=kernels)
        config = parse_with_torchtitan(torchtitan_launch(spec).args)
        assert config.compile.enable and ("model" in config.compile.components) is model_compiled
        assert "loss" in config.compile.components


def test_a_model_of_ones_own_is_refused_naming_the_presets_torchtitan_builds() -> None:
    spec = launch_spec("mixtral-8x7b", 8, 256, layout(expert_parallel=8, data_parallel_size=32))
    own = dataclasses.replace(spec, model=spec.model.model_copy(update={"preset": None}))
    with pytest.raises(
        LaunchError, match=r"model of your own .*has no config function in torchtitan 0\.3.*mixtral-8x22b"
    ):
        torchtitan_launch(own)


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "mixtral-8x22b"])
def test_the_written_mixtral_is_mixtrals_architecture(preset: str, tmp_path: Path) -> None:
    """Mixtral (Mistral AI's config.json): no QK norm, no shared expert, RMSNorm eps 1e-5, RoPE theta 1e6 up to
    max_position_embeddings, output head untied, loss over its own vocabulary, 8 experts top-2 softmax-routed with
    the two weights renormalised. qwen3_30b_a3b's recipe is taken, not its Qwen3 model (QK norm, eps 1e-6, 151,936
    tokens)."""
    config, _, _ = launched(preset, tmp_path)
    mixtral = config.model_spec.model
    model = ModelConfig.model_validate({"preset": preset})
    assert config.model_spec.name == "mixtral" and config.model_spec.state_dict_adapter is None
    assert config.loss.loss_fn.global_vocab_size == mixtral.vocab_size == model.vocab_size
    assert not mixtral.enable_weight_tying and mixtral.norm.eps == 1e-5
    assert config.hf_assets_path == TORCHTITAN_CONFIGS[preset].assets
    assert len(mixtral.layers) == model.num_layers
    for block in mixtral.layers:
        attention, moe = block.attention, block.moe
        assert attention.qk_norm is None and attention.rope.theta == 1e6 and attention.rope.scaling == "none"
        assert (attention.n_heads, attention.n_kv_heads) == (model.num_attention_heads, model.key_value_heads)
        assert block.attention_norm.eps == block.ffn_norm.eps == 1e-5 and block.feed_forward is None
        assert moe.shared_experts is None and moe.routed_experts.inner_experts.hidden_dim == model.expert_ffn_size
        assert (moe.router.num_experts, moe.router.top_k, moe.router.score_func) == (8, 2, "softmax")
        assert moe.router.route_norm and moe.router.route_scale == 1.0 and moe.router.num_expert_groups is None


def test_the_written_mixtral_layer_routes_as_mixtral(tmp_path: Path) -> None:
    """A two-layer Mixtral of the written module, built on the CPU: its MoE layer's output is Mixtral's
    (Jiang et al. 2024, eq. 2: the top-2 of the router's logits, softmax over those two, the weighted sum of the two
    SwiGLU experts) to bf16 rounding (torchtitan's experts multiply in bf16). Softmax over all 8 experts without the
    renormalisation would scale the output by the two weights' sum, well beyond that."""
    import torch
    import torch.nn.functional as F

    spec = launch_spec("mixtral-8x7b", 1, 16, layout(expert_parallel=8))
    tiny = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    model = spec.model.model_copy(update={**tiny, "ffn_hidden_size": 96, "vocab_size": 128})
    launch = torchtitan_launch(dataclasses.replace(spec, model=model))
    assert launch.config_source is not None
    (tmp_path / "pipesched_torchtitan.py").write_text(launch.config_source)
    moe = parse_with_torchtitan(launch.args, tmp_path).model_spec.model.build().layers["0"].moe
    torch.manual_seed(0)
    for parameter in moe.parameters():
        torch.nn.init.normal_(parameter, std=0.1)
    tokens = torch.randn(2, 5, 64)
    experts = moe.routed_experts.inner_experts
    with torch.no_grad():
        out = moe(tokens)
        logits, chosen = torch.topk(moe.router.gate(tokens), 2, dim=-1)
        weights = F.softmax(logits, dim=-1)
        expected = torch.zeros_like(tokens)
        for rank, expert in ((rank, expert) for rank in range(2) for expert in range(8)):
            mask = chosen[..., rank] == expert
            x = tokens[mask]
            swiglu = (F.silu(x @ experts.w1_EFD[expert].T) * (x @ experts.w3_EFD[expert].T)) @ experts.w2_EDF[expert].T
            expected[mask] += weights[..., rank][mask, None] * swiglu
    assert (out - expected).norm() / expected.norm() < 0.01
    assert weights.sum(-1).allclose(torch.ones(2, 5))
