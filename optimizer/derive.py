"""Load a problem document, deriving ``costs`` and ``memory`` from ``model`` and ``cluster`` when it has them.

This is the step before :class:`~pipesched.optimizer.problem.Problem`: the problem model knows nothing of
the cost model; :func:`load_problem` asks the cost model (:func:`~pipesched.optimizer.costmodel.derive_problem`)
for the missing sections, records the layer partition in ``model.layers_per_stage`` (the runtime builds its
chunks from the same split), and validates the whole document.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict, ValidationError

from pipesched.optimizer.configs import ClusterConfig, ModelConfig
from pipesched.optimizer.costmodel import derive_problem
from pipesched.optimizer.problem import Pipeline, Problem
from pipesched.optimizer.validation import StrictModel, raise_field_errors

__all__ = ["ProblemDocument", "load_problem"]


class _DerivationInput(StrictModel):
    """The sections the derivation reads, validated with the problem's own field paths."""

    model_config = ConfigDict(extra="ignore")

    pipeline: Pipeline
    model: ModelConfig
    cluster: ClusterConfig


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
        derived_sections = {name for name in ("costs", "memory") if document.get(name) is None}
        try:
            derived = derive_problem(parts.model, parts.cluster, parts.pipeline)
        except ValidationError as error:
            _blame_inputs(error, parts.cluster, {"Costs": "costs", "Memory": "memory"}.get(error.title))
            raise
        if "costs" in derived_sections:
            document["costs"] = derived.costs.model_dump(mode="json")
        if "memory" in derived_sections:
            document["memory"] = derived.memory.model_dump(mode="json")
        document["model"] = parts.model.model_copy(update={"layers_per_stage": derived.layers_per_stage}).model_dump(
            mode="json", exclude_none=True
        )
        try:
            return Problem.model_validate(document)
        except ValidationError as error:
            sections = {str(entry["loc"][0]) for entry in error.errors() if entry["loc"]}
            for section in sorted(sections & derived_sections):
                _blame_inputs(error, parts.cluster, section)
            raise
    return Problem.model_validate(document)


def _blame_inputs(error: ValidationError, cluster: ClusterConfig, section: str | None) -> None:
    """Re-raise an error in a derived section (``costs``/``memory``, which the user never sent) on the
    ``cluster``/``model`` inputs it came from, with the fix; return when ``section`` is not derived.

    Raises:
        pydantic.ValidationError: on ``cluster.flops_per_s`` (or ``memory_bandwidth_bytes_per_s``) when the
            derived times are out of range and the rate was given, ``cluster.memory_bytes`` for memory, else
            on ``model``.
    """
    if section not in ("costs", "memory"):
        return
    first = next(
        (entry for entry in error.errors() if not entry["loc"] or entry["loc"][0] in (section, *_DERIVED_FIELDS)),
        error.errors()[0],
    )
    what = f"the derived {section} are out of range ({first['msg'].removeprefix('Value error, ')})"
    loc: tuple[str, ...]
    if section == "costs" and cluster.flops_per_s is not None:
        loc = ("cluster", "flops_per_s")
        fix = (
            f"cluster.flops_per_s {cluster.flops_per_s:g} FLOP/s is too small: give the accelerator's dense peak in "
            "FLOP/s (e.g. 9.895e14 for an H100-SXM in bf16), or name it in cluster.accelerator"
        )
        value: Any = cluster.flops_per_s
    elif section == "costs" and cluster.memory_bandwidth_bytes_per_s is not None:
        loc = ("cluster", "memory_bandwidth_bytes_per_s")
        fix = "give the memory bandwidth in bytes/s (e.g. 3.35e12 for an H100-SXM)"
        value = cluster.memory_bandwidth_bytes_per_s
    elif section == "memory" and cluster.memory_bytes is not None:
        loc = ("cluster", "memory_bytes")
        fix = "give the accelerator's memory in bytes"
        value = cluster.memory_bytes
    else:
        loc = ("model",)
        fix = "check the model's sizes (hidden_size, seq_length, micro_batch_size, num_layers)"
        value = None
    raise_field_errors("Problem", [(loc, f"{what}: {fix}", value)])


#: Field names a derived section's errors carry when raised by its own model (``Costs``, ``Memory``).
_DERIVED_FIELDS = ("forward", "backward_input", "backward_weight", "p2p", "activation", "retained_for_weight", "static")


def _derive_missing(value: Any) -> Any:
    return load_problem(value) if isinstance(value, Mapping) else value


#: A :class:`Problem` field (an HTTP request body) that accepts ``model``/``cluster`` in place of ``costs``/``memory``.
ProblemDocument = Annotated[Problem, BeforeValidator(_derive_missing)]
