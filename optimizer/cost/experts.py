"""Expert parallelism: where a mixture-of-experts layer's experts live and what its all-to-alls cost.

**Groups** (Megatron-Core's MoE parallel folding, Liu et al. 2025, arXiv 2504.14960; Megatron-LM
``--expert-model-parallel-size``, ``--expert-tensor-parallel-size``): the t·c·d GPUs that hold the same
pipeline stage are regrouped for the expert layers as expert-tensor e_t × expert-parallel ep × expert-data
e_d. A layout may state e_t (``ExpertParallel.tensor_parallel``); unset, the experts run whole on each GPU when
ep > 1 (e_t = 1, the choice of the published DeepSeek-V3, Qwen3 and Mixtral recipes and Megatron's advice "prefer
EP over TP for expert layers") and are split like a dense FFN when ep = 1 (e_t = t). Megatron-Core itself takes
e_t = t when ``expert_tensor_parallel_size`` is not given (``ModelParallelConfig.__post_init__`` and
``initialize_model_parallel`` from core_v0.10.0 on), so a recipe that states no e_t ran e_t = t. ep·e_t must divide
t·c·d, each GPU holds E/ep experts of 1/e_t of their width (weights, gradients and optimizer state), and their
gradients are reduced over the e_d = t·c·d / (ep·e_t) GPUs holding the same expert shards, while the attention,
norms, router and shared experts are reduced over the d·c GPUs of the dense layers.

**Token traffic** (Lepikhin et al. 2020, GShard, §2.2; DeepSeek-V3 report §3.2.2): every pass of a MoE layer
sends each token to its k experts and brings the results back: two all-to-alls in F (dispatch, combine) and
two in the input-gradient backward I (the gradients, in reverse); W sends nothing. A GPU holds s·b/(c·t)
tokens (sequence parallelism splits them over the tensor-parallel ranks, which dispatch their own), so one
all-to-all moves s·b·k·h·dtype/(c·t) bytes from it, the busiest GPU ``moe_load_imbalance`` times that. With
the expert mesh innermost after e_t, min(ep, gpus_per_node/e_t) of the ep GPUs share a node; inside one node
the (ep − 1)/ep share bound for peers crosses NVLink. An expert group over N nodes dispatches hierarchically,
as DeepEP (DeepSeek-V3 report §3.2.2) and Megatron's flex dispatcher do: a token crosses the network once per
other node holding one of its k experts — (N − 1)·(1 − (1 − 1/N)^k) nodes on average for uniformly spread
experts — and fans out to its experts there over NVLink; combine is the mirror image. A flat all-to-all
(Megatron-Core's ``alltoall`` dispatcher: one NCCL all-to-all over the ep ranks, the dispatcher of Megatron
Bridge's Qwen3-235B H100 and GPT-OSS recipes) sends every one of a token's k copies to its expert's GPU, so
k·(N − 1)/N of them cross the network. Network and NVLink legs run at once, so an all-to-all takes the longer of
the two, plus one latency per peer group.

**Expert tensor parallelism on the token path** (Megatron-Core ``MoEAlltoAllTokenDispatcher``, core_v0.10.0
``token_dispatcher.py``): with e_t > 1 each GPU still dispatches only its own s·b/(c·t) tokens over the ep group
(the all-to-all's bytes above), then all-gathers what it received over the e_t GPUs of its expert shards
(``gather_from_sequence_parallel_region`` on the expert-tensor group) so that each expert's 1/e_t slice sees all of
its tokens, and after the experts reduce-scatters the partial outputs back (``reduce_scatter_to_sequence_parallel_
region``) before the combine all-to-all. Each GPU receives R = s·b·k·h·dtype/(c·t) bytes in the dispatch, so the
all-gather brings it (e_t − 1)·R and the reduce-scatter sends as much: (e_t − 1)·(α + R/β) each on the ring (the
expert-tensor group is innermost, consecutive GPUs of one node while e_t ≤ GPUs per node). In I the two swap
roles (an all-gather's gradient is a reduce-scatter), so F and I each carry one of both; W none. The experts'
products then run on e_t·ep·k·s·b/(c·t·E) rows of each local expert, 1/e_t of its width
(:func:`pipesched.optimizer.cost.timing.expert_gemms`).

**Overlap** (DeepSeek-V3 §3.2.1, DualPipe; Megatron's ``--overlap-moe-expert-parallel-comm``): a schedule that
runs one microbatch's forward beside another's backward can hide the all-to-alls of one behind the compute
of the other. With ``ExpertParallel.overlap`` a pass exposes only what its all-to-alls exceed of its own
compute; otherwise all of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipesched.optimizer.configs import ClusterConfig, ModelConfig

__all__ = ["ExpertGroups", "ExpertTraffic", "expert_groups", "expert_tensor_degree", "expert_traffic"]


@dataclass(frozen=True)
class ExpertGroups:
    """How a stage's GPUs split for the expert layers (module docstring).

    Attributes:
        expert_parallel: ep, GPUs sharing one layer's routed experts.
        expert_tensor_parallel: e_t, GPUs splitting one expert (as stated; unset 1 when ep > 1, t otherwise).
        experts_per_rank: routed experts each GPU holds (E / ep).
    """

    expert_parallel: int
    expert_tensor_parallel: int
    experts_per_rank: int

    def data_parallel(self, tensor_parallel: int, context_parallel: int, data_parallel: int) -> int:
        """e_d: GPUs holding the same experts among a stage's t·c·d (their gradients' reduction group).

        Raises:
            ValueError: ep·e_t does not divide t·c·d (the message names the sizes).
        """
        ranks = tensor_parallel * context_parallel * data_parallel
        width = self.expert_parallel * self.expert_tensor_parallel
        if ranks % width:
            raise ValueError(
                f"expert_parallel {self.expert_parallel} does not divide the {ranks} GPUs (tensor × context × data "
                "parallel) holding a stage"
            )
        return ranks // width


def expert_tensor_degree(tensor_parallel: int, expert_parallel: int, stated: int | None = None) -> int:
    """e_t: ``stated`` where a layout states it, else 1 when ep > 1 (experts whole on each GPU) and the tensor degree
    t when ep = 1 (experts split like a dense FFN) (module docstring)."""
    if stated is not None:
        return stated
    return 1 if expert_parallel > 1 else tensor_parallel


def expert_groups(
    model: ModelConfig, tensor_parallel: int, expert_parallel: int, expert_tensor_parallel: int | None = None
) -> ExpertGroups:
    """The expert groups for tensor degree t, expert degree ep and expert tensor degree e_t (module docstring;
    ``None``: 1 when ep > 1, t otherwise).

    Raises:
        ValueError: ep does not divide the experts, or e_t does not divide the experts' FFN width.
    """
    experts = model.num_experts or 1
    ep = expert_parallel
    if experts % ep:
        raise ValueError(f"expert_parallel {ep} does not divide the {experts} experts")
    e_t = expert_tensor_degree(tensor_parallel, ep, expert_tensor_parallel)
    if model.is_moe and model.expert_ffn_size % e_t:
        raise ValueError(f"expert tensor_parallel {e_t} does not divide the experts' FFN width {model.expert_ffn_size}")
    return ExpertGroups(ep, e_t, experts // ep)


@dataclass(frozen=True)
class ExpertTraffic:
    """The all-to-alls of one MoE layer for one microbatch on the busiest GPU.

    Attributes:
        bytes_per_all_to_all: what the GPU sends in one all-to-all (its tokens × k × h × dtype × imbalance).
        all_to_all_ms: one all-to-all, ms.
        forward_ms, backward_input_ms: the pass's all-to-alls (two each) and expert-tensor collectives, ms.
        link: ``"intra-node"``, ``"inter-node"`` or ``"none"`` (ep = 1).
        expert_tensor_bytes: what the GPU receives in the expert-tensor all-gather (and sends in the
            reduce-scatter): (e_t − 1) × its dispatched bytes; 0 when e_t = 1.
        expert_tensor_ms: one of those two collectives, ms.
    """

    bytes_per_all_to_all: float
    all_to_all_ms: float
    forward_ms: float
    backward_input_ms: float
    link: str
    expert_tensor_bytes: float = 0.0
    expert_tensor_ms: float = 0.0


def expert_traffic(
    model: ModelConfig,
    cluster: ClusterConfig,
    groups: ExpertGroups,
    tensor_parallel: int,
    context_parallel: int,
    *,
    intra_bandwidth_bytes_per_s: float | None = None,
    inter_bandwidth_bytes_per_s: float | None = None,
    hierarchical: bool = True,
) -> ExpertTraffic:
    """Dispatch and combine times of one MoE layer for one microbatch (module docstring).

    Args:
        intra_bandwidth_bytes_per_s, inter_bandwidth_bytes_per_s: achieved all-to-all bandwidth per GPU inside
            and between nodes; default the cluster's nominal links.
        hierarchical: tokens cross the network once per remote node (DeepEP, the flex dispatcher); False: a flat
            all-to-all sends each of the k copies (the ``alltoall`` dispatcher).
    """
    ep = groups.expert_parallel
    if ep <= 1 or not model.is_moe:
        return ExpertTraffic(0.0, 0.0, 0.0, 0.0, "none")
    intra = intra_bandwidth_bytes_per_s or cluster.intra_node_bandwidth_bytes_per_s
    inter = inter_bandwidth_bytes_per_s or cluster.inter_node_bandwidth_bytes_per_s
    tokens = model.seq_length * model.micro_batch_size / (context_parallel * tensor_parallel)
    top_k = model.num_experts_per_token or 1
    row = tokens * model.hidden_size * model.dtype_bytes * model.moe_load_imbalance
    sent = row * top_k
    in_node = max(1, min(ep, cluster.gpus_per_node // groups.expert_tensor_parallel))
    nodes = ep / in_node
    if nodes > 1:
        # each token crosses the network once per other node holding one of its experts, then fans out over NVLink
        remote_nodes = (nodes - 1) * (1 - (1 - 1 / nodes) ** top_k) if hierarchical else top_k * (nodes - 1) / nodes
        inter_ms = 1e3 * row * remote_nodes / inter
        intra_ms = 1e3 * sent * in_node / ep / intra
    else:
        inter_ms, intra_ms = 0.0, 1e3 * sent * (ep - 1) / ep / intra
    peer_groups = 1 if in_node == ep else 2
    one = max(intra_ms, inter_ms) + peer_groups * cluster.collective_latency_ms
    link = "intra-node" if in_node == ep else "inter-node"
    gathered, gather_ms = _expert_tensor_gather(cluster, groups.expert_tensor_parallel, sent, intra, inter)
    return ExpertTraffic(sent, one, 2 * (one + gather_ms), 2 * (one + gather_ms), link, gathered, gather_ms)


def _expert_tensor_gather(
    cluster: ClusterConfig, expert_tensor_parallel: int, received: float, intra: float, inter: float
) -> tuple[float, float]:
    """(bytes, ms) of the all-gather over the e_t GPUs of one expert of the ``received`` dispatched bytes (and of
    its mirror reduce-scatter): (e_t − 1)·(α + R/β) on a ring, over NVLink while e_t ≤ GPUs per node."""
    e_t = expert_tensor_parallel
    if e_t <= 1:
        return 0.0, 0.0
    bandwidth = intra if e_t <= cluster.gpus_per_node else inter
    return (e_t - 1) * received, (e_t - 1) * (cluster.collective_latency_ms + 1e3 * received / bandwidth)
