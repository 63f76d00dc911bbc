"""DualPipeV (DeepSeek, the "cut-in-half" V-shaped DualPipe of DeepSeek-V3's training code).

V placement: rank r holds stage r (chunk 0) and stage 2p−1−r (chunk 1). DualPipeV pairs the forward
of one microbatch with the backward of another so that, on hardware, one's communication hides
behind the other's compute; we model the pairs as the same actions back to back, in DualPipeV's
order (rank r, p ranks, m microbatches):

1. ``2(p−r−1)`` × F0;  2. ``r+1`` × (F0, F1);  3. ``p−r−1`` × (B1 split as I then W at once, F1);
4. ``m−2p+r+1`` × (F0, B1, F1, B0) — the overlapped pairs;  5. ``p−r−1`` × (B1, F1, B0);
6. ``r+1`` × (B1, B0), from the middle on (odd ranks before B1, even ranks after it) running I
   only and deferring W;  7. ``p−r−1`` × (the oldest deferred W, then B0 as I only, its W deferred);
   8. ``r+1`` × deferred W.

Steps 7's order (W before I) is DeepSeek's and PyTorch's (``ScheduleDualPipeV``, torch 2.13). Where
DualPipeV runs a fused B (steps 4–6), this family runs I and W back to back when ``split_backward``:
in pipesched's model that is never slower (the gradient leaves after I, not after I + W) and frees
memory no later. With each of DualPipeV's B written as I W, the orders equal PyTorch's
(``tests/runtime/test_torch_peers.py``); PyTorch's own mixed order (fused B and split I/W) is timed by the
same simulator through :func:`~pipesched.optimizer.instance.compile_for_orders`.

Activation peak about p+1 microbatches (rank 0: 2p−1 chunk-0 plus one chunk-1 activation). The
order needs m ≥ 2p−1; for fewer microbatches it is built for 2p−1 and the extra ones are dropped,
which keeps it deadlock-free. With split_backward false every backward is a fused B.
"""

from __future__ import annotations

from pipesched.optimizer.families._base import FamilySpec, PlannerEstimate, TorchClass
from pipesched.optimizer.families._padding import drop_microbatches
from pipesched.optimizer.ir import Action, ActionKind, Orders
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.progress import check_deadline


def _rank_order(problem: Problem, rank: int, num_microbatches: int) -> list[Action]:
    check_deadline()
    p, m = problem.pipeline.num_ranks, num_microbatches
    stages = (rank, 2 * p - 1 - rank)
    forwards = [0, 0]
    backwards = [0, 0]
    deferred: list[Action] = []
    row: list[Action] = []
    split = problem.split_backward

    def forward(chunk: int) -> None:
        row.append(Action(stages[chunk], ActionKind.FORWARD, forwards[chunk]))
        forwards[chunk] += 1

    def backward(chunk: int, *, defer_weight: bool = False) -> None:
        stage, j = stages[chunk], backwards[chunk]
        backwards[chunk] += 1
        if not split:
            row.append(Action(stage, ActionKind.BACKWARD, j))
            return
        row.append(Action(stage, ActionKind.BACKWARD_INPUT, j))
        weight = Action(stage, ActionKind.BACKWARD_WEIGHT, j)
        if defer_weight:
            deferred.append(weight)
        else:
            row.append(weight)

    def weight() -> None:
        if split and deferred:
            row.append(deferred.pop(0))

    for _ in range(2 * (p - rank - 1)):
        forward(0)
    for _ in range(rank + 1):
        forward(0)
        forward(1)
    for _ in range(p - rank - 1):
        backward(1)
        forward(1)
    for _ in range(m - 2 * p + rank + 1):
        forward(0)
        backward(1)
        forward(1)
        backward(0)
    for _ in range(p - rank - 1):
        backward(1)
        forward(1)
        backward(0)
    step_6 = rank + 1
    zero_bubble = False
    for i in range(step_6):
        if i == step_6 // 2 and rank % 2 == 1:
            zero_bubble = True
        backward(1, defer_weight=zero_bubble)
        if i == step_6 // 2 and rank % 2 == 0:
            zero_bubble = True
        backward(0, defer_weight=zero_bubble)
    for _ in range(p - rank - 1):
        weight()
        backward(0, defer_weight=True)
    for _ in range(rank + 1):
        weight()
    return row


def _build(problem: Problem) -> Orders:
    p, m = problem.pipeline.num_ranks, problem.pipeline.num_microbatches
    padded = max(m, 2 * p - 1)
    return drop_microbatches([_rank_order(problem, rank, padded) for rank in range(p)], m)


FAMILIES = [
    FamilySpec(
        name="dualpipe-v",
        description="DeepSeek DualPipeV: V placement, forward/backward pairs of different microbatches; "
        "activations about p+1 microbatches.",
        build=_build,
        listing_order=120,
        placements=("v",),
        stages_per_rank=range(2, 3),
        domain_note="any microbatch count (native order m ≥ 2·num_ranks−1)",
        torch=TorchClass("DualPipeV", backward="mixed"),
        # Qi et al. 2024, Table 1: 2p + 1 half-size chunks on rank 0.
        planner=PlannerEstimate(
            in_flight=lambda p, v, m: min(2 * m, 2 * p + 1),
            bubble=0.2,
            seconds_per_thousand_actions=0.4,
            # DeepSeek-V3 report §3.2.1: a forward and a backward chunk of two microbatches overlap, their
            # all-to-alls hidden behind each other's compute
            overlaps_microbatches=True,
        ),
    )
]
