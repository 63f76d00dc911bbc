"""The scheduling problem of ``docs/CONTRACT.md`` as pydantic models.

A :class:`Problem` describes one pipeline-parallel training step: how many ranks and
microbatches, which rank holds which stage (the placement), what every pass costs in
milliseconds, what it allocates in bytes, the per-rank memory limit, and what to optimise.

Validation errors name the field path (``costs.forward``) and say what would be valid.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, get_args

from pydantic import BeforeValidator, Field, field_validator, model_validator

from pipesched.optimizer.configs import ClusterConfig, ContextParallel, ExpertParallel, ModelConfig, TensorParallel
from pipesched.optimizer.field_errors import StrictModel as _Strict
from pipesched.optimizer.field_errors import raise_field_errors

__all__ = [
    "SHARDINGS",
    "Costs",
    "DataParallel",
    "Memory",
    "Optimizer",
    "Pipeline",
    "PlacementName",
    "Problem",
    "Sharding",
    "SolverOptions",
    "TensorParallel",
    "Training",
    "least_time_limit_s",
    "raise_field_errors",
    "stage_to_rank",
    "weight_version_memory",
]

#: A named placement (contract, Terms): how stages lie on ranks; an explicit list is the alternative.
PlacementName = Literal["loop", "v", "bidirectional"]

#: What is sharded over the data-parallel group (contract, Terms): ``none`` (DDP), ``optimizer`` (ZeRO-1),
#: ``gradients`` (ZeRO-2), ``full`` (ZeRO-3 / FSDP).
Sharding = Literal["none", "optimizer", "gradients", "full"]
#: Every sharding level, least sharded first.
SHARDINGS: tuple[Sharding, ...] = get_args(Sharding)
#: The optimizers (``torch.optim``) the runtime steps; what ``memory.static_optimizer`` names.
Optimizer = Literal["sgd", "adamw"]

#: The largest num_stages × num_microbatches a problem may have (each is 2–3 actions).
MAX_STAGE_MICROBATCHES = 1_000_000

#: Forward passes (num_stages × num_microbatches) pipesched compiles, searches minimally and answers per second
#: of ``solver.time_limit_s + 2``: a larger problem is refused, naming the time limit it needs. The work no search
#: can skip (compile, the sequential schedule, its bound and the answer) takes about 140 µs a pass on a quiet
#: 2-core machine and 350 µs with four busy processes beside it (8 ranks × 2 bidirectional stages × 460
#: microbatches: 1.0 s and 2.6 s); 2,000 a second keeps that loaded case within the limit + 2 s (3,000 did not).
PASSES_PER_SECOND = 2_000


def least_time_limit_s(num_stages: int, num_microbatches: int) -> float:
    """The least ``solver.time_limit_s`` (s) admitted for ``num_stages × num_microbatches`` forward passes:
    ``passes / PASSES_PER_SECOND − 2``, 0 when any limit is."""
    return max(0.0, num_stages * num_microbatches / PASSES_PER_SECOND - 2.0)


#: The most work (ms) one step may hold in total: num_microbatches × Σ over stages of F + I + W + 2·p2p. About
#: 31 years; above it costs were surely given in another unit, and sums of them lose float precision.
MAX_STEP_MS = 1e12

#: The most activation and static memory (bytes) one rank may be asked to account for: static plus
#: num_microbatches × Σ over its stages of activation (10²¹ B, a zettabyte).
MAX_RANK_BYTES = 1e21

NonNegative = Annotated[float, Field(ge=0)]


def _number_or_list(value: Any) -> Any:
    """Accept a number ≥ 0 or a list of numbers ≥ 0, with one clear message otherwise."""
    items = value if isinstance(value, list) else [value]
    for position, item in enumerate(items):
        if isinstance(item, bool) or not isinstance(item, int | float) or not math.isfinite(item):
            where = f" (entry {position})" if isinstance(value, list) else ""
            raise ValueError(f"expected a number ≥ 0 or a list of numbers ≥ 0, got {item!r}{where}")
        if item < 0:
            where = f" (entry {position})" if isinstance(value, list) else ""
            raise ValueError(f"must not be negative, got {item!r}{where}: give a time in ms or a size in bytes ≥ 0")
    if isinstance(value, list) and not value:
        raise ValueError("an empty list: give a single number or one value per stage/rank")
    return value


#: A cost or size that is either one number for every stage or a list with one value per stage.
PerStage = Annotated[float | list[float], BeforeValidator(_number_or_list)]
#: A per-rank number or list.
PerRank = Annotated[float | list[float], BeforeValidator(_number_or_list)]


def _placement_kind(value: Any) -> Any:
    """One message for a placement that is neither a known name nor a list (pydantic gave one per union member)."""
    if isinstance(value, str) and value not in get_args(PlacementName):
        raise ValueError(
            f'{value!r} is not a placement: use "loop", "v", "bidirectional" or a list of ranks, one per stage'
        )
    if not isinstance(value, str | list):
        raise ValueError(f'expected "loop", "v", "bidirectional" or a list of ranks, one per stage; got {value!r}')
    for stage, rank in enumerate(value if isinstance(value, list) else []):
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise ValueError(f"entry {stage}: expected the rank of stage {stage} (an integer), got {rank!r}")
    return value


def stage_to_rank(num_ranks: int, stages_per_rank: int, placement: str | list[int]) -> list[int]:
    """The rank of every stage id: the one placement rule (contract, Terms: placement).

    ``"loop"``: stage s on rank ``s % num_ranks``; ``"v"`` (two stages per rank): stages r and
    ``2·num_ranks − 1 − r`` on rank r; ``"bidirectional"``: ids ``0 … S−1`` are replica 0 in the V placement and
    ids ``S … 2S−1`` replica 1, mirrored (id ``S + s`` on rank ``num_ranks − 1 − rank(s)``); a list is the map.

    Returns:
        ``num_ranks · stages_per_rank`` ranks, twice that for ``"bidirectional"``.

    Raises:
        ValueError: a placement name that is none of these.
    """
    p, num_stages = num_ranks, num_ranks * stages_per_rank
    if isinstance(placement, list):
        return list(placement)
    if placement == "loop":
        return [s % p for s in range(num_stages)]
    v = [s if s < p else 2 * p - 1 - s for s in range(num_stages)]
    if placement == "v":
        return v
    if placement == "bidirectional":
        return v + [p - 1 - r for r in v]
    raise ValueError(f'unknown placement {placement!r}: use "loop", "v", "bidirectional" or a list of ranks')


class Pipeline(_Strict):
    """Ranks, microbatches and the placement of stages on ranks.

    ``num_stages = num_ranks * stages_per_rank`` model stages. Placements (contract, Terms):
    ``"loop"`` puts stage s on rank ``s % num_ranks``; ``"v"`` needs ``stages_per_rank == 2`` and puts
    stages r and ``2*num_ranks-1-r`` on rank r; ``"bidirectional"`` runs two model replicas in
    opposite directions (BitPipe): replica 0 uses the V placement over stage ids ``0 … num_stages-1``,
    replica 1 its mirror image over ids ``num_stages … 2*num_stages-1``, and microbatches
    ``0 … ceil(m/2)-1`` go through replica 0, the rest through replica 1. An explicit list gives
    ``placement[s]`` = rank of stage s.
    """

    num_ranks: int = Field(ge=1, le=1024, description="Pipeline-parallel ranks (GPUs).")
    num_microbatches: int = Field(ge=1, le=100_000, description="Microbatches per training step.")
    stages_per_rank: int = Field(1, ge=1, le=64, description="Model stages (chunks) held by each rank.")
    placement: Annotated[PlacementName | list[int], BeforeValidator(_placement_kind)] = Field(
        "loop", description='"loop", "v", "bidirectional", or an explicit stage→rank list.'
    )

    @property
    def num_stages(self) -> int:
        """Model stages: ``num_ranks * stages_per_rank``."""
        return self.num_ranks * self.stages_per_rank

    @property
    def stage_to_rank(self) -> list[int]:
        """The rank of every stage id (:func:`stage_to_rank`; ``2 · num_stages`` ids for ``"bidirectional"``)."""
        return stage_to_rank(self.num_ranks, self.stages_per_rank, self.placement)

    def stage_holders(self) -> list[list[int]]:
        """For every model stage, the ranks holding a copy: one, or two under ``"bidirectional"`` (one per
        replica)."""
        ranks, num_stages = self.stage_to_rank, self.num_stages
        if len(ranks) == num_stages:
            return [[rank] for rank in ranks]
        return [sorted({ranks[s], ranks[num_stages + s]}) for s in range(num_stages)]

    @model_validator(mode="after")
    def _check_placement(self) -> Pipeline:
        errors: list[tuple[tuple[str | int, ...], str, Any]] = []
        passes = self.num_stages * self.num_microbatches
        if passes > MAX_STAGE_MICROBATCHES:
            errors.append(
                (
                    ("num_microbatches",),
                    f"{self.num_stages} stages × {self.num_microbatches} microbatches = {passes:,} forward passes, "
                    f"more than the {MAX_STAGE_MICROBATCHES:,} pipesched plans: use fewer microbatches or stages",
                    self.num_microbatches,
                )
            )
        placement = self.placement
        if placement in ("v", "bidirectional") and self.stages_per_rank != 2:
            errors.append(
                (
                    ("stages_per_rank",),
                    f'placement "{placement}" needs stages_per_rank 2 (rank r holds stages r and '
                    f"2*num_ranks-1-r), got {self.stages_per_rank}: set stages_per_rank to 2 "
                    'or use placement "loop"',
                    self.stages_per_rank,
                )
            )
        if isinstance(placement, list):
            if len(placement) != self.num_stages:
                errors.append(
                    (
                        ("placement",),
                        f"an explicit placement lists one rank per stage: expected {self.num_stages} "
                        f"entries (num_ranks {self.num_ranks} × stages_per_rank {self.stages_per_rank}), "
                        f"got {len(placement)}",
                        placement,
                    )
                )
            else:
                for stage, rank in enumerate(placement):
                    if not 0 <= rank < self.num_ranks:
                        errors.append(
                            (
                                ("placement", stage),
                                f"stage {stage} is placed on rank {rank}, but ranks are 0 … {self.num_ranks - 1}",
                                rank,
                            )
                        )
                empty = sorted(set(range(self.num_ranks)) - set(placement))
                if empty and not errors:
                    errors.append(
                        (
                            ("placement",),
                            f"rank(s) {empty} hold no stage: every rank must hold at least one stage",
                            placement,
                        )
                    )
        raise_field_errors("Pipeline", errors)
        return self


class Costs(_Strict):
    """Per-pass times in milliseconds: one number for every stage, or a list with one per stage."""

    forward: PerStage = Field(description="F: forward pass time, ms.")
    backward_input: PerStage = Field(description="I: backward for the input gradient, ms.")
    backward_weight: PerStage = Field(description="W: backward for the weight gradient, ms.")
    p2p: PerStage = Field(
        0.0, description="Latency of one activation or gradient transfer out of a stage to another rank, ms."
    )
    unshard: PerStage | None = Field(
        None, description="UNSHARD: all-gather of a stage's sharded weights over the data-parallel group, ms."
    )
    reduce_grad: PerStage | None = Field(
        None,
        description="REDUCE_GRAD: all-reduce or reduce-scatter of a stage's gradients over the data-parallel group, ms",
    )
    optimizer_step: PerRank | None = Field(None, description="OPTIMIZER_STEP: one rank's optimizer step, ms.")
    unshard_wait: PerStage | None = Field(
        None,
        description=(
            "A stage's UNSHARD waits this long for its last data-parallel replica before it runs (not in the "
            "contract): the replicas of a rank reach a collective at different instants and it starts when the last "
            "one enters it; the mean over replicas of (last entry − own entry), ms. None or 0: it starts at once. "
            "`pipesched profile --data-parallel D` measures it on its calibration run."
        ),
    )
    reduce_grad_wait: PerStage | None = Field(
        None,
        description=(
            "A stage's REDUCE_GRAD waits this long for its last data-parallel replica before it runs, as "
            "unshard_wait (not in the contract), ms."
        ),
    )
    profiled_model: str | None = Field(
        None,
        max_length=300,
        description=(
            "The model these costs were measured on (not in the contract): `pipesched profile --model` writes its "
            "--model (gpt-tiny, …, module:function); `pipesched run` says whether its ranks ran it. null: costs as "
            "written, measured on no model pipesched knows."
        ),
    )
    overlap_slowdown: float = Field(
        0.0,
        ge=0,
        le=10,
        description=(
            "Compute beside communication (not in the contract): while a rank's communication stream runs an "
            "UNSHARD or REDUCE_GRAD, that rank's passes and optimizer step progress at 1/(1 + overlap_slowdown) "
            "speed (GPUs: shared SMs and memory bandwidth; CPUs: the collective's thread on the rank's core). "
            "0 (default): no slowdown. `pipesched profile` measures it for data-parallel profiles and writes it with "
            "--overlap-slowdown."
        ),
    )
    communication_slowdown: float = Field(
        0.0,
        ge=0,
        le=10,
        description=(
            "Communication beside compute (not in the contract): while one of a rank's passes or its optimizer step "
            "runs, that rank's UNSHARD and REDUCE_GRAD progress at 1/(1 + communication_slowdown) speed (CPUs: the "
            "passes take the core the collective's threads need; GPUs: the GEMMs take the SMs and memory bandwidth "
            "the collective's kernels need). costs.unshard / costs.reduce_grad are then a collective's time with "
            "nothing beside it. 0 (default): a collective takes its cost whatever runs beside it. `pipesched "
            "profile` measures it for data-parallel profiles on its calibration run."
        ),
    )


class Memory(_Strict):
    """Activation memory in bytes (contract, Problem).

    F allocates ``activation``; I frees ``activation − retained_for_weight``; W frees
    ``retained_for_weight``; a fused B frees all of it. ``limit`` and ``static`` are per rank.
    """

    activation: PerStage = Field(description="Bytes a stage's F allocates for one microbatch.")
    retained_for_weight: PerStage = Field(0.0, description="Bytes kept after I until W.")
    limit: PerRank | None = Field(None, description="Per-rank memory limit in bytes, counting static; null for none.")
    static: PerRank = Field(0.0, description="Per-rank bytes always held (weights, gradients, optimizer state).")
    weights: PerStage | None = Field(
        None,
        description="Bytes of one stage's unsharded weights. With data_parallel.sharding full, UNSHARD holds the "
        "gathered (d−1)/d of them until RESHARD; static counts the shard. null: gathered weights not counted.",
    )
    gradients: PerStage | None = Field(
        None,
        description="Bytes of one stage's unsharded gradient buffer. With sharding gradients or full, static counts "
        "the whole buffer and REDUCE_GRAD frees (d−1)/d of it. null: gradient frees not counted.",
    )
    static_optimizer: Optimizer | None = Field(
        None,
        description="The optimizer whose state static counts (sgd: none; adamw: two moments per parameter), as "
        "pipesched profile --optimizer measured it; pipesched run steps it unless told otherwise. null: not said.",
    )


class DataParallel(_Strict):
    """The data-parallel group (contract, Terms): ``size`` copies of the whole pipeline; rank r of every copy
    holds the same stages. ``sharding``: ``none`` (DDP, gradients all-reduced), ``optimizer`` (ZeRO-1),
    ``gradients`` (ZeRO-2, gradients reduce-scattered), ``full`` (ZeRO-3 / FSDP, weights gathered before use).
    """

    size: int = Field(1, ge=1, le=1_000_000, description="Data-parallel degree d (copies of the pipeline).")
    sharding: Sharding = Field("none", description="What is sharded over the data-parallel group.")
    reshard_after_forward: bool = Field(
        False,
        description="With sharding full: free gathered weights after every F and gather them again before every "
        "backward (FSDP2; breadth-first schedules keep them over a run of microbatches).",
    )
    overlap_grad_reduce: bool = Field(
        True,
        description="Each stage's REDUCE_GRAD right after its last backward, overlapping the rest of the step "
        "(PyTorch, Megatron-LM's overlap_grad_reduce); false: every reduction after the rank's last pass "
        "(Megatron-LM before overlap_grad_reduce, the breadth-first paper's baseline).",
    )
    reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="Gradients reduced in \"fp32\" (torchtitan's FSDP reduce_dtype, Megatron's grad_reduce_in_fp32) "
        "or \"bf16\" (Megatron-LM's and NeMo's default, FSDP's pure bf16).",
    )

    @model_validator(mode="after")
    def _check_reshard(self) -> DataParallel:
        if self.reshard_after_forward and self.sharding != "full":
            raise_field_errors(
                "DataParallel",
                [
                    (
                        ("reshard_after_forward",),
                        f'reshard_after_forward needs sharding "full" (only sharded weights are gathered), got '
                        f'{self.sharding!r}: set sharding to "full" or reshard_after_forward to false',
                        True,
                    )
                ],
            )
        return self


class Training(_Strict):
    """How steps follow each other (contract, Problem: training).

    ``flush: false`` with ``weight_versions: 2`` is PipeDream-2BW (no flush, double-buffered weights,
    W(t+1) = W(t) − ν·∇f(W(t−1)); Narayanan et al. 2020, §3). ``post_validation`` is the Zero Bubble
    paper's optimizer post-validation (Qi et al. 2023, §4): no global synchronisation before the step; without
    a flush it changes nothing (PipeDream-2BW's ranks update on their own, with no end-of-step barrier).
    """

    flush: bool = Field(True, description="A pipeline flush (and a synchronous optimizer step) ends every step.")
    weight_versions: int = Field(
        1, ge=1, le=2, description="Weight versions kept: 1, or 2 for PipeDream-2BW (the default with flush false)."
    )
    post_validation: bool = Field(False, description="Zero Bubble's optimizer post-validation (§4).")

    @model_validator(mode="after")
    def _check_versions(self) -> Training:
        if not self.flush and "weight_versions" not in self.model_fields_set:
            self.weight_versions = 2  # no flush: the next step starts on the old weights (PipeDream-2BW)
        if self.flush and self.weight_versions != 1:
            raise_field_errors(
                "Training",
                [
                    (
                        ("weight_versions",),
                        f"weight_versions {self.weight_versions} needs flush: false (a flushed step uses one weight "
                        "version): set training.flush to false for PipeDream-2BW, or weight_versions to 1",
                        self.weight_versions,
                    )
                ],
            )
        return self


class SolverOptions(_Strict):
    """How to find the schedule."""

    method: str = Field(
        "auto",
        min_length=1,
        max_length=64,
        description='"auto" searches; a family name generates that schedule (GET /v1/methods lists them).',
    )
    time_limit_s: float = Field(10.0, gt=0, le=86_400, description="Wall-clock bound on the search, s.")
    backends: list[Annotated[str, Field(min_length=1, max_length=64)]] | None = Field(
        None, description="Backends the auto portfolio may use (heuristic, cpsat, milp); null for all."
    )
    seed: int = Field(0, ge=0, description="Seed for randomised search steps.")

    @field_validator("time_limit_s", mode="before")
    @classmethod
    def _finite_time_limit(cls, value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"must be a finite number of seconds (0 < time_limit_s ≤ 86400), got {value}: e.g. 10")
        return value


class Problem(_Strict):
    """One scheduling problem (contract, Problem).

    Give ``costs`` and ``memory``; a document with ``model`` and ``cluster`` instead is loaded by
    :func:`pipesched.optimizer.derive.load_problem`, which derives them first. Per-stage lists have
    ``pipeline.num_stages`` entries, per-rank lists ``pipeline.num_ranks``.

    Raises:
        pydantic.ValidationError: with the field path and a sentence saying what is valid.
    """

    pipeline: Pipeline
    costs: Costs | None = None
    memory: Memory | None = None
    model: ModelConfig | None = None
    cluster: ClusterConfig | None = None
    data_parallel: DataParallel | None = Field(None, description="The data-parallel group; none means size 1.")
    tensor_parallel: TensorParallel | None = Field(
        None, description="Megatron tensor parallelism of every stage (with model/cluster); none means size 1."
    )
    context_parallel: ContextParallel | None = Field(
        None,
        description="Context parallelism of every stage (with model/cluster); none means size 1. data_parallel.size "
        "then counts the d·c copies of each stage's weights.",
    )
    expert_parallel: ExpertParallel | None = Field(
        None, description="Expert parallelism of the mixture-of-experts layers (with model/cluster); none means 1."
    )
    training: Training = Field(default_factory=Training, description="Flush, weight versions, post-validation.")
    split_backward: bool = Field(True, description="Split backward into I and W (false: fused B).")
    objective: Literal["makespan", "stage_span", "step_time", "step_period"] = Field(
        "makespan",
        description=(
            'What to minimise. "step_period" (the steady-state time per step) goes with training.flush false; '
            'there an omitted objective or "makespan" reads as "step_period".'
        ),
    )
    solver: SolverOptions = Field(default_factory=SolverOptions)

    @model_validator(mode="after")
    def _resolve_and_check(self) -> Problem:
        if self.costs is None or self.memory is None:
            missing = [name for name in ("costs", "memory") if getattr(self, name) is None]
            if self.model is None or self.cluster is None:
                hint = "give costs and memory, or model and cluster to derive them"
            else:
                hint = (
                    "costs and memory are derived from model and cluster by "
                    "pipesched.optimizer.derive.load_problem (the CLI and the HTTP service call it): load the "
                    "problem with it instead of Problem.model_validate"
                )
            raise_field_errors("Problem", [((missing[0],), f"missing {' and '.join(missing)}: {hint}", None)])
        self._check_model_parallel_sections()
        self._check_lengths()
        self._check_training()
        self._check_magnitudes()
        self._check_size_for_time()
        return self

    def _check_model_parallel_sections(self) -> None:
        """``tensor_parallel``, ``context_parallel`` and ``expert_parallel`` shape the costs and memory derived
        from ``model`` and ``cluster`` (:func:`pipesched.optimizer.derive.load_problem`); beside costs given
        without them they would change nothing, so a degree above 1 there is refused rather than ignored.

        Raises:
            pydantic.ValidationError: naming the section and the two ways to fix it.
        """
        if self.model is not None and self.cluster is not None:
            return
        errors: list[tuple[tuple[str | int, ...], str, Any]] = [
            (
                (name, "size"),
                f"{name}.size {section.size} shapes only costs derived from model and cluster, and this problem "
                "gives its costs without them, so it would be ignored: put the parallelism's effect in costs and "
                f"memory and drop {name}, or give model and cluster instead of costs",
                section.size,
            )
            for name in ("tensor_parallel", "context_parallel", "expert_parallel")
            if (section := getattr(self, name)) is not None and section.size > 1
        ]
        raise_field_errors("Problem", errors)

    def _check_training(self) -> None:
        """Flush, weight versions and objective agree (contract, Problem: training).

        A problem with ``flush: false`` optimises ``step_period`` when its objective is left out or is the
        default ``makespan``; ``stage_span`` is rejected there. Whether ``solver.method`` suits ``training.flush``
        is the families' to say (:func:`pipesched.optimizer.families.method_field_errors`, added by
        :func:`pipesched.optimizer.derive.load_problem`).
        """
        if not self.training.flush and ("objective" not in self.model_fields_set or self.objective == "makespan"):
            # The default objective, makespan, has no meaning for an endless run: its time per step is read.
            self.objective = "step_period"
        errors: list[tuple[tuple[str | int, ...], str, Any]] = []
        if self.training.flush:
            if self.objective == "step_period":
                errors.append(
                    (
                        ("objective",),
                        "objective step_period is the steady-state time per step of a schedule without flushes: "
                        'set training.flush to false (PipeDream-2BW), or use objective "makespan" or "stage_span"',
                        self.objective,
                    )
                )
        else:
            dp = self.data_parallel
            if dp is not None and dp.size > 1 and dp.sharding in ("gradients", "full"):
                errors.append(
                    (
                        ("data_parallel", "sharding"),
                        f"a schedule without flushes (PipeDream-2BW) all-reduces each stage's gradients every step "
                        f"and keeps two whole weight versions; sharding {dp.sharding!r} (sharded gradients or "
                        'weights) is not modelled with them: use sharding "none" or "optimizer", or set '
                        "training.flush to true",
                        dp.sharding,
                    )
                )
            if self.pipeline.placement == "bidirectional":
                errors.append(
                    (
                        ("pipeline", "placement"),
                        'placement "bidirectional" runs two replicas with a flush; schedules without flushes are '
                        'planned for "loop", "v" or an explicit placement: set training.flush to true or change '
                        "the placement",
                        "bidirectional",
                    )
                )
            if self.training.weight_versions != 2:
                errors.append(
                    (
                        ("training", "weight_versions"),
                        "training.flush false needs weight_versions 2: without a flush the next step's forwards "
                        "start before this step's update, so a rank keeps two weight versions (PipeDream-2BW)",
                        self.training.weight_versions,
                    )
                )
            if self.objective != "step_period":
                errors.append(
                    (
                        ("objective",),
                        f"objective {self.objective} measures one flushed step; a schedule without flushes repeats, "
                        'and its time per step is the step_period: set objective to "step_period" or leave it out',
                        self.objective,
                    )
                )
        raise_field_errors("Problem", errors)

    def _check_magnitudes(self) -> None:
        """Refuse costs or sizes whose totals overflow or leave float precision (schedules must serialise)."""
        assert self.costs is not None and self.memory is not None
        m = self.pipeline.num_microbatches
        errors: list[tuple[tuple[str | int, ...], str, Any]] = []
        parts = {
            name: self.stage_values(getattr(self.costs, name))
            for name in ("forward", "backward_input", "backward_weight", "p2p")
        }
        weights = {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0, "p2p": 2.0}
        sums = {name: weights[name] * sum(values) * m for name, values in parts.items()}
        total_ms = sum(sums.values())
        if not total_ms <= MAX_STEP_MS:
            culprit = max(sums, key=lambda name: sums[name])
            errors.append(
                (
                    ("costs", culprit),
                    f"the step's total work, num_microbatches {m} × Σ over stages of (forward + backward_input + "
                    f"backward_weight + 2·p2p), is {total_ms:.3g} ms, beyond the {MAX_STEP_MS:.0e} ms (about 31 "
                    f"years) pipesched computes with; costs.{culprit} contributes most: give times in milliseconds",
                    getattr(self.costs, culprit),
                )
            )
        # Every rank's peak is at most its static bytes + every microbatch's activation on every stage (twice
        # for the two replicas of a bidirectional placement).
        replicas = 2 if self.pipeline.placement == "bidirectional" else 1
        activations = replicas * m * sum(self.stage_values(self.memory.activation))
        static = max(self.static_memory)
        total_bytes = static + activations
        if not total_bytes <= MAX_RANK_BYTES:
            culprit = "static" if static >= activations else "activation"
            errors.append(
                (
                    ("memory", culprit),
                    f"a rank may hold up to {total_bytes:.3g} bytes (static + num_microbatches {m} × the stages' "
                    f"activations), beyond the {MAX_RANK_BYTES:.0e} bytes pipesched computes with: give "
                    f"memory.{culprit} in bytes",
                    getattr(self.memory, culprit),
                )
            )
        raise_field_errors("Problem", errors)

    def _check_size_for_time(self) -> None:
        """Refuse a problem too large to compile and answer within ``solver.time_limit_s`` + 2 s."""
        passes = self.pipeline.num_stages * self.pipeline.num_microbatches
        time_limit = self.solver.time_limit_s
        most = int(PASSES_PER_SECOND * (time_limit + 2.0))
        if passes <= most:
            return
        needed = math.ceil(least_time_limit_s(self.pipeline.num_stages, self.pipeline.num_microbatches))
        raise_field_errors(
            "Problem",
            [
                (
                    ("pipeline", "num_microbatches"),
                    f"{self.pipeline.num_stages} stages × {self.pipeline.num_microbatches} microbatches = "
                    f"{passes:,} forward passes, more than the {most:,} pipesched can schedule and answer within "
                    f"solver.time_limit_s {time_limit:g} s ({PASSES_PER_SECOND:,} per second of the limit + 2 s): "
                    f"raise solver.time_limit_s to at least {needed} s, or use fewer microbatches or stages",
                    self.pipeline.num_microbatches,
                )
            ],
        )

    def _check_lengths(self) -> None:
        assert self.costs is not None and self.memory is not None
        num_stages = self.pipeline.num_stages
        num_ranks = self.pipeline.num_ranks
        shape = f"num_ranks {num_ranks} × stages_per_rank {self.pipeline.stages_per_rank}"
        errors: list[tuple[tuple[str | int, ...], str, Any]] = []
        per_stage = [
            ("costs", "forward", self.costs.forward),
            ("costs", "backward_input", self.costs.backward_input),
            ("costs", "backward_weight", self.costs.backward_weight),
            ("costs", "p2p", self.costs.p2p),
            ("memory", "activation", self.memory.activation),
            ("memory", "retained_for_weight", self.memory.retained_for_weight),
            ("costs", "unshard", self.costs.unshard),
            ("costs", "reduce_grad", self.costs.reduce_grad),
            ("memory", "weights", self.memory.weights),
            ("memory", "gradients", self.memory.gradients),
        ]
        for section, name, value in per_stage:
            if isinstance(value, list) and len(value) != num_stages:
                errors.append(
                    (
                        (section, name),
                        f"{section}.{name} has {len(value)} values but the pipeline has {num_stages} "
                        f"stages ({shape}): give one value per stage or a single number",
                        value,
                    )
                )
        per_rank: list[tuple[str, str, float | list[float] | None]] = [
            ("memory", "limit", self.memory.limit),
            ("memory", "static", self.memory.static),
            ("costs", "optimizer_step", self.costs.optimizer_step),
        ]
        for section, name, rank_value in per_rank:
            if isinstance(rank_value, list) and len(rank_value) != num_ranks:
                errors.append(
                    (
                        (section, name),
                        f"{section}.{name} has {len(rank_value)} values but there are {num_ranks} ranks: give "
                        "one value per rank or a single number",
                        rank_value,
                    )
                )
        if not errors:
            activation = self.stage_values(self.memory.activation)
            retained = self.stage_values(self.memory.retained_for_weight)
            for stage, (act, ret) in enumerate(zip(activation, retained, strict=True)):
                if ret > act:
                    loc: tuple[str | int, ...] = ("memory", "retained_for_weight")
                    if isinstance(self.memory.retained_for_weight, list):
                        loc = (*loc, stage)
                    errors.append(
                        (
                            loc,
                            f"stage {stage} retains {ret:g} bytes for W but its F allocates only {act:g}: "
                            "retained_for_weight must not exceed activation",
                            ret,
                        )
                    )
                    break
            compute = [
                f + i + w
                for f, i, w in zip(
                    self.stage_values(self.costs.forward),
                    self.stage_values(self.costs.backward_input),
                    self.stage_values(self.costs.backward_weight),
                    strict=True,
                )
            ]
            if max(compute) <= 0:
                errors.append(
                    (
                        ("costs",),
                        "every pass costs 0 ms: give forward/backward times greater than zero",
                        None,
                    )
                )
        errors.extend(self._data_parallel_errors())
        raise_field_errors("Problem", errors)

    def _data_parallel_errors(self) -> list[tuple[tuple[str | int, ...], str, Any]]:
        """With d > 1 the collective costs must be given (derived from model/cluster by load_problem)."""
        assert self.costs is not None
        dp = self.data_parallel
        if self.pipeline.placement == "bidirectional" and self.costs.reduce_grad is None:
            return [
                (
                    ("costs", "reduce_grad"),
                    'placement "bidirectional" keeps two model replicas whose copies of a stage all-reduce their '
                    "gradients between mirrored ranks (BitPipe's eager synchronisation, over 2·d ranks): give "
                    "costs.reduce_grad (ms per stage; 0 leaves it out of the model), or give model and cluster "
                    "instead of costs so pipesched derives it",
                    None,
                )
            ]
        if dp is None or dp.size == 1:
            if dp is not None and dp.sharding != "none":
                return [
                    (
                        ("data_parallel", "sharding"),
                        f'sharding "{dp.sharding}" needs data_parallel.size > 1 (there is nothing to shard over '
                        'one copy): set size to the number of pipeline copies, or sharding to "none"',
                        dp.sharding,
                    )
                ]
            return []
        needed = ["reduce_grad"] + (["unshard"] if dp.sharding == "full" else [])
        errors = self._gradient_buffer_errors(dp)
        return errors + [
            (
                ("costs", name),
                f"a data_parallel section (size {dp.size}, sharding {dp.sharding!r}) with costs that omit the "
                f"collectives: give costs.{name} (ms per stage, a number or one per stage), or give model and "
                "cluster instead of costs so pipesched derives them",
                None,
            )
            for name in needed
            if getattr(self.costs, name) is None
        ]

    def _gradient_buffer_errors(self, dp: DataParallel) -> list[tuple[tuple[str | int, ...], str, Any]]:
        """REDUCE_GRAD frees (d−1)/d of ``memory.gradients`` from ``static``: static must hold them."""
        assert self.memory is not None
        if self.memory.gradients is None or dp.sharding not in ("gradients", "full"):
            return []
        pipeline = self.pipeline
        p, num_stages = pipeline.num_ranks, pipeline.num_stages
        ranks = pipeline.stage_to_rank
        gradients = self.stage_values(self.memory.gradients)
        freed = [0.0] * p
        for stage, rank in enumerate(ranks):
            freed[rank] += gradients[stage % num_stages] * (dp.size - 1) / dp.size
        static = self.static_memory
        for rank in range(p):
            if freed[rank] > static[rank] * (1 + 1e-9) + 1e-6:
                return [
                    (
                        ("memory", "static"),
                        f"rank {rank}'s REDUCE_GRADs free {freed[rank]:.0f} bytes of gradients (memory.gradients × "
                        f"(d−1)/d with sharding {dp.sharding!r}), more than its static {static[rank]:.0f} bytes: "
                        "static counts each stage's whole gradient buffer: raise"
                        " memory.static or lower memory.gradients",
                        self.memory.static,
                    )
                ]
        return []

    # -- helpers -------------------------------------------------------------------------------

    def stage_values(self, value: float | list[float]) -> list[float]:
        """Expand a number-or-list field into one float per model stage (length ``num_stages``)."""
        if isinstance(value, list):
            return [float(v) for v in value]
        return [float(value)] * self.pipeline.num_stages

    def rank_values(self, value: float | list[float] | None, default: float) -> list[float]:
        """Expand a number-or-list per-rank field (``None`` → ``default``) to ``num_ranks`` floats."""
        if value is None:
            return [default] * self.pipeline.num_ranks
        if isinstance(value, list):
            return [float(v) for v in value]
        return [float(value)] * self.pipeline.num_ranks

    @property
    def data_parallel_size(self) -> int:
        """d: copies of the pipeline (1 without a data_parallel section)."""
        return 1 if self.data_parallel is None else self.data_parallel.size

    @property
    def data_parallel_group(self) -> DataParallel:
        """The data-parallel group the problem is solved for (size 1, no sharding, without a section)."""
        return self.data_parallel or DataParallel()

    @property
    def replicas_synchronise(self) -> bool:
        """Whether the two replicas of a bidirectional placement all-reduce their gradients with a cost
        (BitPipe's eager gradient synchronisation, Wu et al. 2024, Sec. 3.3): ``costs.reduce_grad`` > 0."""
        assert self.costs is not None
        reduce_grad = self.costs.reduce_grad
        return (
            self.pipeline.placement == "bidirectional"
            and reduce_grad is not None
            and max(self.stage_values(reduce_grad)) > 0
        )

    @property
    def has_step_actions(self) -> bool:
        """Whether the step has communication actions or optimizer steps (d > 1, an optimizer cost, or the
        replicas' gradient synchronisation of a bidirectional placement)."""
        assert self.costs is not None
        return self.data_parallel_size > 1 or self.costs.optimizer_step is not None or self.replicas_synchronise

    @property
    def memory_limits(self) -> list[float]:
        """Per-rank limit in bytes (``inf`` where none is set)."""
        assert self.memory is not None
        return self.rank_values(self.memory.limit, math.inf)

    @property
    def static_memory(self) -> list[float]:
        """Per-rank static bytes."""
        assert self.memory is not None
        return self.rank_values(self.memory.static, 0.0)

    def with_changes(self, **changes: Any) -> Problem:
        """A validated copy with top-level or dotted fields replaced, e.g. ``{"memory.limit": 1e9}``."""
        data = self.model_dump(mode="json")
        for key, value in changes.items():
            target = data
            parts = key.split(".")
            for part in parts[:-1]:
                target = target[part]
            target[parts[-1]] = value
        return Problem.model_validate(data)

    def canonical_json(self) -> str:
        """The problem as solved (costs and memory filled in), with sorted keys: the cache key's input."""
        import json

        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def weight_version_memory(problem: Problem) -> list[float]:
    """Per-rank bytes held beyond ``memory.static`` for the extra weight versions (PipeDream-2BW, Narayanan
    et al. 2020, §3.1): ``(weight_versions − 1) × Σ memory.weights`` over the rank's stages — weights only (one
    gradient buffer and one optimizer state stay in ``static``), the shard of them (1/d) with
    ``data_parallel.sharding: full``; ``× static`` when ``memory.weights`` is not given (an upper bound)."""
    assert problem.memory is not None
    extra = problem.training.weight_versions - 1
    if extra == 0:
        return [0.0] * problem.pipeline.num_ranks
    if problem.memory.weights is None:
        return [extra * s for s in problem.static_memory]
    weights = problem.stage_values(problem.memory.weights)
    ranks = problem.pipeline.stage_to_rank
    shard = 1.0
    if problem.data_parallel is not None and problem.data_parallel.sharding == "full":
        shard = 1.0 / problem.data_parallel.size
    per_rank = [0.0] * problem.pipeline.num_ranks
    for stage, rank in enumerate(ranks):
        per_rank[rank] += weights[stage % len(weights)] * shard
    return [extra * w for w in per_rank]
