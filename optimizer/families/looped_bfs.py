"""Breadth-first (looped) pipeline (Lamy-Poirier, "Breadth-First Pipeline Parallelism", 2022).

Loop placement with v stages per rank (stage ``c·p + r`` on rank r). Each rank runs every
microbatch forward through its local stage c before moving to stage c+1, then runs the backwards
stage by stage in reverse, every microbatch through one stage before the next. It holds all m
microbatches' activations of all its stages at the turn (peak m·Σ activation on the rank), in
exchange for gathering each stage's weights once per batch and reducing each stage's gradients
as soon as its last backward ends. With stages_per_rank 1 it is GPipe.

PyTorch's ``ScheduleLoopedBFS`` (torch 2.13) runs each stage's backwards from the last microbatch down
(m−1 … 0), this family from 0 up; the forwards are equal and the two time alike in pipesched's model
(``tests/runtime/test_torch_peers.py``).
"""

from __future__ import annotations

from pipesched.optimizer.families._base import FamilySpec, PlannerEstimate, TorchClass, backward
from pipesched.optimizer.ir import Action, ActionKind, Orders
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.progress import check_deadline


def _build(problem: Problem) -> Orders:
    p, m = problem.pipeline.num_ranks, problem.pipeline.num_microbatches
    v = problem.pipeline.stages_per_rank
    orders: Orders = []
    for rank in range(p):
        check_deadline()
        stages = [chunk * p + rank for chunk in range(v)]
        row = [Action(stage, ActionKind.FORWARD, j) for stage in stages for j in range(m)]
        for stage in reversed(stages):
            for j in range(m):
                row.extend(backward(problem, stage, j))
        orders.append(row)
    return orders


#: Every microbatch's activations of every local stage at the turn (module docstring).
BREADTH_FIRST_ESTIMATE = PlannerEstimate(
    in_flight=lambda p, v, m: m * v,
    bubble=1.0,
    seconds_per_thousand_actions=0.07,
    last_rank_like_first=True,
    min_stages_per_rank=2,
)

FAMILIES = [
    FamilySpec(
        name="looped-bfs",
        description="Breadth-first looped pipeline: all microbatches through one local stage before the next; "
        "holds all activations.",
        build=_build,
        listing_order=50,
        stages_per_rank=range(1, 65),
        torch=TorchClass("LoopedBFS"),
        planner=BREADTH_FIRST_ESTIMATE,
        gather_runs=True,  # a stage's weights gathered once per run of its microbatches (Sec. 4)
    )
]
