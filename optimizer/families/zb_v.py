"""ZB-V (Zero Bubble paper, Sec. 6 "Zero Bubble V schedule"; Qi et al. 2024).

V placement: rank r holds stages r and 2p−1−r, so rank 0 runs both the first and the last stage.
ZB-V aims at a near-zero bubble at 1F1B's activation peak (p microbatches on a rank). We build it
with the capped list scheduler of :mod:`._greedy` at exactly that cap (p microbatches' activations
of the rank's two stages): backwards first, then forwards, W passes filling every gap. This is a
greedy realisation, not the paper's handcrafted pattern, and its bubble can be larger where p2p
latency is high. Needs split backward (it schedules I and W separately).
"""

from __future__ import annotations

from optimizer.families._base import Family, require
from optimizer.families.v_shape import capped_v_orders, require_v
from optimizer.problem import Problem


def _check(problem: Problem) -> None:
    require_v(problem, "zb-v")
    require(
        problem.split_backward,
        "zb-v",
        "needs split_backward true (it schedules I and W separately): set split_backward to true or use dualpipe-v",
    )


FAMILIES = [
    Family(
        name="zb-v",
        description="ZB-V: V placement, W fills the bubbles, at 1F1B's activation peak (p microbatches per rank).",
        domain='placement "v" (stages_per_rank 2), split_backward true, any microbatch count',
        check=_check,
        build=lambda problem: capped_v_orders(problem, lambda p: p),
    )
]
