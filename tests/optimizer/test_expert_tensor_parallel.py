"""Expert tensor parallelism e_t (issue 28): the experts split over e_t GPUs in memory, in their products, on the
token path and in the gradients' reduction group, from the layout field to the plan and its Megatron launch.

The layout is Grok-1 314B's NeMo recipe on 512 H100s (dgxc-benchmarking grok1: TP 4 × PP 8 × VP 8 × CP 2 × EP 8,
DP 8, one sequence of 8,192 tokens per microbatch): under NeMo 24.12 the recipe states no expert tensor degree and
Megatron-Core takes the tensor degree (e_t = 4), under NeMo 25.04 its launch script states e_t = 1.
"""

from __future__ import annotations

from typing import Any

import pytest

from pipesched.optimizer.configs import ClusterConfig, ContextParallel, ExpertParallel, ModelConfig, TensorParallel
from pipesched.optimizer.cost.experts import expert_groups, expert_traffic
from pipesched.optimizer.cost.memory import layer_activation
from pipesched.optimizer.cost.stages import activation_reserve, resolve_hardware, transformer_layer
from pipesched.optimizer.cost.timing import expert_gemms
from pipesched.optimizer.planner.evaluate import launch_spec
from pipesched.optimizer.planner.launch import LaunchSpec, megatron_args, plan_configuration, torchtitan_launch
from pipesched.optimizer.planner.rank import estimator_for, plan
from pipesched.optimizer.planner.request import PlanRequest
from pipesched.optimizer.presets import MODEL_PRESETS

#: Grok-1 as the rows state it (xai-org/grok-1 model.py; its gated GELU timed as SwiGLU's three matrices).
GROK: dict[str, Any] = {
    **MODEL_PRESETS["llama3.1-8b"],  # Llama 3's vocabulary, sequence, GQA, RoPE, RMSNorm, no biases
    "num_layers": 64,
    "hidden_size": 6144,
    "num_attention_heads": 48,
    "ffn_hidden_size": 32768,
    "num_experts": 8,
    "num_experts_per_token": 2,
}
CLUSTER = ClusterConfig(accelerator="H100-SXM", num_nodes=64, gpus_per_node=8)


def test_expert_shards_and_their_gradient_group_shrink_by_e_t() -> None:
    """Each GPU of EP 8 holds E/ep = 1 expert of 3·h·f = 3·6,144·32,768 = 603,979,776 parameters whole at e_t = 1
    and a quarter of it, 150,994,944, at e_t = 4; the other parameters of the layer do not change. The experts'
    gradients are reduced over e_d = t·c·d/(ep·e_t) = 4·2·8/(8·1) = 8 GPUs at e_t = 1 and 64/32 = 2 at e_t = 4."""
    model = ModelConfig.model_validate(GROK)
    hardware = resolve_hardware(CLUSTER)
    tp, cp = TensorParallel(size=4), ContextParallel(size=2)

    def layer(e_t: int | None) -> Any:
        expert = ExpertParallel(size=8, tensor_parallel=e_t)
        return transformer_layer(model, hardware, tp, CLUSTER, moe=True, context_parallel=cp, expert_parallel=expert)

    whole, split, unset = layer(1), layer(4), layer(None)
    assert whole.expert_parameters == 603_979_776
    assert split.expert_parameters == 150_994_944
    assert whole.parameters - split.parameters == 603_979_776 - 150_994_944
    assert unset.expert_parameters == whole.expert_parameters  # unset with EP > 1: today's e_t = 1
    assert expert_groups(model, 4, 8, 1).data_parallel(4, 2, 8) == 8
    assert expert_groups(model, 4, 8, 4).data_parallel(4, 2, 8) == 2
    assert expert_groups(model, 4, 1).expert_tensor_parallel == 4  # EP 1: split like the dense FFN
    with pytest.raises(ValueError, match="does not divide"):
        expert_groups(model, 4, 8, 4).data_parallel(4, 1, 1)  # ep·e_t = 32 GPUs out of 4


def test_expert_products_see_e_t_times_the_rows_at_a_e_t_th_of_the_width() -> None:
    """Per CP rank 8,192/2 = 4,096 tokens, k = 2 copies: 8,192 copies. Each of the ep·e_t GPUs dispatches its
    4,096/t = 1,024 tokens' 2,048 copies; the one local expert gathers them over e_t GPUs: rows =
    e_t·ep·8,192/(t·E) = 2,048 at e_t = 1 (width 2·f = 65,536 in, f = 32,768 out) and 8,192 at e_t = 4 (widths
    16,384 and 8,192)."""
    model = ModelConfig.model_validate(GROK)
    fc1, fc2 = expert_gemms(model, 4096, 4, 8, 1)[:2]
    assert fc1 == (2048, 65536, 6144) and fc2 == (2048, 6144, 32768)
    fc1, fc2 = expert_gemms(model, 4096, 4, 8, 4)[:2]
    assert fc1 == (8192, 16384, 6144) and fc2 == (8192, 6144, 8192)
    assert expert_gemms(model, 4096, 4, 8) == expert_gemms(model, 4096, 4, 8, 1)


def test_the_token_path_adds_an_all_gather_and_a_reduce_scatter_over_e_t() -> None:
    """Megatron-Core's alltoall dispatcher (core_v0.10.0) on the NVLink at 450 GB/s, the network at 50 GB/s per
    GPU, latency α = 0.01 ms, the flat all-to-all NeMo's Grok-1 recipes run:

    - each GPU dispatches s·b/(c·t) = 1,024 tokens: R = 1,024·k 2·h 6,144·2 B = 25,165,824 B per all-to-all;
    - e_t = 1: the EP group is 8 consecutive GPUs, one node: (7/8)·R/450 GB/s = 0.048934 ms + α = 0.058934 ms,
      F = 2 all-to-alls = 0.117868 ms;
    - e_t = 4: the EP group strides over the expert-tensor groups, 2 GPUs a node over 4 nodes: a flat all-to-all
      sends k·(N − 1)/N = 1.5 copies of each 12,582,912-B row over the network, 1e3·12,582,912·1.5/50e9 =
      0.377487 ms, + 2α = 0.397487 ms; the all-gather brings (e_t − 1)·R = 75,497,472 B in
      3·(α + R/450 GB/s) = 3·0.065924 = 0.197772 ms, the reduce-scatter as long;
      F = 2·(0.397487 + 0.197772) = 1.190519 ms, and I the same."""
    model = ModelConfig.model_validate(GROK)
    bandwidths = {"intra_bandwidth_bytes_per_s": 450e9, "inter_bandwidth_bytes_per_s": 50e9, "hierarchical": False}
    whole = expert_traffic(model, CLUSTER, expert_groups(model, 4, 8, 1), 4, 2, **bandwidths)  # type: ignore[arg-type]
    split = expert_traffic(model, CLUSTER, expert_groups(model, 4, 8, 4), 4, 2, **bandwidths)  # type: ignore[arg-type]
    assert whole.bytes_per_all_to_all == split.bytes_per_all_to_all == 25_165_824
    assert (whole.link, whole.expert_tensor_bytes, whole.expert_tensor_ms) == ("intra-node", 0.0, 0.0)
    assert whole.forward_ms == pytest.approx(0.117868, abs=1e-6)
    assert split.link == "inter-node"
    assert split.all_to_all_ms == pytest.approx(0.397487, abs=1e-6)
    assert split.expert_tensor_bytes == 75_497_472
    assert split.expert_tensor_ms == pytest.approx(0.197772, abs=1e-6)
    assert split.forward_ms == split.backward_input_ms == pytest.approx(1.190519, abs=1e-6)


def _grok_request(**search: Any) -> PlanRequest:
    pins = {
        "tensor_parallel": [4],
        "pipeline_parallel": [8],
        "stages_per_rank": [8],
        "context_parallel": [2],
        "expert_parallel": [8],
        "data_parallel_size": [8],
        "micro_batch_size": [1],
        "method": ["interleaved-1f1b"],
        "sharding": ["optimizer"],
        "activation_recomputation": ["none"],
    }
    return PlanRequest.model_validate(
        {
            "model": {**GROK, "layers_per_stage": [1] * 64},
            "cluster": CLUSTER.model_dump(exclude_unset=True),
            "training": {"global_batch_size": 1024, "kernels": "fused", "gradient_reduce_dtype": "bf16"},
            "search": {"time_limit_s": 20, "top": 4, **pins, **search},
        }
    )


def test_a_plan_request_searches_e_t_and_the_megatron_launch_states_it() -> None:
    """The published layout with e_t ∈ {1, 4}: two plans. e_t = 4 holds a quarter of each expert (less memory)
    and pays the dispatcher's gathers and the EP group across nodes (a longer step); without the pin the planner
    keeps today's e_t = 1. Megatron-LM's argv states the degree (its default would be the tensor degree)."""
    answer = plan(_grok_request(expert_tensor_parallel=[1, 4])).answer
    by_degree = {p.expert_tensor_parallel: p for p in answer.plans}
    assert set(by_degree) == {1, 4}, answer.error
    whole, split = by_degree[1], by_degree[4]
    assert split.peak_memory_bytes < whole.peak_memory_bytes
    assert split.step_time_ms > whole.step_time_ms
    assert answer.plans[0].expert_tensor_parallel == 1
    default = plan(_grok_request()).answer
    assert {p.expert_tensor_parallel for p in default.plans} == {1}
    assert default.plans[0].step_time_ms == pytest.approx(whole.step_time_ms)
    spec = LaunchSpec(
        model=ModelConfig.model_validate(GROK),
        num_nodes=64,
        gpus_per_node=8,
        global_batch_size=1024,
        layout=plan_configuration(split),
    )
    args = megatron_args(spec)
    at = args.index("--expert-tensor-parallel-size")
    assert args[at + 1] == "4"
    assert args[args.index("--expert-model-parallel-size") + 1] == "8"


@pytest.mark.parametrize(
    ("recomputation", "held", "live_in_i"),
    [("none", 75_497_472.0, 75_497_472.0), ("selective", 75_497_472.0, 75_497_472.0), ("full", 0.0, 75_497_472.0)],
)
def test_a_moe_layer_holds_its_e_t_gathered_tokens(recomputation: str, held: float, live_in_i: float) -> None:
    """The experts' input is the e_t-gathered dispatched tokens (Megatron-Core ``token_dispatcher.py``, core_v0.10.0:
    the alltoall dispatcher all-gathers what it received over the expert-tensor group; the allgather and flex
    dispatchers give each GPU the same e_t·R rows), saved by the first expert matrix for its backward and W. By hand,
    bf16, per CP rank 8,192/2 = 4,096 tokens, each GPU's own 4,096/t = 1,024, k = 2 copies: R = 2,048 rows of
    2h = 12,288 B = 25,165,824 B; e_t = 4 holds 4·R, (4 − 1)·25,165,824 = 75,497,472 B more than e_t = 1, kept for
    W as well. Megatron's selective recipe recomputes norms and activation functions, not this input; full
    recomputation keeps the layer input only, so the gathered tokens live in I alone (``full``). The expert
    matrices' outputs are e_t times the rows at 1/e_t of the width: no other byte moves."""
    model = ModelConfig.model_validate({**GROK, "activation_recomputation": recomputation})
    whole, split = (
        layer_activation(model, 4, moe=True, context_parallel=2, expert_tensor_parallel=e_t) for e_t in (1, 4)
    )
    assert split.activation - whole.activation == held
    assert split.full - whole.full == live_in_i
    assert split.retained - whole.retained == held
    dense = layer_activation(model, 4, moe=False, context_parallel=2, expert_tensor_parallel=4)
    assert dense == layer_activation(model, 4, moe=False, context_parallel=2)


def test_the_layer_counts_the_gathered_tokens_at_its_resolved_e_t() -> None:
    """transformer_layer passes the layout's e_t to the activation model: stated 4 with EP 8 holds 75,497,472 B
    (previous test) more than stated or unset 1, times the allocator reserve; with EP 1 the experts are split like
    a dense FFN over t = 4 GPUs, so each holds all four GPUs' routed rows too."""
    model = ModelConfig.model_validate({**GROK, "kernels": "fused"})
    hardware = resolve_hardware(CLUSTER)
    tp, cp = TensorParallel(size=4), ContextParallel(size=2)

    def held(expert: ExpertParallel | None) -> float:
        block = transformer_layer(model, hardware, tp, CLUSTER, moe=True, context_parallel=cp, expert_parallel=expert)
        return block.activation_bytes

    reserve = held(ExpertParallel(size=8, tensor_parallel=4)) - held(ExpertParallel(size=8, tensor_parallel=1))
    assert reserve == pytest.approx(75_497_472.0 * activation_reserve(model, hardware))
    assert held(ExpertParallel(size=8)) == held(ExpertParallel(size=8, tensor_parallel=1))
    assert held(None) == pytest.approx(held(ExpertParallel(size=1, tensor_parallel=4)))
    assert held(None) - held(ExpertParallel(size=1, tensor_parallel=1)) == pytest.approx(reserve)


def test_a_plan_that_assumes_the_tensor_parallel_overlap_launches_with_it() -> None:
    """training.async_tensor_parallel reaches the launch: Megatron-LM gets ``--tp-comm-overlap`` beside
    ``--sequence-parallel`` (Transformer Engine's userbuffers), torchtitan ``--parallelism.enable_async_tensor_
    parallel`` with ``--compile.enable`` (its AsyncTP runs in compiled regions only); without the field neither."""

    def request(overlap: bool) -> PlanRequest:
        return PlanRequest.model_validate(
            {
                "model": {"preset": "llama3.1-8b"},
                "cluster": {"accelerator": "H100-SXM", "num_nodes": 1, "gpus_per_node": 8},
                "training": {"global_batch_size": 32, "kernels": "compiled", "async_tensor_parallel": overlap},
                "search": {"time_limit_s": 5, "top": 1, "tensor_parallel": [4], "pipeline_parallel": [1]},
            }
        )

    for overlap in (True, False):
        answer = plan(request(overlap)).answer
        assert answer.plans, answer.error
        spec = launch_spec(estimator_for(request(overlap)), plan_configuration(answer.plans[0]))
        assert ("--tp-comm-overlap" in megatron_args(spec)) is overlap
        titan = torchtitan_launch(spec).args
        assert "--compile.enable" in titan
        assert ("--compile.enable_async_tensor_parallel" in titan) is overlap
        manager = pytest.importorskip("torchtitan.config.manager")  # torchtitan 0.3.0 takes the flag where it is
        assert manager.ConfigManager().parse_args(titan).compile.enable_async_tensor_parallel is overlap


def test_an_eager_torchtitan_launch_of_an_overlapped_plan_says_it_runs_without_the_overlap() -> None:
    """torchtitan runs AsyncTP only compiled: an eager plan that assumed the overlap launches without it, and the
    bundle's notes say its step is slower than predicted; a compiled one launches with it and says nothing."""
    from pipesched.api.launch.bundle import LaunchOptions, build_bundle

    for kernels, warned in (("eager", True), ("compiled", False)):
        body = {
            "model": {"preset": "llama3.1-8b"},
            "cluster": {"accelerator": "H100-SXM", "num_nodes": 1, "gpus_per_node": 8},
            "training": {"global_batch_size": 32, "kernels": kernels, "async_tensor_parallel": True},
            "search": {"time_limit_s": 5, "top": 1, "tensor_parallel": [4], "pipeline_parallel": [1]},
        }
        answer = plan(PlanRequest.model_validate(body)).answer
        assert answer.plans and answer.request is not None, answer.error
        bundle = build_bundle(answer.request, answer.plans[0], 1, None, LaunchOptions(scheduler="torchrun"))
        args = bundle.files["torchtitan.args"]
        assert ("--compile.enable_async_tensor_parallel" in args) is not warned
        assert any("runs only under --compile.enable" in note for note in bundle.notes) is warned
