"""V-Half and V-Min (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", arXiv 2405.15362).

V placement: rank r holds stages r and 2p−1−r. The paper builds these schedules from repeated
building blocks whose lifespan sets the activation peak: V-Half ≈ 1/2 and V-Min ≈ 1/3 of 1F1B's.
We reach the same memory targets with the capped list scheduler of :mod:`._greedy` (not the
paper's exact blocks): rank r may hold at most ``k`` microbatches' activations of its two stages,
``k = ⌊p/2⌋ + 1`` for V-Half and ``k = ⌊p/3⌋ + 1`` for V-Min (1F1B holds p on rank 0), so the
peak is at most k/p of 1F1B's, and the schedule fills what it can within that. Any microbatch
count, split or fused backward.
"""

from __future__ import annotations

from collections.abc import Callable

from optimizer.families._base import Family, require
from optimizer.families._greedy import capped_greedy_orders, microbatch_reservation
from optimizer.instance import compile_problem
from optimizer.ir import Orders
from optimizer.problem import Problem


def require_v(problem: Problem, family: str) -> None:
    """The domain of the V-placed families: placement "v" (which implies stages_per_rank 2)."""
    pipeline = problem.pipeline
    require(
        pipeline.placement == "v",
        family,
        'needs placement "v" with stages_per_rank 2 (rank r holds stages r and 2·num_ranks−1−r), got '
        f"placement {pipeline.placement!r} with stages_per_rank {pipeline.stages_per_rank}",
    )


def capped_v_orders(problem: Problem, in_flight: Callable[[int], int]) -> Orders:
    """Orders holding at most ``in_flight(p)`` microbatches' activations per rank (see :mod:`._greedy`)."""
    inst = compile_problem(problem)
    k = in_flight(inst.num_ranks)
    caps = [
        k * max(microbatch_reservation(inst, rank, j) for j in range(inst.num_microbatches))
        for rank in range(inst.num_ranks)
    ]
    return capped_greedy_orders(inst, caps)


def _check_half(problem: Problem) -> None:
    require_v(problem, "v-half")


def _check_min(problem: Problem) -> None:
    require_v(problem, "v-min")


FAMILIES = [
    Family(
        name="v-half",
        description="V-Half: V placement, about half of 1F1B's activation memory (⌊p/2⌋+1 microbatches per rank).",
        domain='placement "v" (stages_per_rank 2), any microbatch count',
        check=_check_half,
        build=lambda problem: capped_v_orders(problem, lambda p: p // 2 + 1),
    ),
    Family(
        name="v-min",
        description="V-Min: V placement, about a third of 1F1B's activation memory (⌊p/3⌋+1 microbatches per rank).",
        domain='placement "v" (stages_per_rank 2), any microbatch count',
        check=_check_min,
        build=lambda problem: capped_v_orders(problem, lambda p: p // 3 + 1),
    ),
]
