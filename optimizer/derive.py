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

from pipesched.optimizer.configs import ClusterConfig, ModelConfig, TensorParallel
from pipesched.optimizer.costmodel import derive_problem
from pipesched.optimizer.problem import DataParallel, Pipeline, Problem
from pipesched.optimizer.validation import StrictModel

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
        (document.get("costs") is None or document.get("memory") is None)
        and document.get("model") is not None
        and document.get("cluster") is not None
    ):
        parts = _DerivationInput.model_validate(document)
        derived = derive_problem(
            parts.model,
            parts.cluster,
            parts.pipeline,
            tensor_parallel=parts.tensor_parallel,
            data_parallel=parts.data_parallel,
        )
        if document.get("costs") is None:
            document["costs"] = derived.costs.model_dump(mode="json")
        if document.get("memory") is None:
            document["memory"] = derived.memory.model_dump(mode="json")
        document["model"] = parts.model.model_copy(update={"layers_per_stage": derived.layers_per_stage}).model_dump(
            mode="json", exclude_none=True
        )
    return Problem.model_validate(document)


def _derive_missing(value: Any) -> Any:
    return load_problem(value) if isinstance(value, Mapping) else value


#: A :class:`Problem` field (an HTTP request body) that accepts ``model``/``cluster`` in place of ``costs``/``memory``.
ProblemDocument = Annotated[Problem, BeforeValidator(_derive_missing)]
