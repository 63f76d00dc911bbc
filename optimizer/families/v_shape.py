"""V-Half and V-Min (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", arXiv 2405.15362).

V placement: rank r holds stages r and 2p−1−r. The paper builds these schedules by repeating one
*building block* per microbatch, every 6 time slots (one slot per pass with T_F = T_I = T_W), with
per-rank offsets of the block's four passes (Sec. 4, Fig. 5; the authors' ``zbv_greedy.py``):

* V-Min (activation ≈ 1/3 of 1F1B's): rank r runs its chunk-0 forward at slot ``r``, chunk-1 forward
  at ``2p−1−r``, chunk-1 backward (I) at ``2p+g+r`` and chunk-0 backward at ``4p+g−1−r``, with the gap
  ``g = 2`` when 3 divides p, else 0.
* V-Half (≈ 1/2): slots ``2r``, ``3p−2−r``, ``3p+g+2r−1``, ``6p+g−r−2``, ``g = 3`` for even p, else 0.

Microbatch k adds 6k. From there we follow the authors' pipeline exactly: W passes go into the
empty slots (earliest backward's W first), then the warm-up and cool-down are *squeezed* — each
pass outside the steady phase (from the first chunk-0 backward on rank 0 to the last forward) moves
to the earliest free slot after its dependencies that keeps the rank's activation peak — once with
W placed, and once more without W (re-placing W after), the slots are compacted by eager execution
with unit costs, and each rank's order is its passes sorted by slot. Our simulator times the orders
with the problem's real costs (as the authors' final eager pass does).

Fused backward: the backward slots run B (I and W together) and the W slots are dropped, which
leaves them idle: the blocks are designed for split backward (for p=4, m=8 the fused V-Half bubble
is 0.37 against 0.09 split, still below the capped greedy's 0.47).
Any microbatch count (the block pattern is valid for every m); where the squeeze's assumptions fail
or the order does not pass :func:`pipesched.optimizer.simulate.simulate`, we fall back to the memory-capped
list scheduler of :mod:`._greedy` with ``k = ⌊p/2⌋ + 1`` (V-Half) or ``⌊p/3⌋ + 1`` (V-Min)
microbatches per rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from pipesched.optimizer.families._base import FamilySpec, PlannerEstimate
from pipesched.optimizer.families._greedy import capped_greedy_orders, max_reservations
from pipesched.optimizer.instance import compile_problem
from pipesched.optimizer.ir import Action, ActionKind, Orders
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.progress import check_deadline
from pipesched.optimizer.simulate import InvalidSchedule, simulate

__all__ = ["block_pattern", "capped_v_orders", "mean_stage_costs", "v_block_orders", "valid_or_none"]

# Pass types of one rank's building block, in the authors' order: chunk-0 F, chunk-1 F, chunk-1
# backward (I or B), chunk-0 backward, and (when placed) the W of the chunk-1 and chunk-0 backwards.
_NUM_BLOCK_TYPES = 4
_MEMORY = (1, 1, 0, 0, -1)  # activation units per pass type, W frees the microbatch's stage


def mean_stage_costs(problem: Problem) -> tuple[float, float, float, float, float, float]:
    """Mean per-stage ``(forward_ms, backward_input_ms, backward_weight_ms, p2p_ms, activation, retained)``.

    The authors' V generators take one cost per pass kind; they are run on the stage means.
    """
    assert problem.costs is not None and problem.memory is not None
    values = [
        problem.stage_values(problem.costs.forward),
        problem.stage_values(problem.costs.backward_input),
        problem.stage_values(problem.costs.backward_weight),
        problem.stage_values(problem.costs.p2p),
        problem.stage_values(problem.memory.activation),
        problem.stage_values(problem.memory.retained_for_weight),
    ]
    f, i, w, c, a, r = (sum(v) / len(v) for v in values)
    return f, i, w, c, a, r


def valid_or_none(problem: Problem, orders: Orders) -> Orders | None:
    """``orders`` if the simulator accepts them for ``problem`` (memory limits included), else ``None``."""
    try:
        simulate(compile_problem(problem, step_actions=False), orders)
    except InvalidSchedule:
        return None
    return orders


def capped_v_orders(problem: Problem, in_flight: Callable[[int], int]) -> Orders:
    """Orders holding at most ``in_flight(p)`` microbatches' activations per rank (see :mod:`._greedy`)."""
    inst = compile_problem(problem, step_actions=False)
    k = in_flight(inst.num_ranks)
    caps = [k * reservation for reservation in max_reservations(inst)]
    return capped_greedy_orders(inst, caps)


def block_pattern(p: int, memory: str) -> list[list[int]]:
    """Per rank, the slots of the building block's four passes (see the module docstring).

    Args:
        p: ranks.
        memory: ``"half"`` (V-Half) or ``"min"`` (V-Min).
    """
    if memory == "min":
        gap = 2 if p % 3 == 0 else 0
        return [[r, 2 * p - r - 1, 2 * p + gap + r, 4 * p + gap - r - 1] for r in range(p)]
    gap = 3 if p % 2 == 0 else 0
    return [[2 * r, 3 * p - r - 2, 3 * p + gap + 2 * r - 1, 6 * p + gap - r - 2] for r in range(p)]


Slots = list[list[int]]  # per pass type, the slot of each microbatch's pass (increasing)


def _next_event(ranks: list[Slots], pos: list[list[int]]) -> tuple[int, int, int, int] | None:
    """The unprocessed pass with the smallest ``(slot, rank, type)``: ``(slot, rank, type, microbatch)``."""
    best = None
    for rank, slots in enumerate(ranks):
        for kind, times in enumerate(slots):
            k = pos[rank][kind]
            if k < len(times):
                key = (times[k], rank, kind, k)
                if best is None or key < best:
                    best = key
    return best


def _place_weights(slots: Slots, split: bool) -> Slots:
    """Add W passes in the empty slots, each after its backward (authors' ``put_w``).

    Without ``split`` one W list holds the W of either chunk, in the order of their backwards;
    with ``split`` the chunk-1 backwards' W go to list 4 and the chunk-0 backwards' to list 5
    (in an empty slot, list 4 is served first).
    """
    check_deadline()
    result = [list(times) for times in slots[:_NUM_BLOCK_TYPES]]
    weights: list[list[int]] = [[], []] if split else [[]]
    owed = [0, 0]
    events = sorted((t, kind) for kind, times in enumerate(result) for t in times)
    bound = events[-1][0] if events else -1
    at = dict((t, kind) for t, kind in events)
    for slot in range(bound + 1):
        kind = at.get(slot)
        if kind is not None:
            if kind >= 2:
                owed[kind - 2 if split else 0] += 1
            continue
        for w in range(2):
            if owed[w]:
                weights[w].append(slot)
                owed[w] -= 1
                break
    slot = bound
    for w in range(2):
        while owed[w] > 0:
            slot += 1
            weights[w].append(slot)
            owed[w] -= 1
    return result + weights


def _activation_peak(slots: Slots) -> int:
    """Peak activation units on one rank (authors' ``mem_of_stage``); without W lists, W runs lazily in empty slots."""
    check_deadline()
    has_weights = len(slots) > _NUM_BLOCK_TYPES
    at = {t: kind for kind, times in enumerate(slots) for t in times}
    bound = max(at) if at else -1
    owed = held = peak = 0
    for slot in range(bound + 1):
        kind = at.get(slot)
        if kind is not None:
            held += _MEMORY[min(kind, 4)]
            if 2 <= kind < 4:
                owed += 1
        elif not has_weights and owed:
            held -= 1
            owed -= 1
        peak = max(peak, held)
    return peak


def _eager_slots(ranks: list[Slots]) -> list[Slots]:
    """Compact the slots: every pass starts as soon as its dependencies and its rank allow (unit costs)."""
    p = len(ranks)
    pos = [[0] * len(slots) for slots in ranks]
    end: dict[tuple[int, int, int], int] = {}
    last: list[tuple[int, int] | None] = [None] * p
    start: list[Slots] = [[[0] * len(times) for times in slots] for slots in ranks]
    while (event := _next_event(ranks, pos)) is not None:
        check_deadline()
        _, rank, kind, k = event
        pos[rank][kind] += 1
        ready = 0
        if kind in (0, 2) and rank > 0:
            ready = max(ready, end[(rank - 1, kind, k)])
        if kind in (1, 3) and rank < p - 1:
            ready = max(ready, end[(rank + 1, kind, k)])
        if 0 < kind < _NUM_BLOCK_TYPES:
            ready = max(ready, end[(rank, kind - 1, k)])
        if k > 0:
            ready = max(ready, end[(rank, kind, k - 1)])
        previous = last[rank]
        if previous is not None:
            ready = max(ready, end[(rank, *previous)])
        end[(rank, kind, k)] = ready + 1
        start[rank][kind][k] = ready
        last[rank] = (kind, k)
    return start


def _squeeze(ranks: list[Slots], with_weights: bool) -> list[Slots]:
    """Move warm-up and cool-down passes to earlier free slots within the peak (authors' ``reorder``)."""
    if with_weights:
        ranks = [_place_weights(slots, split=False) for slots in ranks]
    else:
        ranks = [[list(times) for times in slots] for slots in ranks]
    limit = max(_activation_peak(slots) for slots in ranks)
    p = len(ranks)
    m = len(ranks[0][0])
    pos = [[0] * len(slots) for slots in ranks]
    occupied: list[set[int]] = [set() for _ in range(p)]
    phase = 0
    while (event := _next_event(ranks, pos)) is not None:
        check_deadline()
        slot, rank, kind, k = event
        pos[rank][kind] += 1
        if kind == 3 and rank == 0 and phase == 0:
            phase = 1
        if phase == 1:
            if kind == 0 and k == m - 1:
                phase = 2
            occupied[rank].add(slot)
            continue
        if phase == 0 and not with_weights:
            occupied[rank].add(slot)
            continue
        slots = ranks[rank]
        ready = -1
        if kind in (0, 2) and rank > 0:
            ready = max(ready, ranks[rank - 1][kind][k])
        if kind in (1, 3) and rank < p - 1:
            ready = max(ready, ranks[rank + 1][kind][k])
        if 0 < kind < _NUM_BLOCK_TYPES:
            ready = max(ready, slots[kind - 1][k])
        if kind == _NUM_BLOCK_TYPES:
            ready = max(ready, sorted(slots[2] + slots[3])[k])
        if k > 0:
            ready = max(ready, slots[kind][k - 1])
        ready += 1
        if ready > slot:
            raise ValueError("building-block slots violate a dependency")
        placed = False
        for candidate in range(ready, slot):
            if candidate not in occupied[rank]:
                slots[kind][k] = candidate
                if _activation_peak(slots) <= limit:
                    placed = True
                    break
        if not placed:
            slots[kind][k] = slot
        occupied[rank].add(slots[kind][k])
    if not with_weights:
        ranks = [_place_weights(slots, split=False) for slots in ranks]
    return _eager_slots(ranks)


def block_slots(p: int, m: int, memory: str) -> list[Slots]:
    """Per rank and pass type (4 block types + W of chunk 1 + W of chunk 0), the slot of each microbatch.

    The authors' ``schedule_from_pattern``: block pattern → squeeze with W → squeeze without W →
    W re-placed per chunk.
    """
    ranks = [[list(range(start, start + 6 * m, 6)) for start in offsets] for offsets in block_pattern(p, memory)]
    first = _squeeze(ranks, with_weights=True)
    second = _squeeze([slots[:_NUM_BLOCK_TYPES] for slots in first], with_weights=False)
    return [_place_weights(slots[:_NUM_BLOCK_TYPES], split=True) for slots in second]


def v_block_orders(problem: Problem, memory: str) -> Orders | None:
    """Per-rank V-Half (``memory="half"``) or V-Min (``"min"``) orders, or ``None`` if they fail the simulator.

    Returns:
        One order per rank: F, then I and W (or B when the backward is fused) of the rank's stages
        r and 2p−1−r for every microbatch, in building-block slot order.
    """
    p, m = problem.pipeline.num_ranks, problem.pipeline.num_microbatches
    try:
        ranks = block_slots(p, m, memory)
    except (ValueError, KeyError):
        return None
    split = problem.split_backward
    backward_kind = ActionKind.BACKWARD_INPUT if split else ActionKind.BACKWARD
    orders: Orders = []
    for rank, slots in enumerate(ranks):
        first, second = rank, 2 * p - 1 - rank
        passes = [
            (ActionKind.FORWARD, first),
            (ActionKind.FORWARD, second),
            (backward_kind, second),
            (backward_kind, first),
            (ActionKind.BACKWARD_WEIGHT, second),
            (ActionKind.BACKWARD_WEIGHT, first),
        ]
        timed: list[tuple[int, int, Action]] = []
        for kind, times in enumerate(slots):
            action_kind, stage = passes[kind]
            if action_kind == ActionKind.BACKWARD_WEIGHT and not split:
                continue
            timed.extend((t, kind, Action(stage, action_kind, k)) for k, t in enumerate(times))
        orders.append([action for _, _, action in sorted(timed)])
    return valid_or_none(problem, orders)


def _builder(memory: str, in_flight: Callable[[int], int]) -> Callable[[Problem], Orders]:
    def build(problem: Problem) -> Orders:
        orders = v_block_orders(problem, memory)
        return orders if orders is not None else capped_v_orders(problem, in_flight)

    return build


FAMILIES = [
    FamilySpec(
        name="v-half",
        description="V-Half: V placement, building blocks holding about half of 1F1B's activation memory.",
        build=_builder("half", lambda p: p // 2 + 1),
        listing_order=90,
        placements=("v",),
        stages_per_rank=range(2, 3),
        # Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", Table 1: p + 1 half-size chunks.
        planner=PlannerEstimate(
            in_flight=lambda p, v, m: min(2 * m, p + 1), bubble=0.5, seconds_per_thousand_actions=0.9
        ),
    ),
    FamilySpec(
        name="v-min",
        description="V-Min: V placement, building blocks holding about a third of 1F1B's activation memory.",
        build=_builder("min", lambda p: p // 3 + 1),
        listing_order=100,
        placements=("v",),
        stages_per_rank=range(2, 3),
        # Same Table 1: ⌈2p/3⌉ + 1 half-size chunks.
        planner=PlannerEstimate(
            in_flight=lambda p, v, m: min(2 * m, math.ceil(2 * p / 3) + 1),
            bubble=0.8,
            seconds_per_thousand_actions=0.9,
        ),
    ),
]
