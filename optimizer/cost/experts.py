"""Expert parallelism: where a mixture-of-experts layer's experts live and what its all-to-alls cost.

**Groups** (Megatron-Core's MoE parallel folding, Liu et al. 2025, arXiv 2504.14960; Megatron-LM
``--expert-model-parallel-size``, ``--expert-tensor-parallel-size``): the t·c·d GPUs that hold the same
pipeline stage are regrouped for the expert layers as expert-tensor e_t × expert-parallel ep × expert-data
e_d. With ep > 1 the experts run whole on each GPU (e_t = 1, the choice of the published DeepSeek-V3, Qwen3
and Mixtral recipes and Megatron's advice "prefer EP over TP for expert layers"); with ep = 1 they are split
like a dense FFN (e_t = t). So ep must divide t·c·d / e_t, each GPU holds E/ep experts (of 1/e_t of their
width), and their gradients are reduced over the e_d = t·c·d / (ep·e_t) GPUs holding the same experts,
while the attention, norms, router and shared experts are reduced over the d·c GPUs of the dense layers.

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

**Overlap** (DeepSeek-V3 §3.2.1, DualPipe; Megatron's ``--overlap-moe-expert-parallel-comm``): a schedule that
runs one microbatch's forward beside another's backward can hide the all-to-alls of one behind the compute
of the other. With ``ExpertParallel.overlap`` a pass exposes only what its all-to-alls exceed of its own
compute; otherwise all of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipesched.optimizer.configs import ClusterConfig, ModelConfig

__all__ = ["ExpertGroups", "ExpertTraffic", "expert_groups", "expert_traffic"]


@dataclass(frozen=True)
class ExpertGroups:
    """How a stage's GPUs split for the expert layers (module docstring).

    Attributes:
        expert_parallel: ep, GPUs sharing one layer's routed experts.
        expert_tensor_parallel: e_t, GPUs splitting one expert (1 when ep > 1, t otherwise).
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


def expert_groups(model: ModelConfig, tensor_parallel: int, expert_parallel: int) -> ExpertGroups:
    """The expert groups for tensor degree t and expert degree ep (module docstring).

    Raises:
        ValueError: ep does not divide the experts.
    """
    experts = model.num_experts or 1
    ep = expert_parallel
    if experts % ep:
        raise ValueError(f"expert_parallel {ep} does not divide the {experts} experts")
    return ExpertGroups(ep, 1 if ep > 1 else tensor_parallel, experts // ep)


@dataclass(frozen=True)
class ExpertTraffic:
    """The all-to-alls of one MoE layer for one microbatch on the busiest GPU.

    Attributes:
        bytes_per_all_to_all: what the GPU sends in one all-to-all (its tokens × k × h × dtype × imbalance).
        all_to_all_ms: one all-to-all, ms.
        forward_ms, backward_input_ms: the pass's all-to-alls (two each), ms.
        link: ``"intra-node"``, ``"inter-node"`` or ``"none"`` (ep = 1).
    """

    bytes_per_all_to_all: float
    all_to_all_ms: float
    forward_ms: float
    backward_input_ms: float
    link: str


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
    return ExpertTraffic(sent, one, 2 * one, 2 * one, link)
