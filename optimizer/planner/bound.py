"""The least busiest pipeline rank over every layer split: the planner's lower bound of a step
(:meth:`pipesched.optimizer.planner.prune.Estimator.bound_ms`).

The evaluation may split the layers any way (:func:`pipesched.optimizer.partition.partition_layers` by time and
memory, a tie settled by the schedule, or the request's ``layers_per_stage``), so a bound of the step must hold for
every split: it is the least, over the splits, of the busiest rank's cost. Each rank's cost is linear in its layers:

    cost_r = own_r + Σ own of its layers + Σ ``prefix`` of the layers on the stages before its first stage,

``own`` what the rank runs itself (m microbatches' passes, or its optimizer step), ``prefix`` what must run on other
ranks before its first pass and after its last (the pipeline's fill and drain, a chain of one microbatch's passes).
A mixture-of-experts model's first ``dense`` layers cost their own (``first`` in model order). A rank's cost may
also be the largest of several such forms, each a lower bound of what it runs (:func:`contiguous_min_max`'s
``more``: a split backward's rank, its passes, or its forwards and input gradients then the drain to stage 0).

:func:`contiguous_min_max` is exact for one stage per rank (every split of the layers over the ranks is a contiguous
one); :func:`count_min_max` bounds several stages per rank from below by letting each rank hold any number of layers
and charging the stages before its first stage their least (one layer each, none on the embedding's).
Both bisect on the busiest rank's cost and return the largest cost found infeasible (or the start, a lower
bound itself), within ``RELATIVE_TOLERANCE`` of the least feasible one: a lower bound either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["RELATIVE_TOLERANCE", "Form", "LayerCosts", "contiguous_min_max", "count_min_max"]

#: The bisection stops when the bracket is this narrow (relative): the bound is at most this far below the least.
RELATIVE_TOLERANCE = 1e-4

#: A capacity's layer count is rounded up from within this much (relative) of the next integer, so float noise
#: never makes a feasible cost look infeasible (which could put the bound above the least).
_SLACK = 1e-9


@dataclass(frozen=True)
class LayerCosts:
    """Costs of one layer (ms): ``own`` on the rank holding it, ``prefix`` on the ranks after its stage's rank (the
    fill and drain they wait for); the first ``dense`` of ``layers`` layers cost ``dense_own``/``dense_prefix``."""

    layers: int
    dense: int
    own: float
    prefix: float
    dense_own: float
    dense_prefix: float

    def span(self, start: int, stop: int) -> tuple[float, float]:
        """(own, prefix) of the layers at positions [start, stop) in model order."""
        dense = max(0, min(stop, self.dense) - start) if start < self.dense else 0
        rest = stop - start - dense
        return dense * self.dense_own + rest * self.own, dense * self.dense_prefix + rest * self.prefix


def _bisect(feasible: Callable[[float], bool], low: float, high: float) -> float:
    """The largest cost found infeasible (or ``low``, assumed at most the least feasible) within the tolerance;
    ``high`` a first guess above it (doubled until feasible)."""
    low = max(low, 0.0)
    high = max(high, low * (1 + 2 * RELATIVE_TOLERANCE), 1e-9)
    while not feasible(high):
        low, high = high, 2 * high
        if high > 1e30:  # pragma: no cover - costs are finite
            return low
    while high - low > RELATIVE_TOLERANCE * high:
        middle = 0.5 * (low + high)
        if feasible(middle):
            high = middle
        else:
            low = middle
    return low


#: One linear form of the ranks' costs: (a layer's costs, per stage its fixed own cost, its fixed prefix cost).
Form = tuple[LayerCosts, Sequence[float], Sequence[float]]


def contiguous_min_max(costs: LayerCosts, own: Sequence[float], prefix: Sequence[float], *more: Form) -> float:
    """Least over the contiguous splits (stage s on rank s, any layers ≥ 0 each) of the busiest rank's cost.

    Args:
        costs: a layer's costs.
        own: per stage, its fixed own cost (the embedding's on stage 0, the head's on the last).
        prefix: per stage, its fixed prefix cost, charged to every later stage (the embedding's, the p2p).
        more: other forms ``(costs, own, prefix)`` of the same layers (``layers`` and ``dense`` equal), each a
            lower bound of the ranks' costs too: a rank's cost is then the largest of its forms.

    Each form's own−prefix slopes are ≥ 0 (a layer costs its rank at least what it costs the ranks after): a stage's
    cost is nondecreasing in its layers, and the stages after it lower its prefix by holding more, so for a given
    busiest cost the split that gives every stage from the last back the most layers it can hold (under every
    form) is feasible whenever any split is (the remaining layers, in model order, are the prefix of the stages
    before): the bisection's test is exact. Cost O(stages · forms) per test.
    """
    forms = [_StageForm.of(form, len(own)) for form in ((costs, own, prefix), *more)]
    stages, layers, dense = len(own), costs.layers, costs.dense
    grow = 1 + _SLACK

    def feasible(limit: float) -> bool:
        ceiling = limit * grow
        remaining = layers
        for stage in range(stages - 1, 0, -1):
            taken = remaining
            for form in forms:
                most = form.most(stage, remaining, limit, ceiling)
                if most < 0:
                    return False
                taken = min(taken, most)
            remaining -= taken
            if remaining == 0:
                return all(form.empty[stage] <= ceiling for form in forms)
        dense_first = min(remaining, dense)
        return all(
            form.own[0] + dense_first * form.dense_own + (remaining - dense_first) * form.moe_own <= ceiling
            for form in forms
        )

    low = max((sum(form.own) + form.costs.span(0, layers)[0]) / stages for form in forms)  # the mean rank's own
    layer = max(max(form.moe_own, form.dense_own) for form in forms)
    high = max(max(form.own) + form.before[-1] + form.prefix[-1] for form in forms) + 2 * layer
    return _bisect(feasible, low, low + high)


@dataclass(frozen=True)
class _StageForm:
    """One form of :func:`contiguous_min_max`, with its running sums: ``before[s]`` the fixed prefix of the stages
    before s, ``empty[s]`` the costliest stage before s (1 ≤ s' < s) left without a layer, and stage 0's own."""

    costs: LayerCosts
    own: Sequence[float]
    prefix: Sequence[float]
    before: list[float]
    empty: list[float]

    @classmethod
    def of(cls, form: Form, stages: int) -> _StageForm:
        costs, own, prefix = form
        before = [0.0] * stages
        for stage in range(1, stages):
            before[stage] = before[stage - 1] + prefix[stage - 1]
        empty = [own[0]] * stages
        for stage in range(2, stages):
            empty[stage] = max(empty[stage - 1], before[stage - 1] + own[stage - 1])
        return cls(costs, own, prefix, before, empty)

    @property
    def moe_own(self) -> float:
        return self.costs.own

    @property
    def dense_own(self) -> float:
        return self.costs.dense_own

    def most(self, stage: int, remaining: int, limit: float, ceiling: float) -> int:
        """The most of the ``remaining`` layers (the last ones in model order) ``stage`` may hold within ``limit``,
        the others its prefix; −1 when even none fits."""
        costs, dense, grow = self.costs, self.costs.dense, 1 + _SLACK
        # the prefix of the remaining layers (positions [0, remaining), the dense ones first)
        if remaining <= dense:
            rest = remaining * costs.dense_prefix
        else:
            rest = dense * costs.dense_prefix + (remaining - dense) * costs.prefix
        base = self.before[stage] + rest + self.own[stage]  # with no layer on this stage
        if base > ceiling:
            return -1
        room = limit - base
        moe_slope, dense_slope = costs.own - costs.prefix, costs.dense_own - costs.dense_prefix
        moe_left = remaining - dense if remaining > dense else 0
        taken = moe_left if moe_slope <= 0 else min(moe_left, int(room / moe_slope * grow + _SLACK))
        if taken == moe_left and remaining > moe_left:
            room -= taken * moe_slope
            dense_left = remaining - moe_left
            more = dense_left if dense_slope <= 0 else int(max(0.0, room) / dense_slope * grow + _SLACK)
            taken += min(dense_left, more)
        return taken


def count_min_max(costs: LayerCosts, own: Sequence[float], least: Sequence[int]) -> float:
    """A lower bound of the least busiest rank's cost where each rank r may hold any ``least[r]`` or more layers.

    Args:
        costs: a layer's costs (only ``own`` counts here).
        own: per rank, its fixed own cost (embedding, head) plus the least prefix of the stages before its first.
        least: per rank, the fewest layers it holds.

    A cost is judged feasible when every rank's room holds its ``least`` layers at the cheaper layer's cost, the
    rooms hold ``layers`` of them, and the rooms' sum holds every layer's own cost (dense and not): conditions every
    feasible split meets, so the answer is at most the least. Cost O(ranks) per test.
    """
    cheaper = min(costs.own, costs.dense_own) if costs.dense else costs.own
    total = costs.span(0, costs.layers)[0]
    layers = costs.layers
    pairs = list(zip(own, least, strict=True))
    grow = 1 + _SLACK

    def feasible(limit: float) -> bool:
        held = 0
        room_sum = 0.0
        floor = -_SLACK * limit
        for fixed, fewest in pairs:
            room = limit - fixed
            if room < floor:
                return False
            if room > 0:
                count = layers if cheaper <= 0 else min(layers, int(room / cheaper * grow + _SLACK))
                room_sum += room
            else:
                count = 0
            if count < fewest:
                return False
            held += count
        return held >= layers and room_sum * grow >= total

    low = (sum(own) + total) / len(own)
    return _bisect(feasible, low, low + max(own) - min(own) + 2 * max(costs.own, costs.dense_own))
