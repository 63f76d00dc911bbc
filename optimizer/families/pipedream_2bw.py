"""PipeDream-2BW (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021,
arXiv 2006.09503, §3, Figures 3–4): 1F1B without a flush, two weight versions, gradients accumulated over
the step's m microbatches, the delayed update W(t+1) = W(t) − ν·∇f(W(t−1)).

PipeDream-Flush is the same 1F1B order with a flush at every step: that is the ``1f1b`` family.

Rank r of p runs ``p − r`` forwards before its first backward, then one backward and one forward for ever;
the forwards of step t+1 fill what would be step t's cool-down. The family returns the repeating pattern of
:mod:`pipesched.optimizer.pattern` (ids ``m + j`` are the next step's microbatches). Rank 0 then reads,
for m = 8, p = 4: ``0F3 0B0 0F4 0B1 … 0F7 0B4 0F8 0B5 0F9 0B6 0F10 0B7`` (``0F8`` … ``0F10`` are step t+1's
microbatches 0 … 2). With split backward each B is ``I`` then ``W`` of the same microbatch.

**Steady state** (derived from the cycles of the timed run; checked by ``tests/optimizer/test_training.py``):
with uniform costs F, I, W (B = I + W when fused; read W as 0 there), p2p latency c and no optimizer cost,

    step_period = m·(F + I + W) + m·(p − 1)/p · max(0, 2c − W).

The endless 1F1B order does not depend on m, so the period is m times the per-microbatch rate. That rate is
the larger of a rank's work per microbatch and the longest cycle per microbatch: a microbatch's round trip
from rank 0 to the last rank and back, p·(F + I) + 2(p−1)·c plus rank 0's W, while rank 0 keeps p microbatches
in flight (p pairs of work, p·(F + I + W)). When p does not divide m the step ends repeat only every few
steps (cyclicity p / gcd(p, m)); the period is their mean.

An optimizer step o per rank runs after the rank's last backward of the step. With split backward it adds o
to the period (W is off the round trip); with fused backward it sits on the round trip of every rank, and the
measured period grows by up to p·o. Peak activation memory p·M_B on rank 0 (as 1F1B) plus the second weight
version.

Domain: placement ``"loop"`` with one stage per rank, ``training.flush`` false, and m ≥ p − 1 (rank 0's
next-step forwards must fit before its step ends: two versions, §3.1's "at least p microbatches").
"""

from __future__ import annotations

from pipesched.optimizer.families._base import FamilySpec, PlannerEstimate, backward, require
from pipesched.optimizer.ir import Action, ActionKind, Orders
from pipesched.optimizer.pattern import pattern_from_sequence
from pipesched.optimizer.problem import Pipeline, Problem

__all__ = ["FAMILIES", "one_f_one_b_pattern"]


def _check(pipeline: Pipeline) -> None:
    p, m = pipeline.num_ranks, pipeline.num_microbatches
    require(
        m >= p - 1,
        "pipedream-2bw",
        f"needs num_microbatches ≥ num_ranks − 1 = {p - 1} (two weight versions: rank 0 starts p − 1 forwards of the "
        f"next step before its step ends), got {m}: raise pipeline.num_microbatches",
    )


def one_f_one_b_pattern(problem: Problem, in_flight: list[int]) -> Orders:
    """1F1B without a flush as a pattern: rank r runs ``in_flight[r]`` forwards before its first backward.

    Raises:
        ValueError: when the counts would need a third weight version (``in_flight[r] > m + 1``).
    """
    m = problem.pipeline.num_microbatches
    orders: Orders = []
    for rank, ahead in enumerate(in_flight):
        total = 3 * m
        sequence = [Action(rank, ActionKind.FORWARD, g) for g in range(min(ahead, total))]
        for g in range(total):
            sequence.extend(backward(problem, rank, g))
            if g + ahead < total:
                sequence.append(Action(rank, ActionKind.FORWARD, g + ahead))
        length = m * (3 if problem.split_backward else 2)
        orders.append(pattern_from_sequence(sequence, m, length))
    return orders


def _build(problem: Problem) -> Orders:
    p = problem.pipeline.num_ranks
    return one_f_one_b_pattern(problem, [p - r for r in range(p)])


FAMILIES = [
    FamilySpec(
        name="pipedream-2bw",
        description=(
            "PipeDream-2BW: 1F1B without a flush, two weight versions, delayed update; peak p·M_B + one more "
            "weight copy on rank 0."
        ),
        build=_build,
        listing_order=140,
        flush=False,
        domain_note="num_microbatches ≥ num_ranks − 1",
        check_pipeline=_check,
        # 1F1B's p microbatches on rank 0, no flush (no bubble in steady state), a second weight copy; its own
        # update rule, so the planner tries it only when search.method names it (PipeDream-2BW's planner: width
        # × depth × microbatches under the 2-version memory, Narayanan et al. 2020, §4).
        planner=PlannerEstimate(
            in_flight=lambda p, v, m: min(p, m),
            bubble=0.0,
            seconds_per_thousand_actions=0.5,
            by_default=False,
            weight_versions=2,
        ),
    )
]
