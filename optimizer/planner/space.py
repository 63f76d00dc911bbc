"""The configurations a plan may choose, as data: every field a dimension, every value allowed by the request.

A configuration splits ``num_nodes × gpus_per_node`` GPUs into tensor (t, inside a node) × context (c) ×
pipeline (p) × data-parallel (d) groups, ``t·c·p·d = num_gpus``, and the global batch B into d replicas × m
microbatches of b sequences, ``B = d·m·b``. The pipeline's layout is one chunk per rank, ``stages_per_rank``
chunks in a loop (powers of two up to 8, and one layer per stage when ``lga`` is named; any count up to
``num_layers / p`` when ``search.stages_per_rank`` names it), two in a V, or two V-shaped replicas
(``bidirectional``, even p); the schedule is a family (or ``auto``) whose domain admits the layout and m: the
families the planner tries are those declaring a :class:`~pipesched.optimizer.families.PlannerEstimate` (those
not ``by_default`` only when ``search.method`` names them). A family without a flush (PipeDream-2BW) all-reduces
its gradients every step: it is tried with sharding ``none`` or ``optimizer`` only. A mixture-of-experts model
also chooses its expert-parallel degree ep, carved out of the t·c·d GPUs of a stage, and with ep > 1 its expert
tensor-parallel degree e_t (1 unless ``search.expert_tensor_parallel`` names others, such as t: Megatron-Core's
default when a recipe states none), ep·e_t dividing t·c·d (:mod:`pipesched.optimizer.cost.experts`). With ep = 1
the experts are split like the dense FFN, e_t = t; a dense model reports e_t = 1.

Context-parallel degrees tried: powers of two whose 2c head-tail chunks divide the sequence and leave each
rank at least ``MIN_CONTEXT_TOKENS`` tokens (Megatron's advice: context parallelism from 8K tokens); expert
degrees: the divisors of the expert count that divide t·c·d, up to ``MAX_EXPERT_PARALLEL``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from functools import cache

from pipesched.optimizer.configs import ClusterConfig, ModelConfig
from pipesched.optimizer.families import default_family, get_family, registry
from pipesched.optimizer.planner.request import RECOMPUTATION, PlanSearch
from pipesched.optimizer.problem import SHARDINGS, Pipeline, Sharding

__all__ = [
    "DIMENSIONS",
    "MAX_EXPERT_PARALLEL",
    "MIN_CONTEXT_TOKENS",
    "Configuration",
    "context_degrees",
    "divisors",
    "enumerate_space",
    "expert_degrees",
    "expert_tensor_degrees",
    "layouts",
    "methods_for",
    "tensor_degrees",
]

#: Micro-batch sizes tried (each must divide the per-replica batch).
_MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
#: Fewest tokens of a sequence a context-parallel rank holds (module docstring).
MIN_CONTEXT_TOKENS = 4096
#: Largest expert-parallel degree tried.
MAX_EXPERT_PARALLEL = 256


@dataclass(frozen=True, order=True)
class Configuration:
    """One point of the space; field names are the plan's and ``search``'s."""

    pipeline_parallel: int
    tensor_parallel: int
    data_parallel_size: int
    sharding: Sharding
    stages_per_rank: int
    placement: str
    micro_batch_size: int
    num_microbatches: int
    activation_recomputation: str
    method: str
    precision: str = "bf16"
    context_parallel: int = 1
    expert_parallel: int = 1
    expert_tensor_parallel: int = 1

    def as_dict(self) -> dict[str, int | str]:
        """The fields by name."""
        return asdict(self)

    @property
    def num_stages(self) -> int:
        """Model chunks: ``pipeline_parallel × stages_per_rank``."""
        return self.pipeline_parallel * self.stages_per_rank

    @property
    def expert_split(self) -> int | None:
        """e_t where expert parallelism makes it a choice (ep > 1), else ``None``: the experts split as
        :func:`~pipesched.optimizer.cost.experts.expert_groups` splits them by default (t with ep = 1), whatever a
        plan stored before the field existed says."""
        return self.expert_tensor_parallel if self.expert_parallel > 1 else None

    @property
    def weight_copies(self) -> int:
        """GPUs holding the same weights of a pipeline rank: d·c (the problem's ``data_parallel.size``)."""
        return self.data_parallel_size * self.context_parallel


#: The search dimensions, by field name.
DIMENSIONS: tuple[str, ...] = tuple(field.name for field in fields(Configuration))


def tensor_degrees(model: ModelConfig, cluster: ClusterConfig) -> list[int]:
    """Tensor degrees that divide a node, the attention and key/value heads and the FFN."""
    return [
        t
        for t in range(1, cluster.gpus_per_node + 1)
        if cluster.gpus_per_node % t == 0
        and model.num_attention_heads % t == 0
        and model.key_value_heads % t == 0
        and model.ffn_size % t == 0
    ]


def context_degrees(model: ModelConfig, search: PlanSearch) -> list[int]:
    """Context-parallel degrees worth trying (module docstring); every pinned value that splits the sequence."""
    s = model.seq_length
    if search.context_parallel is not None:
        return [c for c in search.context_parallel if s % (2 * c) == 0 or c == 1]
    degrees, c = [1], 2
    while s % (2 * c) == 0 and s // c >= MIN_CONTEXT_TOKENS:
        degrees.append(c)
        c *= 2
    return degrees


def expert_degrees(model: ModelConfig, stage_gpus: int, search: PlanSearch) -> list[int]:
    """Expert-parallel degrees for a stage of ``stage_gpus`` (t·c·d) GPUs: 1 for a dense model."""
    if not model.is_moe:
        return [1]
    experts = model.num_experts or 1
    return [
        ep
        for ep in divisors(experts)
        if stage_gpus % ep == 0 and ep <= MAX_EXPERT_PARALLEL and _allowed(search.expert_parallel, ep)
    ]


def expert_tensor_degrees(model: ModelConfig, t: int, stage_gpus: int, ep: int, search: PlanSearch) -> list[int]:
    """Expert tensor-parallel degrees e_t for ep of a stage's ``stage_gpus`` (t·c·d) GPUs (module docstring): the
    named ones (default 1) with ep·e_t dividing t·c·d and e_t dividing the experts' FFN width, when ep > 1; t when
    ep = 1; 1 for a dense model."""
    if not model.is_moe:
        return [1]
    if ep == 1:
        return [t]
    named = search.expert_tensor_parallel or [1]
    return [e for e in named if stage_gpus % (ep * e) == 0 and model.expert_ffn_size % e == 0]


#: The most chunks per rank tried with the loop placement unless ``search.stages_per_rank`` names more (more chunks,
#: more actions to simulate per configuration: beyond 8 the search reaches fewer configurations in its time).
DEFAULT_MAX_LOOP_STAGES = 8


def layouts(
    pipeline_parallel: int,
    num_layers: int,
    stages_per_rank: Sequence[int] | None = None,
    *,
    one_layer_per_stage: bool = False,
) -> list[tuple[int, str]]:
    """(stages_per_rank, placement) pairs for ``pipeline_parallel`` ranks with ≤ ``num_layers`` stages (module
    docstring): loops of powers of two up to :data:`DEFAULT_MAX_LOOP_STAGES` chunks (and one layer per stage with
    ``one_layer_per_stage``, for LGA), or the named ``stages_per_rank`` up to ``num_layers / p``; a V; two V-shaped
    replicas on an even pipeline."""
    p = pipeline_parallel
    if p == 1:
        return [(1, "loop")]
    most = num_layers // p
    if stages_per_rank is not None:
        loop = sorted({v for v in stages_per_rank if 1 <= v <= most})
    else:
        powers = {
            2**k for k in range(DEFAULT_MAX_LOOP_STAGES.bit_length()) if 2**k <= min(most, DEFAULT_MAX_LOOP_STAGES)
        }
        loop = sorted(powers | ({most} if one_layer_per_stage and num_layers % p == 0 else set()))
    candidates = [(v, "loop") for v in loop] + [(2, "v")] + ([(2, "bidirectional")] if p % 2 == 0 else [])
    return [(v, placement) for v, placement in candidates if p * v <= num_layers]


@cache
def methods_for(
    stages_per_rank: int, placement: str, pipeline_parallel: int, *, named: bool = False
) -> tuple[str, ...]:
    """Families worth trying on a layout, in listing order: those with a planner estimate whose layouts admit it
    (one rank: the default family, plain gradient accumulation); ``named``: also those tried only when
    ``search.method`` names them."""
    if pipeline_parallel == 1:
        return (default_family().name,)
    tried = [
        family for family in registry().values() if family.planner is not None and (named or family.planner.by_default)
    ]
    return tuple(
        family.name
        for family in tried
        if family.planner is not None
        and family.admits_layout(placement, stages_per_rank)
        and stages_per_rank >= family.planner.min_stages_per_rank
    )


@cache
def _admits(method: str, pipeline_parallel: int, stages_per_rank: int, placement: str, num_microbatches: int) -> bool:
    """Whether family ``method`` admits the pipeline (its layout and microbatch count)."""
    if method == "auto":
        return True
    try:
        pipeline = Pipeline(
            num_ranks=pipeline_parallel,
            num_microbatches=num_microbatches,
            stages_per_rank=stages_per_rank,
            placement=placement,
        )
    except ValueError:
        return False
    return get_family(method).admits_pipeline(pipeline)


@cache
def _shards(method: str, sharding: str) -> bool:
    """Whether ``method`` runs with ``sharding``: a family without a flush keeps two whole weight versions and
    all-reduces its gradients every step (sharding ``none`` or ``optimizer``)."""
    return method == "auto" or get_family(method).flush or sharding in ("none", "optimizer")


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` ≥ 1, ascending (trial division up to √n)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def _allowed(values: Sequence[object] | None, candidate: int | str) -> bool:
    return values is None or candidate in values


def enumerate_space(
    model: ModelConfig,
    cluster: ClusterConfig,
    global_batch_size: int,
    search: PlanSearch,
    *,
    ignore_batch: bool = False,
    precision: str = "bf16",
) -> Iterator[Configuration]:
    """Every configuration the request allows, in no particular order.

    Args:
        precision: the precision searched when ``search.precision`` does not list several
            (``training.precision``).
        ignore_batch: enumerate as if every micro-batch size divided the batch (used to tell a batch no
            configuration divides from pins that contradict each other).
    """
    num_gpus = cluster.num_gpus
    precisions = tuple(search.precision) if search.precision else (precision,)
    for t in tensor_degrees(model, cluster):
        if not _allowed(search.tensor_parallel, t) or num_gpus % t:
            continue
        for c in context_degrees(model, search):
            if num_gpus % (t * c):
                continue
            rest = num_gpus // (t * c)
            for p in divisors(rest):
                if not _allowed(search.pipeline_parallel, p) or p > model.num_layers:
                    continue
                d = rest // p
                if not _allowed(search.data_parallel_size, d):
                    continue
                if not ignore_batch and global_batch_size % d:
                    continue
                for ep in expert_degrees(model, t * c * d, search):
                    for e_t in expert_tensor_degrees(model, t, t * c * d, ep, search):
                        degrees = (t, c, p, d, ep, e_t)
                        yield from _pipelines(model, global_batch_size, search, degrees, precisions, ignore_batch)


def _pipelines(
    model: ModelConfig,
    global_batch_size: int,
    search: PlanSearch,
    degrees: tuple[int, int, int, int, int, int],
    precisions: tuple[str, ...],
    ignore_batch: bool,
) -> Iterator[Configuration]:
    """The sharding, layout, microbatch, recomputation and schedule choices of one t × c × p × d × ep (× e_t)
    split."""
    t, c, p, d, ep, e_t = degrees
    local = global_batch_size // d if not ignore_batch else None
    methods_pinned = search.method
    lga = methods_pinned is not None and "lga" in methods_pinned
    for sharding in SHARDINGS if d * c > 1 else ("none",):
        if not _allowed(search.sharding, sharding):
            continue
        for v, placement in layouts(p, model.num_layers, search.stages_per_rank, one_layer_per_stage=lga):
            if not _allowed(search.stages_per_rank, v) or not _allowed(search.placement, placement):
                continue
            for b in search.micro_batch_size or _MICRO_BATCH_SIZES:
                if local is not None and local % b:
                    continue
                m = local // b if local is not None else max(p, 1) * v
                if not _allowed(search.num_microbatches, m) and local is not None:
                    continue
                if local is None and search.num_microbatches:
                    m = search.num_microbatches[0]
                for recompute in RECOMPUTATION:
                    if not _allowed(search.activation_recomputation, recompute):
                        continue
                    candidates = methods_for(v, placement, p, named=methods_pinned is not None)
                    if methods_pinned is not None:
                        candidates = tuple(name for name in methods_pinned if name in candidates or name == "auto")
                    for method in candidates:
                        if not _admits(method, p, v, placement, m) or not _shards(method, sharding):
                            continue
                        for precision in precisions:
                            yield Configuration(
                                p,
                                t,
                                d,
                                sharding,
                                v,
                                placement,
                                b,
                                m,
                                recompute,
                                method,
                                precision=precision,
                                context_parallel=c,
                                expert_parallel=ep,
                                expert_tensor_parallel=e_t,
                            )
