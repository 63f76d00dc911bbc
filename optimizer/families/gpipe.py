"""GPipe (Huang et al. 2019): every forward, then every backward; holds all m activations."""

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
        row = [Action(rank, ActionKind.FORWARD, j) for j in range(m)]
        for j in range(m):
            row.extend(backward(problem, rank, j))
        orders.append(row)
    return orders


FAMILIES = [
    FamilySpec(
        name="gpipe",
        description="All forwards, then all backwards (flush); peak activation memory m·M_B on every rank.",
        build=_build,
        listing_order=10,
        torch=TorchClass("GPipe"),
        planner=PlannerEstimate(
            in_flight=lambda p, v, m: m, bubble=1.0, seconds_per_thousand_actions=0.06, last_rank_like_first=True
        ),
    )
]
