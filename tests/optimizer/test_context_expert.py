"""Mixture-of-experts models, context parallelism and expert parallelism in the cost model and the problem."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from pipesched.optimizer.configs import ClusterConfig, ContextParallel, ExpertParallel, ModelConfig, TensorParallel
from pipesched.optimizer.cost.calibration.measurements import CONTEXT_EXPERT_SOURCES
from pipesched.optimizer.cost.context import (
    key_value_block_bytes,
    merge_bytes,
    pytorch_attention_speed,
    ring_attention,
)
from pipesched.optimizer.cost.experts import expert_groups, expert_traffic
from pipesched.optimizer.cost.flops import active_parameters, layer_flops, model_flops_per_token, model_parameters
from pipesched.optimizer.cost.profile import active_catalogue, use_catalogue
from pipesched.optimizer.cost.stages import resolve_hardware, transformer_layer
from pipesched.optimizer.cost.timing import expert_gemms
from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.planner.rank import plan
from pipesched.optimizer.planner.request import PlanRequest
from pipesched.optimizer.presets import PUBLISHED_PARAMETERS

REPO = Path(__file__).resolve().parents[2]
H100 = ClusterConfig(accelerator="H100-SXM", num_nodes=4, gpus_per_node=8)


def errors(excinfo: pytest.ExceptionInfo[ValidationError]) -> dict[tuple[str | int, ...], str]:
    return {tuple(error["loc"]): error["msg"] for error in excinfo.value.errors()}


@pytest.mark.parametrize("preset", sorted(PUBLISHED_PARAMETERS))
def test_moe_presets_count_the_published_total_and_active_parameters(preset: str) -> None:
    total, active = PUBLISHED_PARAMETERS[preset]
    model = ModelConfig(preset=preset)
    assert model_parameters(model) == pytest.approx(total, rel=0.03)
    assert active_parameters(model) == pytest.approx(active, rel=0.03)
    assert active_parameters(model) < model_parameters(model) / 3


def test_a_dense_model_is_all_active_and_its_flops_are_palms() -> None:
    model = ModelConfig(preset="llama3.1-8b")
    assert active_parameters(model) == model_parameters(model)
    h, layers, s = model.hidden_size, model.num_layers, model.seq_length
    # 6N + 12·l·h·s with N the matrices and the head (PaLM, App. B); causal halves the s-term
    assert model_flops_per_token(model) - model_flops_per_token(model, causal=True) == 6 * layers * h * s


def test_moe_flops_count_the_active_experts_and_memory_counts_all() -> None:
    dense = ModelConfig(preset="mixtral-8x7b", num_experts=None, num_experts_per_token=None)
    moe = ModelConfig(preset="mixtral-8x7b")
    # two of eight experts run per token: the FFN FLOPs double, its parameters grow eightfold
    dense_ffn = layer_flops(dense).backward_weight
    moe_ffn = layer_flops(moe, moe=True).backward_weight
    attention = 2 * moe.seq_length * (4096 * (4096 + 2 * 1024) + 4096 * 4096)
    assert moe_ffn - attention == pytest.approx(2 * (dense_ffn - attention) + 2 * moe.seq_length * 8 * 4096, rel=1e-9)
    hardware = resolve_hardware(H100)
    layer = transformer_layer(moe, hardware, moe=True)
    assert layer.expert_parameters == pytest.approx(8 * 3 * 4096 * 14336)
    # expert parallelism 8: one expert per GPU
    sharded = transformer_layer(moe, hardware, cluster=H100, moe=True, expert_parallel=ExpertParallel(size=8))
    assert sharded.expert_parameters == pytest.approx(layer.expert_parameters / 8)
    assert layer.parameters - layer.expert_parameters == pytest.approx(sharded.parameters - sharded.expert_parameters)


def test_load_imbalance_slows_the_busiest_rank() -> None:
    balanced = ModelConfig(preset="qwen3-30b-a3b")
    skewed = ModelConfig(preset="qwen3-30b-a3b", moe_load_imbalance=1.3)
    assert layer_flops(skewed, moe=True).forward > layer_flops(balanced, moe=True).forward
    groups = expert_groups(balanced, 1, 8)
    one = expert_traffic(balanced, H100, groups, 1, 1)
    assert expert_traffic(skewed, H100, groups, 1, 1).bytes_per_all_to_all == pytest.approx(
        1.3 * one.bytes_per_all_to_all
    )


def test_all_to_all_moves_tokens_times_top_k_times_hidden_on_the_expert_groups_link() -> None:
    model = ModelConfig(preset="deepseek-v3")
    tokens = 4096  # one sequence, tensor and context degree 1
    within = expert_traffic(model, H100, expert_groups(model, 1, 8), 1, 1)
    assert within.bytes_per_all_to_all == tokens * 8 * 7168 * 2
    assert within.link == "intra-node"
    across = expert_traffic(model, H100, expert_groups(model, 1, 32), 1, 1)
    assert across.link == "inter-node"
    # four nodes: a token crosses the network once per other node among its 8 experts' (3·(1 − 0.75⁸) ≈ 2.7)
    remote_nodes = 3 * (1 - 0.75**8)
    network = 1e3 * tokens * 7168 * 2 * remote_nodes / H100.inter_node_bandwidth_bytes_per_s
    assert across.all_to_all_ms == pytest.approx(network + 2 * H100.collective_latency_ms, rel=0.01)
    assert across.all_to_all_ms > 2 * within.all_to_all_ms
    assert across.forward_ms == across.backward_input_ms == 2 * across.all_to_all_ms
    # tensor parallelism with sequence parallelism: each of the t ranks dispatches its s/t tokens
    assert expert_traffic(model, H100, expert_groups(model, 2, 8), 2, 1).bytes_per_all_to_all == tokens * 4 * 7168 * 2


def test_a_flat_all_to_all_sends_every_copy_over_the_network() -> None:
    model = ModelConfig(preset="deepseek-v3")
    tokens = 4096
    hierarchical = expert_traffic(model, H100, expert_groups(model, 1, 32), 1, 1)
    flat = expert_traffic(model, H100, expert_groups(model, 1, 32), 1, 1, hierarchical=False)
    # four nodes: 8 copies, 3/4 of them bound for experts on other nodes, against 3·(1 − 0.75⁸) ≈ 2.7 crossings
    network = 1e3 * tokens * 7168 * 2 * 8 * 3 / 4 / H100.inter_node_bandwidth_bytes_per_s
    assert flat.all_to_all_ms == pytest.approx(network + 2 * H100.collective_latency_ms, rel=0.01)
    assert flat.all_to_all_ms > 2 * hierarchical.all_to_all_ms
    # inside one node the two dispatchers move the same bytes over NVLink
    one_node = expert_groups(model, 1, 8)
    assert expert_traffic(model, H100, one_node, 1, 1, hierarchical=False) == expert_traffic(
        model, H100, one_node, 1, 1
    )


def test_each_dispatcher_crosses_the_network_at_its_own_achieved_bandwidth() -> None:
    model = ModelConfig(preset="deepseek-v3")
    groups, layout = expert_groups(model, 1, 32), ExpertParallel(size=32)
    catalogue = active_catalogue()
    profile = resolve_hardware(H100).profile
    intra = H100.intra_node_bandwidth_bytes_per_s * profile.collective_efficiency_intra

    def layer_and_traffic(dispatcher: str, efficiencies: dict[str, float]) -> tuple[float, float]:
        update = {"moe_dispatcher": dispatcher, "moe_dispatch_efficiency_inter": efficiencies}
        with use_catalogue(catalogue.model_copy(update={"software": catalogue.software.model_copy(update=update)})):
            hardware = resolve_hardware(H100)
            forward = transformer_layer(model, hardware, cluster=H100, moe=True, expert_parallel=layout).forward_ms
        achieved = H100.inter_node_bandwidth_bytes_per_s * efficiencies.get(
            dispatcher, profile.collective_efficiency_inter
        )
        traffic = expert_traffic(
            model,
            H100,
            groups,
            1,
            1,
            intra_bandwidth_bytes_per_s=intra,
            inter_bandwidth_bytes_per_s=achieved,
            hierarchical=dispatcher == "hierarchical",
        )
        return forward, traffic.forward_ms

    for dispatcher in ("hierarchical", "all-to-all"):
        base, base_traffic = layer_and_traffic(dispatcher, {})
        # the other dispatcher's figure leaves this one at the profile's collective efficiency
        other = "all-to-all" if dispatcher == "hierarchical" else "hierarchical"
        assert layer_and_traffic(dispatcher, {other: 0.2})[0] == pytest.approx(base)
        # its own figure, half the profile's, doubles its network leg: the forward grows by what its all-to-alls grow
        slow, slow_traffic = layer_and_traffic(dispatcher, {dispatcher: profile.collective_efficiency_inter / 2})
        assert slow_traffic > 1.8 * base_traffic
        assert slow - base == pytest.approx(slow_traffic - base_traffic, rel=1e-6)


def test_a_framework_that_overlaps_its_all_to_alls_hides_them_in_any_schedule() -> None:
    request = PlanRequest.model_validate(
        {
            "model": {"preset": "qwen3-30b-a3b"},
            "cluster": {"accelerator": "H100-SXM", "num_nodes": 4, "gpus_per_node": 8},
            "training": {"global_batch_size": 64, "kernels": "fused"},
            "search": {
                "time_limit_s": 5,
                "top": 1,
                "pipeline_parallel": [2],
                "tensor_parallel": [1],
                "expert_parallel": [16],
                "stages_per_rank": [1],
                "micro_batch_size": [4],
                "method": ["1f1b"],
            },
        }
    )
    exposed = plan(request).answer.plans[0]
    catalogue = active_catalogue()
    software = catalogue.software.model_copy(update={"moe_all_to_all_overlap": True})
    with use_catalogue(catalogue.model_copy(update={"software": software})):
        hidden = plan(request).answer.plans[0]
    assert hidden.step_time_ms < exposed.step_time_ms


def test_overlapped_all_to_alls_expose_only_what_exceeds_the_compute() -> None:
    model = ModelConfig(preset="deepseek-v3")
    hardware = resolve_hardware(H100)
    exposed = transformer_layer(model, hardware, cluster=H100, moe=True, expert_parallel=ExpertParallel(size=32))
    hidden = transformer_layer(
        model, hardware, cluster=H100, moe=True, expert_parallel=ExpertParallel(size=32, overlap=True)
    )
    local = transformer_layer(model, hardware, cluster=H100, moe=True, expert_parallel=ExpertParallel(size=8))
    assert hidden.forward_ms < exposed.forward_ms
    assert local.forward_ms < exposed.forward_ms


def test_context_parallelism_divides_activations_and_flops_but_not_weights() -> None:
    model = ModelConfig(preset="llama3.1-8b", seq_length=65536)
    hardware = resolve_hardware(H100)
    whole = transformer_layer(model, hardware, cluster=H100)
    split = transformer_layer(model, hardware, cluster=H100, context_parallel=ContextParallel(size=4))
    assert split.activation_bytes == pytest.approx(whole.activation_bytes / 4)
    # a quarter of the matrix-multiply work, in products a quarter as tall (a little less efficient)
    assert whole.backward_weight_ms / 4 <= split.backward_weight_ms <= 1.02 * whole.backward_weight_ms / 4
    assert split.parameters == whole.parameters
    flops = layer_flops(model, context_parallel=4)
    assert flops.attention_forward == pytest.approx(layer_flops(model).attention_forward / 4)


def test_causal_attention_dominates_at_131k_tokens() -> None:
    long = layer_flops(ModelConfig(preset="llama3.1-405b", seq_length=131072))
    short = layer_flops(ModelConfig(preset="llama3.1-405b", seq_length=8192))

    def share(flops: Any) -> float:
        total = flops.forward + flops.backward_input + flops.backward_weight
        return float((flops.attention_forward + flops.attention_backward) / total)

    assert long.attention_backward / long.backward_input > 0.5
    assert share(long) > 0.4
    assert share(short) < 0.06


def test_ring_attention_hides_its_transfers_at_long_sequences_and_uses_the_right_link() -> None:
    model = ModelConfig(preset="llama3.1-405b", seq_length=131072)
    cluster = ClusterConfig(accelerator="H100-SXM", num_nodes=32, gpus_per_node=8)
    # 8 key/value heads of 128 on 8 tensor-parallel ranks: one head each, keys and values
    assert key_value_block_bytes(model, 8, 16) == 131072 / 16 * 2 * 128 * 2
    hidden = ring_attention(model, cluster, 8, 16, attention_forward_ms=50.0, attention_backward_ms=125.0)
    assert hidden.link == "inter-node" and hidden.steps == 15
    assert hidden.forward_exposed_ms == hidden.backward_input_exposed_ms == 0.0
    short = ModelConfig(preset="llama3.1-405b", seq_length=8192)
    exposed = ring_attention(short, cluster, 8, 16, attention_forward_ms=0.01, attention_backward_ms=0.02)
    assert exposed.forward_exposed_ms > 0 and exposed.backward_input_exposed_ms > exposed.forward_exposed_ms
    inside = ring_attention(short, cluster, 4, 2, attention_forward_ms=0.0, attention_backward_ms=0.0)
    assert inside.link == "intra-node"


def test_ring_steps_merge_their_partial_results_at_memory_speed() -> None:
    model = ModelConfig(preset="llama3.1-8b", seq_length=65536)
    assert merge_bytes(model, 1, 1) == (0.0, 0.0)
    forward, backward = merge_bytes(model, 1, 4)
    # three merges of 16,384 tokens × 4,096 output elements, 10 bytes each; I: query + 2 × 8 key/value heads, fp32
    assert forward == 3 * 16384 * 4096 * 10
    assert backward == 3 * 16384 * (4096 + 2 * 8 * 128) * 8
    cluster = ClusterConfig(accelerator="H100-SXM", num_nodes=1, gpus_per_node=8)
    ring = ring_attention(model, cluster, 1, 4, attention_forward_ms=1e3, attention_backward_ms=1e3)
    assert (ring.forward_merge_bytes, ring.backward_input_merge_bytes) == (forward, backward)


def test_pytorch_attention_runs_flashattention_2_with_and_without_context_parallelism() -> None:
    hardware = resolve_hardware(H100)
    fused = ModelConfig(preset="llama3.1-8b", seq_length=131072, kernels="fused")
    compiled = fused.model_copy(update={"kernels": "compiled"})
    assert pytorch_attention_speed(fused, hardware) == 1.0
    speed = pytorch_attention_speed(compiled, hardware)
    assert 0.3 < speed < 0.7  # FlashAttention-2 on Hopper: about half of today's kernels
    a100 = ClusterConfig(accelerator="A100-80GB", num_nodes=1, gpus_per_node=8)
    assert pytorch_attention_speed(compiled, resolve_hardware(a100)) == 1.0  # on Ampere it is today's kernel

    def slowdown(seq_length: int) -> float:  # compiled PyTorch's layer over Transformer Engine's
        short = {"seq_length": seq_length}
        pytorch = transformer_layer(compiled.model_copy(update=short), hardware, cluster=H100)
        engine = transformer_layer(fused.model_copy(update=short), hardware, cluster=H100)
        return pytorch.forward_ms / engine.forward_ms

    assert slowdown(131072) > slowdown(2048) > 1.0  # attention's share, and FlashAttention-2's cost, grow with s
    ring = ContextParallel(size=4)
    slow = transformer_layer(compiled, hardware, cluster=H100, context_parallel=ring)
    alone = transformer_layer(compiled, hardware, cluster=H100)
    assert slow.forward_ms > alone.forward_ms / 4  # a quarter of the tokens, and the ring's merges besides


def test_unknown_kernels_run_the_ring_at_the_expected_time_of_the_frameworks() -> None:
    hardware = resolve_hardware(H100)
    unknown = ModelConfig(preset="llama3.1-8b", seq_length=131072, kernels="unknown")
    ring = ContextParallel(size=4)
    layers = {
        mode: transformer_layer(
            unknown.model_copy(update={"kernels": mode}), hardware, cluster=H100, context_parallel=ring
        )
        for mode in ("eager", "compiled", "fused")
    }
    assert layers["fused"].forward_ms < layers["compiled"].forward_ms  # PyTorch's FlashAttention-2 ring is slower
    for sharding in ("full", "optimizer"):
        shares = hardware.software.kernels_shares("unknown", sharding)
        blended = transformer_layer(unknown, hardware, cluster=H100, context_parallel=ring, sharding=sharding)
        expected = sum(share * layers[mode].forward_ms for mode, share in shares.items()) / sum(shares.values())
        assert blended.forward_ms == pytest.approx(expected)  # expected time, not expected speed
        assert blended.activation_bytes == max(layer.activation_bytes for layer in layers.values())
    fsdp = transformer_layer(unknown, hardware, cluster=H100, context_parallel=ring, sharding="full")
    zero1 = transformer_layer(unknown, hardware, cluster=H100, context_parallel=ring, sharding="optimizer")
    assert zero1.forward_ms < fsdp.forward_ms  # replicated weights: mostly Megatron/NeMo's published runs


def test_a_moe_layer_takes_at_least_its_host_time() -> None:
    hardware = resolve_hardware(H100)
    host = hardware.software.moe_layer_host_ms
    assert host > 0
    small = ModelConfig(preset="qwen3-30b-a3b", seq_length=4096, micro_batch_size=1, kernels="fused")
    layer = transformer_layer(small, hardware, cluster=H100, moe=True, expert_parallel=ExpertParallel(size=8))
    assert layer.forward_ms == pytest.approx(host)
    assert layer.backward_input_ms == pytest.approx(1.5 * host)
    assert layer.backward_weight_ms == pytest.approx(host / 2)
    big = small.model_copy(update={"micro_batch_size": 8})
    busy = transformer_layer(big, hardware, cluster=H100, moe=True, expert_parallel=ExpertParallel(size=8))
    assert busy.forward_ms > host  # the GPU's own time once the microbatch is large
    dense = transformer_layer(small, hardware, cluster=H100, moe=False)
    assert dense.forward_ms < host


def _document(**sections: Any) -> dict[str, Any]:
    return {
        "pipeline": {"num_ranks": 4, "num_microbatches": 8},
        "model": {"preset": "qwen3-30b-a3b"},
        "cluster": {"accelerator": "H100-SXM", "num_nodes": 4, "gpus_per_node": 8},
        **sections,
    }


def test_expert_state_is_sharded_over_the_expert_data_parallel_group() -> None:
    base = {"data_parallel": {"size": 8, "sharding": "optimizer"}}
    replicated = load_problem(_document(**base))
    sharded = load_problem(_document(**base, expert_parallel={"size": 8}))
    assert replicated.memory is not None and sharded.memory is not None
    # one expert eighth per GPU: static memory falls by far more than the optimizer's 1/8 alone would give
    # (the first ranks: the last one's static also counts the loss's transient, alike in both)
    assert max(sharded.memory.static[:-1]) < 0.4 * max(replicated.memory.static[:-1])
    assert sharded.costs is not None and replicated.costs is not None
    assert sharded.costs.forward != replicated.costs.forward  # the all-to-alls


def test_context_and_expert_degrees_that_do_not_divide_are_field_errors() -> None:
    with pytest.raises(ValidationError) as excinfo:
        load_problem(_document(context_parallel={"size": 3}, model={"preset": "qwen3-30b-a3b", "seq_length": 4096}))
    assert "head-tail" in errors(excinfo)[("context_parallel", "size")]
    with pytest.raises(ValidationError) as excinfo:
        load_problem(_document(expert_parallel={"size": 3}, data_parallel={"size": 8, "sharding": "none"}))
    assert "does not divide the 128 experts" in errors(excinfo)[("expert_parallel", "size")]
    with pytest.raises(ValidationError) as excinfo:
        load_problem(_document(expert_parallel={"size": 2}, model={"preset": "llama3.1-8b"}, data_parallel={"size": 2}))
    assert "dense model" in errors(excinfo)[("expert_parallel", "size")]


def test_moe_and_latent_attention_fields_are_checked_together() -> None:
    with pytest.raises(ValidationError) as excinfo:
        ModelConfig(preset="mixtral-8x7b", num_experts_per_token=None)
    assert "top-k" in errors(excinfo)[("num_experts_per_token",)]
    with pytest.raises(ValidationError) as excinfo:
        ModelConfig(preset="mixtral-8x7b", num_experts_per_token=9)
    assert "exceed the 8 experts" in errors(excinfo)[("num_experts_per_token",)]
    with pytest.raises(ValidationError) as excinfo:
        ModelConfig(preset="llama3.1-8b", moe_ffn_hidden_size=1024)
    assert "give num_experts" in errors(excinfo)[("moe_ffn_hidden_size",)]
    with pytest.raises(ValidationError) as excinfo:
        ModelConfig(preset="deepseek-v3", v_head_dim=None)
    assert "v_head_dim" in errors(excinfo)[("v_head_dim",)]
    with pytest.raises(ValidationError) as excinfo:
        ModelConfig(preset="deepseek-v3", first_dense_layers=61)
    assert "leaves none" in errors(excinfo)[("first_dense_layers",)]


def test_deepseek_dense_layers_lead_the_first_stage() -> None:
    def static(first_dense_layers: int) -> list[float]:
        problem = load_problem(
            {
                "pipeline": {"num_ranks": 4, "num_microbatches": 8},
                "model": {
                    "preset": "deepseek-v3",
                    "first_dense_layers": first_dense_layers,
                    "layers_per_stage": [16, 15, 15, 15],
                },
                "cluster": {"accelerator": "H100-SXM", "num_nodes": 32, "gpus_per_node": 8},
                "data_parallel": {"size": 64, "sharding": "optimizer"},
                "expert_parallel": {"size": 64},
            }
        )
        assert problem.memory is not None and isinstance(problem.memory.static, list)
        return problem.memory.static

    published, all_experts = static(3), static(0)
    # the three dense layers are stage 0's: it holds less than with experts there, the other stages the same
    assert published[0] < all_experts[0]
    assert published[1:] == pytest.approx(all_experts[1:], rel=1e-9)


def test_published_layout_rows_follow_the_calibration_row_format() -> None:
    folder = REPO / "optimizer" / "cost" / "calibration" / "data"
    seen = 0
    for name in CONTEXT_EXPERT_SOURCES:
        document = json.loads((folder / f"{name}.json").read_text())
        assert document["source"]["id"] == name and document["source"]["url"].startswith("https://")
        for row in document["rows"]:
            layout, run = row["layout"], row["training"]
            model = ModelConfig.model_validate(row["model"])
            assert (
                layout["data_parallel"] * run["num_microbatches"] * run["micro_batch_size"] == run["global_batch_size"]
            )
            gpus = layout["data_parallel"] * layout["tensor_parallel"] * layout["pipeline_parallel"]
            gpus *= layout["context_parallel"]
            assert gpus == row["cluster"]["num_nodes"] * row["cluster"]["gpus_per_node"], row["id"]
            assert layout["context_parallel"] > 1 or layout["expert_parallel"] > 1 or name == "llama3_herd_table4"
            if layout["expert_parallel"] > 1:
                assert model.is_moe and (model.num_experts or 0) % layout["expert_parallel"] == 0
            assert row["measured"]["tokens_per_s_per_gpu"] > 0
            seen += 1
    assert seen >= 50


def test_a_megatron_bridge_row_that_runs_another_layout_than_its_table_says_why() -> None:
    """A Megatron Bridge row's id records the layout its table prints; where the row is timed on another one (the
    25.11 tables repeat 25.09's columns; the starter pack committed with them says what ran), its notes say so."""
    document = json.loads(
        (REPO / "optimizer" / "cost" / "calibration" / "data" / "megatron_bridge_cp_ep.json").read_text()
    )
    printed = re.compile(r"tp(\d+)pp(\d+)cp(\d+)vp(\d+)ep(\d+)-gbs(\d+)-mbs(\d+)$")
    read_otherwise = []
    for row in document["rows"]:
        match = printed.search(row["id"])
        assert match, row["id"]
        layout, run = row["layout"], row["training"]
        ran = (
            layout["tensor_parallel"],
            layout["pipeline_parallel"],
            layout["context_parallel"],
            layout["stages_per_rank"],
            layout["expert_parallel"],
            run["global_batch_size"],
            run["micro_batch_size"],
        )
        if ran != tuple(int(value) for value in match.groups()):
            assert "layout read from the starter pack" in row["software"]["notes"], row["id"]
            read_otherwise.append(row["id"].split("-")[0])
    # only 25.11 rows are read so
    assert read_otherwise and set(read_otherwise) == {"mbridge2511"}


def test_tensor_parallel_helper_is_unchanged_for_dense_layers() -> None:
    model = ModelConfig(preset="llama3.1-70b")
    hardware = resolve_hardware(H100)
    tp = TensorParallel(size=8)
    # a dense layer ignores expert parallelism
    assert transformer_layer(model, hardware, tp, H100) == transformer_layer(
        model, hardware, tp, H100, expert_parallel=ExpertParallel(size=8)
    )


@pytest.mark.parametrize(("preset", "share"), [("gpt-oss-120b", 0.105), ("gpt-oss-20b", 0.100)])
def test_gpt_oss_causal_attention_core_is_a_tenth_of_its_flops(preset: str, share: float) -> None:
    """The preset's docstring: at 4096 tokens the causal core, 3·s·(q + v) a layer (64 heads of 64 for q and v),
    is a tenth of a token's model FLOPs; the 128-token window of half the layers is left out."""
    model = ModelConfig(preset=preset)
    core = 3 * 4096 * (64 * 64 + 64 * 64) * model.num_layers
    assert model.seq_length == 4096
    assert core / model_flops_per_token(model, causal=True) == pytest.approx(share, abs=0.001)


def test_nemo_automodel_rows_state_the_recomputation_their_benchmark_configs_set() -> None:
    """NeMo AutoModel's table prints no recomputation; the benchmark configs committed with it do
    (``parallelizer.activation_checkpointing``: true wraps every block, full; false, none). Each row states it
    and names its config, so the bench pins it instead of leaving it to the planner."""
    path = REPO / "optimizer" / "cost" / "calibration" / "data" / "nemo_automodel_h100.json"
    document = json.loads(path.read_text())
    for row in document["rows"]:
        software = row["software"]
        assert not any(item.startswith("activation_recomputation") for item in software.get("assumed", [])), row["id"]
        notes = software["notes"]
        assert re.search(r"examples/benchmark/configs/\w+\.yaml at 01926a5c", notes), row["id"]
        stated = "full" if "activation_checkpointing: true" in notes else "none"
        assert "activation_checkpointing: false" in notes or stated == "full", row["id"]
        assert row["training"]["activation_recomputation"] == stated, row["id"]


def test_a_local_experts_gemm_takes_its_share_of_the_expert_groups_routed_copies() -> None:
    """GPT-OSS 120B at MBS 4, EP 8 (Megatron Bridge's 26.04.01 B200 row): 8 ranks × 16,384 tokens × top-4 over
    128 experts = 4,096 rows per local expert; at MBS 1 on H100 (its 26.04.01 H100 row) 1,024. Without expert
    parallelism every expert is split t ways and takes s·b·k/E rows (bench/moe_expert_rows.py reads these)."""
    model = ModelConfig.model_validate({"preset": "gpt-oss-120b", "micro_batch_size": 4})
    fc1, fc2 = expert_gemms(model, 4 * 4096, 1, 8)[:2]
    assert fc1 == (4096, 2 * 2880, 2880) and fc2 == (4096, 2880, 2880)
    assert len(expert_gemms(model, 4 * 4096, 1, 8)) == 2 * 128 // 8 + 1  # 16 local experts and the router
    assert expert_gemms(model, 4096, 1, 8)[0][0] == 1024
    assert expert_gemms(model, 4096, 2, 1)[0] == (4096 * 4 / 128, 2880, 2880)
