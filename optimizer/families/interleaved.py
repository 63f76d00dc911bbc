"""Interleaved 1F1B (Narayanan et al., SC 2021, "Efficient Large-Scale Language Model Training …", Sec. 2.2).

Loop placement with v ≥ 2 stages per rank: rank r holds stages ``c·p + r``, c = 0 … v−1. Megatron's
order: the k-th forward of a rank runs chunk ``(k // p) mod v`` of microbatch
``(k // (p·v))·p + k mod p`` (groups of p microbatches walk through the chunks), the k-th backward
chunk ``v − 1 − (k // p) mod v`` of the same microbatch; rank r runs ``2(p − r − 1) + (v − 1)·p``
warm-up forwards, then one forward one backward, then the cool-down backwards. Bubble
(p−1)/v·(T_F + T_B) per rank, i.e. the 1F1B bubble divided by v.

Megatron needs m divisible by p. Here any m works: the order is built for ``ceil(m/p)·p``
microbatches and the extra ones are dropped (see :func:`drop_microbatches`), which keeps it
deadlock-free; when p does not divide m the last group runs with idle slots.
"""

from __future__ import annotations

from pipesched.optimizer.families._base import FamilySpec, PlannerEstimate, TorchClass, backward
from pipesched.optimizer.families._padding import drop_microbatches
from pipesched.optimizer.ir import Action, ActionKind, Orders
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.progress import check_deadline


def _build(problem: Problem) -> Orders:
    p, m = problem.pipeline.num_ranks, problem.pipeline.num_microbatches
    v = problem.pipeline.stages_per_rank
    padded = -(-m // p) * p
    total = padded * v

    def microbatch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    orders: Orders = []
    for rank in range(p):
        check_deadline()

        def forward(k: int, rank: int = rank) -> Action:
            return Action(((k // p) % v) * p + rank, ActionKind.FORWARD, microbatch(k))

        def backward_k(k: int, rank: int = rank) -> list[Action]:
            return backward(problem, (v - 1 - (k // p) % v) * p + rank, microbatch(k))

        warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
        row = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            row.append(forward(warmup + k))
            row.extend(backward_k(k))
        for k in range(total - warmup, total):
            row.extend(backward_k(k))
        orders.append(row)
    return drop_microbatches(orders, m)


FAMILIES = [
    FamilySpec(
        name="interleaved-1f1b",
        description="Megatron interleaved 1F1B: v model chunks per rank in loop placement; bubble ÷ v.",
        build=_build,
        listing_order=30,
        stages_per_rank=range(2, 65),
        domain_note="any microbatch count (Megatron: m divisible by p)",
        layout_hint="use 1f1b for one stage per rank",
        torch=TorchClass("Interleaved1F1B"),
        # Megatron-LM's warm-up: 2(p − 1) + (v − 1)·p + 1 chunk activations on rank 0.
        planner=PlannerEstimate(
            in_flight=lambda p, v, m: min(m * v, 2 * (p - 1) + (v - 1) * p + 1),
            bubble=1.0,
            seconds_per_thousand_actions=0.07,
        ),
    )
]
