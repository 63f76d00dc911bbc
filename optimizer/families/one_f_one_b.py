"""1F1B (PipeDream-Flush, DAPPLE): warm-up forwards, then one forward one backward, then cool-down.

Rank r runs ``min(p − r − 1, m)`` warm-up forwards, so rank 0 holds at most p activations
(peak p·M_B). Bubble (p−1)(T_F + T_B) with zero p2p (Zero Bubble paper, Sec. 2).
"""

from __future__ import annotations

from pipesched.optimizer.families._base import FamilySpec, PlannerEstimate, TorchClass, backward
from pipesched.optimizer.ir import Action, ActionKind, Orders
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.progress import check_deadline


def _build(problem: Problem) -> Orders:
    p, m = problem.pipeline.num_ranks, problem.pipeline.num_microbatches
    orders: Orders = []
    for rank in range(p):
        check_deadline()
        warmup = min(p - rank - 1, m)
        row = [Action(rank, ActionKind.FORWARD, j) for j in range(warmup)]
        for j in range(m - warmup):
            row.append(Action(rank, ActionKind.FORWARD, warmup + j))
            row.extend(backward(problem, rank, j))
        for j in range(m - warmup, m):
            row.extend(backward(problem, rank, j))
        orders.append(row)
    return orders


FAMILIES = [
    FamilySpec(
        name="1f1b",
        description="One-forward-one-backward with a flush (PipeDream-Flush); peak p·M_B on rank 0.",
        build=_build,
        listing_order=20,
        torch=TorchClass("1F1B"),
        # Narayanan et al. 2021, §2.2: rank 0 holds p microbatches at its peak.
        planner=PlannerEstimate(in_flight=lambda p, v, m: min(p, m), bubble=1.0, seconds_per_thousand_actions=0.06),
        default=True,
    )
]
