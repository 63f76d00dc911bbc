"""ZB-H1 and ZB-H2: the Zero Bubble paper's handcrafted schedules (Qi et al., ICLR 2024, Sec. 3.1, Fig. 3).

Both split the backward into I (input gradient) and W (weight gradient) and run W late to fill
the bubbles 1F1B leaves. Rank r of p (0-based), m microbatches:

* **ZB-H1** runs ``p − r`` forwards before its first I (1F1B's in-flight count, so rank 0 peaks at
  p·M_B, "same as 1F1B"), then repeats I, W, F with its first ``r`` W passes deferred to the end.
  Bubble (p−1)(T_F + T_I − T_W) with zero p2p (paper, Sec. 3.1).
* **ZB-H2** runs ``2p − 1 − 2r`` forwards before its first I (rank 0 peaks at (2p−1)·M_B), then
  repeats I, W, F with its first ``2r`` W passes deferred. Bubble (p−1)(T_F + T_I − 2T_W) with
  zero p2p.

These orders reproduce the paper's Table 5 bubble rates (and stage spans to 1e-9 ms) on all 12
profiled settings of ``bench/data/zb_paper_settings.json`` with the stage_span objective.
Any microbatch count works: warm-ups and deferrals are capped at m.
"""

from __future__ import annotations

from pipesched.optimizer.families._base import FamilySpec, PlannerEstimate
from pipesched.optimizer.ir import Action, ActionKind, Orders
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.progress import check_deadline


def handcrafted_orders(problem: Problem, *, warmup: list[int], deferred: list[int]) -> Orders:
    """Per-rank orders: ``warmup[r]`` forwards, then I, W, F repeated with ``deferred[r]`` W passes late.

    Args:
        problem: a one-stage-per-rank loop problem with split backward.
        warmup: per rank, forwards before the first I (capped at m).
        deferred: per rank, how many W passes trail their I by one extra slot each (capped at m).

    Returns:
        One order per rank; W passes left at the end run in microbatch order.
    """
    p, m = problem.pipeline.num_ranks, problem.pipeline.num_microbatches
    orders: Orders = []
    for rank in range(p):
        check_deadline()
        forwards = min(warmup[rank], m)
        row = [Action(rank, ActionKind.FORWARD, j) for j in range(forwards)]
        weights = 0
        for j in range(m):
            row.append(Action(rank, ActionKind.BACKWARD_INPUT, j))
            if j >= deferred[rank]:
                row.append(Action(rank, ActionKind.BACKWARD_WEIGHT, weights))
                weights += 1
            if forwards < m:
                row.append(Action(rank, ActionKind.FORWARD, forwards))
                forwards += 1
        row.extend(Action(rank, ActionKind.BACKWARD_WEIGHT, j) for j in range(weights, m))
        orders.append(row)
    return orders


def _build_h1(problem: Problem) -> Orders:
    p = problem.pipeline.num_ranks
    return handcrafted_orders(problem, warmup=[p - r for r in range(p)], deferred=list(range(p)))


def _build_h2(problem: Problem) -> Orders:
    p = problem.pipeline.num_ranks
    return handcrafted_orders(problem, warmup=[2 * p - 1 - 2 * r for r in range(p)], deferred=[2 * r for r in range(p)])


FAMILIES = [
    FamilySpec(
        name="zb-h1",
        description="Zero Bubble ZB-H1: 1F1B with W deferred into the bubbles; bubble (p−1)(F+I−W), peak p·M_B.",
        build=_build_h1,
        listing_order=60,
        backward="split",
        backward_hint="use method 1f1b",
        planner=PlannerEstimate(in_flight=lambda p, v, m: min(p, m), bubble=0.4, seconds_per_thousand_actions=0.06),
    ),
    FamilySpec(
        name="zb-h2",
        description="Zero Bubble ZB-H2: 2p−1 warm-up forwards on rank 0; bubble (p−1)(F+I−2W), peak (2p−1)·M_B.",
        build=_build_h2,
        listing_order=70,
        backward="split",
        backward_hint="use method 1f1b",
        planner=PlannerEstimate(
            in_flight=lambda p, v, m: min(2 * p - 1, m), bubble=0.1, seconds_per_thousand_actions=0.08
        ),
    ),
]
