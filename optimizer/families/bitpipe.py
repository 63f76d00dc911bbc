"""BitPipe (Wu et al. 2024, arXiv 2410.19367): two V-shaped pipelines running in opposite directions.

Placement "bidirectional" (see :mod:`pipesched.optimizer.instance`): replica 0 has stage ids 0 … S−1 in V
placement, replica 1 ids S … 2S−1 mirrored, so every rank holds four stage ids; microbatches
0 … ⌈m/2⌉−1 run through replica 0, the rest through replica 1. Both directions fill each other's
warm-up and cool-down. We order the actions with the capped list scheduler of :mod:`._greedy`,
letting each rank hold the activations of at most p microbatches (1F1B's peak in microbatches);
BitPipe's eager gradient synchronisation is outside the model. Any microbatch count, split or
fused backward. The authors' generator was not available to port (no public code found), so this
remains our greedy; on uniform costs its bubble is below interleaved 1F1B's at equal microbatches
(p=4, m=16: 0.010 against 0.059; ``tests/optimizer/test_v_families.py``). With a fused backward (B) the cap of
p microbatches starves both V pipelines (p=4, m=16, p2p 0.05: bubble 0.31, 1F1B's is 0.17); ``auto``
runs the same greedy at larger caps where the memory limit allows (1.5p: 0.08, 3p: 0.03).
"""

from __future__ import annotations

from pipesched.optimizer.families._base import FamilySpec
from pipesched.optimizer.families.v_shape import capped_v_orders

FAMILIES = [
    FamilySpec(
        name="bitpipe",
        description="BitPipe: two V-shaped replicas in opposite directions filling each other's bubbles.",
        build=lambda problem: capped_v_orders(problem, lambda p: p),
        listing_order=110,
        placements=("bidirectional",),
        stages_per_rank=range(2, 3),
    )
]
