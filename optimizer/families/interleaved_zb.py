"""Interleaved zero bubble: PyTorch's ``ScheduleInterleavedZeroBubble`` (``torch.distributed.pipelining``).

Loop placement with v ≥ 1 stages per rank (rank r holds stages ``c·p + r``, c = 0 … v−1) and split
backward. It is interleaved 1F1B (Narayanan et al., SC 2021, Sec. 2.2) with the Zero Bubble paper's
ZB-H1 rule for the weight passes (Qi et al., ICLR 2024, Sec. 3.1): W of a backward runs right after
a later I instead of with its own I, and rank r keeps its first ``r`` W passes for the cool-down.

The published algorithm, for p ranks, m microbatches, rank r:

* microbatches go in rounds of ``mpr = m / max(1, m // p)`` (PyTorch needs m divisible by the round
  count ``max(1, m // p)``); the k-th forward of a rank runs chunk ``(k // mpr) mod v``, the k-th
  backward chunk ``v − 1 − (k // mpr) mod v``; each stage takes its microbatches in order 0, 1, …;
* rank r runs ``min((v − 1)·mpr + p − 1 − r, m·v)`` warm-up forwards (one fewer per hop from the
  last rank, where interleaved 1F1B has two fewer: the I pass is shorter than a fused backward);
* then, for each remaining forward: F, the next I, and, once r I passes have run, the W of the
  oldest I without its W; then the cool-down: I (and W as before) for each remaining backward; then
  the W passes still pending, oldest first.

PyTorch inserts idle slots (``None``) for its lockstep view and communication actions around these
passes; the compute order per rank is exactly the list above (checked against torch 2.13 in
``tests/runtime/test_torch_peers.py``). For m not divisible by the round count (PyTorch raises), the order
is built for the next microbatch count it accepts and the extra microbatches are dropped, which
keeps it deadlock-free (:func:`~pipesched.optimizer.families._padding.drop_microbatches`).

Rank 0 runs ``(v − 1)·mpr + p`` forwards before its first I (with mpr = p: v·p stage activations,
p microbatches' worth of a whole rank's layers, as 1F1B and ZB-H1); with v = 1 the order is ZB-H1's.
"""

from __future__ import annotations

from collections import defaultdict

from pipesched.optimizer.families._base import FamilySpec, PlannerEstimate, TorchClass
from pipesched.optimizer.families._padding import drop_microbatches
from pipesched.optimizer.ir import Action, ActionKind, Orders
from pipesched.optimizer.problem import Problem

__all__ = ["FAMILIES", "interleaved_zb_orders", "torch_microbatch_count"]


def torch_microbatch_count(num_ranks: int, num_microbatches: int) -> int:
    """The least m' ≥ m that PyTorch's interleaved schedules accept: m' divisible by ``max(1, m' // p)``."""
    m = num_microbatches
    while m % max(1, m // num_ranks) != 0:
        m += 1
    return m


def _rank_order(p: int, v: int, m: int, rank: int) -> list[Action]:
    rounds = max(1, m // p)
    per_round = m // rounds
    total = m * v
    warmup = min((v - 1) * per_round + p - 1 - rank, total)

    def forward_stage(k: int) -> int:
        return ((k // per_round) % v) * p + rank

    def backward_stage(k: int) -> int:
        return (v - 1 - (k // per_round) % v) * p + rank

    next_mb: dict[tuple[ActionKind, int], int] = defaultdict(int)

    def take(kind: ActionKind, stage: int) -> Action:
        j = next_mb[kind, stage]
        next_mb[kind, stage] = j + 1
        return Action(stage, kind, j)

    row: list[Action] = []
    pending: list[int] = []  # stages of I passes whose W has not run, oldest first
    backwards = 0

    def backward_step() -> None:
        nonlocal backwards
        stage = backward_stage(backwards)
        backwards += 1
        row.append(take(ActionKind.BACKWARD_INPUT, stage))
        pending.append(stage)
        if backwards > rank:
            row.append(take(ActionKind.BACKWARD_WEIGHT, pending.pop(0)))

    for k in range(total):
        row.append(take(ActionKind.FORWARD, forward_stage(k)))
        if k >= warmup:
            backward_step()
    while backwards < total:
        backward_step()
    while pending:
        row.append(take(ActionKind.BACKWARD_WEIGHT, pending.pop(0)))
    return row


def interleaved_zb_orders(num_ranks: int, stages_per_rank: int, num_microbatches: int) -> Orders:
    """Per-rank orders of PyTorch's interleaved zero-bubble schedule (module docstring), any m ≥ 1."""
    padded = torch_microbatch_count(num_ranks, num_microbatches)
    orders = [_rank_order(num_ranks, stages_per_rank, padded, rank) for rank in range(num_ranks)]
    return drop_microbatches(orders, num_microbatches)


def _build(problem: Problem) -> Orders:
    pipeline = problem.pipeline
    return interleaved_zb_orders(pipeline.num_ranks, pipeline.stages_per_rank, pipeline.num_microbatches)


FAMILIES = [
    FamilySpec(
        name="interleaved-zb",
        description="PyTorch's interleaved zero bubble: interleaved 1F1B in loop placement with split backward, "
        "W passes deferred as in ZB-H1.",
        build=_build,
        listing_order=40,
        stages_per_rank=range(1, 65),
        backward="split",
        domain_note="any microbatch count (PyTorch: m divisible by max(1, m // num_ranks))",
        layout_hint="use zb-v or dualpipe-v for the V placement",
        backward_hint="use interleaved-1f1b",
        torch=TorchClass("InterleavedZeroBubble", backward="split"),
        # Interleaved 1F1B's warm-up (its forwards are PyTorch's Interleaved1F1B's); W deferred as ZB-H1 fills
        # part of the bubble. Tried when search.method names it.
        planner=PlannerEstimate(
            in_flight=lambda p, v, m: min(m * v, 2 * (p - 1) + (v - 1) * p + 1),
            bubble=0.3,
            seconds_per_thousand_actions=0.1,
            min_stages_per_rank=2,
            by_default=False,
        ),
    )
]
