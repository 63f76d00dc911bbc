"""Loose ends a user meets (U21): what the plan table says of a sharding at data-parallel 1."""

from __future__ import annotations

from rich.console import Console

from pipesched.api.cli.plan import print_plans
from pipesched.optimizer.planner.rank import plan
from pipesched.optimizer.planner.request import PlanRequest

#: Llama 3.1 8B at 131K tokens on one node of 8 H100s, pinned to tensor 4 × context 2 (data-parallel 1).
CONTEXT_PARALLEL = {
    "model": {"preset": "llama3.1-8b", "seq_length": 131072},
    "cluster": {"accelerator": "H100-SXM", "num_nodes": 1, "gpus_per_node": 8},
    "training": {"global_batch_size": 1},
    "search": {
        "time_limit_s": 20,
        "top": 3,
        "pipeline_parallel": [1],
        "tensor_parallel": [4],
        "context_parallel": [2],
        "activation_recomputation": ["full"],
        "sharding": ["none", "optimizer", "full"],
    },
}


def test_a_sharding_at_data_parallel_1_with_context_parallelism_says_the_gpus_it_spans() -> None:
    """At d = 1 and c = 2 the plan table listed "1 none", "1 optimizer", "1 full" as three plans of one layout,
    which reads as the same thing three times; the weights are copied over the c ranks too and sharded over d·c
    (the three peaks differ), so the cell now says so: "1 full over d·c 2". Without context parallelism, d = 1
    is searched with sharding none only (one row)."""
    answer = plan(PlanRequest.model_validate(CONTEXT_PARALLEL)).answer
    assert {p.data_parallel.sharding for p in answer.plans} == {"none", "optimizer", "full"}
    assert len({p.peak_memory_bytes for p in answer.plans}) == 3
    out = Console(record=True, width=250)
    print_plans(answer, out)
    text = out.export_text()
    assert "1 full over d·c 2" in text and "1 optimizer over d·c 2" in text
    assert "1 none " in text and "none over" not in text
    alone = {
        **CONTEXT_PARALLEL,
        "search": {**CONTEXT_PARALLEL["search"], "context_parallel": [1], "tensor_parallel": [8]},
    }
    answer = plan(PlanRequest.model_validate({**alone, "model": {"preset": "llama3.1-8b", "seq_length": 8192}})).answer
    assert answer.plans and {p.data_parallel.sharding for p in answer.plans} == {"none"}
