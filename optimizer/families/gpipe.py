"""GPipe (Huang et al. 2019): every forward, then every backward; holds all m activations."""

from __future__ import annotations

from pipesched.optimizer.families._base import Family, backward, require_loop_single_stage
from pipesched.optimizer.ir import Action, ActionKind, Orders
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.progress import check_deadline


def _check(problem: Problem) -> None:
    require_loop_single_stage(problem, "gpipe")


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
    Family(
        name="gpipe",
        description="All forwards, then all backwards (flush); peak activation memory m·M_B on every rank.",
        domain='placement "loop", stages_per_rank 1, any microbatch count',
        check=_check,
        build=_build,
    )
]
