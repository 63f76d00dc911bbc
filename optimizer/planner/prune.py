"""Cheap figures of a configuration, before any schedule is built: memory, a lower bound and an estimate.

Pure functions of the model, the cluster and one :class:`~pipesched.optimizer.planner.space.Configuration`:

- **Blocks**: a layer, the embedding and the head for the configuration's tensor, context and expert degrees,
  micro-batch size and recomputation (:mod:`pipesched.optimizer.cost.stages`), the layers split evenly over the
  chunks (Megatron's default; the evaluation partitions them by time and memory). A mixture-of-experts
  model's ``first_dense_layers`` lead the first chunks; the routed experts among a rank's parameters are
  sharded over the expert-data-parallel group (:mod:`pipesched.optimizer.cost.experts`), the rest over the d·c
  GPUs holding the same weights.
- **Static memory** per rank (:func:`pipesched.optimizer.cost.memory.static_bytes_per_parameter_sharded`, fully
  sharded state as the stack keeps it: :func:`pipesched.optimizer.cost.stages.full_sharding_state`):
  with ``full`` sharding and a pipeline the gathered 16-bit weights stay for the whole step (torchtitan sets
  ``reshard_after_forward=False`` under pipeline parallelism); without a pipeline two layers are gathered at a
  time (the one computing and the prefetched next); with ``gradients``/``full`` unsharded gradients in the
  reduction's dtype, (d−1)/d of them: a pipelined stage's whole, accumulated over the microbatches until the last
  one's reduction, as without a pipeline under FSDP's once-a-step sync (``fsdp_gradient_sync`` "last_microbatch"),
  else one layer's (FSDP reduces unit by unit: a mixture-of-experts layer without expert parallelism is a unit of
  billions of parameters). The step model (:mod:`pipesched.optimizer.cost.collectives`)
  counts the same gathered weights in ``memory.weights`` and the same gradients, so this estimate stays near
  the simulated peak.
- **Activations in flight** on the first and the last rank at their peak, as each family declares them
  (:class:`~pipesched.optimizer.families.PlannerEstimate`): GPipe m, 1F1B / ZB-H1 p (Narayanan et al. 2021,
  §2.2; Qi et al. 2023, §2), ZB-H2 2p − 1, interleaved 1F1B 2(p − 1) + (v − 1)·p + 1 chunks (Megatron-LM's
  warm-up), looped BFS all m·v, ZB-V 2p half-size chunks, V-Half p + 1, V-Min ⌈2p/3⌉ + 1, DualPipeV 2p + 1
  (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", Table 1); ``auto`` as 1F1B; the LM head's
  logits once on the last rank (each microbatch's backward follows its forward there) unless the family holds
  every forward before any backward; on top, the largest transient of a pass on the rank (a recomputed layer's,
  and on the last rank the loss's: the blocks' ``transient_bytes``, counted in the derived static memory too). An
  estimate: the simulator measures the real peak of every schedule it evaluates.
- **Data-parallel time** (the planner's own estimate, to order and prune before simulation; an evaluated plan's
  step is the simulator's ``step_time`` with the step model's collectives): ring
  collectives of :mod:`pipesched.optimizer.cost.collectives` over the data-parallel group, on the intra-node
  link when the group stays in a node (torchtitan's mesh order pp × dp × cp × tp: the d·c weight copies span
  t·c·d consecutive GPUs), else the inter-node link. Gradients are reduced in fp32 (4 B/param), weights
  gathered in 16 bits.
  ``none``: one all-reduce; ``optimizer``/``gradients``: a reduce-scatter and an all-gather of the updated
  weights after the step; ``full``: a reduce-scatter and one all-gather per step (two per microbatch without a
  pipeline, resharded after forward). Exposed: without a pipeline, what a microbatch's collectives exceed of
  its compute, plus one layer's (the first gather, the last reduction); with a pipeline, the reduction of the
  chunk whose backward ends last (1/v of the rank's) and every gather not prefetched (1/v with ``full``,
  all of the after-step gather with ``optimizer``/``gradients``).
- **Optimizer step**: Adam is memory-bound: 30 bytes per local parameter (fp32 master, two moments read and
  written, the fp32 gradient read, the 16-bit weight written) over the memory bandwidth.
- **Lower bound** of the step, valid for whatever layer split the evaluation picks (by time and memory, a tie
  settled by the schedule, or the request's ``layers_per_stage``): the least, over the splits, of the busiest
  rank (:mod:`pipesched.optimizer.planner.bound`). With a flush every rank's optimizer step waits for the last
  pass of any rank (the simulator's synchronised step), so the bound is the least busiest rank's passes plus
  the mean rank's optimizer step (at most the heaviest's). A rank's passes are its m microbatches' F + I + W
  and the pipeline's fill and drain it cannot avoid: its first pass (on its first stage r, loop or V) waits for
  one microbatch's forwards on stages 0..r−1 and the hops between them, and with a fused backward its last pass
  (a backward of stage r: a later stage's would need stage r's after it) is followed by that microbatch's
  backwards on stages r−1..0. One stage per rank: exact over the contiguous splits. Several: each rank may
  hold any number of layers, the stages before its first charged one layer each. Without a flush
  (PipeDream-2BW) the step period: the least busiest rank's passes, plus the estimated optimizer step the plan
  adds to it without data parallelism (with it, the simulated period holds the steps: at least the mean
  rank's passes and step). Expert all-to-alls are charged as the problem charges them (hidden where the
  framework or the family overlaps microbatches: :meth:`Estimator.expert_overlap`). Data-parallel collectives
  are charged where no schedule hides them (:meth:`Estimator.collective_floors`, the least the problem gives
  them under any split): every pass waits for stage 0's first UNSHARD (FSDP), which starts no earlier than the
  step; with a fused backward every rank's drain ends at stage 0's last backward, whose REDUCE_GRAD every
  optimizer step waits for; with a split backward a rank's last pass is a W of its stage, whose REDUCE_GRAD
  follows it, or (one stage per rank) its F and I of m microbatches, then the last I's chain back to stage 0,
  that microbatch's W there and stage 0's REDUCE_GRAD (the larger of the two counts); ZeRO-2's optimizer step
  all-gathers the updated weights (the mean rank's); the passes run slower beside their stage's collectives (the
  profile's ``overlap_slowdown``, as the problem spreads it over them; without a pipeline, FSDP's gathers per
  microbatch too). Bidirectional placements: the mean rank's passes and step.
  The quick bound every estimate carries (:attr:`Estimate.bound_ms`) is the mean rank's passes and step; the
  search prunes with it first, then with the tight one (:meth:`Estimator.bound_ms`, cached).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, cached_property
from typing import Literal

from pipesched.optimizer.configs import ClusterConfig, ContextParallel, ExpertParallel, ModelConfig, TensorParallel
from pipesched.optimizer.cost.collectives import (
    achieved_links,
    all_gather_ms,
    all_reduce_ms,
    group_link,
    reduce_scatter_ms,
)
from pipesched.optimizer.cost.experts import expert_groups
from pipesched.optimizer.cost.memory import static_bytes_per_parameter_sharded
from pipesched.optimizer.cost.profile import layout_sharding, unknown_kernels_class
from pipesched.optimizer.cost.stages import (
    Block,
    Hardware,
    embedding_block,
    full_sharding_state,
    head_block,
    headroom_bytes,
    resolve_hardware,
    transformer_layer,
)
from pipesched.optimizer.families import PlannerEstimate, get_family
from pipesched.optimizer.partition import even_partition
from pipesched.optimizer.planner.bound import LayerCosts, contiguous_min_max, count_min_max
from pipesched.optimizer.planner.space import Configuration
from pipesched.optimizer.problem import DataParallel, stage_to_rank
from pipesched.optimizer.units import format_bytes

__all__ = ["ADAM_BYTES_PER_PARAMETER", "Estimate", "Estimator", "in_flight"]

#: Bytes Adam's step moves per local parameter (module docstring).
ADAM_BYTES_PER_PARAMETER = 30.0

#: ``auto``'s bubble as a fraction of 1F1B's (p − 1) chunk times, for ordering only (a family declares its own).
AUTO_BUBBLE = 0.1


def _bubble(method: str) -> float:
    return AUTO_BUBBLE if method == "auto" else _estimate_of(method).bubble


@cache
def _estimate_of(method: str) -> PlannerEstimate:
    estimate = get_family(method).planner
    if estimate is None:
        raise ValueError(f"the planner has no estimate for {method}: it declares no PlannerEstimate")
    return estimate


@cache
def _flush_and_fused(method: str) -> tuple[bool, bool]:
    """Whether ``method``'s schedules flush (every family but PipeDream-2BW, and ``auto``) and run a fused backward
    (B, not I and W: ``auto`` may split it)."""
    family = get_family(method) if method != "auto" else None
    return family is None or family.flush, family is not None and not family.runs_split_backward


def in_flight(method: str, p: int, v: int, m: int) -> tuple[int, int]:
    """Chunk activations held at the peak on the first and on the last pipeline rank (module docstring)."""
    if p == 1:
        return 1, 1
    if method == "auto":
        first, like_first = min(p, m), False
    else:
        estimate = _estimate_of(method)
        first, like_first = estimate.in_flight(p, v, m), estimate.last_rank_like_first
    last = first if like_first else max(1, min(first, v))
    return first, last


@dataclass(frozen=True)
class Estimate:
    """A configuration's cheap figures (ms, bytes) and, when it cannot fit, why. ``bound_ms`` is the quick lower
    bound of its step (the mean rank's passes and optimizer step); :meth:`Estimator.bound_ms` the tight one."""

    peak_memory_bytes: float
    static_bytes: float
    bound_ms: float
    estimate_ms: float
    data_parallel_exposed_ms: float
    optimizer_step_ms: float
    fits: bool
    reason: str | None


@dataclass(frozen=True)
class _Layout:
    """Per rank (the first and the last, and the busiest): compute per microbatch, parameters, chunk activation."""

    rank_compute_ms: float
    rank_backward_ms: float
    first_parameters: float
    last_parameters: float
    max_parameters: float
    first_chunk_activation: float
    last_chunk_activation: float
    transient_bytes: float
    layer_parameters: float
    head_activation: float = 0.0
    head_transient: float = 0.0
    first_expert_parameters: float = 0.0
    last_expert_parameters: float = 0.0
    max_expert_parameters: float = 0.0
    heaviest_position: float = 0.0
    max_chunk_activation: float = 0.0
    mean_compute_ms: float = 0.0
    mean_parameters: float = 0.0
    mean_expert_parameters: float = 0.0


@dataclass(frozen=True)
class _CollectiveFloors:
    """The least data-parallel collectives the simulated step charges under any layer split, ms
    (:meth:`Estimator.collective_floors`): stage 0's UNSHARD (sharding ``full``), the REDUCE_GRAD of stage 0, of
    the last stage and of any stage, and the all-gather in the mean rank's OPTIMIZER_STEP (sharding ``gradients``);
    a stage's whole gather and reduction at least ``*_latency_ms`` + ``*_ms_per_parameter`` × its parameters, and the
    profile's ``slowdown`` of the passes beside them."""

    first_gather: float
    first_reduce: float
    last_reduce: float
    any_reduce: float
    step_gather: float
    gather_latency_ms: float
    gather_ms_per_parameter: float
    reduce_latency_ms: float
    reduce_ms_per_parameter: float
    slowdown: float

    def gather(self, parameters: float) -> float:
        """The least whole gather of a stage holding ``parameters``, ms (0 unless sharding ``full``)."""
        return self.gather_latency_ms + self.gather_ms_per_parameter * parameters

    def reduction(self, parameters: float) -> float:
        """The least whole reduction of a stage holding ``parameters``, ms."""
        return self.reduce_latency_ms + self.reduce_ms_per_parameter * parameters

    def beside(self, parameters: float) -> float:
        """What a stage's passes gain over the step beside its collectives, at least, per ``parameters`` it holds
        (the latency left out: linear in the layers)."""
        return self.slowdown * (self.gather_ms_per_parameter + self.reduce_ms_per_parameter) * parameters


#: No data-parallel collective (d·c = 1), or none bounded (:meth:`Estimator.collective_floors`).
_NO_FLOORS = _CollectiveFloors(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class _Drain:
    """A split backward's second form of a rank's cost (:meth:`Estimator.bound_ms`): ``costs`` a layer's F + I (m
    of them own, one in the prefix), ``ends`` the embedding's and the head's own, ``fills`` the first stage's and
    every other stage's fixed prefix, ``after`` what every rank's chain ends with (stage 0's W, its reduction)."""

    costs: LayerCosts
    ends: tuple[float, float]
    fills: tuple[float, float]
    after: float


#: A block's degrees, as :meth:`Estimator.blocks` takes them: (t, b, recompute, precision, c, ep, sharding, overlap).
_Degrees = tuple[int, int, str, str | None, int, int, str, bool, int | None]

#: A cached block's key: (t, b, recompute, precision, c, ep, kernels class, "overlap" or ""[, "dense"]).
_Key = tuple[int | str, ...]


class Estimator:
    """Cheap figures for the configurations of one request (blocks cached per degree, size and recomputation)."""

    def __init__(
        self,
        model: ModelConfig,
        cluster: ClusterConfig,
        global_batch_size: int,
        *,
        sequence_parallel: bool = True,
        async_tensor_parallel: bool = False,
        reduce_dtype: Literal["fp32", "bf16"] = "fp32",
    ) -> None:
        self.model = model
        self.cluster = cluster
        self.global_batch_size = global_batch_size
        self.sequence_parallel = sequence_parallel
        self.async_tensor_parallel = async_tensor_parallel
        self.reduce_dtype = reduce_dtype
        self._blocks: dict[_Key, tuple[Block, Block, Block, Block, ModelConfig]] = {}
        self._layouts: dict[tuple[object, ...], _Layout] = {}
        self._bounds: dict[tuple[object, ...], float] = {}
        self._floors: dict[tuple[object, ...], _CollectiveFloors] = {}
        self._full_states: dict[str, str] = {}

    def data_parallel(self, config: Configuration) -> DataParallel:
        """The configuration's data-parallel group: the d·c copies of its weights and their sharding, the
        request's gradient reduce dtype; without a pipeline fully sharded weights are freed after each forward
        (FSDP's default), with one they stay gathered (torchtitan under pipeline parallelism)."""
        return DataParallel(
            size=config.weight_copies,
            sharding=config.sharding,
            reshard_after_forward=config.sharding == "full" and config.pipeline_parallel == 1,
            reduce_dtype=self.reduce_dtype,
        )

    @property
    def gradient_bytes(self) -> float:
        """Bytes per element of the gradient buffer: the request's reduction dtype."""
        return 4.0 if self.reduce_dtype == "fp32" else 2.0

    def full_state(self, sharding: str) -> str:
        """How fully sharded state is kept for a layout of class ``sharding`` (:meth:`sharding_of`) by the stack
        the model's kernels name (:func:`~pipesched.optimizer.cost.stages.full_sharding_state`)."""
        if sharding not in self._full_states:
            self._full_states[sharding] = full_sharding_state(
                self.model, self.hardware.software, sharding, gradient_bytes=self.gradient_bytes
            )
        return self._full_states[sharding]

    @cached_property
    def hardware(self) -> Hardware:
        """The resolved accelerator, its software profile the model's framework's (``model.framework``)."""
        return resolve_hardware(self.cluster, self.model.framework)

    @property
    def headroom_bytes(self) -> float:
        """Bytes kept free per GPU (:func:`pipesched.optimizer.cost.stages.headroom_bytes`)."""
        return headroom_bytes(self.cluster, self.hardware)

    @property
    def limit_bytes(self) -> float:
        """Per-GPU memory a plan may use: the accelerator's minus the headroom."""
        return self.hardware.memory_bytes - self.headroom_bytes

    def model_for(self, micro_batch_size: int, recompute: str, precision: str | None = None) -> ModelConfig:
        """The model with the configuration's micro-batch size, recomputation and precision."""
        return self.model.model_copy(
            update={
                "micro_batch_size": micro_batch_size,
                "activation_recomputation": recompute,
                "precision": precision or self.model.precision,
                "layers_per_stage": None,
            }
        )

    def expert_overlap(self, config: Configuration) -> bool:
        """Whether the configuration's expert all-to-alls hide behind another microbatch's pass
        (:class:`~pipesched.optimizer.configs.ExpertParallel` ``overlap``): the framework overlaps them, or the
        family runs one microbatch's forward beside another's backward (DualPipe)."""
        if config.expert_parallel <= 1:
            return False
        estimate = get_family(config.method).planner if config.method != "auto" else None
        return self.hardware.software.moe_all_to_all_overlap or (
            estimate is not None and estimate.overlaps_microbatches
        )

    def _key(
        self,
        t: int,
        b: int,
        recompute: str,
        precision: str | None,
        c: int,
        ep: int,
        sharding: str,
        overlap: bool,
        e_t: int | None = None,
    ) -> _Key:
        """The cache key of a block: the precision resolved, the sharding as its class for kernels "unknown" (the
        only use a block has for it)."""
        unknown = self.model.kernels == "unknown"
        kernels_class = unknown_kernels_class(sharding, self.model.kernels_prior) if unknown else ""
        resolved = precision or self.model.precision
        return (t, b, recompute, resolved, c, ep, kernels_class, "overlap" if overlap else "", e_t or 0)

    def blocks(
        self,
        t: int,
        b: int,
        recompute: str,
        precision: str | None = None,
        c: int = 1,
        ep: int = 1,
        sharding: str = "",
        overlap: bool = False,
        e_t: int | None = None,
    ) -> tuple[Block, Block, Block, Block, ModelConfig]:
        """(layer, embedding, head, layer without recomputation, model) for tensor degree t, size b, context
        degree c, expert degree ep and the data-parallel ``sharding`` ("": no data parallelism; with kernels
        "unknown" it names who runs the layout: :func:`pipesched.optimizer.cost.stages.blended`); a
        mixture-of-experts model's layer is its expert layer, its all-to-alls hidden where ``overlap``, its experts
        split over e_t GPUs (None: :func:`~pipesched.optimizer.cost.experts.expert_groups`' default)."""
        key = self._key(t, b, recompute, precision, c, ep, sharding, overlap, e_t)
        if key not in self._blocks:
            model = self.model_for(b, recompute, str(key[3]))
            tp = self.tensor_parallel(t)
            plain_model = model.model_copy(update={"activation_recomputation": "none"})
            self._blocks[key] = (
                self._layer(model, tp, c, ep, moe=model.is_moe, sharding=sharding, overlap=overlap, e_t=e_t),
                embedding_block(model, self.hardware, tp, self.cluster, context_parallel=c),
                head_block(model, self.hardware, tp, context_parallel=c, sharding=sharding),
                self._layer(plain_model, tp, c, ep, moe=model.is_moe, sharding=sharding, overlap=overlap, e_t=e_t),
                model,
            )
        return self._blocks[key]

    def dense_layer(self, degrees: _Degrees) -> Block:
        """The dense layer (a mixture-of-experts model's ``first_dense_layers``) for the degrees of
        :meth:`blocks`, in its order."""
        t, b, recompute, precision, c, ep, sharding, overlap, e_t = degrees
        key = (*self._key(t, b, recompute, precision, c, ep, sharding, overlap, e_t), "dense")
        if key not in self._blocks:
            model = self.model_for(b, recompute, str(key[3]))
            layer = self._layer(model, self.tensor_parallel(t), c, ep, moe=False, sharding=sharding)
            self._blocks[key] = (layer, *self.blocks(t, b, recompute, str(key[3]), c, ep, sharding, overlap, e_t)[1:])
        return self._blocks[key][0]

    @staticmethod
    def sharding_of(config: Configuration) -> str:
        """The configuration's data-parallel sharding, "" without data parallelism (d·c = 1), tagged where it has
        model parallelism: its class for kernels "unknown" (:func:`~pipesched.optimizer.cost.profile.layout_sharding`).
        """
        degrees = (config.tensor_parallel, config.pipeline_parallel, config.context_parallel, config.expert_parallel)
        return layout_sharding(config.sharding, config.weight_copies, *degrees) or ""

    def framework_log_spread(self, config: Configuration) -> float:
        """log(layer time of the slowest framework that runs the layout / layer time as planned) for kernels
        "unknown" with context parallelism (the plan takes the expected time over the frameworks,
        :func:`pipesched.optimizer.cost.stages.blended`; a ring on PyTorch's FlashAttention-2,
        :func:`pipesched.optimizer.cost.context.ring_kernel_speed`, can be far slower than that), 0 otherwise.
        The plan's interval widens down by it."""
        c = config.context_parallel
        if self.model.kernels != "unknown" or c <= 1:
            return 0.0
        t, b, ep = config.tensor_parallel, config.micro_batch_size, config.expert_parallel
        sharding = self.sharding_of(config)
        e_t = config.expert_split
        recompute, precision = config.activation_recomputation, config.precision
        layer, _, _, _, model = self.blocks(t, b, recompute, precision, c, ep, sharding, e_t=e_t)
        planned = layer.forward_ms + layer.backward_input_ms + layer.backward_weight_ms
        slowest = planned
        for mode in self.hardware.software.kernels_shares("unknown", sharding, self.model.kernels_prior):
            said = model.model_copy(update={"kernels": mode})
            own = self._layer(said, self.tensor_parallel(t), c, ep, moe=model.is_moe, e_t=e_t)
            slowest = max(slowest, own.forward_ms + own.backward_input_ms + own.backward_weight_ms)
        return math.log(slowest / planned) if planned > 0 else 0.0

    def _layer(
        self,
        model: ModelConfig,
        tp: TensorParallel | None,
        c: int,
        ep: int,
        *,
        moe: bool,
        sharding: str | None = None,
        overlap: bool = False,
        e_t: int | None = None,
    ) -> Block:
        return transformer_layer(
            model,
            self.hardware,
            tp,
            self.cluster,
            moe=moe,
            context_parallel=ContextParallel(size=c) if c > 1 else None,
            expert_parallel=ExpertParallel(size=ep, overlap=overlap, tensor_parallel=e_t) if ep > 1 else None,
            sharding=sharding,
        )

    def tensor_parallel(self, size: int) -> TensorParallel | None:
        """The tensor-parallel settings of degree ``size`` (None for 1)."""
        if size <= 1:
            return None
        return TensorParallel(
            size=size, sequence_parallel=self.sequence_parallel, async_communication=self.async_tensor_parallel
        )

    def degrees(self, config: Configuration) -> _Degrees:
        """The degrees of ``config``'s blocks, in :meth:`blocks`' order."""
        return (
            config.tensor_parallel,
            config.micro_batch_size,
            config.activation_recomputation,
            config.precision,
            config.context_parallel,
            config.expert_parallel,
            self.sharding_of(config),
            self.expert_overlap(config),
            config.expert_split,
        )

    def layout(self, config: Configuration) -> _Layout:
        """Even split of the layers over the chunks (the dense ones first), summed per rank."""
        degrees = self.degrees(config)
        key = (*degrees, config.pipeline_parallel, config.stages_per_rank, config.placement)
        if key in self._layouts:
            return self._layouts[key]
        layer, embedding, head, _, _ = self.blocks(*degrees)
        dense = self.dense_layer(degrees)
        first_dense = self.model.first_dense_layers if self.model.is_moe else self.model.num_layers
        p, v, placement = config.pipeline_parallel, config.stages_per_rank, config.placement
        num_stages = p * v
        counts = even_partition(self.model.num_layers, num_stages)
        ranks = stage_to_rank(p, v, placement)
        if num_stages == 1:  # a tied head shares the embedding's matrix on the same rank
            tp = self.tensor_parallel(config.tensor_parallel)
            model = self.model_for(config.micro_batch_size, config.activation_recomputation, config.precision)
            head = head_block(
                model,
                self.hardware,
                tp,
                separate_copy=False,
                context_parallel=config.context_parallel,
                sharding=self.sharding_of(config),
            )
        compute = [0.0] * p
        backward = [0.0] * p
        parameters = [0.0] * p
        experts = [0.0] * p
        activation = [0.0] * p
        # The ranks holding each model stage: two under "bidirectional" (ids s and num_stages + s).
        holders = [sorted({ranks[s], ranks[(s + num_stages) % len(ranks)]}) for s in range(num_stages)]
        # An even split has at most two layer counts, and all but one stage are all dense or all MoE: a few
        # distinct stages, built once each (a 126-stage pipeline would otherwise build 126 per configuration).
        stages: dict[tuple[int, int], Block] = {}
        before = 0
        for stage, count in enumerate(counts):
            dense_count = max(0, min(count, first_dense - before))
            before += count
            shape = (dense_count, count - dense_count)
            if shape not in stages:
                stages[shape] = dense.times(dense_count) + layer.times(count - dense_count)
            block = stages[shape]
            if stage == 0:
                block = block + embedding
            for rank in holders[stage]:
                activation[rank] = max(activation[rank], block.activation_bytes)
            if stage == num_stages - 1:
                block = block + head  # its logits are held by one microbatch at a time (F then B)
            # Each holder keeps the stage's weights; a bidirectional placement's two replicas share the batch.
            for rank in holders[stage]:
                compute[rank] += block.compute_ms / len(holders[stage])
                backward[rank] += (block.backward_input_ms + block.backward_weight_ms) / len(holders[stage])
                parameters[rank] += block.parameters
                experts[rank] += block.expert_parameters
        transient = max(layer.transient_bytes, dense.transient_bytes)  # a recomputed layer's
        busiest = max(range(p), key=lambda rank: compute[rank])
        last_rank = ranks[num_stages - 1]
        heaviest = max(range(p), key=lambda rank: parameters[rank])
        figures = _Layout(
            rank_compute_ms=compute[busiest],
            rank_backward_ms=backward[busiest],
            first_parameters=parameters[0],
            last_parameters=parameters[last_rank],
            max_parameters=parameters[heaviest],
            first_chunk_activation=activation[0],
            last_chunk_activation=activation[last_rank] if last_rank != 0 else activation[0],
            transient_bytes=transient,
            head_transient=max(transient, head.transient_bytes),
            layer_parameters=max(layer.parameters, dense.parameters),
            head_activation=head.activation_bytes,
            first_expert_parameters=experts[0],
            last_expert_parameters=experts[last_rank],
            max_expert_parameters=experts[heaviest],
            heaviest_position=heaviest / (p - 1) if p > 1 else 0.0,
            max_chunk_activation=max(activation),
            mean_compute_ms=sum(compute) / p,
            mean_parameters=sum(parameters) / p,
            mean_expert_parameters=sum(experts) / p,
        )
        self._layouts[key] = figures
        return figures

    def static_bytes(
        self, config: Configuration, parameters: float, layer_parameters: float, expert_parameters: float = 0.0
    ) -> float:
        """Weights, gradients and optimizer state of a rank holding ``parameters``, ``expert_parameters`` of them
        routed experts sharded over their own group (module docstring)."""
        copies = config.weight_copies
        groups = [(parameters - expert_parameters, copies)]
        if expert_parameters:
            t, c, d = config.tensor_parallel, config.context_parallel, config.data_parallel_size
            experts = expert_groups(self.model, t, config.expert_parallel, config.expert_split)
            group = experts.data_parallel(t, c, d)
            groups.append((expert_parameters, group))
        static = 0.0
        pipelined = config.pipeline_parallel > 1
        per_unit = config.sharding in ("gradients", "full")
        # the unsharded gradients accumulate over the microbatches in a pipelined stage and under FSDP's
        # once-a-step sync, in the reduction's dtype (pipesched.optimizer.cost.collectives: Accumulated gradients)
        accumulates = pipelined or self.hardware.software.fsdp_gradient_sync == "last_microbatch"
        state = self.full_state(self.sharding_of(config))
        for count, group in groups:
            static += count * static_bytes_per_parameter_sharded(
                self.model, config.sharding, group, gradient_bytes=self.gradient_bytes, full_state=state
            )
            if config.sharding == "full" and group > 1 and pipelined:
                static += count * self.model.dtype_bytes  # gathered for the whole step
            if per_unit and group > 1 and accumulates:
                static += count * self.gradient_bytes * (group - 1) / group
        if config.sharding == "full" and copies > 1 and not pipelined:
            static += 2 * layer_parameters * self.model.dtype_bytes
        if per_unit and copies > 1 and not accumulates:  # one FSDP unit's unsharded gradients
            static += self.gradient_bytes * layer_parameters * (copies - 1) / copies
        return static

    def data_parallel_bandwidth(self, config: Configuration) -> float:
        """Per-GPU bandwidth of the data-parallel ring (intra-node when the group fits a node), B/s."""
        bandwidth, where = group_link(self.cluster, config.weight_copies, config.tensor_parallel)
        profile = self.hardware.profile
        efficiency = (
            profile.collective_efficiency_intra if where == "intra-node" else profile.collective_efficiency_inter
        )
        return bandwidth * efficiency

    def pipeline_bandwidth(self, config: Configuration) -> float:
        """Per-GPU bandwidth between neighbouring pipeline ranks, B/s."""
        stride = config.tensor_parallel * config.weight_copies
        if stride < self.cluster.gpus_per_node and config.pipeline_parallel * stride <= self.cluster.gpus_per_node:
            return self.cluster.intra_node_bandwidth_bytes_per_s
        return self.cluster.inter_node_bandwidth_bytes_per_s

    def data_parallel_ms(self, config: Configuration, layout: _Layout) -> float:
        """Data-parallel collectives not hidden behind compute, ms (module docstring)."""
        d = config.weight_copies
        if d == 1:
            return 0.0
        beta = self.data_parallel_bandwidth(config)
        latency = self.cluster.collective_latency_ms
        parameters = layout.max_parameters
        gradient_bytes = self.gradient_bytes * parameters
        weight_bytes = float(self.model.dtype_bytes) * parameters
        reduce = (
            all_reduce_ms(gradient_bytes, d, beta, latency)
            if config.sharding == "none"
            else reduce_scatter_ms(gradient_bytes, d, beta, latency)
        )
        gather = all_gather_ms(weight_bytes, d, beta, latency) if config.sharding != "none" else 0.0
        layers_per_rank = max(1, self.model.num_layers // config.pipeline_parallel)
        if config.pipeline_parallel == 1:
            if config.sharding == "full":
                compute = layout.rank_compute_ms
                if self.hardware.software.fsdp_gradient_sync == "last_microbatch":  # one reduction a step
                    exposed = config.num_microbatches * max(0.0, 2 * gather - compute) + max(0.0, reduce - compute)
                    return exposed + (reduce + gather) / layers_per_rank
                per_microbatch = reduce + 2 * gather
                return (
                    config.num_microbatches * max(0.0, per_microbatch - compute) + (reduce + gather) / layers_per_rank
                )
            once = reduce + gather
            return max(0.0, once - layout.rank_backward_ms) + once / layers_per_rank
        v = config.stages_per_rank
        if config.sharding == "full":
            return (reduce + gather) / v
        return reduce / v + gather

    def optimizer_ms(self, config: Configuration, layout: _Layout) -> float:
        """Adam's step on the heaviest rank's local parameters, ms (module docstring)."""
        return self.rank_optimizer_ms(config, layout.max_parameters, layout.max_expert_parameters)

    def mean_optimizer_ms(self, config: Configuration, layout: _Layout) -> float:
        """Adam's step on the mean rank's local parameters, ms: at most the heaviest rank's under any layer split
        (the ranks' parameters sum the same)."""
        return self.rank_optimizer_ms(config, layout.mean_parameters, layout.mean_expert_parameters)

    def rank_optimizer_ms(self, config: Configuration, parameters: float, experts: float) -> float:
        """Adam's step on a rank holding ``parameters``, ``experts`` of them routed experts, ms: the step model's
        bytes per parameter (:func:`pipesched.optimizer.cost.collectives`: 28 B for an fp32 model, else 30 B)."""
        local = parameters
        if config.sharding != "none":
            local = (local - experts) / config.weight_copies
            if experts:
                t, c, d = config.tensor_parallel, config.context_parallel, config.data_parallel_size
                expert = expert_groups(self.model, t, config.expert_parallel, config.expert_split)
                local += experts / expert.data_parallel(t, c, d)
        adam_bytes = ADAM_BYTES_PER_PARAMETER if self.model.dtype != "fp32" else 28.0
        return 1e3 * adam_bytes * local / self.hardware.memory_bandwidth_bytes_per_s

    @cached_property
    def _achieved_cluster(self) -> ClusterConfig:
        """The cluster with its node links at the profile's collective efficiencies, as the problem's collectives
        take them (:func:`pipesched.optimizer.derive._add_collectives`)."""
        profile = self.hardware.profile
        return achieved_links(self.cluster, profile.collective_efficiency_intra, profile.collective_efficiency_inter)

    def collective_floors(self, config: Configuration) -> _CollectiveFloors:
        """The least data-parallel collectives ``config``'s problem charges, ms, whatever its layer split: zero
        without data parallelism (d·c = 1), for a mixture-of-experts model (its experts reduced over their own
        group) and for a bidirectional placement (its replicas reduce together): not bounded there.

        The problem (:func:`pipesched.optimizer.derive._add_collectives`) takes a stage's whole collective X (the
        gather G, the reduction R: :func:`pipesched.optimizer.cost.collectives.data_parallel_costs`) and keeps as
        its UNSHARD/REDUCE_GRAD the part exposed beside one microbatch's compute
        (:func:`pipesched.optimizer.cost.overlap.stage_overlap`): u·X + (1 − u)·max(0, X − compute), or u·X alone
        (one stage resharding after forward), or all of a fully sharded pipeline stage's reduction (it starts after
        the stage's last backward), u the stage's largest FSDP unit over its parameters (1 without parameters).
        Either way at least u·X:

        - ``gradients``/``full``: X pays its ring's (d−1) latency steps once per unit, n = parameters / unit of
          them, so u·X = (d−1)·α + (d−1)/d · unit bytes / β: the largest unit's collective alone, (d−1)·α for a
          stage without parameters;
        - ``none``/``optimizer`` (one all-reduce): u·X ≥ 2(d−1)/d · unit bytes / β, and 2(d−1)·α without parameters.

        A stage's largest unit (:meth:`pipesched.optimizer.cost.stages.StageBlocks.largest_unit`) is at least the
        embedding on stage 0 and the head on the last stage whatever layers they hold (one stage: the larger of a
        layer and the embedding); another stage may hold none. β and α are the problem's: the weight copies' ring
        (:func:`~pipesched.optimizer.cost.collectives.group_link`) on :attr:`_achieved_cluster`, the collective
        latency. Gathers move the model dtype, reductions the request's reduce dtype. ZeRO-2's OPTIMIZER_STEP
        all-gathers the rank's updated weights ((d−1)·α + (d−1)/d · bytes / β, on top of Adam's traffic): linear in
        the rank's parameters, so the ranks' mean is the mean rank's.

        The problem also lengthens a stage's F and I beside its collectives (``stage_overlap``): gathered once a
        step, each microbatch's F and I by half of the profile's ``overlap_slowdown`` × (G + R) / m, so its m
        microbatches by s·(G + R), at least s × (the per-parameter rate of G and R) × its parameters: linear in its
        layers (:meth:`_CollectiveFloors.beside`); one stage resharding after forward: :meth:`_one_stage_beside`."""
        d = config.weight_copies
        if d <= 1 or self.model.is_moe or config.placement == "bidirectional":
            return _NO_FLOORS
        # what the parameters and the group depend on (not the family, the microbatches or the recomputation)
        key = (
            config.pipeline_parallel,
            config.stages_per_rank,
            config.placement,
            config.tensor_parallel,
            config.data_parallel_size,
            config.context_parallel,
            config.sharding,
            config.precision,
        )
        if key in self._floors:
            return self._floors[key]
        self._floors[key] = floors = self._compute_floors(config)
        return floors

    def _compute_floors(self, config: Configuration) -> _CollectiveFloors:
        """:meth:`collective_floors` of a data-parallel dense ``config`` (``weight_copies`` > 1), uncached."""
        d = config.weight_copies
        layer, embedding, head, _, model = self.blocks(*self.degrees(config))
        beta, _ = group_link(self._achieved_cluster, d, config.tensor_parallel)
        alpha = self.cluster.collective_latency_ms
        reduce_bytes = self.gradient_bytes
        per_unit = config.sharding in ("gradients", "full")

        def reduction(unit: float) -> float:
            if per_unit:
                return reduce_scatter_ms(unit * reduce_bytes, d, beta, alpha)
            return 2 * (d - 1) * alpha if unit <= 0 else 1e3 * 2 * (d - 1) / d * unit * reduce_bytes / beta

        one_stage = config.num_stages == 1
        first_unit = max(layer.parameters, embedding.parameters) if one_stage else embedding.parameters
        last_unit = first_unit if one_stage else head.parameters
        weight_bytes = float(model.dtype_bytes)
        gather = all_gather_ms(first_unit * weight_bytes, d, beta, alpha) if config.sharding == "full" else 0.0
        mean_parameters = self.layout(config).mean_parameters
        step_gather = (
            all_gather_ms(mean_parameters * weight_bytes, d, beta, alpha) if config.sharding == "gradients" else 0.0
        )
        full = config.sharding == "full"
        reduce_steps = 1 if per_unit else 2  # a reduce-scatter's ring steps, an all-reduce's twice as many
        return _CollectiveFloors(
            first_gather=gather,
            first_reduce=reduction(first_unit),
            last_reduce=reduction(last_unit),
            any_reduce=min(reduction(0.0), reduction(layer.parameters), reduction(first_unit), reduction(last_unit)),
            step_gather=step_gather,
            gather_latency_ms=(d - 1) * alpha if full else 0.0,
            gather_ms_per_parameter=1e3 * (d - 1) / d * weight_bytes / beta if full else 0.0,
            reduce_latency_ms=reduce_steps * (d - 1) * alpha,
            reduce_ms_per_parameter=1e3 * reduce_steps * (d - 1) / d * reduce_bytes / beta,
            slowdown=self.hardware.profile.overlap_slowdown,
        )

    @staticmethod
    def _rounding_ms(config: Configuration) -> float:
        """What the problem's rounding may take off a bound, ms: it rounds every cost to 1e-6 ms (half of it
        either way), a rank's F, I, W of m microbatches on v stages, the chain's passes and hops before it, its
        optimizer step's terms, its collectives' (a gather, a reduction), each maybe that much less."""
        m, p, v = config.num_microbatches, config.pipeline_parallel, config.stages_per_rank
        return 5e-7 * (3 * m * v + 4 * p * v + 6)

    def p2p_ms(self, config: Configuration) -> float:
        """One activation between neighbouring pipeline ranks, ms (as the problem derives it)."""
        model = self.model
        p2p_bytes = 1.0 * model.seq_length * config.micro_batch_size * model.hidden_size * model.dtype_bytes
        p2p_bytes /= config.context_parallel
        if self.sequence_parallel:
            p2p_bytes /= config.tensor_parallel
        return self.cluster.p2p_latency_ms + 1e3 * p2p_bytes / self.pipeline_bandwidth(config)

    def bound_ms(self, config: Configuration) -> float:
        """The lower bound of ``config``'s step, ms (module docstring): the least busiest rank over the layer
        splits (:mod:`pipesched.optimizer.planner.bound`), its passes with the pipeline's fill and drain and the
        data-parallel collectives no schedule hides, plus the mean rank's optimizer step; without a flush the
        least busiest rank's passes (plus the estimated step the plan adds without data parallelism).

        The collectives rest on the simulator's rules (:mod:`pipesched.optimizer.simulate`,
        :mod:`pipesched.optimizer.instance`): an UNSHARD precedes every pass of its frame and starts no earlier than
        the step's first start (``first_start`` is taken over every action, collectives included), so the chain of
        forwards behind any rank's first pass starts at least stage 0's UNSHARD after it; a REDUCE_GRAD of stage s
        waits for every final backward (W, or B) of s, and under the synchronised step every OPTIMIZER_STEP waits
        for every REDUCE_GRAD (``sync_before_step``); replica waits and the overlap slowdown only delay. A rank's
        last pass is a final backward (every F and I of a stage precedes its own W or B on the rank); with a fused
        backward it is of the rank's first stage and that microbatch's backwards on the stages before it follow,
        down to stage 0; with a split one it is a W whose stage's REDUCE_GRAD follows. The rank's last I (or B)
        comes after its m forwards and m input gradients, and that microbatch's input gradients on the stages
        before it, its W on stage 0 and stage 0's REDUCE_GRAD follow: the split backward's second form (a mixed
        schedule's B holds its I and W).

        Cached; at least :attr:`Estimate.bound_ms` (the mean rank's), costlier (a bisection over the splits)."""
        layout = self.layout(config)
        p2p_ms = self.p2p_ms(config)
        m, p, v = config.num_microbatches, config.pipeline_parallel, config.stages_per_rank
        rounding = self._rounding_ms(config)
        floors = self.collective_floors(config)
        if p == 1:  # one rank holds every layer: no split to choose; its one stage gathered, then reduced
            passes = m * layout.rank_compute_ms + self._one_stage_beside(config, floors, layout.max_parameters)
            collectives = floors.first_gather + floors.first_reduce + floors.step_gather
            return max(0.0, passes + self.optimizer_ms(config, layout) + collectives - rounding)
        flush, fused = _flush_and_fused(config.method)
        degrees = self.degrees(config)
        key: tuple[object, ...] = (*degrees, p, v, config.placement, m, config.sharding, config.weight_copies)
        key = (*key, config.data_parallel_size, flush, fused, p2p_ms)
        if key in self._bounds:
            return self._bounds[key]
        if config.placement == "bidirectional":  # a stage's two holders share its batch: the mean rank
            optimizer = self.mean_optimizer_ms(config, layout)
            self._bounds[key] = bound = max(0.0, m * layout.mean_compute_ms + optimizer - rounding)
            return bound
        if not flush:  # the step period: at least each rank's passes (and with a simulated step its optimizer's)
            bound = self._period_bound(config, layout, floors)
        else:  # every rank's step waits for the last pass of any rank
            bound = self._flushed_bound(config, layout, floors, p2p_ms, fused)
        self._bounds[key] = bound = max(0.0, bound - rounding)
        return bound

    def _bound_blocks(self, config: Configuration) -> tuple[Block, Block, Block, Block]:
        """``config``'s layer, embedding, head and dense layer (a mixture-of-experts model's first layers)."""
        degrees = self.degrees(config)
        layer, embedding, head, _, _ = self.blocks(*degrees)
        return layer, embedding, head, self.dense_layer(degrees)

    def _period_bound(self, config: Configuration, layout: _Layout, floors: _CollectiveFloors) -> float:
        """:meth:`bound_ms` without a flush, before rounding: the step period is at least each rank's passes (and
        with a simulated step, ``weight_copies`` > 1, the mean rank's passes and optimizer step)."""
        m = config.num_microbatches
        layer, embedding, head, dense = self._bound_blocks(config)
        num_layers = self.model.num_layers
        first_dense = self.model.first_dense_layers if self.model.is_moe else num_layers
        costs = LayerCosts(num_layers, first_dense, m * layer.compute_ms, 0.0, m * dense.compute_ms, 0.0)
        passes = self._least_busiest(config, costs, (m * embedding.compute_ms, m * head.compute_ms), (0.0, 0.0))
        if config.weight_copies == 1:  # the plan adds the estimated optimizer step to the period
            return passes + self.optimizer_ms(config, layout)
        # the simulator's period: the busiest rank's passes and step, at least the mean rank's
        mean = m * layout.mean_compute_ms
        return max(passes, mean + self.mean_optimizer_ms(config, layout) + floors.step_gather)

    def _flushed_bound(
        self, config: Configuration, layout: _Layout, floors: _CollectiveFloors, p2p_ms: float, fused: bool
    ) -> float:
        """:meth:`bound_ms` with a flush, before rounding: every rank's step waits for the last pass of any rank
        (the least busiest rank over the splits, its fill and drain, the collectives no schedule hides)."""
        m = config.num_microbatches
        layer, embedding, head, dense = self._bound_blocks(config)
        num_layers = self.model.num_layers
        first_dense = self.model.first_dense_layers if self.model.is_moe else num_layers

        def fill(block: Block) -> float:
            # a microbatch's chain before the rank's first pass (F) and, with a fused backward, after its last (B)
            return block.compute_ms if fused else block.forward_ms

        hop = (2 if fused else 1) * p2p_ms
        # a stage's passes run beside its collectives: at least their slowdown per parameter it holds
        layer_costs = LayerCosts(
            num_layers,
            first_dense,
            m * layer.compute_ms + floors.beside(layer.parameters),
            fill(layer),
            m * dense.compute_ms + floors.beside(dense.parameters),
            fill(dense),
        )
        ends = (
            m * embedding.compute_ms + floors.beside(embedding.parameters),
            m * head.compute_ms + floors.beside(head.parameters),
        )
        # the heaviest optimizer step is at least the mean rank's (the ranks' parameters sum the same); every
        # chain starts at stage 0's first gather; a fused backward's drain ends at stage 0's last backward, its
        # reduction after it, a split backward's rank at its own last W, its stage's reduction after it
        optimizer = self.mean_optimizer_ms(config, layout) + floors.step_gather + floors.first_gather
        tails = self._reduction_tails(config, floors)
        if fused:
            optimizer += floors.first_reduce
        drain = None
        if not fused:  # or the rank's forwards and input gradients, then the last one's drain to stage 0's W

            def chain(block: Block) -> float:
                return block.forward_ms + block.backward_input_ms

            drain_costs = LayerCosts(
                num_layers,
                first_dense,
                m * chain(layer) + floors.beside(layer.parameters),
                chain(layer),
                m * chain(dense) + floors.beside(dense.parameters),
                chain(dense),
            )
            drain = _Drain(
                drain_costs,
                (ends[0] - m * embedding.backward_weight_ms, ends[1] - m * head.backward_weight_ms),
                (chain(embedding) + 2 * p2p_ms, 2 * p2p_ms),
                embedding.backward_weight_ms + floors.first_reduce,
            )
        starts = (fill(embedding) + hop, hop)
        return optimizer + self._least_busiest(config, layer_costs, ends, starts, None if fused else tails, drain)

    def _quick_collectives(self, config: Configuration, mean_parameters: float) -> float:
        """What :meth:`collective_floors` adds to the quick bound, ms: ZeRO-2's gather in the step, and with a
        flush stage 0's first gather, the reduction after the last pass (stage 0's with a fused backward, any
        stage's least with a split one) and the mean rank's passes' slowdown beside its collectives, all at most
        what :meth:`bound_ms` adds."""
        floors = self.collective_floors(config)
        flush, fused = _flush_and_fused(config.method)
        if not flush:
            return floors.step_gather
        reduction = floors.first_reduce if fused else floors.any_reduce
        return floors.step_gather + floors.first_gather + reduction + floors.beside(mean_parameters)

    def _one_stage_beside(self, config: Configuration, floors: _CollectiveFloors, parameters: float) -> float:
        """What one stage holding ``parameters`` (no pipeline) adds to its m microbatches' passes beside its
        collectives, at least, ms: the problem's (:func:`pipesched.optimizer.derive._hide_behind_compute`,
        :func:`pipesched.optimizer.cost.overlap.stage_overlap`) with every max(0, ·) left out and each collective at
        its least. Gathered once (``reshard_after_forward`` false): the slowdown of the whole gather and reduction.
        Resharded after forward (FSDP without a pipeline): every microbatch but the first waits for its first
        unit's gather, and all its forward beside the whole gather; every backward waits for the first unit's
        gather (the whole gather with ``BACKWARD_POST`` prefetch) beside the reduction; with a reduction every
        microbatch, all but the last wait for their last unit's."""
        m = config.num_microbatches
        s, gather, reduction = floors.slowdown, floors.gather(parameters), floors.reduction(parameters)
        if not self.data_parallel(config).reshard_after_forward:
            return s * (gather + reduction)
        software = self.hardware.software
        after = software.fsdp_backward_prefetch == "BACKWARD_POST"

        def backward(reduce: float) -> float:
            return gather + s * reduce if after else floors.first_gather + s * (gather + reduce)

        forward = (m - 1) * floors.first_gather + m * s * gather
        if software.fsdp_gradient_sync == "every_microbatch":
            return forward + m * backward(reduction) + (m - 1) * floors.first_reduce
        return forward + (m - 1) * backward(0.0) + backward(reduction)

    @staticmethod
    def _reduction_tails(config: Configuration, floors: _CollectiveFloors) -> list[float]:
        """Per stage, the least REDUCE_GRAD after its last backward (:meth:`collective_floors`)."""
        num_stages = config.num_stages
        tails = [floors.any_reduce] * num_stages
        tails[-1] = floors.last_reduce
        tails[0] = floors.first_reduce
        return tails

    @staticmethod
    def _least_busiest(
        config: Configuration,
        costs: LayerCosts,
        ends: tuple[float, float],
        fills: tuple[float, float],
        tails: list[float] | None = None,
        drain: _Drain | None = None,
    ) -> float:
        """The least busiest rank's cost over the splits: ``ends`` the embedding's and the head's own costs,
        ``fills`` the first stage's and every other stage's fixed fill (:mod:`pipesched.optimizer.planner.bound`),
        ``tails`` per stage what follows the rank's last pass when it is that stage's (the rank is charged its
        stages' least); ``drain`` a second form of each rank's cost (one stage per rank only: the larger counts).
        """
        p, v = config.pipeline_parallel, config.stages_per_rank
        num_stages = p * v
        own = [0.0] * num_stages
        own[0] += ends[0]
        own[-1] += ends[1]
        ranks = stage_to_rank(p, v, config.placement)
        if tails is not None:
            for rank in range(p):
                tail = min(tails[s] for s in range(num_stages) if ranks[s] == rank)
                own[min(s for s in range(num_stages) if ranks[s] == rank)] += tail
        prefix = [fills[0]] + [fills[1]] * (num_stages - 1)
        if v == 1 and list(ranks) == list(range(p)):
            if drain is None:
                return contiguous_min_max(costs, own, prefix)
            drain_own = [drain.after] * num_stages
            drain_own[0] += drain.ends[0]
            drain_own[-1] += drain.ends[1]
            drain_prefix = [drain.fills[0]] + [drain.fills[1]] * (num_stages - 1)
            return contiguous_min_max(costs, own, prefix, (drain.costs, drain_own, drain_prefix))
        # Several stages per rank: any count of layers per rank; the stages before a rank's first (stage r under
        # loop and V placements) charged their least, one layer each (none on the embedding's stage, which a
        # request's split may leave without one; so may the last stage).
        layer_fill = min(costs.prefix, costs.dense_prefix) if costs.dense else costs.prefix
        rank_own = [0.0] * p
        least = [0] * p
        for stage in range(num_stages):
            rank = ranks[stage]
            rank_own[rank] += own[stage]
            least[rank] += 0 if stage in (0, num_stages - 1) else 1
        first = [min(s for s in range(num_stages) if ranks[s] == rank) for rank in range(p)]
        for rank in range(p):
            rank_own[rank] += sum(prefix[s] + (layer_fill if s else 0.0) for s in range(first[rank]))
        return count_min_max(costs, rank_own, least)

    def estimate(self, config: Configuration) -> Estimate:
        """Memory, bound and estimated step of ``config`` (module docstring)."""
        layout = self.layout(config)
        p, v, m = config.pipeline_parallel, config.stages_per_rank, config.num_microbatches
        first_count, last_count = in_flight(config.method, p, v, m)
        versions = 0.0 if config.method == "auto" else _estimate_of(config.method).weight_versions - 1.0
        static_first = self.static_bytes(
            config, layout.first_parameters, layout.layer_parameters, layout.first_expert_parameters
        )
        static_last = self.static_bytes(
            config, layout.last_parameters, layout.layer_parameters, layout.last_expert_parameters
        )
        # PipeDream-2BW's second weight version: weights only (Narayanan et al. 2020, §3.1).
        static_first += versions * layout.first_parameters * self.model.dtype_bytes
        static_last += versions * layout.last_parameters * self.model.dtype_bytes
        peak_first = static_first + first_count * layout.first_chunk_activation + layout.transient_bytes
        heads = last_count if config.method != "auto" and _estimate_of(config.method).last_rank_like_first else 1
        peak_last = (
            static_last
            + last_count * layout.last_chunk_activation
            + heads * layout.head_activation
            + layout.head_transient
        )
        # the rank holding the most parameters (a middle one when the first layers are dense: DeepSeek-V3), its
        # activations in flight between the first rank's and the last's by its position (loop placements)
        static_heaviest = self.static_bytes(
            config, layout.max_parameters, layout.layer_parameters, layout.max_expert_parameters
        )
        static_heaviest += versions * layout.max_parameters * self.model.dtype_bytes
        position = 0.0 if config.placement == "v" else layout.heaviest_position  # a V holds as much on every rank
        heaviest_count = math.floor(first_count + (last_count - first_count) * position)
        peak_heaviest = static_heaviest + heaviest_count * layout.max_chunk_activation
        peak = max(peak_first, peak_last, peak_heaviest)
        static = max(static_first, static_last, static_heaviest)
        exposed = self.data_parallel_ms(config, layout)
        optimizer = self.optimizer_ms(config, layout)
        p2p_ms = self.p2p_ms(config)
        # the quick bound: every rank runs its passes then its step, and the ranks' sum is the same under any split;
        # with a flush, after stage 0's first gather and before the least reduction (bound_ms)
        mean_step = self.mean_optimizer_ms(config, layout) + self._quick_collectives(config, layout.mean_parameters)
        bound = max(0.0, m * layout.mean_compute_ms + mean_step - self._rounding_ms(config))
        bubble = _bubble(config.method) * (p - 1) * (layout.rank_compute_ms / v + 2 * p2p_ms)
        estimate = m * layout.rank_compute_ms + bubble + exposed + optimizer
        limit = self.limit_bytes
        fits = peak <= limit
        reason = None
        if not fits and peak_heaviest > max(peak_first, peak_last):
            reason = (
                f"needs about {format_bytes(peak)} on its heaviest pipeline rank (static {format_bytes(static)}) over "
                f"the {format_bytes(limit)} a GPU offers"
            )
        elif not fits:
            which = "first" if peak_first >= peak_last else "last"
            reason = (
                f"needs about {format_bytes(peak)} on the {which} pipeline rank (static {format_bytes(static)}, "
                f"{first_count if which == 'first' else last_count} chunk activations in flight under "
                f"{config.method}) over the {format_bytes(limit)} a GPU offers"
            )
        return Estimate(peak, static, bound, estimate, exposed, optimizer, fits, reason)
