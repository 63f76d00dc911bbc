"""Split a model's transformer layers into contiguous pipeline stages (uneven allowed).

The layers are identical, so a contiguous split is given by the number of layers per stage; stage 0 also
holds the embedding and the last stage the LM head, which is what makes even splits uneven in time.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from pipesched.optimizer.units import format_bytes

__all__ = [
    "TIE_TOLERANCE",
    "LayerTie",
    "PartitionError",
    "TieVerdict",
    "break_tie",
    "even_partition",
    "layer_tie",
    "megatron_partition",
    "partition_layers",
    "slowest_stage",
]

#: Stage times within this relative difference are a tie (:func:`partition_layers` gives the layer to the latest
#: stage). Summation-order noise only (the middle stages' times are computed the same way and come out equal to
#: the bit): 1e-9 of a 10–100 ms stage is 1e-8–1e-7 ms, below the 1e-6 ms the problem's costs are rounded to.
TIE_TOLERANCE = 1e-9


class PartitionError(ValueError):
    """No split of the layers fits every rank's memory."""


def even_partition(num_layers: int, num_stages: int) -> list[int]:
    """``num_layers`` split as evenly as possible, the remainder on the first stages (Megatron's default).

    Raises:
        PartitionError: when ``num_stages`` < 1.
    """
    if num_stages < 1:
        raise PartitionError(f"need at least one stage, got {num_stages}")
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if stage < extra else 0) for stage in range(num_stages)]


def megatron_partition(
    num_layers: int, num_stages: int, *, account_for_embedding: bool = False, account_for_loss: bool = False
) -> list[int]:
    """Megatron-Core's split of ``num_layers`` over ``num_stages`` model chunks (pipeline × virtual stages, in
    model order) when no layout is given: the embedding and the loss each count as one more layer where the
    run says so (``--account-for-embedding-in-pipeline-split``, ``--account-for-loss-in-pipeline-split``), the
    total is split evenly, and the first chunk (the embedding's) and the last (the loss's) hold one layer fewer
    (``get_transformer_layer_offset`` and ``get_num_layers_to_build`` in megatron/core/transformer/
    transformer_block.py). Not time-balanced: the head's cost lands on the last chunk as the run placed it.

    Raises:
        PartitionError: the (counted) layers do not split evenly, which Megatron-Core refuses too.
    """
    counted = num_layers + int(account_for_embedding) + int(account_for_loss)
    per_stage, rest = divmod(counted, num_stages)
    if rest:
        raise PartitionError(
            f"{num_layers} layers (+ embedding {account_for_embedding}, + loss {account_for_loss}) do not split "
            f"evenly over {num_stages} stages"
        )
    counts = [per_stage] * num_stages
    counts[0] -= int(account_for_embedding)
    counts[-1] -= int(account_for_loss)
    if min(counts) < 1:
        raise PartitionError(f"{num_layers} layers over {num_stages} stages leave a stage without a layer")
    return counts


def slowest_stage(layers_per_stage: Sequence[int], stage_time: Callable[[int, int], float]) -> float:
    """The largest ``stage_time(stage, layers)`` over the stages, ms."""
    return max(stage_time(stage, count) for stage, count in enumerate(layers_per_stage))


def partition_layers(
    num_layers: int,
    num_stages: int,
    *,
    stage_time: Callable[[int, int], float],
    stage_memory: Callable[[int, int], float] | None = None,
    stage_ranks: Sequence[Sequence[int]] | None = None,
    num_ranks: int | None = None,
    limit: float = float("inf"),
    min_layers: int = 1,
) -> list[int]:
    """Layers per stage minimising the slowest stage's time, subject to every rank's memory.

    Args:
        num_layers: transformer layers L to place.
        num_stages: model stages S (each gets ≥ ``min_layers``).
        stage_time: ``(stage, layers) → ms`` (F + I + W of the stage, embedding/head included), nondecreasing
            in ``layers``.
        stage_memory: ``(stage, layers) → bytes`` a rank holds for that stage (static + the activations a
            schedule needs at least), nondecreasing in ``layers``; ``None`` for no memory constraint.
        stage_ranks: the ranks holding each stage (default: stage s on rank s).
        num_ranks: ranks (default: ``num_stages``).
        limit: per-rank memory limit, bytes.
        min_layers: least layers per stage.

    Returns:
        ``num_stages`` counts summing to ``num_layers``.

    Algorithm: water-filling. Starting from ``min_layers`` everywhere, give the next layer to the stage whose
    time after taking it is smallest among the stages whose ranks still fit. With nondecreasing per-stage
    times this greedy is exact for the min-max objective (the classic resource-allocation result: the
    final maximum is the L-th smallest marginal level), and it also equalises the other stages; with one
    stage per rank the memory constraint is per stage and the result stays optimal. With several stages per
    rank the shared memory makes it a heuristic.

    Ties go to the latest stage: among stages whose time after taking the layer is the same (within
    ``TIE_TOLERANCE``, relative), the one latest in model order takes it, so the split's extra layers sit on
    the stages with the fewest microbatches in flight. Under every schedule a microbatch's forward reaches
    stage s before s + 1 and its backward leaves s + 1 before s, so its activations on s + 1 live within its
    span on s: at any instant a later stage holds no more microbatches than an earlier one (1F1B: S − s at
    stage s; interleaved: a rank's first chunk the most). That is about model order, not ranks, so it holds
    for any placement (loop, V, bidirectional); a rank's peak sums its stages at one instant, which the
    partition does not see (under V the last stage shares rank 0 with the first; with several stages per rank
    the stages left short can move to other ranks: docs/CALIBRATION.md), and ``limit`` still bounds it. A tie
    costs nothing in the objective (the slowest stage is as fast up to the tolerance); the schedule's
    makespan can still move with where a rank's extra work sits in its order. This rule is the default only: where
    a family's schedule is known, :func:`layer_tie` names the tie and :func:`break_tie` lets the simulated
    schedule choose among the tied splits (``load_problem`` does, for a named family): the fastest that fits the
    ranks' memory, or the lowest peak over ranks where none fits or memory is not enforced.

    Cost: O((L + S) log S) calls and heap steps for S stages (a time's tie key: a search among the distinct
    times seen), each memory check O(ranks holding the stage) (every rank's held bytes are kept up to date,
    never summed again).

    Raises:
        PartitionError: fewer layers than ``num_stages * min_layers``, or no split fits the memory (the
            message gives the rank and the bytes).
    """
    if num_layers < num_stages * min_layers:
        raise PartitionError(f"{num_layers} layers cannot fill {num_stages} stages with ≥ {min_layers} each")
    holders = [list(ranks) for ranks in stage_ranks] if stage_ranks is not None else [[s] for s in range(num_stages)]
    ranks = num_ranks if num_ranks is not None else num_stages
    counts = [min_layers] * num_stages
    # Each rank's stages, and the bytes it holds with the current counts: a check costs O(holders of a stage).
    rank_stages: list[list[int]] = [[] for _ in range(ranks)]
    for stage, stage_holders in enumerate(holders):
        for rank in stage_holders:
            rank_stages[rank].append(stage)
    held = [0.0] * ranks
    if stage_memory is not None:
        held = [sum(stage_memory(stage, counts[stage]) for stage in rank_stages[rank]) for rank in range(ranks)]
        for rank in range(ranks):
            if held[rank] > limit:
                raise PartitionError(
                    f"rank {rank} needs {format_bytes(held[rank])} with {min_layers} layer(s) per stage, "
                    f"over its limit {format_bytes(limit)}"
                )
    levels = _TieLevels()  # ties (within the tolerance) pop latest stage first: (time, -stage)
    heap = [(levels.key(stage_time(stage, counts[stage] + 1)), -stage) for stage in range(num_stages)]
    heapq.heapify(heap)
    remaining = num_layers - sum(counts)
    while remaining > 0:
        if not heap:
            worst = max(range(ranks), key=held.__getitem__)
            raise PartitionError(
                f"{remaining} of {num_layers} layers do not fit: with {counts} layers per stage rank {worst} "
                f"already holds {format_bytes(held[worst])} of {format_bytes(limit)}"
            )
        stage = -heapq.heappop(heap)[1]
        if stage_memory is not None:
            growth = stage_memory(stage, counts[stage] + 1) - stage_memory(stage, counts[stage])
            if any(held[rank] + growth > limit for rank in holders[stage]):
                continue  # memory only grows: this stage stays closed
            for rank in holders[stage]:
                held[rank] += growth
        counts[stage] += 1
        remaining -= 1
        heapq.heappush(heap, (levels.key(stage_time(stage, counts[stage] + 1)), -stage))
    return counts


def layer_tie(
    layers_per_stage: Sequence[int], stage_time: Callable[[int, int], float], *, min_layers: int = 1
) -> LayerTie | None:
    """The tie of :func:`partition_layers`' last level in its split ``layers_per_stage``, ``None`` without one.

    The water-filling places layers in nondecreasing order of the time their stage reaches with them, so its
    last level is the highest such time among the stages above ``min_layers``; the stages whose last layer
    reached it took one there, and those whose next layer would reach it too (within :data:`TIE_TOLERANCE`) were
    left short only because the layers ran out, or their rank's memory (:func:`break_tie` takes a ``fits``).
    ``None`` as well when a stage reaches the level with two layers (times flat in the layers: not a one-layer
    choice)."""
    levels = _TieLevels()
    reached = {
        stage: levels.key(stage_time(stage, count))
        for stage, count in enumerate(layers_per_stage)
        if count > min_layers
    }
    if not reached:
        return None
    level = max(reached.values())
    took = [stage for stage, time in reached.items() if time == level]
    short = [stage for stage, count in enumerate(layers_per_stage) if levels.key(stage_time(stage, count + 1)) == level]
    flat = [stage for stage in took if levels.key(stage_time(stage, layers_per_stage[stage] - 1)) == level]
    if not short or flat:
        return None
    base = [count - (stage in took) for stage, count in enumerate(layers_per_stage)]
    return LayerTie(tuple(base), tuple(sorted(took + short)), len(took), tuple(took))


@dataclass(frozen=True)
class LayerTie:
    """The time-tied splits of the water-filling: its last level's layers are fewer than the stages tied there.

    Every split ``base`` + one layer on each of ``extra`` of ``stages`` has the same slowest stage (up to
    :data:`TIE_TOLERANCE`): each of ``stages`` reaches the same time with its next layer, and the water-filling
    left no other stage below that level that could take one. Which ``extra`` stages take it is free as far as
    the stage times go; a schedule's memory can tell the splits apart (:func:`break_tie`).

    Attributes:
        base: layers per stage without the tied level's layers.
        stages: the stages tied at the last level, in model order (more than ``extra`` of them).
        extra: how many of them take one more layer (≥ 1).
        taken: the ``extra`` stages :func:`partition_layers` gave them to (its rule: the latest, by model order,
            among those their ranks' memory left open).
    """

    base: tuple[int, ...]
    stages: tuple[int, ...]
    extra: int
    taken: tuple[int, ...]

    def split(self, taken: Collection[int]) -> list[int]:
        """Layers per stage with one more on each stage of ``taken`` (``extra`` of :attr:`stages`).

        Raises:
            ValueError: ``taken`` is not ``extra`` of the tied stages.
        """
        if len(set(taken)) != self.extra or not set(taken) <= set(self.stages):
            raise ValueError(f"take {self.extra} of the tied stages {list(self.stages)}, not {sorted(taken)}")
        return [count + (stage in taken) for stage, count in enumerate(self.base)]


@dataclass(frozen=True)
class TieVerdict:
    """A schedule's judgement of one split: per rank its peak bytes (static included), and its step, ms."""

    peak_bytes: Sequence[float]
    step_ms: float

    def key(self) -> tuple[float, int, float]:
        """What :func:`break_tie` minimises, in this order: the peak over ranks (bytes), the number of ranks at
        it (within :data:`TIE_TOLERANCE`, relative), the step (ms)."""
        peak = max(self.peak_bytes, default=0.0)
        return peak, sum(1 for value in self.peak_bytes if value >= peak * (1 - TIE_TOLERANCE)), self.step_ms

    def better_than(self, other: TieVerdict, limit: Sequence[float] | None = None) -> bool:
        """Lower by :meth:`key`; peaks and steps within :data:`TIE_TOLERANCE` (relative) are equal.

        With ``limit`` (each rank's memory limit, bytes) the plan's own objective comes first: a split whose every
        rank fits its limit beats one that does not, and between two that fit the shorter step wins (then
        :meth:`key`); only where neither fits is the peak first. Without it, :meth:`key` alone."""
        if limit is not None:
            fits, other_fits = self.fits(limit), other.fits(limit)
            if fits != other_fits:
                return fits
            if fits and abs(self.step_ms - other.step_ms) > TIE_TOLERANCE * max(self.step_ms, other.step_ms):
                return self.step_ms < other.step_ms
        peak, at_peak, step = self.key()
        other_peak, other_at_peak, other_step = other.key()
        if abs(peak - other_peak) > TIE_TOLERANCE * max(peak, other_peak):
            return peak < other_peak
        if at_peak != other_at_peak:
            return at_peak < other_at_peak
        return step < other_step * (1 - TIE_TOLERANCE)

    def fits(self, limit: Sequence[float]) -> bool:
        """Every rank's peak within its ``limit`` (bytes)."""
        return all(peak <= bound for peak, bound in zip(self.peak_bytes, limit, strict=False))


def break_tie(
    tie: LayerTie,
    judge: Callable[[list[int]], TieVerdict | None],
    *,
    stage_ranks: Sequence[Sequence[int]],
    fits: Callable[[list[int]], bool] | None = None,
    should_stop: Callable[[], bool] | None = None,
    limit: Sequence[float] | None = None,
) -> list[int]:
    """Among ``tie``'s splits (one slowest-stage time), the one whose schedule runs fastest within ``limit``, or,
    without a limit or where none fits it, peaks lowest over the ranks.

    ``judge`` simulates the schedule of a split and gives each rank's peak and the step; it is the one judge: the
    split returned is the best judged by :meth:`TieVerdict.key` (the peak over ranks, then how many ranks sit at
    it, then the step). Why the schedule must judge: a rank's peak sums the stages it holds at one instant, and
    which of its stages holds the most microbatches then depends on the placement and the family's order, which
    the partition does not see (NeMo AutoModel's DeepSeek-V3 on 4 ranks × 8 chunks, interleaved 1F1B: the
    model-order rule put 17 layers on rank 0, 86.3 GiB against the lowest index's 81.7; judged, 79.3 GiB, the
    least of all 4,060 tied splits).

    Which splits are judged, bounded: a descent from the partition's own split (:attr:`LayerTie.taken`). Which of a
    rank's own stages takes a layer needs no schedule: a microbatch's activations on a later stage live within
    its span on an earlier one, so a later stage of a rank never holds more of them at any instant. So a move
    takes a layer from a rank at the peak (its earliest taken stage) to another rank (its latest stage left
    short), the other ranks lowest peak first;
    the first move the judge finds better is kept. The descent ends when no move from a rank at the peak is
    better, or after ``len(tie.stages)`` kept moves; a step judges at most (ranks at the peak) × (other ranks)
    splits, none twice. ``fits`` (the partition's memory bound) leaves a split out unjudged; ``should_stop``
    is polled before each judgement (a time limit), and ``None`` from the judge (it cannot judge) ends it too.
    ``limit`` (each rank's memory limit, bytes): among splits that fit it the shorter step wins, the peak only
    settling equal steps (:meth:`TieVerdict.better_than`); the peak comes first only where a split does not fit.
    Without it the peak comes first everywhere.

    Returns:
        The best judged split; the partition's own when nothing judged beats it or it could not be judged.
    """
    holders = [list(ranks) for ranks in stage_ranks]
    taken = set(tie.taken)
    best_split = tie.split(taken)
    best = None if should_stop is not None and should_stop() else judge(best_split)
    if best is None:
        return best_split
    judged = {frozenset(taken)}
    for _ in range(len(tie.stages)):
        for source, target in _moves(tie, taken, holders, best):
            candidate = (taken - {source}) | {target}
            if frozenset(candidate) in judged:
                continue
            judged.add(frozenset(candidate))
            split = tie.split(candidate)
            if fits is not None and not fits(split):
                continue
            verdict = None if should_stop is not None and should_stop() else judge(split)
            if verdict is None:
                return best_split
            if verdict.better_than(best, limit):
                taken, best, best_split = candidate, verdict, split
                break
        else:
            break
    return best_split


def _moves(tie: LayerTie, taken: set[int], holders: list[list[int]], verdict: TieVerdict) -> list[tuple[int, int]]:
    """The moves :func:`break_tie` tries from ``taken``, in order, as (the tied stage that gives its layer up, the
    one that takes it): from each rank at the peak (highest first) its earliest taken stage, to each other rank
    holding a tied stage left short (lowest peak first) its latest such stage."""
    peaks = verdict.peak_bytes
    peak = max(peaks, default=0.0)
    at_peak = sorted(
        (rank for rank, value in enumerate(peaks) if value >= peak * (1 - TIE_TOLERANCE)), key=lambda r: -peaks[r]
    )
    short_by_rank: dict[int, list[int]] = {}
    taken_by_rank: dict[int, list[int]] = {}
    for stage in tie.stages:
        for rank in holders[stage]:
            (taken_by_rank if stage in taken else short_by_rank).setdefault(rank, []).append(stage)
    moves = []
    for source_rank in at_peak:
        if source_rank not in taken_by_rank:
            continue
        targets = sorted(set(short_by_rank) - {source_rank}, key=lambda rank: (peaks[rank], rank))
        moves += [(taken_by_rank[source_rank][0], short_by_rank[rank][-1]) for rank in targets]
    return moves


class _TieLevels:
    """Stage times keyed for the heap: a time within ``TIE_TOLERANCE`` of one already seen takes that one's key,
    so a near tie orders as an exact one (the latest stage first) at O(log levels) a key."""

    def __init__(self) -> None:
        self.levels: list[float] = []

    def key(self, time: float) -> float:
        index = bisect.bisect_left(self.levels, time)
        for near in self.levels[max(index - 1, 0) : index + 1]:
            if abs(near - time) <= TIE_TOLERANCE * abs(time):
                return near
        self.levels.insert(index, time)
        return time
