"""Collective times (ms): the ring formulas, the data-parallel step's collectives and memory, and the
tensor-parallel communication of one layer.

Data parallelism: what ``costs.unshard``/``reduce_grad``/``optimizer_step`` and
``memory.weights``/``gradients``/``static`` are for a model on a cluster (contract, Problem: data_parallel).

Ring collectives over a group of d ranks moving B bytes, link bandwidth β per rank (bytes/s) and latency α
per step (Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH",
2005, Sec. 4; Patarasuk and Yuan 2009):

* all-reduce: 2(d−1)·α + 2(d−1)/d · B/β
* reduce-scatter and all-gather: (d−1)·α + (d−1)/d · B/β each

What each sharding level moves per stage and step (ZeRO, Rajbhandari et al. 2020, Sec. 5; FSDP, Zhao et
al. 2023, Sec. 3):

* ``none`` (DDP) and ``optimizer`` (ZeRO-1): REDUCE_GRAD all-reduces the gradients (ZeRO-1's
  reduce-scatter + all-gather of the updated weights costs the same as the all-reduce, so it is counted
  there).
* ``gradients`` (ZeRO-2): REDUCE_GRAD reduce-scatters the gradients; the all-gather of the updated
  weights after the optimizer step is part of ``optimizer_step``.
* ``full`` (ZeRO-3 / FSDP): UNSHARD all-gathers the weights (in the model dtype), REDUCE_GRAD
  reduce-scatters the gradients.

Gradients are reduced in fp32 (4 B per parameter), as torchtitan's FSDP mixed-precision policy
(``reduce_dtype = float32``) and Megatron-LM's default ``grad_reduce_in_fp32`` do. The data-parallel
group of a pipeline rank is its d copies; with the usual mesh order (tensor parallel innermost, then data
parallel, pipeline outermost: Megatron-LM's ``tp-dp-pp``, torchtitan's ``["pp", "dp", "tp"]``) it lies
inside one node when ``tensor_parallel · d ≤ gpus_per_node``, and uses the inter-node bandwidth otherwise.

The optimizer step (Adam, mixed precision) is bound by memory traffic: per parameter it reads the fp32
master weight, gradient and both moments (16 B) and writes master, moments (12 B) and the model-dtype
copy (2 B with bf16): 30 B at the accelerator's memory bandwidth (``ADAM_BYTES_PER_PARAMETER``), over the
rank's shard of the parameters when the optimizer state is sharded.

Static bytes per parameter by sharding have one home,
:func:`pipesched.optimizer.cost.memory.static_bytes_per_parameter_sharded` (ZeRO paper, Sec. 5.1, K = 12 for
mixed-precision Adam): weights w (2 B bf16), gradients 4 B (fp32), optimizer state 12 B, each divided by d
from the sharding level that shards it; fully sharded, as the stack keeps it (PyTorch FSDP's fp32 parameters
4 + 4 + 8, Megatron-FSDP's 2 + 4 + g + 8, a bf16 model's 2 + 2 + 4). Gathered weights and unsharded gradients
are not static: they live in the step model's ``memory.weights`` (held from UNSHARD to RESHARD) and
``memory.gradients`` (freed but for the shard at REDUCE_GRAD), each byte counted once.

Granularity (``gradients`` and ``full``, which torchtitan runs as FSDP2): torchtitan applies ``fully_shard``
to every transformer block, to the token embedding, and to the final norm with the output head (PyTorch
FSDP2, ``torch.distributed.fsdp.fully_shard``; torchtitan ``parallelize`` ``apply_fsdp``). Each such unit's
gradients are produced unsharded by its backward, reduce-scattered as one bucket right after it, and freed
but for the rank's fp32 shard. So a stage holds the unsharded gradients of one unit at a time, the largest
of its units counted: ``memory.gradients`` is the reduction's bytes × the parameters of the stage's largest
unit, ``static`` holds the sharded state plus (d−1)/d of that buffer, and REDUCE_GRAD frees that (d−1)/d. Likewise the
gathered weights: without ``reshard_after_forward`` every unit of the stage stays gathered from its forward
to its backward (the whole stage's weights, ``memory.weights``); with it FSDP2 frees each unit after its
forward and backward, so at most the running unit and the prefetched next one are gathered (two largest
units, capped at the stage). ``none``/``optimizer`` (DDP, ZeRO-1) keep the whole fp32 gradient buffer
(static). Under pipelining the unit-by-unit reduction waits: a ``torch.distributed.pipelining`` stage runs
every backward, its last too, with ``set_requires_gradient_sync(False)`` (``backward_maybe_with_nosync``,
torch 2.5–2.13) and calls FSDP's ``post_backward`` once the last has returned, so FSDP accumulates the stage's
unsharded gradients over the microbatches and reduces them once, after its last backward
(:mod:`pipesched.optimizer.cost.overlap`): a pipelined stage holds its whole unsharded gradient until
REDUCE_GRAD (``memory.gradients`` = the reduction's bytes × the stage's parameters; below). Each unit is its
own collective (FSDP2's ``fully_shard`` per block, FSDP1's auto-wrap per block: one all-gather and one
reduce-scatter call per unit; Zhao et al. 2023, §3), so each pays the ring's (d−1) steps of latency: a
stage's UNSHARD and REDUCE_GRAD carry n·(d−1)·α for its n units (n = the stage's parameters over its largest
unit's, the count of equal units), which matters at hundreds of ranks.
Approximation: the step model places one UNSHARD/REDUCE_GRAD per stage, so the one unit's
buffers count from UNSHARD (or the step's start) to RESHARD (REDUCE_GRAD), not only during the unit's own
compute: an upper bound by one unit.

Accumulated gradients, in the reduction's dtype: between reductions FSDP2 keeps a unit's unsharded gradient
as ``FSDPParam.unsharded_accumulated_grad``, cast to the ``MixedPrecisionPolicy``'s ``reduce_dtype`` right after
each backward (``to_accumulated_grad_if_needed`` and ``accumulate_unsharded_grad_if_needed`` in torch's
``distributed/fsdp/_fully_shard/_fsdp_param.py``, called from ``FSDPParamGroup.post_backward`` when
``reduce_grads`` is off, torch 2.13); FSDP2 drops a ``reduce_dtype`` equal to ``param_dtype``, and the gradient
then accumulates in the parameter's ``.grad``, in ``param_dtype``. So with bf16 compute a reduction in fp32 (PyTorch's
and torchtitan's policy, NeMo AutoModel's ``FSDP2Config.mp_policy``) holds 4 B a parameter, one in bf16 2 B: the
gradient buffer counts ``reduce_bytes`` a parameter. Measured on a 2-rank gloo mesh over 2 microbatches with
``set_requires_gradient_sync(False)``: fp32 (4 B) with ``reduce_dtype`` fp32 over a bf16 or an fp32 model, bf16
``.grad`` with ``reduce_dtype`` bf16 (``tests/runtime/test_fsdp_static_bytes.py``).

Tensor parallelism (Shoeybi et al. 2019, Megatron-LM, §3; Korthikanti et al. 2022, §4.2.2): each layer's
forward all-reduces its s·b·h activation twice (after attention and after the MLP), and its input-gradient
backward twice; with sequence parallelism each all-reduce becomes an all-gather plus a reduce-scatter of the
same total volume. Megatron runs these on the compute stream (not overlapped), so they add to F and I.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipesched.optimizer.configs import ClusterConfig, ModelConfig
from pipesched.optimizer.cost.memory import static_bytes_per_parameter_sharded

__all__ = [
    "ADAM_BYTES_PER_PARAMETER",
    "FLOAT8_GATHER_BYTES",
    "GRADIENT_REDUCE_BYTES",
    "DataParallelCosts",
    "achieved_links",
    "all_gather_ms",
    "all_reduce_ms",
    "data_parallel_costs",
    "group_link",
    "reduce_scatter_ms",
    "tensor_parallel_layer_ms",
]

#: Bytes of memory traffic per parameter in one mixed-precision Adam step (module docstring).
ADAM_BYTES_PER_PARAMETER = 30.0
#: Bytes per gradient element reduced over the data-parallel group (fp32).
GRADIENT_REDUCE_BYTES = 4.0


def all_reduce_ms(num_bytes: float, group_size: int, bandwidth_bytes_per_s: float, latency_ms: float = 0.0) -> float:
    """Ring all-reduce of ``num_bytes`` over ``group_size`` ranks, ms: 2(d−1)·α + 2(d−1)/d · B/β (Thakur et al.
    2005, Sec. 4.4). Zero for a group of one."""
    d = group_size
    if d <= 1:
        return 0.0
    return 2 * (d - 1) * latency_ms + 1e3 * 2 * (d - 1) / d * num_bytes / bandwidth_bytes_per_s


def reduce_scatter_ms(
    num_bytes: float, group_size: int, bandwidth_bytes_per_s: float, latency_ms: float = 0.0
) -> float:
    """Ring reduce-scatter of ``num_bytes`` (the whole buffer) over ``group_size`` ranks, ms:
    (d−1)·α + (d−1)/d · B/β (Thakur et al. 2005, Sec. 4.5)."""
    d = group_size
    if d <= 1:
        return 0.0
    return (d - 1) * latency_ms + 1e3 * (d - 1) / d * num_bytes / bandwidth_bytes_per_s


def all_gather_ms(num_bytes: float, group_size: int, bandwidth_bytes_per_s: float, latency_ms: float = 0.0) -> float:
    """Ring all-gather producing ``num_bytes`` on every rank, ms: (d−1)·α + (d−1)/d · B/β (Thakur et al. 2005,
    Sec. 4.1)."""
    return reduce_scatter_ms(num_bytes, group_size, bandwidth_bytes_per_s, latency_ms)


def achieved_links(cluster: ClusterConfig, intra_efficiency: float, inter_efficiency: float) -> ClusterConfig:
    """``cluster`` with its node links at the fractions of their bandwidth collectives achieve (an accelerator
    profile's ``collective_efficiency_intra`` / ``_inter``): what :func:`group_link` and the collectives' times
    take, for the problem's data-parallel costs and the planner's bound alike."""
    return cluster.model_copy(
        update={
            "intra_node_bandwidth_bytes_per_s": cluster.intra_node_bandwidth_bytes_per_s * intra_efficiency,
            "inter_node_bandwidth_bytes_per_s": cluster.inter_node_bandwidth_bytes_per_s * inter_efficiency,
        }
    )


def group_link(cluster: ClusterConfig, group_size: int, tensor_parallel: int = 1) -> tuple[float, str]:
    """Bandwidth (bytes/s per rank) of a data-parallel group of ``group_size`` and where it lies.

    Inside a node when ``tensor_parallel · group_size ≤ gpus_per_node`` (module docstring), using
    ``intra_node_bandwidth_bytes_per_s``; across nodes otherwise. Across N nodes with g of the group's ranks in
    each (g = gpus_per_node / tensor_parallel), NCCL's rings and trees cross every node boundary once per
    channel, one channel per NIC (each GPU its own NIC, as on DGX/HGX hosts): a node takes in the other nodes'
    (N−1)/N of the buffer once, over its g NICs, and passes it on over NVLink. The ring formulas' (d−1)/d · B/β
    then hold with β = min(intra-node, g · inter-node · ((d−1)/d) / ((N−1)/N)) (the slower of the NVLink and the
    network legs; with g = 1 it is the per-GPU network link). A cluster without these fields (or without
    ``gpus_per_node``) uses ``p2p_bandwidth_bytes_per_s``.

    Returns:
        ``(bandwidth_bytes_per_s, "intra-node" | "inter-node" | "p2p link")``.
    """
    gpus_per_node = getattr(cluster, "gpus_per_node", None)
    intra = getattr(cluster, "intra_node_bandwidth_bytes_per_s", None)
    inter = getattr(cluster, "inter_node_bandwidth_bytes_per_s", None)
    if gpus_per_node:
        if tensor_parallel * group_size <= gpus_per_node and intra:
            return float(intra), "intra-node"
        if tensor_parallel * group_size > gpus_per_node and inter:
            per_node = max(1, min(group_size, gpus_per_node // max(tensor_parallel, 1)))
            nodes = group_size / per_node
            if nodes <= 1:  # a group of one (nothing moves), or spread one rank per node by a wide stride
                return float(inter), "inter-node"
            network = per_node * float(inter) * ((group_size - 1) / group_size) / ((nodes - 1) / nodes)
            return (min(float(intra), network) if intra else network), "inter-node"
    return float(cluster.p2p_bandwidth_bytes_per_s), "p2p link"


@dataclass(frozen=True)
class DataParallelCosts:
    """What :func:`data_parallel_costs` derived.

    Attributes:
        unshard_ms: per model stage, the weights' all-gather (0 unless sharding is ``full``).
        reduce_grad_ms: per model stage, the gradients' all-reduce or reduce-scatter.
        optimizer_step_ms: per rank, the Adam step over the rank's (shard of the) parameters.
        weights_bytes: per model stage, the gathered weights in the model dtype (the whole stage, or with
            ``reshard_after_forward`` two of its largest FSDP units; module docstring).
        gradients_bytes: per model stage, the unsharded gradient buffer it holds before REDUCE_GRAD, in the
            reduction's dtype (``reduce_bytes`` a parameter; module docstring: Accumulated gradients), with
            ``gradients``/``full`` its largest FSDP unit's; otherwise the whole stage's.
        static_bytes: per rank, the sharded weights, gradients and optimizer state plus (d−1)/d of each of its
            stages' ``gradients_bytes`` with ``gradients``/``full`` (REDUCE_GRAD frees them).
        link: where the group lies (:func:`group_link`).
    """

    unshard_ms: list[float]
    reduce_grad_ms: list[float]
    optimizer_step_ms: list[float]
    weights_bytes: list[float]
    gradients_bytes: list[float]
    static_bytes: list[float]
    link: str


def data_parallel_costs(
    *,
    model: ModelConfig,
    cluster: ClusterConfig,
    stage_parameters: list[float],
    stage_holders: list[list[int]],
    num_ranks: int,
    data_parallel_size: int,
    sharding: str,
    memory_bandwidth_bytes_per_s: float,
    tensor_parallel: int = 1,
    stage_largest_unit: list[float] | None = None,
    reshard_after_forward: bool = False,
    reduce_bytes: float = GRADIENT_REDUCE_BYTES,
    reduce_every_microbatch: bool = True,
    stage_expert_parameters: list[float] | None = None,
    expert_data_parallel_size: int | None = None,
    expert_group_stride: int = 1,
    full_state: str = "zero3",
) -> DataParallelCosts:
    """Collective times (ms), optimizer step (ms) and memory (bytes) of a pipeline with d data-parallel copies.

    Args:
        model: the model (its ``dtype`` sets the weights' bytes per parameter).
        cluster: links (``group_link``) and ``collective_latency_ms`` as the per-step latency α.
        stage_parameters: parameters of each model stage (on one tensor-parallel rank).
        stage_holders: ranks holding each model stage (two for bidirectional placement: both replicas
            take part in the stage's gradient reduction, so its group has 2·d ranks).
        num_ranks: pipeline ranks.
        data_parallel_size: d.
        sharding: ``none``, ``optimizer``, ``gradients`` or ``full``.
        memory_bandwidth_bytes_per_s: the accelerator's memory bandwidth (optimizer step).
        tensor_parallel: tensor-parallel degree (where the group lies).
        stage_largest_unit: parameters of each stage's largest FSDP unit (a transformer block, the embedding,
            or the final norm with the head); ``None``: the whole stage is one unit.
        reshard_after_forward: with ``full``, units are freed after their forward (module docstring).
        reduce_bytes: bytes per gradient element on the wire (4 for fp32, 2 for a bf16 reduction).
        reduce_every_microbatch: with ``gradients``/``full`` on one stage per rank, each microbatch reduces its
            gradients unit by unit (one unit's unsharded gradient buffer at a time); False (the software profile's
            ``fsdp_gradient_sync`` "last_microbatch": FSDP's no_sync) holds the stage's whole unsharded gradient
            until the last microbatch's reduction, as a pipeline stage does.
        stage_expert_parameters: the routed-expert parameters among each stage's (expert parallelism,
            :mod:`pipesched.optimizer.cost.experts`): reduced, gathered and sharded over
            ``expert_data_parallel_size`` GPUs (the ranks holding the same experts, every
            ``expert_group_stride``-th GPU: expert-tensor × expert-parallel degree) instead of d.
        full_state: with ``full``, how the stack keeps the sharded state
            (:data:`~pipesched.optimizer.cost.memory.FULL_SHARDING_STATES`;
            :func:`~pipesched.optimizer.cost.stages.full_sharding_state`).

    Formulas and sources: module docstring.
    """
    if stage_expert_parameters is not None and expert_data_parallel_size is not None:
        return _with_experts(
            model=model,
            cluster=cluster,
            stage_parameters=stage_parameters,
            stage_holders=stage_holders,
            num_ranks=num_ranks,
            data_parallel_size=data_parallel_size,
            sharding=sharding,
            memory_bandwidth_bytes_per_s=memory_bandwidth_bytes_per_s,
            tensor_parallel=tensor_parallel,
            stage_largest_unit=stage_largest_unit,
            reshard_after_forward=reshard_after_forward,
            reduce_bytes=reduce_bytes,
            reduce_every_microbatch=reduce_every_microbatch,
            stage_expert_parameters=stage_expert_parameters,
            expert_data_parallel_size=expert_data_parallel_size,
            expert_group_stride=expert_group_stride,
            full_state=full_state,
        )
    d = data_parallel_size
    weight_bytes = float(model.dtype_bytes)
    bandwidth, link = group_link(cluster, d, tensor_parallel)
    latency = cluster.collective_latency_ms
    adam_bytes = ADAM_BYTES_PER_PARAMETER if model.dtype != "fp32" else 28.0
    per_block = sharding in ("gradients", "full")
    units = stage_largest_unit if stage_largest_unit is not None else list(stage_parameters)
    unshard, reduce, weights, gradients = [], [], [], []
    for params, unit, holders in zip(stage_parameters, units, stage_holders, strict=True):
        group = d * len(holders)
        gathered = min(params, 2 * unit) if reshard_after_forward else params
        weights.append(gathered * weight_bytes)
        one_unit = per_block and num_ranks == 1 and reduce_every_microbatch
        gradients.append((unit if one_unit else params) * reduce_bytes)  # in the reduction's dtype: module docstring
        # one collective per FSDP unit, each paying its ring's steps (module docstring: Granularity)
        unit_latency = latency * max(1.0, params / unit) if per_block and unit > 0 else latency
        unshard.append(all_gather_ms(params * weight_bytes, d, bandwidth, unit_latency) if sharding == "full" else 0.0)
        g_bytes = params * reduce_bytes
        if per_block:
            reduce.append(reduce_scatter_ms(g_bytes, group, bandwidth, unit_latency))
        else:
            reduce.append(all_reduce_ms(g_bytes, group, bandwidth, latency))
    rank_params = [0.0] * num_ranks
    rank_buffers = [0.0] * num_ranks
    for params, buffer, holders in zip(stage_parameters, gradients, stage_holders, strict=True):
        for rank in holders:
            rank_params[rank] += params
            rank_buffers[rank] += buffer * (d - 1) / d if per_block else 0.0
    shard = d if sharding != "none" else 1
    per_parameter = static_bytes_per_parameter_sharded(
        model, sharding, d, gradient_bytes=reduce_bytes, full_state=full_state
    )
    optimizer_step = []
    static = []
    for params, buffers in zip(rank_params, rank_buffers, strict=True):
        step_ms = 1e3 * params / shard * adam_bytes / memory_bandwidth_bytes_per_s
        if sharding == "gradients":
            # ZeRO-2 gathers the updated weights after the step (ZeRO-1's gather is inside its all-reduce cost).
            step_ms += all_gather_ms(params * weight_bytes, d, bandwidth, latency)
        optimizer_step.append(step_ms)
        static.append(params * per_parameter + buffers)
    return DataParallelCosts(
        unshard_ms=[round(x, 6) for x in unshard],
        reduce_grad_ms=[round(x, 6) for x in reduce],
        optimizer_step_ms=[round(x, 6) for x in optimizer_step],
        weights_bytes=weights,
        gradients_bytes=gradients,
        static_bytes=[float(round(x)) for x in static],
        link=link,
    )


def _with_experts(
    *,
    stage_parameters: list[float],
    stage_expert_parameters: list[float],
    expert_data_parallel_size: int,
    expert_group_stride: int,
    tensor_parallel: int,
    stage_largest_unit: list[float] | None,
    **common: Any,
) -> DataParallelCosts:
    """The dense parameters over the data-parallel group plus the routed experts over their own group: times
    add (one stream runs both), bytes add, the optimizer steps add. The one FSDP unit's unsharded gradient
    buffer is counted with the dense part only."""
    dense_parameters = [
        total - experts for total, experts in zip(stage_parameters, stage_expert_parameters, strict=True)
    ]
    dense = data_parallel_costs(
        stage_parameters=dense_parameters,
        tensor_parallel=tensor_parallel,
        stage_largest_unit=stage_largest_unit,
        **common,
    )
    experts = data_parallel_costs(
        **{**common, "data_parallel_size": expert_data_parallel_size},
        stage_parameters=list(stage_expert_parameters),
        tensor_parallel=expert_group_stride,
        stage_largest_unit=stage_largest_unit if common["reshard_after_forward"] else [0.0] * len(stage_parameters),
    )

    def add(first: list[float], second: list[float]) -> list[float]:
        return [round(a + b, 6) for a, b in zip(first, second, strict=True)]

    return DataParallelCosts(
        unshard_ms=add(dense.unshard_ms, experts.unshard_ms),
        reduce_grad_ms=add(dense.reduce_grad_ms, experts.reduce_grad_ms),
        optimizer_step_ms=add(dense.optimizer_step_ms, experts.optimizer_step_ms),
        weights_bytes=add(dense.weights_bytes, experts.weights_bytes),
        gradients_bytes=add(dense.gradients_bytes, experts.gradients_bytes),
        static_bytes=[float(round(a + b)) for a, b in zip(dense.static_bytes, experts.static_bytes, strict=True)],
        link=dense.link if dense.link == experts.link else f"{dense.link} (experts {experts.link})",
    )


def describe(costs: DataParallelCosts) -> dict[str, Any]:
    """A JSON-able summary (for logs and the bench)."""
    return {
        "link": costs.link,
        "unshard_ms": costs.unshard_ms,
        "reduce_grad_ms": costs.reduce_grad_ms,
        "optimizer_step_ms": costs.optimizer_step_ms,
    }


#: Bytes per element of the sequence-parallel all-gathers under torchao's Float8 tensor parallelism.
FLOAT8_GATHER_BYTES = 1.0


def tensor_parallel_layer_ms(
    model: ModelConfig,
    tensor_parallel: int,
    bandwidth_bytes_per_s: float,
    latency_ms: float = 0.0,
    *,
    float8_gathers: bool = False,
) -> float:
    """Communication of one layer's F (equally of its I) for one microbatch, ms: two all-reduces of s·b·h in the
    model's dtype, or with sequence parallelism two all-gathers and two reduce-scatters of the same volume.

    ``float8_gathers``: the all-gathers move FP8 (1 byte per element), the reduce-scatters the model's dtype.
    torchao's Float8 tensor parallelism (``Float8ColwiseParallel``, ``Float8RowwiseParallel``,
    ``PrepareFloat8ModuleInput`` in ``torchao/float8/float8_tensor_parallel.py``, pytorch/ao eab345c, which
    torchtitan 9dec370's ``apply_tp`` uses whenever Float8 is on; its ``docs/float8.md``: "float8 all-gather ... for
    TP (by default for ``Float8Linear``)") casts the sequence-sharded input to FP8 before
    redistributing it to replicated (the forward's gathers), and casts the gradient to FP8 e5m2 before the
    rowwise output's backward gathers it (``NoopFwToFloat8BwDynamic`` applied after the redistribute); the
    partial outputs and the input gradients are reduce-scattered in bf16. Its per-cast amax all-reduces over the
    tensor-parallel group (one scalar each, about eight a layer) are latency only and not counted. Transformer
    Engine (Megatron-Core's and NeMo's FP8 layers) does the same: its LayerNorm writes the column-parallel input
    in FP8 before the sequence-parallel all-gather (``ln_out_dtype = torch.uint8`` when FP8, then
    ``gather_along_first_dim(ln_out, ...)``, or into the FP8 userbuffer under the all-gather overlap,
    ``transformer_engine/pytorch/module/layernorm_linear.py`` v1.7 to v1.13; from v2.0 ``with_quantized_all_gather
    = fp8`` and "AG overlap with FP8 GEMM inputs requires FP8 buffer"), and the row-parallel layers' backward
    casts the output gradient to FP8 before gathering it ("FP8 case with gather: unfused bgrad, cast, transpose
    for efficient gather", ``grad_output_preprocess`` in ``module/base.py``, v1.7 to v1.13); the reduce-scatters
    stay in the activations' dtype (NVIDIA/TransformerEngine, tags v1.7, v1.13, v2.1)."""
    activation_bytes = model.seq_length * model.micro_batch_size * model.hidden_size * model.dtype_bytes
    if not float8_gathers:
        return 2 * all_reduce_ms(activation_bytes, tensor_parallel, bandwidth_bytes_per_s, latency_ms)
    gathered = activation_bytes * FLOAT8_GATHER_BYTES / model.dtype_bytes
    return 2 * (
        all_gather_ms(gathered, tensor_parallel, bandwidth_bytes_per_s, latency_ms)
        + reduce_scatter_ms(activation_bytes, tensor_parallel, bandwidth_bytes_per_s, latency_ms)
    )
