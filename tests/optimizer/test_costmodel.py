"""Costs and memory derived from model/cluster configs (optimizer/cost/stages.py) against the Zero Bubble paper."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from pipesched.optimizer.accelerators import CATALOGUE, get_accelerator
from pipesched.optimizer.configs import ClusterConfig, ModelConfig
from pipesched.optimizer.cost.memory import static_bytes_per_parameter_sharded
from pipesched.optimizer.cost.profile import builtin_catalogue
from pipesched.optimizer.cost.stages import derive_problem, full_sharding_state
from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.problem import Pipeline, Problem
from pipesched.optimizer.units import format_bytes
from tests.conftest import paper_settings

GIB = 1024**3

#: Zero Bubble paper, Table 3: transformer layers and microbatch size of each model (seq 1024, GPT-2 vocabulary).
#: With the embedding and the head counted as one layer each the models have 24/32/48/64 "layers", the l of the
#: paper's interleaved baseline.
PAPER_MODELS: dict[str, tuple[int, int]] = {"1.5B": (22, 6), "6.2B": (30, 3), "14.6B": (46, 1), "28.3B": (62, 1)}


def one_setting_per_model() -> list[dict[str, Any]]:
    chosen: dict[str, dict[str, Any]] = {}
    for setting in paper_settings():
        chosen.setdefault(setting["model"], setting)
    return list(chosen.values())


def paper_model_problem(setting: dict[str, Any], **cluster: Any) -> Problem:
    num_layers, micro_batch_size = PAPER_MODELS[setting["model"]]
    return load_problem(
        {
            "pipeline": {"num_ranks": setting["num_ranks"], "num_microbatches": setting["num_microbatches"]},
            "model": {
                "num_layers": num_layers,
                "hidden_size": setting["hidden_size"],
                "num_attention_heads": setting["num_attention_heads"],
                "seq_length": setting["seq_length"],
                "vocab_size": 50304,
                "micro_batch_size": micro_batch_size,
                "dtype": "fp16",
                "kernels": "fused",  # the paper profiled Megatron-LM's fused kernels
            },
            "cluster": {"accelerator": "A100-80GB", **cluster},
        }
    )


def model_problem(model: dict[str, Any], cluster: dict[str, Any], num_ranks: int = 4, **pipeline: Any) -> Problem:
    return load_problem(
        {
            "pipeline": {"num_ranks": num_ranks, "num_microbatches": 8, **pipeline},
            "model": model,
            "cluster": cluster,
        }
    )


SMALL_MODEL = {"num_layers": 8, "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 512, "vocab_size": 32000}


def headroom(accelerator: str, memory_bytes: float) -> float:
    """The calibrated profile's default headroom (5% + the CUDA context) on ``memory_bytes``."""
    profile = builtin_catalogue().get(accelerator)
    assert profile is not None
    return profile.headroom_bytes(memory_bytes)


def reserve(accelerator: str, kernels: str = "unknown") -> float:
    """The calibrated allocator reserve over the modelled activation bytes: the profile's (fitted to eager and
    compiled PyTorch), the software's for hand-fused kernels, the larger when the kernels are unknown."""
    catalogue = builtin_catalogue()
    profile = catalogue.get(accelerator)
    assert profile is not None
    fused = catalogue.software.fused_activation_memory_factor
    if kernels == "fused":
        return fused
    return max(profile.activation_memory_factor, fused)


def field_errors(excinfo: pytest.ExceptionInfo[ValidationError]) -> dict[tuple[str | int, ...], str]:
    return {tuple(error["loc"]): error["msg"] for error in excinfo.value.errors()}


@pytest.mark.parametrize("setting", one_setting_per_model(), ids=lambda s: s["model"])
def test_paper_models_time_ratios_match_profiles(setting: dict[str, Any]) -> None:
    problem = paper_model_problem(setting)
    assert problem.costs is not None
    # a middle stage: transformer layers only, as the paper's profiled stages
    forward = problem.stage_values(problem.costs.forward)[1]
    backward_input = problem.stage_values(problem.costs.backward_input)[1]
    backward_weight = problem.stage_values(problem.costs.backward_weight)[1]
    profiled_input = setting["backward_input_ms"] / setting["forward_ms"]
    profiled_weight = setting["backward_weight_ms"] / setting["forward_ms"]
    assert backward_input / forward == pytest.approx(profiled_input, rel=0.15)
    assert backward_weight / forward == pytest.approx(profiled_weight, rel=0.15)
    # absolute time: the paper's layers per middle stage on an A100 at the default efficiency
    assert problem.model is not None and problem.model.layers_per_stage is not None
    layers = problem.model.layers_per_stage[1]
    paper_layers = (PAPER_MODELS[setting["model"]][0] + 2) // setting["num_ranks"]
    assert forward / layers * paper_layers == pytest.approx(setting["forward_ms"], rel=0.15)


@pytest.mark.parametrize("setting", one_setting_per_model(), ids=lambda s: s["model"])
def test_paper_models_activation_memory_is_table_1(setting: dict[str, Any]) -> None:
    problem = paper_model_problem(setting)
    assert problem.memory is not None and problem.model is not None and problem.model.layers_per_stage is not None
    s, b = setting["seq_length"], PAPER_MODELS[setting["model"]][1]
    h, a = setting["hidden_size"], setting["num_attention_heads"]
    assert setting["activation"] == 34 * h + 5 * a * s  # the settings file's units: no s·b
    for stage in range(1, problem.pipeline.num_stages - 1):
        layers = problem.model.layers_per_stage[stage]
        activation = problem.stage_values(problem.memory.activation)[stage]
        retained = problem.stage_values(problem.memory.retained_for_weight)[stage]
        factor = reserve("A100-80GB", problem.model.kernels)
        assert activation == pytest.approx(layers * s * b * (34 * h + 5 * a * s) * factor, abs=1)
        assert retained == pytest.approx(layers * 32 * s * b * h * factor, abs=1)
        assert layers * 32 * s * b * h == layers * s * b * setting["retained_for_weight"]


def test_flops_alone_give_table_1_ratios() -> None:
    """With unbounded memory bandwidth only the matrix multiplies remain: I/F and W/F are Table 1's FLOP ratios."""
    h, s = 2048, 2048
    problem = model_problem(
        {**SMALL_MODEL, "hidden_size": h, "num_attention_heads": 16, "seq_length": s, "num_layers": 12},
        {"flops_per_s": 1e15, "memory_bytes": 1e15, "memory_bandwidth_bytes_per_s": 1e30, "efficiency": 0.5},
    )
    assert problem.costs is not None
    forward = problem.stage_values(problem.costs.forward)[1]
    layers = problem.model.layers_per_stage[1]  # type: ignore[union-attr,index]
    assert forward == pytest.approx(layers * s * h * (24 * h + 4 * s) / 0.5e15 * 1e3, rel=1e-6)
    assert problem.stage_values(problem.costs.backward_input)[1] / forward == pytest.approx(
        (24 * h + 8 * s) / (24 * h + 4 * s), rel=1e-6
    )
    assert problem.stage_values(problem.costs.backward_weight)[1] / forward == pytest.approx(
        24 * h / (24 * h + 4 * s), rel=1e-6
    )


def test_head_and_embedding_make_end_stages_uneven_and_p2p_and_static_follow() -> None:
    model = {**SMALL_MODEL, "vocab_size": 256_000, "layers_per_stage": [2, 2, 2, 2], "kernels": "eager"}
    cluster = {"accelerator": "H100-SXM", "p2p_bandwidth_bytes_per_s": 25e9, "p2p_latency_ms": 0.02}
    problem = model_problem(model, cluster)
    assert problem.costs is not None and problem.memory is not None
    forward = problem.stage_values(problem.costs.forward)
    assert forward[3] > 2 * forward[1]  # 2·s·b·h·V of the head outweighs two layers
    assert forward[0] > forward[1]  # the embedding costs a little
    s, h = SMALL_MODEL["seq_length"], SMALL_MODEL["hidden_size"]
    assert problem.costs.p2p == pytest.approx(0.02 + s * h * 2 / 25e9 * 1e3, rel=1e-5)
    # static: 18 B/param (bf16 weights, fp32 grads, fp32 master + Adam m, v)
    layer_parameters = 12 * h * h + 13 * h
    static = problem.static_memory
    assert static[1] == pytest.approx(2 * layer_parameters * 18, rel=1e-9)
    assert static[0] == pytest.approx((2 * layer_parameters + 256_000 * h + s * h) * 18, rel=1e-9)
    # the last rank also counts the loss's transient: the fp32 logits' gradients (8 B per logit element, torchtitan's
    # F.cross_entropy on logits.float(), eager PyTorch's) at the allocator reserve
    b = SMALL_MODEL.get("micro_batch_size", 1)
    loss = 8 * s * b * 256_000 * reserve("H100-SXM", "eager")
    assert static[3] == pytest.approx((2 * layer_parameters + 256_000 * h + 2 * h) * 18 + loss, rel=1e-6)
    memory = get_accelerator("H100-SXM").memory_bytes
    assert problem.memory.limit == pytest.approx(memory - headroom("H100-SXM", memory), abs=1)
    # the head keeps the fp32 softmax: the last stage's activation exceeds a middle stage's
    activation = problem.stage_values(problem.memory.activation)
    assert activation[3] > activation[1] + 4 * s * 256_000


def test_sharded_optimizer_state_divides_master_weights_and_moments() -> None:
    model = ModelConfig(**SMALL_MODEL)
    assert static_bytes_per_parameter_sharded(model, "none", 1) == 18
    assert static_bytes_per_parameter_sharded(model, "optimizer", 8) == 2 + 4 + 12 / 8
    assert static_bytes_per_parameter_sharded(ModelConfig(**SMALL_MODEL, dtype="fp32"), "none", 1) == 16


def test_fully_sharded_state_is_what_each_stack_keeps() -> None:
    """ZeRO-3 / Megatron-FSDP keep 16-bit and fp32 weights, the gradient buffer in the reduction's dtype and two
    fp32 moments (2 + g + 12); PyTorch FSDP over an fp32 model keeps the fp32 parameter as the master and casts its
    gradient back to it whatever the reduction's dtype (4 + 4 + 8); over a bf16 model all of it is bf16 (2 + 2 + 4).
    Each divided by d; the gathered 16-bit weights are the caller's."""
    model = ModelConfig(**SMALL_MODEL)
    for reduced, zero3 in ((4.0, 18), (2.0, 16)):
        assert static_bytes_per_parameter_sharded(model, "full", 8, gradient_bytes=reduced) == zero3 / 8
        pytorch = static_bytes_per_parameter_sharded(
            model, "full", 8, gradient_bytes=reduced, full_state="fp32_parameters"
        )
        assert pytorch == 16 / 8
        bf16 = static_bytes_per_parameter_sharded(
            model, "full", 8, gradient_bytes=reduced, full_state="bf16_parameters"
        )
        assert bf16 == 8 / 8
    # ZeRO-1/2 are one layout whatever the stack
    assert static_bytes_per_parameter_sharded(model, "gradients", 8, full_state="fp32_parameters") == 2 + 16 / 8
    with pytest.raises(ValueError, match="full_state 'fp16_parameters'"):
        static_bytes_per_parameter_sharded(model, "full", 8, full_state="fp16_parameters")


def test_the_kernels_say_who_keeps_the_fully_sharded_state() -> None:
    """Eager and compiled PyTorch shard fp32 parameters; hand-fused kernels keep the software's state (Megatron-FSDP's
    for a plan, NeMo AutoModel's bf16 model for its rows); kernels "unknown" the largest of the modes that publish
    the layout's class: a plan that fits fits whichever of them runs it."""
    software = builtin_catalogue().software.model_copy(
        update={
            "unknown_kernels_shares": {
                "full": {"eager": 0.5, "compiled": 0.0, "fused": 0.5},
                "full+model-parallel": {"eager": 0.0, "compiled": 1.0, "fused": 0.0},
                "replicated": {"eager": 0.0, "compiled": 0.0, "fused": 1.0},
                "replicated+model-parallel": {"eager": 0.0, "compiled": 0.0, "fused": 1.0},
            }
        }
    )

    def state(kernels: str, sharding: str | None = "full", **changes: Any) -> str:
        model = ModelConfig(**SMALL_MODEL, kernels=kernels)
        return full_sharding_state(model, software.model_copy(update=changes), sharding)

    assert state("eager") == state("compiled") == "fp32_parameters"
    assert state("fused") == "zero3"
    assert state("fused", fused_fsdp_state="bf16_parameters") == "bf16_parameters"
    assert state("unknown") == "zero3"  # 18 B over d against PyTorch's 16 with fp32 reduction
    assert state("unknown", "full+model-parallel") == "fp32_parameters"  # only compiled PyTorch publishes it


def test_recomputation_trades_memory_for_backward_time() -> None:
    cluster = {"accelerator": "A100-40GB"}
    model = {**SMALL_MODEL, "layers_per_stage": [2, 2, 2, 2], "kernels": "eager"}
    base = model_problem(model, cluster)
    selective = model_problem({**model, "activation_recomputation": "selective"}, cluster)
    full = model_problem({**model, "activation_recomputation": "full"}, cluster)
    s, b, h = SMALL_MODEL["seq_length"], 1, SMALL_MODEL["hidden_size"]

    def stage1(problem: Problem, field: str) -> float:
        section = problem.costs if hasattr(problem.costs, field) else problem.memory
        return problem.stage_values(getattr(section, field))[1]

    factor = reserve("A100-40GB", "eager")
    assert stage1(selective, "activation") == pytest.approx(2 * 34 * s * b * h * factor, abs=1)
    assert stage1(full, "activation") == pytest.approx(2 * s * b * h * 2 * factor, abs=1)
    assert stage1(full, "retained_for_weight") == stage1(full, "activation")
    assert stage1(base, "forward") == stage1(full, "forward")
    assert stage1(full, "backward_input") == pytest.approx(stage1(base, "backward_input") + stage1(base, "forward"))
    assert stage1(base, "backward_input") < stage1(selective, "backward_input") < stage1(full, "backward_input")


def test_derived_problem_round_trips_and_edits_are_kept() -> None:
    problem = model_problem({**SMALL_MODEL, "num_layers": 10}, {"accelerator": "MI300X"})
    assert problem.model is not None and problem.model.layers_per_stage is not None
    assert sum(problem.model.layers_per_stage) == 10 and len(problem.model.layers_per_stage) == 4
    dumped = problem.model_dump(mode="json")
    again = load_problem(dumped)
    assert again.costs == problem.costs and again.memory == problem.memory
    # a user edits the derived costs: the edit is kept, model/cluster are not re-derived
    dumped["costs"]["forward"] = 5.0
    dumped["memory"]["limit"] = 1e9
    edited = load_problem(dumped)
    assert edited.costs is not None and edited.costs.forward == 5.0
    assert edited.memory is not None and edited.memory.limit == 1e9
    assert edited.model == problem.model


def test_a_memory_limit_beside_model_and_cluster_keeps_the_derived_memory() -> None:
    """``"memory": {"limit": …}`` with model and cluster had been "memory.activation: Field required": the
    derived activations and static memory are kept, the limit given replaces the GPU's."""
    document = {
        "pipeline": {"num_ranks": 4, "num_microbatches": 8},
        "model": SMALL_MODEL,
        "cluster": {"accelerator": "H100-SXM"},
    }
    derived = load_problem(document)
    limited = load_problem({**document, "memory": {"limit": 2e9}})
    assert limited.memory is not None and derived.memory is not None
    assert limited.memory.limit == 2e9 != derived.memory.limit
    assert limited.memory.model_dump(exclude={"limit"}) == derived.memory.model_dump(exclude={"limit"})
    with pytest.raises(ValidationError) as excinfo:
        load_problem({**document, "memory": {"limit": -1}})
    assert list(field_errors(excinfo)) == [("memory", "limit")]


def test_explicit_numbers_and_catalogue() -> None:
    assert {"A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200", "MI300X", "L40S"} <= set(CATALOGUE)
    explicit = {"flops_per_s": 100e12, "memory_bytes": 24 * GIB, "memory_bandwidth_bytes_per_s": 1e12}
    problem = model_problem(SMALL_MODEL, explicit)
    assert problem.memory is not None and problem.memory.limit == 22 * GIB
    # an explicit number overrides the catalogue's
    override = model_problem(SMALL_MODEL, {"accelerator": "H100-SXM", "memory_bytes": 40 * GIB})
    assert override.memory is not None and override.memory.limit == pytest.approx(
        40 * GIB - headroom("H100-SXM", 40 * GIB), abs=1
    )
    with pytest.raises(ValidationError) as excinfo:
        model_problem(SMALL_MODEL, {"flops_per_s": 100e12})
    errors = field_errors(excinfo)
    assert ("cluster", "memory_bytes") in errors and ("cluster", "memory_bandwidth_bytes_per_s") in errors


def test_errors_name_the_field_and_give_numbers() -> None:
    with pytest.raises(ValidationError) as excinfo:
        model_problem({**SMALL_MODEL, "num_attention_heads": 12}, {"accelerator": "H100-SXM"})
    message = field_errors(excinfo)[("model", "num_attention_heads")]
    assert "12 attention heads do not divide hidden_size 1024" in message and "16" in message

    with pytest.raises(ValidationError) as excinfo:
        model_problem({**SMALL_MODEL, "num_layers": 24}, {"accelerator": "H100-SXM"}, num_ranks=32)
    assert "24 layers cannot fill 32 stages: use ≤ 24 stages" in field_errors(excinfo)[("model", "num_layers")]

    with pytest.raises(ValidationError) as excinfo:
        model_problem(SMALL_MODEL, {"accelerator": "TPU-v9"})
    message = field_errors(excinfo)[("cluster", "accelerator")]
    assert "unknown accelerator 'TPU-v9'" in message and all(name in message for name in CATALOGUE)

    # ~70B parameters at 18 B/param on 8 ranks of 80 GiB: weights and optimizer state alone do not fit
    big = {"num_layers": 80, "hidden_size": 8192, "num_attention_heads": 64, "seq_length": 4096, "vocab_size": 32000}
    with pytest.raises(ValidationError) as excinfo:
        model_problem(big, {"accelerator": "A100-80GB"}, num_ranks=8)
    message = field_errors(excinfo)[("cluster", "accelerator")]
    layer = 12 * 8192**2 + 13 * 8192
    total = (80 * layer + 2 * 32000 * 8192 + 4096 * 8192 + 2 * 8192) * 18
    limit = 80 * GIB - headroom("A100-80GB", 80 * GIB)
    assert f"need {total / 8 / GIB:.4g} GiB per rank" in message and f"has {format_bytes(limit)}" in message
    assert f"use ≥ {-(-total // limit):.0f} ranks" in message and "shard optimizer state" in message

    with pytest.raises(ValidationError) as excinfo:
        model_problem({**SMALL_MODEL, "layers_per_stage": [4, 4]}, {"accelerator": "H100-SXM"})
    assert "2 entries but the pipeline has 4 stages" in field_errors(excinfo)[("model", "layers_per_stage")]
    with pytest.raises(ValidationError) as excinfo:
        model_problem({**SMALL_MODEL, "layers_per_stage": [3, 0, 3, 2]}, {"accelerator": "H100-SXM"})
    assert ("model", "layers_per_stage", 1) in field_errors(excinfo)

    # A headroom as large as the memory: say so, not "use ≥ N ranks".
    explicit = {"flops_per_s": 1e12, "memory_bytes": GIB, "memory_bandwidth_bytes_per_s": 1e11}
    with pytest.raises(ValidationError) as excinfo:
        model_problem(SMALL_MODEL, {**explicit, "memory_headroom_bytes": 2 * GIB})
    message = field_errors(excinfo)[("cluster", "memory_headroom_bytes")]
    assert "2 GiB headroom leaves nothing of the accelerator's 1 GiB" in message and "below 1 GiB" in message


def test_activations_that_do_not_fit_any_split_are_an_error() -> None:
    long_sequences = {**SMALL_MODEL, "seq_length": 32768, "micro_batch_size": 8}
    with pytest.raises(ValidationError) as excinfo:
        model_problem(long_sequences, {"accelerator": "L40S"})
    message = field_errors(excinfo)[("cluster", "accelerator")]
    assert "GiB" in message and "activation recomputation" in message


def test_derive_problem_reports_the_partition_and_hardware() -> None:
    derived = derive_problem(
        ModelConfig(**SMALL_MODEL), ClusterConfig(accelerator="h200"), Pipeline(num_ranks=2, num_microbatches=4)
    )
    assert derived.hardware is not None and derived.hardware.name == "H200"
    assert sum(derived.layers_per_stage) == 8 and len(derived.stages) == 2
    assert derived.static_bytes == derived.memory.static


def test_cli_solve_shows_the_derived_problem(tmp_path: Path) -> None:
    from pipesched.api.cli import app

    path = tmp_path / "problem.json"
    path.write_text(
        json.dumps(
            {
                "pipeline": {"num_ranks": 4, "num_microbatches": 8},
                "model": {**SMALL_MODEL, "vocab_size": 128_000},
                "cluster": {"accelerator": "H100-SXM"},
                "solver": {"method": "1f1b"},
            }
        )
    )
    out = tmp_path / "schedule.json"
    result = CliRunner().invoke(app, ["solve", str(path), "-o", str(out)], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "derived from model/cluster" in result.output and "layers per stage" in result.output
    schedule = json.loads(out.read_text())
    layers = schedule["problem"]["model"]["layers_per_stage"]
    assert sum(layers) == 8 and len(layers) == 4
    assert f"layers per stage {layers}" in result.output
    # the written problem solves again as is
    path.write_text(json.dumps(schedule["problem"]))
    again = CliRunner().invoke(app, ["solve", str(path)], terminal_width=200)
    assert again.exit_code == 0, again.output


@pytest.mark.parametrize("held_out", list(PAPER_MODELS))
def test_time_model_predicts_a_model_it_was_not_fitted_to(held_out: str) -> None:
    """Leave one model out: fit the time model's three constants (1 / effective FLOP/s and the forward and
    input-gradient traffic per activation byte, see optimizer/cost/stages.py) to the other three models'
    profiled per-layer times by least squares, then predict the held-out model's T_I/T_F and T_W/T_F
    within the same 15%. The constants shipped in cost/stages.py are the fit to all four; this checks that
    the model's form, not the fit, carries to a model it has not seen."""
    import numpy as np

    def per_layer(setting: dict[str, Any]) -> tuple[list[float], list[float], tuple[float, float, float]]:
        num_layers, b = PAPER_MODELS[setting["model"]]
        s, h = setting["seq_length"], setting["hidden_size"]
        gemm = s * b * 12 * h * h  # Table 1 with f = 4h
        attention = 4 * s * s * b * h
        activation = s * b * setting["activation"]
        layers = (num_layers + 2) // setting["num_ranks"]
        flops = [gemm + attention, gemm + 2 * attention, gemm]  # F, I, W
        traffic = [activation, activation, 0.0]
        times = (
            setting["forward_ms"] / layers,
            setting["backward_input_ms"] / layers,
            setting["backward_weight_ms"] / layers,
        )
        return flops, traffic, times

    rows, targets = [], []
    for setting in one_setting_per_model():
        if setting["model"] == held_out:
            continue
        flops, traffic, times = per_layer(setting)
        # unknowns: ms per FLOP, ms per forward-traffic byte, ms per input-gradient-traffic byte
        rows += [[flops[0], traffic[0], 0.0], [flops[1], 0.0, traffic[1]], [flops[2], 0.0, 0.0]]
        targets += list(times)
    scale = np.abs(np.array(rows)).max(axis=0)
    fitted, *_ = np.linalg.lstsq(np.array(rows) / scale, np.array(targets), rcond=None)
    per_flop, per_forward_byte, per_input_byte = fitted / scale
    assert per_flop > 0 and per_forward_byte >= 0 and per_input_byte >= 0

    (setting,) = [s for s in one_setting_per_model() if s["model"] == held_out]
    flops, traffic, _ = per_layer(setting)
    forward = flops[0] * per_flop + traffic[0] * per_forward_byte
    backward_input = flops[1] * per_flop + traffic[1] * per_input_byte
    backward_weight = flops[2] * per_flop
    assert backward_input / forward == pytest.approx(setting["backward_input_ms"] / setting["forward_ms"], rel=0.15)
    assert backward_weight / forward == pytest.approx(setting["backward_weight_ms"] / setting["forward_ms"], rel=0.15)
