"""Ring collective times (ms) and the tensor-parallel communication of one layer.

The ring formulas have one home, :mod:`pipesched.optimizer.collectives` (Thakur et al. 2005, "Optimization
of Collective Communication Operations in MPICH", §4; Patarasuk and Yuan 2009), re-exported here for the
cost model and the planner: all-reduce 2(d−1)·(α + B/(d·β)); reduce-scatter and all-gather (d−1)·(α + B/(d·β)).

Tensor parallelism (Shoeybi et al. 2019, Megatron-LM, §3; Korthikanti et al. 2022, §4.2.2): each layer's
forward all-reduces its s·b·h activation twice (after attention and after the MLP), and its input-gradient
backward twice; with sequence parallelism each all-reduce becomes an all-gather plus a reduce-scatter of the
same total volume. Megatron runs these on the compute stream (not overlapped), so they add to F and I.
"""

from __future__ import annotations

from pipesched.optimizer.collectives import all_gather_ms, all_reduce_ms, reduce_scatter_ms
from pipesched.optimizer.configs import ModelConfig

__all__ = ["all_gather_ms", "all_reduce_ms", "reduce_scatter_ms", "tensor_parallel_layer_ms"]


def tensor_parallel_layer_ms(
    model: ModelConfig, tensor_parallel: int, bandwidth_bytes_per_s: float, latency_ms: float = 0.0
) -> float:
    """Communication of one layer's F (equally of its I) for one microbatch: two all-reduces of s·b·h, ms."""
    activation_bytes = model.seq_length * model.micro_batch_size * model.hidden_size * model.dtype_bytes
    return 2 * all_reduce_ms(activation_bytes, tensor_parallel, bandwidth_bytes_per_s, latency_ms)
