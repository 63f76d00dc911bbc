"""What the planner tells a user whose published layout it refuses or beats (Q19's audit, issues 24 and 28:
``bench/published_vs_free.py``)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import ValidationError

from pipesched.optimizer.planner.rank import estimator_for, plan, prepare, space_of
from pipesched.optimizer.planner.request import PlanRequest

GIB = 1024**3


def replicated_8b(**cluster: Any) -> dict[str, Any]:
    """Llama 3.1 8B replicated on 8 H100s (no sharding, no pipeline): its weights, gradients and Adam state alone
    (~16 B a parameter) exceed an 80 GiB GPU, so no configuration fits."""
    return {
        "model": {"preset": "llama3.1-8b"},
        "cluster": {"accelerator": "H100-SXM", "num_nodes": 1, "gpus_per_node": 8, **cluster},
        "training": {"global_batch_size": 8},
        "search": {
            "time_limit_s": 10,
            "pipeline_parallel": [1],
            "tensor_parallel": [1],
            "sharding": ["none"],
            "micro_batch_size": [1],
            "activation_recomputation": ["full"],
        },
    }


def refusal(document: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as excinfo:
        prepare(PlanRequest.model_validate(document))
    (error,) = excinfo.value.errors()
    return str(error["msg"])


@pytest.mark.parametrize("headroom", [None, 3 * GIB])
def test_a_refusal_by_memory_states_the_headroom_and_advises_a_gpu_that_holds_the_plan(headroom: float | None) -> None:
    """The refusal read "no configuration fits a GPU's 75 GiB … use GPUs with ≥ 130 GiB" for an 80 GiB H100: the
    75 GiB was the memory less the 5 GiB headroom, unsaid, and a GPU of the advised size keeps its own headroom
    free too, so it refused the same layout again. Now the GPU's memory and the headroom are stated, and a GPU of
    the advised size holds the layout by the estimate; the layout named with its
    micro-batches (and its context and expert degrees where above 1)."""
    extra = {} if headroom is None else {"memory_headroom_bytes": headroom}
    message = refusal(replicated_8b(**extra))
    assert "80 GiB less" in message and "cluster.memory_headroom_bytes" in message, message
    assert "micro-batch 1 × " in message and "(1 node)" in message, message  # the layout that needs the least
    needed = float(re.search(r"use GPUs with ≥ ([\d,.]+) GiB", message).group(1).replace(",", ""))  # type: ignore[union-attr]
    least = float(re.search(r"the least any needs is ([\d.]+) GiB", message).group(1))  # type: ignore[union-attr]
    assert needed > least
    larger = PlanRequest.model_validate(replicated_8b(memory_bytes=needed * GIB, **extra))
    estimator = estimator_for(larger)
    least_bytes = min(estimator.estimate(c).peak_memory_bytes for c in space_of(larger, estimator))
    assert least_bytes <= estimator.limit_bytes, (needed, least_bytes / GIB)


def test_a_layout_the_memory_estimate_puts_over_the_limit_is_simulated_and_planned_when_it_fits() -> None:
    """Qwen3-30B-A3B on 8 H100s (NeMo AutoModel's published job, global batch 512): the free search's best was
    PP 2 × TP 2 × EP 4 × DP 2 with DualPipeV, 10,925 tok/s/GPU, because the memory estimate (77.6 GiB) refused
    PP 2 × EP 4 × DP 4 at micro-batch 2 with full recomputation before simulation; its simulated schedule peaks at
    73.3 GiB of the 75 GiB a GPU offers and gives 11,495. The layout below had no plan ("no configuration fits");
    now it is simulated and planned under the limit."""
    document = {
        "model": {"preset": "qwen3-30b-a3b", "seq_length": 4096},
        "cluster": {"accelerator": "H100-SXM", "num_nodes": 1, "gpus_per_node": 8},
        "training": {"global_batch_size": 512, "precision": "bf16", "kernels": "fused"},
        "search": {
            "time_limit_s": 20,
            "pipeline_parallel": [2],
            "tensor_parallel": [1],
            "expert_parallel": [4],
            "context_parallel": [1],
            "sharding": ["optimizer"],
            "micro_batch_size": [2],
            "activation_recomputation": ["full"],
            "method": ["dualpipe-v"],
        },
    }
    request = PlanRequest.model_validate(document)
    estimator = estimator_for(request)
    (config,) = space_of(request, estimator)
    assert estimator.estimate(config).peak_memory_bytes > estimator.limit_bytes  # the estimate refuses it
    (best,) = plan(request).answer.plans
    assert best.peak_memory_bytes <= estimator.limit_bytes
    assert best.tokens_per_s_per_gpu > 10_925  # the free search's best before
