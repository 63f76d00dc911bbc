"""Context parallelism: what ring attention sends and how much of it the attention compute hides.

With context parallelism c (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers", §3;
Megatron-LM ``--context-parallel-size`` with ``--cp-comm-type p2p``; torchtitan's ``context_parallel``) each
rank holds s/c tokens of every sequence: its queries, keys and values. Attention runs in c steps: in each a
rank computes its queries against one key/value block and passes that block to the next rank of the ring, so
c − 1 transfers each overlap one block's attention. Causal masks are balanced head-tail (the sequence cut in
2c chunks, rank i holding chunks i and 2c − 1 − i: Megatron's zig-zag, torchtitan's
``context_parallel_load_balancer``), so every rank does 1/c of the causal attention and every step costs the
same.

Per layer and microbatch on one of t tensor-parallel ranks:

- a key/value block is (s·b/c) tokens × (key + value width on the rank) × the dtype's bytes; the key/value
  width is 2·n_kv·d/t for (grouped-query) attention (n_kv < t: one head on each rank, Megatron replicates
  it) and the uncompressed a·(d_nope + d_rope) + a·d_v over t for multi-head latent attention (Megatron
  passes the up-projected keys and values);
- F sends c − 1 blocks, each beside 1/c of the rank's attention core; the input-gradient backward I sends
  the blocks again and their gradients (twice the bytes) beside 1/c of the backward core; W sends nothing;
- a step's exposed time is max(0, transfer − that step's compute), summed over the c − 1 steps;
- every step after the first merges its partial result into the running one by the log-sum-exp rescale
  (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; Megatron/Transformer Engine's
  ``flash_attn_fwd_out_correction``, PyTorch's ``_SDPAMerger``): F reads the step's output and reads and
  writes the float32 running output, :data:`MERGE_FORWARD_BYTES` per output element; I accumulates the query
  gradient and the passed key/value gradients in float32, :data:`MERGE_BACKWARD_BYTES` per element of each.
  That traffic runs at HBM speed on the compute stream, beside nothing;
- the ring's link is the intra-node one while t·c GPUs fit a node (the mesh puts context parallelism right
  outside tensor parallelism: Megatron's ``tp-cp-ep-dp-pp``, torchtitan's ``[…, "cp", "tp"]``), otherwise
  the inter-node one (every step waits for its slowest hop).

**The attention kernel.** Megatron-Core runs each step through Transformer Engine's fused attention (cuDNN or
FlashAttention-3 on Hopper); PyTorch's ``context_parallel`` (torchtitan, kernels ``eager`` or ``compiled``)
dispatches each step to ATen's ``_scaled_dot_product_flash_attention`` (``_templated_ring_attention`` in
``torch/distributed/tensor/experimental/_attention.py``), PyTorch's FlashAttention-2 port, which reaches about
35% of an H100's bf16 peak against 75% for Hopper kernels (Shah et al. 2024, FlashAttention-3, §4.1). Its speed
relative to today's kernels is the software's ``attention_kernel_speed`` of ``flash-attn-2023`` on that
accelerator (fitted to MosaicML's and torchtitan's FlashAttention-2 runs): :func:`pytorch_attention_speed`, the
same kernel PyTorch's attention runs without context parallelism. With kernels ``unknown`` (the framework not
said) the layer takes the expected time over the frameworks that run its layout
(:func:`pipesched.optimizer.cost.stages.blended`): PyTorch's ring for
the eager and compiled share of the runs, Transformer Engine's for the fused share.

Activation memory and FLOPs divided by c are in :mod:`.memory` and :mod:`.flops`; the weights are replicated
over the c ranks, so their gradients are reduced (and, sharded, gathered) over the d·c ranks holding the
same layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipesched.optimizer.configs import ClusterConfig, ModelConfig
from pipesched.optimizer.cost.flops import attention_core_width

if TYPE_CHECKING:
    from pipesched.optimizer.cost.timing import Hardware

__all__ = [
    "MERGE_BACKWARD_BYTES",
    "MERGE_FORWARD_BYTES",
    "RingAttention",
    "context_link",
    "key_value_block_bytes",
    "pytorch_attention_speed",
    "ring_attention",
]

#: Bytes per output element one merge step moves in F: the step's bf16 output read (2), the float32 running
#: output read and written (8).
MERGE_FORWARD_BYTES = 10.0
#: Bytes per gradient element (query, and the passed keys and values) one step accumulates in I: float32 read and
#: written.
MERGE_BACKWARD_BYTES = 8.0


@dataclass(frozen=True)
class RingAttention:
    """Ring attention of one layer for one microbatch on one rank.

    Attributes:
        block_bytes: one key/value block, bytes.
        steps: transfers per pass (c − 1).
        forward_exposed_ms: what F waits for the ring beyond its attention compute, ms.
        backward_input_exposed_ms: the same for I (blocks and their gradients), ms.
        link: ``"intra-node"`` or ``"inter-node"``.
        forward_merge_bytes, backward_input_merge_bytes: the partial results' merge traffic of F and I, bytes
            (module docstring).
    """

    block_bytes: float
    steps: int
    forward_exposed_ms: float
    backward_input_exposed_ms: float
    link: str
    forward_merge_bytes: float = 0.0
    backward_input_merge_bytes: float = 0.0


def key_value_block_bytes(model: ModelConfig, tensor_parallel: int, context_parallel: int) -> float:
    """Bytes of one rank's key/value block: (s·b/c) tokens × key + value width on the rank (module docstring)."""
    tokens = model.seq_length * model.micro_batch_size / context_parallel
    if model.is_mla:
        query_key, value = attention_core_width(model)
        width = (query_key + value) / tensor_parallel
    else:
        heads = max(1, math.ceil(model.key_value_heads / tensor_parallel))
        width = 2 * heads * model.head_size
    return tokens * width * model.dtype_bytes


def pytorch_attention_speed(model: ModelConfig, hardware: Hardware) -> float:
    """FlashAttention's kernel speed relative to the profile's attention (today's kernels for the accelerator):
    PyTorch's FlashAttention-2 (``attention_kernel_speed`` of ``flash-attn-2023`` on the accelerator, s₂) for
    kernels ``eager`` or ``compiled``, 1 for ``fused`` (kernels ``unknown`` blend the layers of the modes:
    :func:`pipesched.optimizer.cost.stages.blended`).

    With context parallelism the ring calls ATen's ``_scaled_dot_product_flash_attention`` (module docstring);
    without it ``torch.nn.functional.scaled_dot_product_attention`` picks its backend by a fixed priority that puts
    FlashAttention before cuDNN on Hopper (meta-pytorch/tritonbench issue 41, November 2024: SDPA on an H100 runs
    far slower than its cuDNN backend unless that backend is asked for; huggingface/transformers pull request
    48163, 2026: cuDNN's Hopper kernels 1.7-2.3x faster than the default for training shapes). So torchtitan's
    and llm-foundry's runs on an H100 ran FlashAttention-2 with or without context parallelism, while
    Transformer Engine's fused attention (Megatron-Core, NeMo) runs cuDNN's Hopper kernels. torch 2.11 picks
    cuDNN's kernels itself (measured on an H100 by ``bench/device_step_bench.py --breakdown``: the default ran
    cuDNN at 57% / 47% of the bf16 peak forward / backward for 128-wide causal heads at 8,192 tokens, its
    FlashAttention backend at 31% / 27%): the software profile's ``pytorch_sdpa_backend`` "cudnn" then gives 1."""
    if model.kernels == "fused" or hardware.software.pytorch_sdpa_backend == "cudnn":
        return 1.0
    return hardware.software.attention_speed("flash-attn-2023", hardware.name)


def merge_bytes(model: ModelConfig, tensor_parallel: int, context_parallel: int) -> tuple[float, float]:
    """(F, I) bytes of the c − 1 merges of one layer and microbatch on one rank (module docstring)."""
    steps = context_parallel - 1
    tokens = model.seq_length * model.micro_batch_size / context_parallel
    if model.is_mla:
        query_key, value = attention_core_width(model)
        output, key_value = value / tensor_parallel, (query_key + value) / tensor_parallel
        query = query_key / tensor_parallel
    else:
        heads = max(1, math.ceil(model.key_value_heads / tensor_parallel))
        output = query = model.num_attention_heads * model.head_size / tensor_parallel
        key_value = 2 * heads * model.head_size
    forward = steps * tokens * output * MERGE_FORWARD_BYTES
    return forward, steps * tokens * (query + key_value) * MERGE_BACKWARD_BYTES


def context_link(cluster: ClusterConfig, tensor_parallel: int, context_parallel: int) -> tuple[float, str]:
    """(bandwidth per GPU in bytes/s, where) of the context-parallel ring (module docstring)."""
    if tensor_parallel * context_parallel <= cluster.gpus_per_node:
        return cluster.intra_node_bandwidth_bytes_per_s, "intra-node"
    return cluster.inter_node_bandwidth_bytes_per_s, "inter-node"


def ring_attention(
    model: ModelConfig,
    cluster: ClusterConfig,
    tensor_parallel: int,
    context_parallel: int,
    *,
    attention_forward_ms: float,
    attention_backward_ms: float,
    bandwidth_bytes_per_s: float | None = None,
) -> RingAttention:
    """The ring's transfers and their exposed time for one layer and microbatch (module docstring).

    Args:
        attention_forward_ms, attention_backward_ms: the rank's whole attention core in F and in I (all c
            blocks), ms; each step overlaps 1/c of it.
        bandwidth_bytes_per_s: the ring's achieved bandwidth; default the link of :func:`context_link`.
    """
    c = context_parallel
    block = key_value_block_bytes(model, tensor_parallel, c)
    bandwidth, link = context_link(cluster, tensor_parallel, c)
    if bandwidth_bytes_per_s is not None:
        bandwidth = bandwidth_bytes_per_s
    if c <= 1:
        return RingAttention(0.0, 0, 0.0, 0.0, link)
    latency = cluster.p2p_latency_ms
    forward_step = latency + 1e3 * block / bandwidth
    backward_step = latency + 1e3 * 2 * block / bandwidth
    steps = c - 1
    forward_exposed = steps * max(0.0, forward_step - attention_forward_ms / c)
    backward_exposed = steps * max(0.0, backward_step - attention_backward_ms / c)
    return RingAttention(block, steps, forward_exposed, backward_exposed, link, *merge_bytes(model, tensor_parallel, c))
