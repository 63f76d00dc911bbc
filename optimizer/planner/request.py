"""The plan request and answer of the contract (Plan: ``POST /v1/plans``, ``pipesched plan``) as pydantic models."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, WithJsonSchema

from pipesched.optimizer.configs import ClusterConfig, ModelConfig
from pipesched.optimizer.families import registry
from pipesched.optimizer.field_errors import StrictModel

__all__ = [
    "PLAN_METHODS",
    "RECOMPUTATION",
    "SHARDING",
    "DataParallelPlan",
    "Launch",
    "Plan",
    "PlanAnswer",
    "PlanRequest",
    "PlanSearch",
    "PlanTraining",
    "Rejected",
    "Searched",
]

SHARDING = ("none", "optimizer", "gradients", "full")
RECOMPUTATION = ("none", "selective", "full")
#: What ``search.method`` may name: ``auto`` and the families that declare a planner estimate.
PLAN_METHODS: tuple[str, ...] = ("auto", *(name for name, family in registry().items() if family.planner is not None))


def _plan_method(value: str) -> str:
    if value not in PLAN_METHODS:
        raise ValueError(f"{value!r} is not a method the planner tries: choose one of {', '.join(PLAN_METHODS)}")
    return value


PlanMethod = Annotated[
    str, AfterValidator(_plan_method), WithJsonSchema({"type": "string", "enum": list(PLAN_METHODS)})
]


class PlanTraining(StrictModel):
    """What the job fixes: the global batch."""

    global_batch_size: int = Field(
        ge=1, le=10_000_000, description="Sequences of model.seq_length tokens per optimizer step."
    )


class PlanSearch(StrictModel):
    """How to search, and which values each dimension may take (null: every value that makes sense).

    Each list restricts the plan field of the same name; one value pins it.
    """

    time_limit_s: float = Field(60.0, gt=0, le=3600, description="Wall-clock bound on the whole search, s.")
    top: int = Field(5, ge=1, le=100, description="Plans to return, best first.")
    explain: bool = Field(False, description="List the configurations that did not fit, with the reason.")
    sequence_parallel: bool = Field(True, description="Tensor parallelism with sequence parallelism.")
    pipeline_parallel: list[int] | None = Field(None, description="Allowed pipeline degrees.")
    tensor_parallel: list[int] | None = Field(None, description="Allowed tensor degrees (within a node).")
    data_parallel_size: list[int] | None = Field(None, description="Allowed data-parallel sizes.")
    sharding: list[Literal["none", "optimizer", "gradients", "full"]] | None = Field(
        None, description="Allowed data-parallel sharding levels."
    )
    stages_per_rank: list[int] | None = Field(None, description="Allowed model chunks per pipeline rank.")
    placement: list[Literal["loop", "v", "bidirectional"]] | None = Field(None, description="Allowed placements.")
    micro_batch_size: list[int] | None = Field(None, description="Allowed sequences per microbatch.")
    num_microbatches: list[int] | None = Field(None, description="Allowed microbatches per step and pipeline.")
    activation_recomputation: list[Literal["none", "selective", "full"]] | None = Field(
        None, description="Allowed recomputation modes."
    )
    method: list[PlanMethod] | None = Field(
        None, description=f"Allowed schedules: auto or families ({', '.join(PLAN_METHODS[1:])})."
    )


class PlanRequest(StrictModel):
    """The contract's plan request: model (a preset and overrides, or every field), cluster, batch, search."""

    model: ModelConfig
    cluster: ClusterConfig
    training: PlanTraining
    search: PlanSearch = Field(default_factory=PlanSearch)


class DataParallelPlan(StrictModel):
    """Data-parallel size and sharding level of a plan."""

    size: int
    sharding: str


class Launch(StrictModel):
    """How to run the plan: a torchtitan TOML fragment and a torchrun command line."""

    torchtitan: str
    torchrun: str


class Plan(StrictModel):
    """One ranked configuration with its simulated step (contract, Plan answer)."""

    pipeline_parallel: int
    tensor_parallel: int
    data_parallel: DataParallelPlan
    stages_per_rank: int
    placement: str
    micro_batch_size: int
    num_microbatches: int
    activation_recomputation: str
    method: str
    step_time_ms: float = Field(
        description="Simulated pipeline makespan + exposed data-parallel time + optimizer step."
    )
    tokens_per_s_per_gpu: float
    mfu: float = Field(description="Model FLOPs (6·N + 12·l·h·s per token) over the accelerators' peak.")
    peak_memory_bytes: float = Field(description="Highest rank's static + activation peak, bytes.")
    lower_bound_ms: float = Field(description="A bound no schedule of this configuration beats, ms.")
    schedule_id: str | None = None
    launch: Launch
    pipeline_makespan_ms: float = Field(description="The simulator's makespan of the pipeline schedule, ms.")
    data_parallel_exposed_ms: float = Field(description="Data-parallel collectives not hidden behind compute, ms.")
    optimizer_step_ms: float = Field(description="The optimizer step, ms.")


class Rejected(StrictModel):
    """A configuration that did not make it, and why (``search.explain``)."""

    configuration: dict[str, int | str]
    reason: str


class Searched(StrictModel):
    """Counts of the search: enumerated configurations, pruned by memory, pruned by bound, simulated."""

    enumerated: int = 0
    pruned_memory: int = 0
    pruned_bound: int = 0
    solved: int = 0
    unexplored: int = Field(0, description="Left when the time limit ended the search.")


class PlanAnswer(StrictModel):
    """The contract's plan answer."""

    id: str | None = None
    status: Literal["queued", "running", "done", "failed", "cancelled"] = "done"
    plans: list[Plan] = Field(default_factory=list)
    searched: Searched = Field(default_factory=Searched)
    explain: list[Rejected] | None = None
    elapsed_s: float = 0.0
    first_answer_s: float | None = Field(None, description="Seconds until the first ranked plan was known.")
    error: str | None = None
