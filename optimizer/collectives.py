"""Data-parallel collective costs and memory: what ``costs.unshard``/``reduce_grad``/``optimizer_step`` and
``memory.weights``/``gradients``/``static`` are for a model on a cluster (contract, Problem: data_parallel).

Ring collectives over a group of d ranks moving B bytes, link bandwidth β per rank (bytes/s) and latency α
per step (Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH",
2005, Sec. 4; ``shared/NOTES.md`` §6):

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

Static bytes per parameter by sharding (ZeRO paper, Sec. 5.1, K = 12 for mixed-precision Adam): weights
w (2 B bf16, or 1/d of it with ``full``), gradients 4 B (fp32), optimizer state 12 B (1/d of it from
``optimizer`` up). With ``gradients``/``full`` the whole gradient buffer is counted from the step's
start and REDUCE_GRAD frees (d−1)/d of it (``memory.gradients``); with ``full`` UNSHARD holds the gathered
(d−1)/d of the weights until RESHARD (``memory.weights``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipesched.optimizer.configs import ClusterConfig, ModelConfig

__all__ = [
    "ADAM_BYTES_PER_PARAMETER",
    "GRADIENT_REDUCE_BYTES",
    "DataParallelCosts",
    "all_gather_ms",
    "all_reduce_ms",
    "data_parallel_costs",
    "group_link",
    "reduce_scatter_ms",
]

#: Bytes of memory traffic per parameter in one mixed-precision Adam step (module docstring).
ADAM_BYTES_PER_PARAMETER = 30.0
#: Bytes per gradient element reduced over the data-parallel group (fp32).
GRADIENT_REDUCE_BYTES = 4.0
#: fp32 optimizer state per parameter with mixed precision: master weights, first and second moment.
_OPTIMIZER_STATE_BYTES = 12.0


def all_reduce_ms(num_bytes: float, group_size: int, bandwidth_bytes_per_s: float, latency_ms: float) -> float:
    """Ring all-reduce of ``num_bytes`` over ``group_size`` ranks, ms: 2(d−1)·α + 2(d−1)/d · B/β (Thakur et al.
    2005, Sec. 4.4). Zero for a group of one."""
    d = group_size
    if d <= 1:
        return 0.0
    return 2 * (d - 1) * latency_ms + 1e3 * 2 * (d - 1) / d * num_bytes / bandwidth_bytes_per_s


def reduce_scatter_ms(num_bytes: float, group_size: int, bandwidth_bytes_per_s: float, latency_ms: float) -> float:
    """Ring reduce-scatter of ``num_bytes`` (the whole buffer) over ``group_size`` ranks, ms:
    (d−1)·α + (d−1)/d · B/β (Thakur et al. 2005, Sec. 4.5)."""
    d = group_size
    if d <= 1:
        return 0.0
    return (d - 1) * latency_ms + 1e3 * (d - 1) / d * num_bytes / bandwidth_bytes_per_s


def all_gather_ms(num_bytes: float, group_size: int, bandwidth_bytes_per_s: float, latency_ms: float) -> float:
    """Ring all-gather producing ``num_bytes`` on every rank, ms: (d−1)·α + (d−1)/d · B/β (Thakur et al. 2005,
    Sec. 4.1)."""
    return reduce_scatter_ms(num_bytes, group_size, bandwidth_bytes_per_s, latency_ms)


def group_link(cluster: ClusterConfig, group_size: int, tensor_parallel: int = 1) -> tuple[float, str]:
    """Bandwidth (bytes/s per rank) of a data-parallel group of ``group_size`` and where it lies.

    Inside a node when ``tensor_parallel · group_size ≤ gpus_per_node`` (module docstring), using
    ``intra_node_bandwidth_bytes_per_s``; across nodes otherwise, using ``inter_node_bandwidth_bytes_per_s``.
    A cluster without these fields (or without ``gpus_per_node``) uses ``p2p_bandwidth_bytes_per_s``.

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
            return float(inter), "inter-node"
    return float(cluster.p2p_bandwidth_bytes_per_s), "p2p link"


@dataclass(frozen=True)
class DataParallelCosts:
    """What :func:`data_parallel_costs` derived.

    Attributes:
        unshard_ms: per model stage, the weights' all-gather (0 unless sharding is ``full``).
        reduce_grad_ms: per model stage, the gradients' all-reduce or reduce-scatter.
        optimizer_step_ms: per rank, the Adam step over the rank's (shard of the) parameters.
        weights_bytes: per model stage, unsharded weights in the model dtype.
        gradients_bytes: per model stage, the unsharded fp32 gradient buffer.
        static_bytes: per rank, weights + gradients + optimizer state by sharding level.
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
) -> DataParallelCosts:
    """Collective times (ms), optimizer step (ms) and memory (bytes) of a pipeline with d data-parallel copies.

    Args:
        model: the model (its ``dtype`` sets the weights' bytes per parameter).
        cluster: links (``group_link``) and ``p2p_latency_ms`` as the per-step latency α.
        stage_parameters: parameters of each model stage (on one tensor-parallel rank).
        stage_holders: ranks holding each model stage (two for bidirectional placement: both replicas
            take part in the stage's gradient reduction, so its group has 2·d ranks).
        num_ranks: pipeline ranks.
        data_parallel_size: d.
        sharding: ``none``, ``optimizer``, ``gradients`` or ``full``.
        memory_bandwidth_bytes_per_s: the accelerator's memory bandwidth (optimizer step).
        tensor_parallel: tensor-parallel degree (where the group lies).

    Formulas and sources: module docstring.
    """
    d = data_parallel_size
    weight_bytes = float(model.dtype_bytes)
    bandwidth, link = group_link(cluster, d, tensor_parallel)
    latency = cluster.p2p_latency_ms
    mixed = model.dtype != "fp32"
    optimizer_state = _OPTIMIZER_STATE_BYTES if mixed else 8.0
    adam_bytes = ADAM_BYTES_PER_PARAMETER if mixed else 28.0
    unshard, reduce, weights, gradients = [], [], [], []
    for params, holders in zip(stage_parameters, stage_holders, strict=True):
        group = d * len(holders)
        w_bytes = params * weight_bytes
        g_bytes = params * GRADIENT_REDUCE_BYTES
        weights.append(w_bytes)
        gradients.append(g_bytes)
        unshard.append(all_gather_ms(w_bytes, d, bandwidth, latency) if sharding == "full" else 0.0)
        if sharding in ("gradients", "full"):
            reduce.append(reduce_scatter_ms(g_bytes, group, bandwidth, latency))
        else:
            reduce.append(all_reduce_ms(g_bytes, group, bandwidth, latency))
    rank_params = [0.0] * num_ranks
    for params, holders in zip(stage_parameters, stage_holders, strict=True):
        for rank in holders:
            rank_params[rank] += params
    shard = d if sharding != "none" else 1
    optimizer_step = []
    static = []
    for params in rank_params:
        step_ms = 1e3 * params / shard * adam_bytes / memory_bandwidth_bytes_per_s
        if sharding == "gradients":
            # ZeRO-2 gathers the updated weights after the step (ZeRO-1's gather is inside its all-reduce cost).
            step_ms += all_gather_ms(params * weight_bytes, d, bandwidth, latency)
        optimizer_step.append(step_ms)
        w = weight_bytes / (d if sharding == "full" else 1)
        static.append(params * (w + GRADIENT_REDUCE_BYTES + optimizer_state / shard))
    return DataParallelCosts(
        unshard_ms=[round(x, 6) for x in unshard],
        reduce_grad_ms=[round(x, 6) for x in reduce],
        optimizer_step_ms=[round(x, 6) for x in optimizer_step],
        weights_bytes=weights,
        gradients_bytes=gradients,
        static_bytes=[float(round(x)) for x in static],
        link=link,
    )


def describe(costs: DataParallelCosts) -> dict[str, Any]:
    """A JSON-able summary (for logs and the bench)."""
    return {
        "link": costs.link,
        "unshard_ms": costs.unshard_ms,
        "reduce_grad_ms": costs.reduce_grad_ms,
        "optimizer_step_ms": costs.optimizer_step_ms,
    }
