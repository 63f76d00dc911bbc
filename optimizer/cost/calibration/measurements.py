"""Published (or a user's own) training runs: the rows the accelerator profiles are fitted to.

The format is documented in ``README.md`` beside this module; the published rows live in ``data/*.json``, one
file per source, each row with its source's URL, table and the date it was read.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pipesched.optimizer.accelerators import accelerator_names, get_accelerator
from pipesched.optimizer.configs import ModelConfig
from pipesched.optimizer.field_errors import StrictModel
from pipesched.optimizer.partition import megatron_partition

__all__ = [
    "CONTEXT_EXPERT_SOURCES",
    "Layout",
    "Measured",
    "Measurement",
    "MeasurementFile",
    "Software",
    "Source",
    "TrainingRun",
    "builtin_measurements",
    "fitting_measurements",
    "load_measurements",
    "parse_measurements",
]


class Source(StrictModel):
    """Where a file's rows come from (README: ``source``)."""

    id: str
    title: str
    url: str
    read: str = Field(description="Date the figures were copied, YYYY-MM-DD.")
    repository: str | None = None
    path: str | None = None
    commit: str | None = None
    committed: str | None = None
    tables: str | None = None
    notes: str = ""


class Layout(StrictModel):
    """The parallel layout of a run (README: ``layout.*``)."""

    data_parallel: int = Field(1, ge=1)
    sharding: Literal["none", "optimizer", "gradients", "full"] = "none"
    tensor_parallel: int = Field(1, ge=1)
    sequence_parallel: bool = True
    pipeline_parallel: int = Field(1, ge=1)
    stages_per_rank: int = Field(1, ge=1)
    schedule: str | None = Field(
        None, description="The pipeline's schedule family (a method name); needed with pipeline_parallel > 1."
    )
    context_parallel: int = Field(1, ge=1)
    expert_parallel: int = Field(1, ge=1)
    expert_tensor_parallel: int | None = Field(
        None,
        ge=1,
        description="GPUs splitting one routed expert (e_t, Megatron's --expert-tensor-parallel-size) as the run's "
        "recipe and framework version ran it; null: 1 with expert_parallel > 1, tensor_parallel otherwise.",
    )
    pipeline_split: Literal["balanced", "even", "embedding_and_loss"] | list[int] = Field(
        "balanced",
        description="How the run split its layers over the pipeline × virtual stages (model order): "
        '"balanced" (not stated: pipesched\'s own time-balanced partition), "even" (Megatron-Core without a '
        'layout), "embedding_and_loss" (Megatron\'s --account-for-embedding/loss-in-pipeline-split), or the '
        "layers of each stage as the run's layout states them.",
    )


class TrainingRun(StrictModel):
    """Precision, recomputation and batch of a run (README: ``training.*``)."""

    precision: Literal["bf16", "fp8"] = "bf16"
    activation_recomputation: Literal["none", "selective", "full"] = "none"
    micro_batch_size: int = Field(ge=1)
    num_microbatches: int = Field(1, ge=1)
    global_batch_size: int = Field(ge=1)


class Software(StrictModel):
    """What the framework did that changes speed (README: ``software.*``)."""

    framework: str = "torchtitan"
    compile: bool = False
    fused_kernels: bool = False
    async_tensor_parallel: bool = False
    gradient_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    attention_kernel: Literal["current", "flash-attn-2023", "cudnn"] = "current"
    moe_dispatcher: Literal["hierarchical", "all-to-all"] = "hierarchical"
    fsdp_backward_prefetch: Literal["BACKWARD_PRE", "BACKWARD_POST"] = "BACKWARD_PRE"
    fsdp_gradient_sync: Literal["every_microbatch", "last_microbatch"] = "every_microbatch"
    moe_all_to_all_overlap: bool = False
    mixed_precision: str | None = None
    compiled_loss: bool | None = None
    assumed: list[str] = Field(default_factory=list)
    notes: str | None = None


class Measured(StrictModel):
    """What the source reports (README: ``measured.*``)."""

    tokens_per_s_per_gpu: float = Field(gt=0)
    mfu: float | None = Field(None, gt=0, le=1)
    model_tflops_per_gpu: float | None = Field(None, gt=0)
    peak_memory_bytes: float | None = Field(None, gt=0)


class Measurement(StrictModel):
    """One training run (README: a row)."""

    id: str
    table: str = ""
    model: ModelConfig
    accelerator: str
    cluster: dict[str, Any] = Field(default_factory=dict)
    power_limit_w: float | None = Field(
        None,
        gt=0,
        description="The power limit the GPUs ran under where the source states one below the datasheet's TDP (W): "
        "their tensor cores sustain the profile's power_limited_peak of the datasheet peak.",
    )
    layout: Layout = Field(default_factory=Layout)
    training: TrainingRun
    software: Software = Field(default_factory=Software)
    measured: Measured
    published: dict[str, Any] = Field(default_factory=dict)
    source: str = Field("", description="The source's id (filled from the file).")

    @field_validator("accelerator")
    @classmethod
    def _known_accelerator(cls, name: str) -> str:
        try:
            get_accelerator(name)
        except KeyError:
            raise ValueError(
                f"unknown accelerator {name!r}: use one of {', '.join(accelerator_names())} (the catalogue, "
                "pipesched.optimizer.accelerators), with cluster.memory_bytes / flops_per_s where the part differs"
            ) from None
        return name

    @model_validator(mode="after")
    def _check_batch(self) -> Measurement:
        layout, run = self.layout, self.training
        if layout.pipeline_parallel > 1 and layout.schedule is None:
            raise ValueError(
                f"row {self.id}: pipeline_parallel {layout.pipeline_parallel} needs layout.schedule, the schedule "
                "family the run used (a method name of GET /v1/methods)"
            )
        if layout.data_parallel * run.num_microbatches * run.micro_batch_size != run.global_batch_size:
            raise ValueError(
                f"row {self.id}: data_parallel {layout.data_parallel} × num_microbatches {run.num_microbatches} × "
                f"micro_batch_size {run.micro_batch_size} ≠ global_batch_size {run.global_batch_size}: fix one of them"
            )
        split = self.layers_per_stage  # a Megatron rule that does not divide raises here
        stages = layout.pipeline_parallel * layout.stages_per_rank
        if split is not None and (len(split) != stages or sum(split) != self.model.num_layers or min(split) < 1):
            raise ValueError(
                f"row {self.id}: layout.pipeline_split {split} is not {stages} stages of at least one layer summing "
                f"to the model's {self.model.num_layers} layers"
            )
        return self

    @property
    def layers_per_stage(self) -> list[int] | None:
        """The run's layers per model stage (``layout.pipeline_split``: :func:`~pipesched.optimizer.partition.
        megatron_partition` for Megatron's rules); None where pipesched balances them itself."""
        layout = self.layout
        split = layout.pipeline_split
        if isinstance(split, list):
            return list(split)
        if split == "balanced" or layout.pipeline_parallel == 1:
            return None
        both = split == "embedding_and_loss"
        stages = layout.pipeline_parallel * layout.stages_per_rank
        return megatron_partition(self.model.num_layers, stages, account_for_embedding=both, account_for_loss=both)

    @property
    def num_gpus(self) -> int:
        """GPUs of the run: d · t · p · cp."""
        layout = self.layout
        return layout.data_parallel * layout.tensor_parallel * layout.pipeline_parallel * layout.context_parallel

    @property
    def key(self) -> str:
        """``source/id``: how reports cite the row."""
        return f"{self.source}/{self.id}" if self.source else self.id


class MeasurementFile(StrictModel):
    """A file of rows with their source."""

    source: Source | None = None
    rows: list[Measurement]


def parse_measurements(document: Any) -> list[Measurement]:
    """Rows of a measurement document: ``{"source", "rows"}`` or a bare list of rows.

    Raises:
        pydantic.ValidationError: a row or the source does not follow the format (README), with its path.
    """
    if isinstance(document, list):
        document = {"rows": document}
    parsed = MeasurementFile.model_validate(document)
    source_id = parsed.source.id if parsed.source is not None else ""
    return [row.model_copy(update={"source": row.source or source_id}) for row in parsed.rows]


def load_measurements(path: str | Path) -> list[Measurement]:
    """The rows of a measurement file (JSON).

    Raises:
        OSError: the file cannot be read. json.JSONDecodeError: it is not JSON.
        pydantic.ValidationError: as :func:`parse_measurements`.
    """
    return parse_measurements(json.loads(Path(path).read_text()))


@cache
def _builtin() -> tuple[Measurement, ...]:
    folder = resources.files("pipesched.optimizer.cost.calibration") / "data"
    rows: list[Measurement] = []
    for entry in sorted(folder.iterdir(), key=lambda item: item.name):
        if entry.name.endswith(".json"):
            rows.extend(parse_measurements(json.loads(entry.read_text())))
    return tuple(rows)


def builtin_measurements() -> list[Measurement]:
    """Every published row shipped with pipesched (``data/*.json``), sources in name order."""
    return list(_builtin())


#: The sources of published runs with context or expert parallelism (or a mixture-of-experts model): the check of
#: those cost terms (``bench/cpep_bench.py``), held out of the profile fit so that its error is a held-out error.
CONTEXT_EXPERT_SOURCES = (
    "megatron_bridge_cp_ep",
    "nemo_2407_h100_cp",
    "nemo_long_sequence",
    "torchtitan_h100_202412_cp",
    "llama3_herd_table4",
    "megatron_moe_model_zoo",
    "nemo_automodel_h100",
    "deepseek_v3_report",
    "nemo_2502_cp_ep",
)


def fitting_measurements() -> list[Measurement]:
    """The rows the accelerator profiles are fitted to: every built-in row but the context/expert-parallel
    sources (:data:`CONTEXT_EXPERT_SOURCES`)."""
    return [row for row in _builtin() if row.source not in CONTEXT_EXPERT_SOURCES]
