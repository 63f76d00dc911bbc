"""The plan request and answer of the contract (Plan: ``POST /v1/plans``, ``pipesched plan``) as pydantic models."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import ErrorDetails

from pipesched.optimizer.configs import ClusterConfig, FrameworkName, ModelConfig
from pipesched.optimizer.families import registry
from pipesched.optimizer.field_errors import FieldError, StrictModel, raise_field_errors, without_errors
from pipesched.optimizer.frameworks import FRAMEWORKS, framework_kernels
from pipesched.optimizer.problem import DataParallel, Sharding

__all__ = [
    "PLAN_METHODS",
    "RECOMPUTATION",
    "Launch",
    "Plan",
    "PlanAnswer",
    "PlanRequest",
    "PlanSearch",
    "PlanTraining",
    "Rejected",
    "Searched",
]

RECOMPUTATION = ("none", "selective", "full")
#: What ``search.method`` may name: ``auto`` and the families that declare a planner estimate.
PLAN_METHODS: tuple[str, ...] = ("auto", *(name for name, family in registry().items() if family.planner is not None))


def _plan_method(value: str) -> str:
    if value not in PLAN_METHODS:
        raise ValueError(f"{value!r} is not a method the planner tries: choose one of {', '.join(PLAN_METHODS)}")
    return value


#: The most sequences a global batch may hold, and so the largest count a search list may name: no parallel degree
#: or count of a plan exceeds the global batch (a data-parallel replica takes a sequence at least, a pipeline
#: stage a layer, ≤ 100,000).
MAX_GLOBAL_BATCH = 10_000_000
#: A count a search list may name (a parallel degree, sequences, microbatches, chunks): a whole number ≥ 1.
Degree = Annotated[int, Field(ge=1, le=MAX_GLOBAL_BATCH)]
#: Why a search list's items end at :data:`MAX_GLOBAL_BATCH`, said when one is beyond it.
_COUNT_REASON = "no degree or count of a plan exceeds the global batch's 10⁷ sequences"

PlanMethod = Annotated[
    str, AfterValidator(_plan_method), WithJsonSchema({"type": "string", "enum": list(PLAN_METHODS)})
]


class PlanTraining(StrictModel):
    """What the job fixes: the global batch (in sequences or in tokens), the precision of the matrix multiplies,
    how kernels run."""

    BOUND_REASONS: ClassVar[dict[str, str]] = {
        "global_batch_size": "10⁷ sequences, about 5,000 times Llama 3.1 405B's 2,048 (16M tokens of 8,192)",
        "global_batch_tokens": "10⁷ sequences of model.seq_length's largest, 2²⁴ tokens",
    }

    global_batch_size: int = Field(
        ge=1, le=MAX_GLOBAL_BATCH, description="Sequences of model.seq_length tokens per optimizer step."
    )
    precision: Literal["bf16", "fp8"] | None = Field(
        None,
        description='"bf16" or "fp8" (FP8 matrix multiplies, bf16 elsewhere: torchtitan\'s Float8, Transformer '
        "Engine's current scaling); null: model.precision (bf16). search.precision may list both.",
    )
    kernels: Literal["unknown", "eager", "compiled", "fused"] | None = Field(
        None,
        description='"eager" (torchtitan\'s default), "compiled" (torch.compile), "fused" (Megatron-LM / '
        'Transformer Engine kernels), "unknown" (framework not said); null: model.kernels ("unknown").',
    )
    framework: FrameworkName | None = Field(
        None,
        description=f"The training framework that will run the plan ({', '.join(FRAMEWORKS)}; aliases such as "
        '"nemo", "megatron-bridge", "llm-foundry" accepted): its kernels where kernels is not said (torchtitan and '
        "composer eager, compiled when said; megatron and automodel fused; any other kernels is refused), and what it "
        "keeps and overlaps that no other field states: FSDP's sharded state per parameter (torchtitan and composer "
        "16 B, Megatron-FSDP 18 B, NeMo AutoModel's bf16 model 8 B), backward prefetch, gradient sync, the loss; "
        "for megatron its schedules (1f1b, interleaved-1f1b) where search.method pins none; pipesched launch's default "
        "target where it has one. null: model.framework (not said: the software "
        'profile\'s defaults, and kernels "unknown" the expected time over the frameworks that publish the layout).',
    )
    global_batch_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_GLOBAL_BATCH * 2**24,
        description="Tokens per optimizer step, instead of global_batch_size: a multiple of model.seq_length.",
    )
    async_tensor_parallel: bool = Field(
        False,
        description="Tensor-parallel collectives overlapped with the matrix multiplies they feed (PyTorch's AsyncTP, "
        "torchtitan --compile.enable_async_tensor_parallel; Transformer Engine's userbuffers, Megatron-LM "
        "--tp-comm-overlap, on in NeMo's and Megatron Bridge's performance recipes at TP ≥ 4): the software profile's "
        "async_tensor_parallel_hidden share of them hidden. false: every tensor-parallel byte exposed. Not in the "
        "contract yet.",
    )
    gradient_reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="The data-parallel gradient reduction's dtype: \"fp32\" (torchtitan's FSDP policy, Megatron's "
        '--accumulate-allreduce-grads-in-fp32) or "bf16" (Megatron Bridge\'s performance recipes, '
        "grad_reduce_in_fp32 = False): half the bytes on the wire and in the gradient buffer. fp32 is every "
        "framework's own default (training.framework: torchtitan, Megatron-LM and Megatron Bridge's bf16_mixed, NeMo "
        "AutoModel, Composer's DEFAULT), so one named does not change it; a plan's note says the dtype it assumed.",
    )


def _batch_from_tokens(data: Any) -> Any:
    """``training.global_batch_tokens`` → ``training.global_batch_size`` (sequences of ``model.seq_length``).

    Raises:
        pydantic.ValidationError: the tokens are not a whole number of sequences (the nearest that are named),
            or disagree with a ``global_batch_size`` given beside them.
    """
    training = data.get("training") if isinstance(data, dict) else None
    if (
        isinstance(training, dict)
        and training.get("global_batch_size") is None
        and not training.get("global_batch_tokens")
    ):
        message = "give the global batch: global_batch_size (sequences) or global_batch_tokens (tokens)"
        raise_field_errors("PlanRequest", [(("training", "global_batch_size"), message, None)])
    if not isinstance(training, dict) or not isinstance(training.get("global_batch_tokens"), int):
        return data
    try:
        seq_length = ModelConfig.model_validate(data.get("model")).seq_length
    except ValidationError:
        return data  # the model's own errors are reported by the model's validation
    tokens = training["global_batch_tokens"]
    loc = ("training", "global_batch_tokens")
    sequences, rest = divmod(tokens, seq_length)
    if rest or not sequences:
        nearby = sorted({max(1, sequences), sequences + 1})
        use = " or ".join(f"{n * seq_length:,}" for n in nearby)
        counted = " or ".join(map(str, nearby))
        raise_field_errors(
            "PlanRequest",
            [
                (
                    loc,
                    f"{tokens:,} tokens is not a whole number of sequences of model.seq_length {seq_length:,}: use "
                    f"{use} ({counted} sequence{'s' if nearby != [1] else ''}), or give global_batch_size in "
                    "sequences",
                    tokens,
                )
            ],
        )
    given = training.get("global_batch_size")
    if given is not None and given != sequences:
        raise_field_errors(
            "PlanRequest",
            [(loc, f"{tokens:,} tokens are {sequences} sequences, not global_batch_size {given}: give one", tokens)],
        )
    return {**data, "training": {**training, "global_batch_size": sequences}}


def _size_missing_beside_tokens(errors: list[ErrorDetails]) -> Callable[[ErrorDetails], bool]:
    """Picks ``training.global_batch_size``'s "missing" where ``errors`` refuse ``training.global_batch_tokens``."""
    tokens = ("training", "global_batch_tokens")
    refused = any(tuple(item["loc"][:2]) == tokens for item in errors)
    return lambda item: (
        refused and item["type"] == "missing" and tuple(item["loc"]) == ("training", "global_batch_size")
    )


class PlanSearch(StrictModel):
    """How to search, and which values each dimension may take (null: every value that makes sense).

    Each list restricts the plan field of the same name; one value pins it.
    """

    BOUND_REASONS: ClassVar[dict[str, str]] = {
        "time_limit_s": "an hour; a search's answer comes within seconds to a minute",
        "top": "100 plans",
        **dict.fromkeys(
            (
                "pipeline_parallel",
                "tensor_parallel",
                "data_parallel_size",
                "stages_per_rank",
                "micro_batch_size",
                "num_microbatches",
                "context_parallel",
                "expert_parallel",
                "expert_tensor_parallel",
            ),
            _COUNT_REASON,
        ),
    }

    time_limit_s: float = Field(60.0, gt=0, le=3600, description="Wall-clock bound on the whole search, s.")
    top: int = Field(5, ge=1, le=100, description="Plans to return, best first.")
    explain: bool = Field(False, description="List the configurations that did not fit, with the reason.")
    sequence_parallel: bool = Field(True, description="Tensor parallelism with sequence parallelism.")
    pipeline_parallel: list[Degree] | None = Field(None, description="Allowed pipeline degrees.")
    tensor_parallel: list[Degree] | None = Field(None, description="Allowed tensor degrees (within a node).")
    data_parallel_size: list[Degree] | None = Field(None, description="Allowed data-parallel sizes.")
    sharding: list[Sharding] | None = Field(None, description="Allowed data-parallel sharding levels.")
    stages_per_rank: list[Degree] | None = Field(None, description="Allowed model chunks per pipeline rank.")
    placement: list[Literal["loop", "v", "bidirectional"]] | None = Field(None, description="Allowed placements.")
    micro_batch_size: list[Degree] | None = Field(None, description="Allowed sequences per microbatch.")
    num_microbatches: list[Degree] | None = Field(None, description="Allowed microbatches per step and pipeline.")
    activation_recomputation: list[Literal["none", "selective", "full"]] | None = Field(
        None, description="Allowed recomputation modes."
    )
    method: list[PlanMethod] | None = Field(
        None, description=f"Allowed schedules: auto or families ({', '.join(PLAN_METHODS[1:])})."
    )
    precision: list[Literal["bf16", "fp8"]] | None = Field(
        None, description="Allowed matrix-multiply precisions; null: training.precision only."
    )
    context_parallel: list[Degree] | None = Field(
        None,
        description="Allowed context-parallel degrees (GPUs sharing one sequence; each > 1 splits model.seq_length "
        "into 2·c equal head-tail chunks); null: powers of two.",
    )
    expert_parallel: list[Degree] | None = Field(
        None,
        description="Allowed expert-parallel degrees (mixture-of-experts models: each divides model.num_experts; "
        "a dense model takes 1 only); null: divisors of the experts.",
    )
    expert_tensor_parallel: list[Degree] | None = Field(
        None,
        description="Allowed expert tensor-parallel degrees e_t with expert_parallel > 1 (GPUs splitting one routed "
        "expert; Megatron-LM --expert-tensor-parallel-size, whose default is the tensor-parallel size); null: 1. "
        "With expert_parallel 1 the experts are split like the dense FFN (e_t = tensor_parallel). Not in the "
        "contract yet.",
    )


class PlanRequest(StrictModel):
    """The contract's plan request: model (a preset and overrides, or every field), cluster, batch, search."""

    model: ModelConfig
    cluster: ClusterConfig
    training: PlanTraining
    search: PlanSearch = Field(default_factory=PlanSearch)

    @model_validator(mode="before")
    @classmethod
    def _tokens_to_sequences(cls, data: Any) -> Any:
        return _batch_from_tokens(data)

    @model_validator(mode="wrap")
    @classmethod
    def _one_batch_error(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """A ``training.global_batch_tokens`` refused (1e30, a fraction, a string) is the one error of the batch:
        no sequences were derived from it, so ``training.global_batch_size`` missing beside it is no second
        error."""
        try:
            return handler(data)
        except ValidationError as error:
            raise without_errors(error, _size_missing_beside_tokens(error.errors())) or error from None

    @model_validator(mode="after")
    def _context_and_expert_degrees_suit_the_model(self) -> PlanRequest:
        raise_field_errors("PlanRequest", _degree_errors(self.model, self.search))
        return self

    @model_validator(mode="after")
    def _framework_runs_the_kernels(self) -> PlanRequest:
        """The framework (``training.framework``, else ``model.framework``) against the kernels said
        (``training.kernels``, else a ``model.kernels`` given) and a ``model.framework`` given: a contradiction is
        refused naming both fields."""
        framework = self.training.framework or self.model.framework
        if framework is None:
            return self
        named = "training.framework" if self.training.framework is not None else "model.framework"
        errors: list[FieldError] = []
        if self.model.framework not in (None, framework):
            errors.append(
                (
                    ("model", "framework"),
                    f"model.framework {self.model.framework!r} contradicts training.framework {framework!r}: give one",
                    self.model.framework,
                )
            )
        said = self.training.kernels
        loc = ("training", "kernels")
        if said is None and "kernels" in self.model.model_fields_set:
            said, loc = self.model.kernels, ("model", "kernels")
        try:
            framework_kernels(framework, said, (".".join(loc), named))
        except ValueError as error:
            errors.append((loc, str(error), said))
        raise_field_errors("PlanRequest", errors)
        return self


def _degree_errors(model: ModelConfig, search: PlanSearch) -> list[FieldError]:
    """Empty search lists (they allow no value) and pinned context- and expert-parallel degrees the model cannot
    take: a context-parallel degree c > 1 cuts the sequence into 2·c equal chunks (head-tail load balancing of the
    causal mask, Megatron-LM's and PyTorch's ring attention); an expert-parallel degree divides the routed experts
    (a dense model has none)."""
    errors: list[FieldError] = [
        (
            ("search", name),
            f"search.{name} is an empty list, which allows no value: list the values to try, or drop it to try "
            "every value that makes sense",
            value,
        )
        for name, value in search
        if value == []
    ]
    s = model.seq_length
    bad = [c for c in search.context_parallel or () if c > 1 and s % (2 * c)]
    if bad:
        fits = [c for c in (2, 4, 8, 16, 32, 64) if s % (2 * c) == 0]
        errors.append(
            (
                ("search", "context_parallel"),
                f"context-parallel degree {bad[0]} does not cut model.seq_length {s:,} into 2·{bad[0]} equal "
                f"head-tail chunks: use 1 or one of {fits or 'none (the sequence is odd)'}",
                search.context_parallel,
            )
        )
    pinned = search.expert_parallel or ()
    experts = model.num_experts if model.is_moe else None
    if experts is None and any(ep != 1 for ep in pinned):
        errors.append(
            (
                ("search", "expert_parallel"),
                "the model is dense (no model.num_experts): expert parallelism takes 1 only; drop the pin or name a "
                "mixture-of-experts model",
                search.expert_parallel,
            )
        )
    elif experts is not None and any(experts % ep for ep in pinned):
        wrong = next(ep for ep in pinned if experts % ep)
        errors.append(
            (
                ("search", "expert_parallel"),
                f"expert-parallel degree {wrong} does not divide model.num_experts {experts}: use a divisor of it",
                search.expert_parallel,
            )
        )
    return errors + _expert_tensor_errors(model, search)


def _expert_tensor_errors(model: ModelConfig, search: PlanSearch) -> list[FieldError]:
    """A pinned expert tensor degree e_t the search would set aside without a word: e_t splits routed experts with
    expert_parallel > 1 only (a dense model has none; with expert_parallel 1 the experts split like the dense FFN,
    over tensor_parallel), and divides the experts' FFN width (``optimizer/cost/experts.py``)."""
    pinned = search.expert_tensor_parallel or ()
    loc = ("search", "expert_tensor_parallel")
    if not model.is_moe and any(e_t != 1 for e_t in pinned):
        message = (
            "the model is dense (no model.num_experts): there are no routed experts to split, expert tensor "
            "parallelism takes 1 only; drop the pin (search.tensor_parallel splits the FFN) or name a "
            "mixture-of-experts model"
        )
        return [(loc, message, search.expert_tensor_parallel)]
    if not model.is_moe or not pinned:
        return []
    if search.expert_parallel is not None and all(ep == 1 for ep in search.expert_parallel):
        message = (
            "expert tensor parallelism splits experts only with expert_parallel > 1, and search.expert_parallel "
            "pins 1 (with expert_parallel 1 the experts split like the dense FFN, over tensor_parallel): allow "
            "search.expert_parallel > 1, or drop search.expert_tensor_parallel and pin search.tensor_parallel"
        )
        return [(loc, message, search.expert_tensor_parallel)]
    width = model.expert_ffn_size
    wrong = [e_t for e_t in pinned if width % e_t]
    if len(wrong) == len(pinned):
        fits = [e_t for e_t in (1, 2, 4, 8, 16, 32, 64) if width % e_t == 0]
        message = (
            f"expert tensor degree {wrong[0]} does not divide the experts' FFN width {width:,} (each GPU holds an "
            f"equal slice of every expert): use one of {fits}"
        )
        return [(loc, message, search.expert_tensor_parallel)]
    return []


class Launch(StrictModel):
    """How to run the plan.

    ``torchtitan``: the plan's torchtitan options as a TOML job document (``[parallelism]``, ``[training]``,
    ``[activation_checkpoint]``, …; a comment alone where torchtitan cannot run the plan, saying why);
    ``torchtitan_args``: the same options as torchtitan ≥ 0.3's argv after ``-m torchtitan.train``, one argument a
    line (0.3 reads no job file; :func:`pipesched.optimizer.planner.torchtitan_toml.args_from_toml` turns the TOML
    into it); ``torchrun``: the command line. ``pipesched launch`` writes the argv to ``torchtitan.args`` beside the
    schedule's CSV and the scheduler's file.
    """

    torchtitan: str
    torchtitan_args: str = ""
    torchrun: str


class Plan(StrictModel):
    """One ranked configuration with its simulated step (contract, Plan answer)."""

    pipeline_parallel: int
    tensor_parallel: int
    data_parallel: DataParallel = Field(
        description="The data-parallel group: size (the degree d), sharding, reshard_after_forward; with "
        "context_parallel c the weights are sharded over d·c copies."
    )
    stages_per_rank: int
    placement: str
    micro_batch_size: int
    num_microbatches: int
    activation_recomputation: str
    method: str
    precision: str = "bf16"
    context_parallel: int = Field(1, description="GPUs sharing one sequence (ring attention).")
    expert_parallel: int = Field(1, description="GPUs sharing one layer's routed experts.")
    expert_tensor_parallel: int = Field(
        1,
        description="GPUs splitting one routed expert (e_t; tensor_parallel when expert_parallel is 1, 1 for a dense "
        "model). Not in the contract yet.",
    )
    step_time_ms: float = Field(
        description="Simulated pipeline makespan + exposed data-parallel time + optimizer step."
    )
    tokens_per_s_per_gpu: float
    tokens_per_s_per_gpu_interval: tuple[float, float] = Field(
        description="80% prediction interval: the calibration's held-out 10th and 90th percentile errors applied."
    )
    mfu: float = Field(
        description="Model FLOPs (6·N_active + 12·l·h·s per token, PaLM App. B) over the accelerators' dense bf16 peak."
    )
    peak_memory_bytes: float = Field(description="Highest rank's static + activation peak, bytes.")
    peak_memory_bytes_interval: tuple[float, float] | None = Field(
        None,
        description="80% prediction interval of the peak, bytes: the calibration's held-out (leave-one-out) 10th and "
        "90th percentile log(published / predicted) peak errors applied (the accelerator profile's "
        "peak_memory_log_error; the answer's peak_memory_interval_source says from what). null: the profile has none. "
        "Not in the contract yet.",
    )
    lower_bound_ms: float = Field(
        description="The model's own bound on step_time_ms: no schedule of this configuration takes less in the same "
        "cost model and profile, ms. A bound on the prediction, not a measured figure."
    )
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
    memory_headroom_bytes: float | None = Field(
        None, description="Bytes kept free on every GPU (cluster.memory_headroom_bytes or the profile's default)."
    )
    profile: str | None = Field(None, description="The accelerator profile the predictions used, and its source.")
    peak_memory_interval_source: str | None = Field(
        None,
        description="Where each plan's peak_memory_bytes_interval comes from: the profile's held-out peak errors, "
        "their percentiles and rows. Not in the contract yet.",
    )
    notes: list[str] = Field(
        default_factory=list,
        description="What to know before acting on the plans, e.g. a predicted MFU above any measured.",
    )
    request: PlanRequest | None = Field(
        None, description="The request as searched; `pipesched launch` rebuilds a plan's schedule from it."
    )
    parameters: float | None = Field(None, description="The model's parameters, every expert counted.")
    active_parameters: float | None = Field(
        None, description="Parameters one token passes through (the routed top-k experts only)."
    )
