"""BitPipe (Wu, Chen, Yu 2024, "BitPipe: Bidirectional Interleaved Pipeline Parallelism for Accelerating Large
Models Training", arXiv 2410.19367): two V-shaped pipelines running in opposite directions, as its authors
schedule them in their Megatron-LM fork (``megatron/core/pipeline_parallel/bitpipe_schedule.py``, function
``forward_backward_pipelining_with_BitPipe``, "direct concatenation"; read, not copied: this is our own
construction of the same per-rank order).

Placement "bidirectional" (:func:`pipesched.optimizer.instance.stage_to_rank`): replica 0 ("down") has stage
ids 0 … 2p−1 in V placement, replica 1 ("up") ids 2p … 4p−1 mirrored. Rank r holds four chunks: the down
replica's first arm (stage r) and second arm (2p−1−r), the up replica's first arm (2p + p−1−r) and second arm
(3p + r). Microbatches 0 … m/2−1 run down, m/2 … m−1 up (each replica takes half of the batch).

The authors' order, per rank r, with ``half = p/2``, the rank's *own* replica the one whose first arm starts
on its side (down for r < half, up otherwise), ``n = half − r`` for r < half else ``r − half + 1``, and the
microbatches taken ``half`` per replica at a time (block b = m/p blocks):

* forward sequence, per block: ``n`` of the own first arm; ``half − n`` pairs (other first arm, own first
  arm); ``n`` pairs (other first arm, other second arm); ``half − n`` pairs (own second arm, other second
  arm); ``n`` of the own second arm;
* backward sequence, per block: the same with each first arm read as the second and the reverse;
* warm-up of ``w = p + half + (r if r < half else p−1−r)`` forwards, then per block but the last ``u = 2p − w``
  pairs (forward, backward), ``w − u + 1`` backwards, ``u − 1`` pairs, ``w − u + 1`` forwards; for the last
  block ``u`` pairs and the remaining backwards.

The fork needs an even p and m a multiple of p (it raises otherwise); so does this family (``auto`` covers
the rest, starting from the capped greedy of :mod:`._greedy` that was this family's generator before).
A fused backward is the authors' (Megatron's ``backward_step``); with ``split_backward`` each B is written
as I then W back to back.

Eager gradient synchronisation (paper Sec. 3.3): the two replicas' copies of a stage all-reduce their
gradients between the mirrored ranks (r and p−1−r). The step model makes it the stage's REDUCE_GRAD
(``costs.reduce_grad``, required for a bidirectional placement, d ≥ 1: :class:`pipesched.optimizer.problem.
Problem`), issued by the communication pass right after the stage's last backward on the rank and waiting for
the mirror replica's (:mod:`pipesched.optimizer.communication`). The fork issues the second arms' all-reduce
before each rank's last backward and the first arms' after it: never earlier than ours, so our step time is
a lower bound on theirs for the same compute order.
"""

from __future__ import annotations

from pipesched.optimizer.families._base import FamilySpec, PlannerEstimate, backward, require
from pipesched.optimizer.ir import Action, ActionKind, Orders
from pipesched.optimizer.problem import Pipeline, Problem

__all__ = ["bitpipe_orders", "chunk_stage"]

Pass = tuple[int, int]  # (stage id, microbatch)


def chunk_stage(num_ranks: int, rank: int, replica: int, arm: int) -> int:
    """Stage id of one of ``rank``'s four chunks: ``replica`` 0 (down) or 1 (up), ``arm`` 0 (first) or 1."""
    p = num_ranks
    if replica == 0:
        return rank if arm == 0 else 2 * p - 1 - rank
    return 2 * p + (p - 1 - rank if arm == 0 else p + rank)


def _interleave(first: list[Pass], a: list[Pass], b: list[Pass], c: list[Pass], d: list[Pass], n: int) -> list[Pass]:
    """One block's sequence (module docstring): first[:n], (a, b[n:]), (a[half−n:], c), (d, c[n:]), d[half−n:]."""
    half = len(first)
    sequence = first[:n]
    for i in range(half - n):
        sequence += [a[i], b[n + i]]
    for i in range(n):
        sequence += [a[half - n + i], c[i]]
    for i in range(half - n):
        sequence += [d[i], c[n + i]]
    return sequence + d[half - n :]


def _sequences(p: int, m: int, rank: int) -> tuple[list[Pass], list[Pass]]:
    """The rank's forward and backward sequences of (stage id, microbatch), block by block."""
    half, per_replica = p // 2, m // 2
    own = 0 if rank < half else 1
    n = half - rank if rank < half else rank - half + 1
    forwards: list[Pass] = []
    backwards: list[Pass] = []
    for block in range(m // p):
        microbatches = range(block * half, (block + 1) * half)

        def arm(replica: int, which: int, microbatches: range = microbatches) -> list[Pass]:
            stage = chunk_stage(p, rank, replica, which)
            return [(stage, replica * per_replica + k) for k in microbatches]

        own_first, other_first, own_second, other_second = arm(own, 0), arm(1 - own, 0), arm(own, 1), arm(1 - own, 1)
        forwards += _interleave(own_first, other_first, own_first, other_second, own_second, n)
        backwards += _interleave(own_second, other_second, own_second, other_first, own_first, n)
    return forwards, backwards


def _rank_order(problem: Problem, rank: int) -> list[Action]:
    """The authors' warm-up, per-block 1F1B, and cool-down over the rank's sequences (module docstring)."""
    p, m = problem.pipeline.num_ranks, problem.pipeline.num_microbatches
    forwards, backwards = _sequences(p, m, rank)
    warmup = p + p // 2 + (rank if rank < p // 2 else p - 1 - rank)
    pairs = 2 * p - warmup
    steps: list[tuple[str, Pass]] = [("F", x) for x in forwards[:warmup]]
    for block in range(m // p - 1):
        start = 2 * p * block
        for i in range(pairs):
            steps += [("F", forwards[warmup + start + i]), ("B", backwards[start + i])]
        steps += [("B", x) for x in backwards[start + pairs : start + warmup + 1]]
        for i in range(pairs - 1):
            steps += [("F", forwards[2 * p + start + i]), ("B", backwards[warmup + 1 + start + i])]
        steps += [("F", x) for x in forwards[2 * p + start + pairs - 1 : 2 * p + start + warmup]]
    start = 2 * p * (m // p - 1)
    for i in range(pairs):
        steps += [("F", forwards[warmup + start + i]), ("B", backwards[start + i])]
    steps += [("B", x) for x in backwards[start + pairs :]]
    order: list[Action] = []
    for kind, (stage, microbatch) in steps:
        if kind == "F":
            order.append(Action(stage, ActionKind.FORWARD, microbatch))
        else:
            order.extend(backward(problem, stage, microbatch))
    return order


def bitpipe_orders(problem: Problem) -> Orders:
    """The authors' per-rank orders (module docstring) for a problem inside the family's domain."""
    return [_rank_order(problem, rank) for rank in range(problem.pipeline.num_ranks)]


def _check(pipeline: Pipeline) -> None:
    p, m = pipeline.num_ranks, pipeline.num_microbatches
    require(
        p % 2 == 0 and m % p == 0,
        "bitpipe",
        f"(the authors' schedule) needs an even num_ranks and num_microbatches a multiple of num_ranks, as their "
        f"Megatron-LM fork does; got num_ranks {p}, num_microbatches {m}: use num_microbatches "
        f"{-(-m // p) * p if p % 2 == 0 else 'a multiple of an even num_ranks'}, or method auto",
    )


FAMILIES = [
    FamilySpec(
        name="bitpipe",
        description="BitPipe (the authors' order): two V-shaped replicas in opposite directions, eager gradient sync.",
        build=bitpipe_orders,
        listing_order=110,
        placements=("bidirectional",),
        stages_per_rank=range(2, 3),
        domain_note="an even num_ranks, num_microbatches a multiple of it",
        check_pipeline=_check,
        # The warm-up's chunk forwards (module docstring): p + p/2 + r on rank r < p/2, up to 2p − 1 in the
        # middle; both replicas' weights (the planner's layout counts each stage on its two ranks). Tried when
        # search.method names it.
        planner=PlannerEstimate(
            in_flight=lambda p, v, m: min(2 * p - 1, 2 * m),
            bubble=0.3,
            seconds_per_thousand_actions=0.1,
            last_rank_like_first=True,
            by_default=False,
        ),
    )
]
