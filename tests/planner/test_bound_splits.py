"""The least busiest rank over the layer splits (:mod:`pipesched.optimizer.planner.bound`) against every split,
enumerated: exact (within the bisection's tolerance) for one stage per rank, never above for several."""

from __future__ import annotations

import itertools
import random

import pytest

from pipesched.optimizer.planner.bound import RELATIVE_TOLERANCE, LayerCosts, contiguous_min_max, count_min_max
from pipesched.optimizer.problem import stage_to_rank


def _splits(layers: int, stages: int, least: list[int]) -> list[tuple[int, ...]]:
    return [
        split
        for split in itertools.product(range(layers + 1), repeat=stages)
        if sum(split) == layers and all(n >= low for n, low in zip(split, least, strict=True))
    ]


def _rank_costs(
    costs: LayerCosts, split: tuple[int, ...], own: list[float], prefix: list[float], ranks: list[int]
) -> list[float]:
    """Each rank's cost under ``split``: its stages' own costs, and the prefix of the stages before its first."""
    num_ranks = max(ranks) + 1
    starts = [sum(split[:stage]) for stage in range(len(split))]
    total = [0.0] * num_ranks
    for stage, count in enumerate(split):
        total[ranks[stage]] += own[stage] + costs.span(starts[stage], starts[stage] + count)[0]
    for rank in range(num_ranks):
        first = ranks.index(rank)
        total[rank] += sum(prefix[s] + costs.span(starts[s], starts[s] + split[s])[1] for s in range(first))
    return total


def _random_case(
    rng: random.Random, layers: int, dense: int, stages: int
) -> tuple[LayerCosts, list[float], list[float]]:
    own_cost = rng.uniform(1.0, 3.0)
    costs = LayerCosts(
        layers,
        dense,
        own_cost,
        rng.uniform(0.0, own_cost),
        rng.uniform(0.5, 3.0),
        rng.uniform(0.0, 0.5),
    )
    own = [0.0] * stages
    own[0], own[-1] = rng.uniform(0.0, 2.0), rng.uniform(0.0, 6.0)
    prefix = [rng.uniform(0.0, 0.3) for _ in range(stages)]
    return costs, own, prefix


@pytest.mark.parametrize("seed", range(40))
def test_one_stage_per_rank_is_the_least_over_every_split(seed: int) -> None:
    rng = random.Random(seed)
    stages = rng.randint(2, 4)
    layers = rng.randint(stages, 9)
    costs, own, prefix = _random_case(rng, layers, rng.choice([0, 0, 1, 3, layers]), stages)
    least = min(
        max(_rank_costs(costs, split, own, prefix, list(range(stages))))
        for split in _splits(layers, stages, [0] * stages)
    )
    bound = contiguous_min_max(costs, own, prefix)
    assert least * (1 - 2 * RELATIVE_TOLERANCE) <= bound <= least * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(40))
def test_the_larger_of_two_forms_is_the_least_over_every_split(seed: int) -> None:
    # a split backward's rank: its passes (the first form), or its forwards and input gradients followed by the
    # input gradients of the stages before it (the second: its prefix per layer larger, its own smaller)
    rng = random.Random(1000 + seed)
    stages = rng.randint(2, 4)
    layers = rng.randint(stages, 9)
    dense = rng.choice([0, 0, 1, 3, layers])
    costs, own, prefix = _random_case(rng, layers, dense, stages)
    second, second_own, second_prefix = _random_case(rng, layers, dense, stages)
    second_own = [cost + rng.uniform(0.0, 1.0) for cost in second_own]
    ranks = list(range(stages))
    least = min(
        max(
            max(first, other)
            for first, other in zip(
                _rank_costs(costs, split, own, prefix, ranks),
                _rank_costs(second, split, second_own, second_prefix, ranks),
                strict=True,
            )
        )
        for split in _splits(layers, stages, [0] * stages)
    )
    bound = contiguous_min_max(costs, own, prefix, (second, second_own, second_prefix))
    assert least * (1 - 2 * RELATIVE_TOLERANCE) <= bound <= least * (1 + 1e-9)
    # at least either form alone
    assert bound >= contiguous_min_max(second, second_own, second_prefix) * (1 - 2 * RELATIVE_TOLERANCE)


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("placement", ["loop", "v"])
def test_several_stages_per_rank_stay_below_every_split(seed: int, placement: str) -> None:
    rng = random.Random(seed)
    ranks_count = rng.randint(2, 3)
    v = 2
    stages = ranks_count * v
    layers = rng.randint(stages, 9)
    costs, own, prefix = _random_case(rng, layers, rng.choice([0, 1, 2]), stages)
    ranks = list(stage_to_rank(ranks_count, v, placement))
    least_layers = [0 if stage in (0, stages - 1) else 1 for stage in range(stages)]
    least = min(max(_rank_costs(costs, split, own, prefix, ranks)) for split in _splits(layers, stages, least_layers))
    layer_fill = min(costs.prefix, costs.dense_prefix) if costs.dense else costs.prefix
    rank_own = [0.0] * ranks_count
    rank_least = [0] * ranks_count
    for stage in range(stages):
        rank_own[ranks[stage]] += own[stage]
        rank_least[ranks[stage]] += least_layers[stage]
    for rank in range(ranks_count):
        rank_own[rank] += sum(prefix[s] + (layer_fill if s else 0.0) for s in range(ranks.index(rank)))
    assert count_min_max(costs, rank_own, rank_least) <= least * (1 + 1e-9)
