"""Warm starts that are not families of their own: PyTorch's variants of schedules pipesched builds differently.

Where pipesched's family and PyTorch's built-in schedule differ on purpose, the family keeps the one
that times better in pipesched's model and the other comes here, so that ``auto`` starts from both
(:func:`peer_warm_starts`; :mod:`pipesched.optimizer.solvers.portfolio` offers each one):

* ``zb-v``: pipesched's family is the Zero Bubble authors' cost-aware ZB-V scheduler; PyTorch's
  ``ScheduleZBVZeroBubble`` (torch 2.13) is a fixed pattern, :func:`torch_zbv_orders`. Neither is better
  everywhere: on random per-stage costs the fixed pattern is up to 10% shorter at m = p (where it also
  holds fewer activations) and up to 1.5% longer at m ≥ 2p.

Other differences need no warm start: PyTorch's LoopedBFS runs each stage's backwards in reverse
microbatch order and times exactly like ``looped-bfs``; PyTorch's DualPipeV runs some backwards fused,
which is never faster in pipesched's model than ``dualpipe-v``'s I then W (``tests/runtime/test_torch_peers.py``).
"""

from __future__ import annotations

from pipesched.optimizer.families._padding import drop_microbatches
from pipesched.optimizer.ir import Action, ActionKind, Orders
from pipesched.optimizer.problem import Problem

__all__ = ["peer_warm_starts", "torch_zbv_orders"]

F, I, W = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT  # noqa: E741 - the field's letters


def _zbv_rank(p: int, m: int, rank: int) -> list[Action]:
    n = max(2 * p - 1, m)  # the pattern needs 2p − 1 microbatches; the extra ones are dropped afterwards
    chunk0, chunk1 = rank, 2 * p - 1 - rank
    count = {(s, k): 0 for s in (chunk0, chunk1) for k in (F, I, W)}
    row: list[Action] = []

    def run(stage: int, kind: ActionKind, microbatch: int | None = None) -> None:
        j = count[stage, kind] if microbatch is None else microbatch
        count[stage, kind] += 1
        row.append(Action(stage, kind, j))

    # Warm-up: 2(p − r) − 1 chunk-0 forwards, r pairs (chunk-1 F, chunk-0 F), p − r times chunk-1 F I W.
    for _ in range(2 * (p - rank) - 1):
        run(chunk0, F)
    for _ in range(rank):
        run(chunk1, F)
        run(chunk0, F)
    for _ in range(p - rank):
        run(chunk1, F)
        run(chunk1, I)
        run(chunk1, W)
    # Steady state: chunk-0 F (while any remain), chunk-0 I W, chunk-1 F I W.
    while count[chunk1, F] < count[chunk0, F] or count[chunk0, F] < n:
        if count[chunk0, F] < n:
            run(chunk0, F)
        run(chunk0, I)
        run(chunk0, W)
        run(chunk1, F)
        run(chunk1, I)
        run(chunk1, W)
    # Cool-down: r pairs of I (chunk 0, chunk 1), p − r times chunk-0 I with the oldest chunk-0 W, then every
    # chunk-1 W, then every chunk-0 W left.
    for _ in range(rank):
        run(chunk0, I)
        run(chunk1, I)
    for _ in range(p - rank):
        run(chunk0, I)
        run(chunk0, W)
    while count[chunk1, W] < count[chunk1, I]:
        run(chunk1, W)
    while count[chunk0, W] < count[chunk0, I]:
        run(chunk0, W)
    return row


def torch_zbv_orders(num_ranks: int, num_microbatches: int) -> Orders:
    """PyTorch's ``ScheduleZBVZeroBubble`` compute order (V placement, split backward), per rank.

    Rank r of p: warm-up of ``2(p−r)−1`` chunk-0 forwards, ``r`` (chunk-1 F, chunk-0 F) pairs and ``p−r``
    chunk-1 (F, I, W); steady state (chunk-0 F, I, W; chunk-1 F, I, W); cool-down as in :func:`_zbv_rank`.
    Built for ``max(2p − 1, m)`` microbatches, the extra ones dropped (as PyTorch does).
    """
    orders = [_zbv_rank(num_ranks, num_microbatches, rank) for rank in range(num_ranks)]
    return drop_microbatches(orders, num_microbatches)


def peer_warm_starts(problem: Problem) -> list[tuple[str, Orders]]:
    """``(name, orders)`` of every peer variant that applies to ``problem`` (module docstring)."""
    pipeline = problem.pipeline
    starts: list[tuple[str, Orders]] = []
    if pipeline.placement == "v" and problem.split_backward:
        starts.append(("torch-zbv", torch_zbv_orders(pipeline.num_ranks, pipeline.num_microbatches)))
    return starts
