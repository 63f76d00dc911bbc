"""Ring collective times (ms) and the tensor-parallel communication of one layer.

Ring collectives over d ranks, B bytes per rank, bandwidth β bytes/s per rank, latency α per step (Thakur et
al. 2005, "Optimization of Collective Communication Operations in MPICH", §4; Patarasuk and Yuan 2009):
all-reduce 2(d−1)·(α + B/(d·β)); reduce-scatter and all-gather (d−1)·(α + B/(d·β)) each.

Tensor parallelism (Shoeybi et al. 2019, Megatron-LM, §3; Korthikanti et al. 2022, §4.2.2): each layer's
forward all-reduces its s·b·h activation twice (after attention and after the MLP), and its input-gradient
backward twice; with sequence parallelism each all-reduce becomes an all-gather plus a reduce-scatter of the
same total volume. Megatron runs these on the compute stream (not overlapped), so they add to F and I.
"""

from __future__ import annotations

from pipesched.optimizer.configs import ModelConfig

__all__ = ["all_gather_ms", "all_reduce_ms", "reduce_scatter_ms", "tensor_parallel_layer_ms"]


def all_reduce_ms(num_bytes: float, group_size: int, bandwidth_bytes_per_s: float, latency_ms: float = 0.0) -> float:
    """Ring all-reduce of ``num_bytes`` per rank over ``group_size`` ranks: 2(d−1)(α + B/(dβ)), ms."""
    d = group_size
    if d <= 1:
        return 0.0
    return 2 * (d - 1) * (latency_ms + 1e3 * num_bytes / (d * bandwidth_bytes_per_s))


def reduce_scatter_ms(
    num_bytes: float, group_size: int, bandwidth_bytes_per_s: float, latency_ms: float = 0.0
) -> float:
    """Ring reduce-scatter of ``num_bytes`` (the whole buffer) over ``group_size`` ranks: (d−1)(α + B/(dβ)), ms."""
    d = group_size
    if d <= 1:
        return 0.0
    return (d - 1) * (latency_ms + 1e3 * num_bytes / (d * bandwidth_bytes_per_s))


def all_gather_ms(num_bytes: float, group_size: int, bandwidth_bytes_per_s: float, latency_ms: float = 0.0) -> float:
    """Ring all-gather producing ``num_bytes`` on every rank: (d−1)(α + B/(dβ)), ms."""
    return reduce_scatter_ms(num_bytes, group_size, bandwidth_bytes_per_s, latency_ms)


def tensor_parallel_layer_ms(
    model: ModelConfig, tensor_parallel: int, bandwidth_bytes_per_s: float, latency_ms: float = 0.0
) -> float:
    """Communication of one layer's F (equally of its I) for one microbatch: two all-reduces of s·b·h, ms."""
    activation_bytes = model.seq_length * model.micro_batch_size * model.hidden_size * model.dtype_bytes
    return 2 * all_reduce_ms(activation_bytes, tensor_parallel, bandwidth_bytes_per_s, latency_ms)
