"""What the planner tells a user whose published layout it refuses or beats (Q19's audit, issues 24 and 28:
``bench/published_vs_free.py``)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import ValidationError

from pipesched.optimizer.planner.rank import prepare
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
    the advised size takes the layout (0.1 GiB less does not); the layout named with its micro-batches (and its
    context and expert degrees where above 1)."""
    extra = {} if headroom is None else {"memory_headroom_bytes": headroom}
    message = refusal(replicated_8b(**extra))
    assert "80 GiB less" in message and "cluster.memory_headroom_bytes" in message, message
    assert "micro-batch 1 × " in message and "(1 node)" in message, message  # the layout that needs the least
    needed = float(re.search(r"use GPUs with ≥ ([\d,.]+) GiB", message).group(1).replace(",", ""))  # type: ignore[union-attr]
    least = float(re.search(r"the least any needs is ([\d.]+) GiB", message).group(1))  # type: ignore[union-attr]
    assert needed > least
    prepared = prepare(PlanRequest.model_validate(replicated_8b(memory_bytes=needed * GIB, **extra)))
    assert prepared.candidates
    assert "no configuration fits" in refusal(replicated_8b(memory_bytes=(needed - 0.1) * GIB, **extra))
