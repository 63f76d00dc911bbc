"""Load a problem document, deriving ``costs`` and ``memory`` from ``model`` and ``cluster`` when it has them.

This is the step before :class:`~pipesched.optimizer.problem.Problem`: the problem model knows nothing of
the cost model; :func:`load_problem` asks the cost model (:func:`~pipesched.optimizer.costmodel.derive_problem`)
for the missing sections, records the layer partition in ``model.layers_per_stage`` (the runtime builds its
chunks from the same split), and validates the whole document.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict

from pipesched.optimizer.collectives import data_parallel_costs
from pipesched.optimizer.configs import ClusterConfig, ModelConfig, TensorParallel
from pipesched.optimizer.costmodel import DerivedProblem, derive_problem, stage_ranks
from pipesched.optimizer.problem import DataParallel, Pipeline, Problem
from pipesched.optimizer.validation import StrictModel, raise_field_errors

__all__ = ["ProblemDocument", "load_problem"]


class _DerivationInput(StrictModel):
    """The sections the derivation reads, validated with the problem's own field paths."""

    model_config = ConfigDict(extra="ignore")

    pipeline: Pipeline
    model: ModelConfig
    cluster: ClusterConfig
    tensor_parallel: TensorParallel | None = None
    data_parallel: DataParallel | None = None


def load_problem(data: Mapping[str, Any]) -> Problem:
    """Validate a problem document (contract, Problem), deriving what ``model``/``cluster`` stand in for.

    Args:
        data: the JSON document as a mapping. With ``costs`` and ``memory`` it is validated as is; with
            ``model`` and ``cluster`` and without either of them, the missing ones are derived first.

    Returns:
        The validated problem, ``costs`` and ``memory`` filled in.

    Raises:
        pydantic.ValidationError: every invalid field with its path (``model.hidden_size``,
            ``cluster.accelerator``, ``costs.forward``…) and the fix.
    """
    document = dict(data)
    if (
        (document.get("costs") is None or document.get("memory") is None or _lacks_collectives(document))
        and document.get("model") is not None
        and document.get("cluster") is not None
    ):
        parts = _DerivationInput.model_validate(document)
        dp = parts.data_parallel
        derived = derive_problem(
            parts.model,
            parts.cluster,
            parts.pipeline,
            tensor_parallel=parts.tensor_parallel,
            data_parallel=dp,
        )
        costs_given, memory_given = document.get("costs") is not None, document.get("memory") is not None
        if not costs_given:
            document["costs"] = derived.costs.model_dump(mode="json")
        if not memory_given:
            document["memory"] = derived.memory.model_dump(mode="json")
        if dp is not None and dp.size > 1:
            _add_collectives(document, parts, derived, costs_given=costs_given, memory_given=memory_given)
        document["model"] = parts.model.model_copy(update={"layers_per_stage": derived.layers_per_stage}).model_dump(
            mode="json", exclude_none=True
        )
    return Problem.model_validate(document)


def _group_errors(
    parts: _DerivationInput, size: int, tensor_parallel: int
) -> list[tuple[tuple[str | int, ...], str, Any]]:
    """The data-parallel group must agree with ``cluster.data_parallel_size`` and tile the nodes evenly."""
    errors: list[tuple[tuple[str | int, ...], str, Any]] = []
    cluster_size = parts.cluster.data_parallel_size
    if cluster_size not in (1, size):
        errors.append(
            (
                ("cluster", "data_parallel_size"),
                f"cluster.data_parallel_size {cluster_size} disagrees with data_parallel.size {size}: drop "
                "cluster.data_parallel_size (data_parallel.size sets it) or make them equal",
                cluster_size,
            )
        )
    gpus_per_node = getattr(parts.cluster, "gpus_per_node", None)
    group = size * tensor_parallel
    if gpus_per_node and (gpus_per_node % group if group <= gpus_per_node else group % gpus_per_node):
        fits = [d for d in range(1, gpus_per_node + 1) if gpus_per_node % (d * tensor_parallel) == 0]
        errors.append(
            (
                ("data_parallel", "size"),
                f"data_parallel.size {size} × tensor_parallel {tensor_parallel} = {group} GPUs neither divides nor is "
                f"a multiple of gpus_per_node {gpus_per_node}: the groups would straddle nodes unevenly; use a size "
                f"in {fits} or a multiple of {max(1, gpus_per_node // tensor_parallel)}",
                size,
            )
        )
    return errors


def _lacks_collectives(document: Mapping[str, Any]) -> bool:
    """Whether a document with d > 1 gives costs without ``costs.reduce_grad``."""
    dp, costs = document.get("data_parallel"), document.get("costs")
    return (
        isinstance(dp, Mapping)
        and isinstance(dp.get("size"), int)
        and dp["size"] > 1
        and isinstance(costs, Mapping)
        and costs.get("reduce_grad") is None
    )


def _add_collectives(
    document: dict[str, Any], parts: _DerivationInput, derived: DerivedProblem, *, costs_given: bool, memory_given: bool
) -> None:
    """Fill ``costs.unshard``/``reduce_grad``/``optimizer_step`` (those not given) and, for derived memory,
    ``memory.weights``/``gradients``/``static`` by sharding level (:mod:`pipesched.optimizer.collectives`)."""
    dp = parts.data_parallel
    assert dp is not None and derived.hardware is not None
    tensor_parallel = document.get("tensor_parallel")
    tp_size = int(tensor_parallel.get("size", 1)) if isinstance(tensor_parallel, Mapping) else 1
    raise_field_errors("Problem", _group_errors(parts, dp.size, tp_size))
    collectives = data_parallel_costs(
        model=parts.model,
        cluster=parts.cluster,
        stage_parameters=[block.parameters for block in derived.stages],
        stage_holders=stage_ranks(parts.pipeline),
        num_ranks=parts.pipeline.num_ranks,
        data_parallel_size=dp.size,
        sharding=dp.sharding,
        memory_bandwidth_bytes_per_s=derived.hardware.memory_bandwidth_bytes_per_s,
        tensor_parallel=tp_size,
        stage_largest_unit=derived.largest_unit,
        reshard_after_forward=dp.reshard_after_forward,
    )
    costs = dict(document["costs"])
    for name, value in (
        ("unshard", collectives.unshard_ms),
        ("reduce_grad", collectives.reduce_grad_ms),
        ("optimizer_step", collectives.optimizer_step_ms),
    ):
        if costs.get(name) is None:
            costs[name] = value
    document["costs"] = costs
    if not memory_given:
        memory = dict(document["memory"])
        memory["weights"] = [float(round(x)) for x in collectives.weights_bytes]
        memory["gradients"] = [float(round(x)) for x in collectives.gradients_bytes]
        memory["static"] = collectives.static_bytes
        document["memory"] = memory


def _derive_missing(value: Any) -> Any:
    return load_problem(value) if isinstance(value, Mapping) else value


#: A :class:`Problem` field (an HTTP request body) that accepts ``model``/``cluster`` in place of ``costs``/``memory``.
ProblemDocument = Annotated[Problem, BeforeValidator(_derive_missing)]
