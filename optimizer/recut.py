"""The same model re-cut for another pipeline shape (placement, stages per rank), for side-by-side comparison.

Two ways, the first that applies:

* The problem has ``model`` and ``cluster``: costs, memory and the layer partition are derived again for the
  new shape by :func:`pipesched.optimizer.derive.load_problem` (FLOPs and the Zero Bubble paper's Table 1).
* Otherwise the problem's per-stage values are read as a model cut into ``num_stages`` equal slices of
  layers, and each new stage takes the slices it covers, in proportion: with uniform costs every stage's
  cost and activation is divided by the new-to-old ratio of stage counts (an even split by the number of
  stages), with per-stage lists a heavy first or last stage stays heavy (the data-parallel per-stage
  values — ``costs.unshard``/``reduce_grad``, ``memory.weights``/``gradients`` — the same way). ``p2p``
  keeps the value of the slice a new stage starts in (the same activation tensor crosses every boundary);
  per-rank ``static``, ``limit`` and ``optimizer_step`` stay as they are (every rank still holds
  1/num_ranks of the layers).

The number of ranks, microbatches and everything else stay the same.
"""

from __future__ import annotations

from typing import Any, Literal

from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.problem import Problem

__all__ = ["recut_problem", "recut_values"]

_PER_STAGE_COSTS = ("forward", "backward_input", "backward_weight")
_PER_STAGE_MEMORY = ("activation", "retained_for_weight")
_PER_STAGE_OPTIONAL_COSTS = ("unshard", "reduce_grad")  # collectives over a stage's weights: split by layers too
_PER_STAGE_OPTIONAL_MEMORY = ("weights", "gradients")
_PER_STAGE_WAITS = ("unshard_wait", "reduce_grad_wait")  # a collective's wait for its last replica: as p2p, not split


def recut_values(values: list[float], new_count: int, *, extensive: bool = True) -> list[float]:
    """Per-stage ``values`` of ``len(values)`` equal slices of a model, for ``new_count`` equal slices.

    ``extensive`` (costs, bytes): a new stage gets the sum of the overlapped parts of old stages (old value ×
    overlapped fraction of the old stage). Otherwise (latency): the value of the old stage it starts in.
    """
    old_count = len(values)
    if not extensive:
        return [values[(k * old_count) // new_count] for k in range(new_count)]
    result = []
    for k in range(new_count):
        start, end = k * old_count, (k + 1) * old_count  # in units of 1 / (old_count · new_count) of the model
        total = 0.0
        for i in range(start // new_count, min(old_count, -(-end // new_count))):
            overlap = min(end, (i + 1) * new_count) - max(start, i * new_count)
            if overlap > 0:
                total += values[i] * overlap / new_count
        result.append(total)
    return result


def recut_problem(problem: Problem, placement: Literal["loop", "v"], stages_per_rank: int) -> tuple[Problem, str]:
    """``problem``'s model on ``num_ranks × stages_per_rank`` stages in ``placement``, and how it was re-cut.

    Raises:
        ValueError: the shape is not valid (V needs 2 stages per rank), or the model cannot be derived for it
            (pydantic's ValidationError, naming the field).
    """
    if placement == "v" and stages_per_rank != 2:
        raise ValueError('placement "v" needs stages_per_rank 2')
    pipeline = {**problem.pipeline.model_dump(mode="json"), "placement": placement, "stages_per_rank": stages_per_rank}
    if problem.model is not None and problem.cluster is not None:
        data: dict[str, Any] = problem.model_dump(mode="json", exclude_none=True)
        data.pop("costs", None)
        limit = data.get("memory", {}).get("limit")
        data.pop("memory", None)
        data["pipeline"] = pipeline
        data["model"].pop("layers_per_stage", None)
        derived = load_problem(data)
        if limit is not None and problem.memory is not None and problem.memory.limit is not None:
            derived = derived.with_changes(**{"memory.limit": limit})
        return derived, "derived again from model and cluster"
    assert problem.costs is not None and problem.memory is not None
    new_count = problem.pipeline.num_ranks * stages_per_rank
    data = problem.model_dump(mode="json", exclude_none=True)
    data["pipeline"] = pipeline
    for name in _PER_STAGE_COSTS:
        data["costs"][name] = recut_values(problem.stage_values(getattr(problem.costs, name)), new_count)
    data["costs"]["p2p"] = recut_values(problem.stage_values(problem.costs.p2p), new_count, extensive=False)
    for name in _PER_STAGE_OPTIONAL_COSTS:
        if getattr(problem.costs, name) is not None:
            data["costs"][name] = recut_values(problem.stage_values(getattr(problem.costs, name)), new_count)
    for name in _PER_STAGE_WAITS:
        if getattr(problem.costs, name) is not None:
            data["costs"][name] = recut_values(
                problem.stage_values(getattr(problem.costs, name)), new_count, extensive=False
            )
    for name in _PER_STAGE_MEMORY:
        data["memory"][name] = recut_values(problem.stage_values(getattr(problem.memory, name)), new_count)
    for name in _PER_STAGE_OPTIONAL_MEMORY:
        if getattr(problem.memory, name) is not None:
            data["memory"][name] = recut_values(problem.stage_values(getattr(problem.memory, name)), new_count)
    old_count = problem.pipeline.num_stages
    how = (
        "per-stage costs and activations split by layers"
        if old_count == new_count
        else f"per-stage costs and activations split by layers: {old_count} → {new_count} stages (no model given)"
    )
    return Problem.model_validate(data), how
