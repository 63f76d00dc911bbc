"""The layer partitioner (optimizer/partition.py): exact min-max split, memory, and what it buys a schedule."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import pytest

from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.partition import (
    TIE_TOLERANCE,
    PartitionError,
    even_partition,
    megatron_partition,
    partition_layers,
    slowest_stage,
)
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.solve import solve

#: A 16-layer model with a 256k vocabulary: the LM head weighs several layers, so an even split is slow.
UNEVEN_MODEL = {
    "num_layers": 16,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "seq_length": 1024,
    "vocab_size": 256_000,
    "micro_batch_size": 2,
}


def uneven_problem(layers_per_stage: list[int] | None, time_limit_s: float = 2.0) -> Problem:
    return load_problem(
        {
            "pipeline": {"num_ranks": 4, "num_microbatches": 8},
            "model": {**UNEVEN_MODEL, "layers_per_stage": layers_per_stage},
            "cluster": {"accelerator": "H100-SXM", "p2p_latency_ms": 0.02},
            "solver": {"method": "auto", "time_limit_s": time_limit_s},
        }
    )


def compute_ms(problem: Problem) -> list[float]:
    assert problem.costs is not None
    return [
        f + i + w
        for f, i, w in zip(
            problem.stage_values(problem.costs.forward),
            problem.stage_values(problem.costs.backward_input),
            problem.stage_values(problem.costs.backward_weight),
            strict=True,
        )
    ]


def compositions(total: int, parts: int, least: int) -> Iterator[list[int]]:
    for cuts in itertools.combinations(range(1, total - parts * least + parts), parts - 1):
        bounds = [0, *cuts, total - parts * least + parts]
        yield [bounds[k + 1] - bounds[k] - 1 + least for k in range(parts)]


def test_even_partition() -> None:
    assert even_partition(10, 4) == [3, 3, 2, 2]
    assert even_partition(8, 8) == [1] * 8
    with pytest.raises(PartitionError):
        even_partition(3, 0)


def test_partitioner_beats_the_even_split_on_a_heavy_head() -> None:
    even = uneven_problem(even_partition(16, 4))
    partitioned = uneven_problem(None)
    assert partitioned.model is not None and partitioned.model.layers_per_stage is not None
    layers = partitioned.model.layers_per_stage
    assert sum(layers) == 16 and layers[-1] < 4  # the head's stage gives layers away
    assert max(compute_ms(partitioned)) < 0.9 * max(compute_ms(even))

    auto_even = solve(even)
    auto_partitioned = solve(partitioned)
    assert auto_even.status != "infeasible" and auto_partitioned.status != "infeasible"
    assert auto_partitioned.makespan < auto_even.makespan
    # the schedule's problem records the partition the runtime must build
    assert auto_partitioned.problem.model is not None
    assert auto_partitioned.problem.model.layers_per_stage == layers


def test_greedy_is_exact_against_enumeration() -> None:
    rng = random.Random(7)
    for _ in range(200):
        num_stages = rng.randint(1, 4)
        num_layers = rng.randint(num_stages, 10)
        per_layer = [rng.uniform(0.5, 2.0) for _ in range(num_stages)]
        fixed = [rng.uniform(0.0, 6.0) for _ in range(num_stages)]
        memory_per_layer = [rng.uniform(1.0, 3.0) for _ in range(num_stages)]
        limit = rng.uniform(3.0, 30.0)

        def stage_time(stage: int, count: int, per_layer: list[float] = per_layer, fixed: list[float] = fixed) -> float:
            return fixed[stage] + per_layer[stage] * count

        def stage_memory(stage: int, count: int, memory: list[float] = memory_per_layer) -> float:
            return memory[stage] * count

        feasible = [
            split
            for split in compositions(num_layers, num_stages, 1)
            if all(stage_memory(k, n) <= limit for k, n in enumerate(split))
        ]
        if not feasible:
            with pytest.raises(PartitionError):
                partition_layers(num_layers, num_stages, stage_time=stage_time, stage_memory=stage_memory, limit=limit)
            continue
        best = min(slowest_stage(split, stage_time) for split in feasible)
        split = partition_layers(num_layers, num_stages, stage_time=stage_time, stage_memory=stage_memory, limit=limit)
        assert sum(split) == num_layers and min(split) >= 1
        assert all(stage_memory(k, n) <= limit for k, n in enumerate(split))
        assert slowest_stage(split, stage_time) == pytest.approx(best)


def test_a_tie_goes_to_the_latest_stage_and_a_real_difference_does_not() -> None:
    # 5 equal layers over 4 equal stages: the extra layer goes where the fewest microbatches are in flight
    assert partition_layers(5, 4, stage_time=lambda stage, count: float(count)) == [1, 1, 1, 2]
    # within the tolerance (summation noise) still a tie; twice the tolerance apart it is not
    noisy = [1.0, 1.0 - 0.5 * TIE_TOLERANCE, 1.0, 1.0 + 0.5 * TIE_TOLERANCE]
    assert partition_layers(5, 4, stage_time=lambda stage, count: count * noisy[stage]) == [1, 1, 1, 2]
    faster = [1.0, 1.0 - 2 * TIE_TOLERANCE, 1.0, 1.0]
    assert partition_layers(5, 4, stage_time=lambda stage, count: count * faster[stage]) == [1, 2, 1, 1]


def test_ties_put_the_extra_layers_latest_at_no_cost_in_the_slowest_stage() -> None:
    # The stages mirrored give the split the lowest-index tie-break would: ours has at least as many layers
    # in every suffix of stages (fewer microbatches in flight on them), and its slowest stage is as fast
    rng = random.Random(11)
    moved = 0
    for _ in range(400):
        num_stages = rng.randint(2, 6)
        num_layers = rng.randint(num_stages, 14)
        fixed = [rng.choice([0.0, 0.0, 1.0, 2.0]) for _ in range(num_stages)]
        per_layer = [rng.choice([1.0, 1.0, 2.0]) for _ in range(num_stages)]
        noise = [1.0 + rng.uniform(-0.1, 0.1) * TIE_TOLERANCE for _ in range(num_stages)]

        def stage_time(
            stage: int,
            count: int,
            fixed: list[float] = fixed,
            per_layer: list[float] = per_layer,
            noise: list[float] = noise,
        ) -> float:
            return (fixed[stage] + per_layer[stage] * count) * noise[stage]

        split = partition_layers(num_layers, num_stages, stage_time=stage_time)
        earliest = partition_layers(
            num_layers, num_stages, stage_time=lambda stage, count, last=num_stages - 1: stage_time(last - stage, count)
        )[::-1]
        moved += split != earliest
        assert slowest_stage(split, stage_time) <= slowest_stage(earliest, stage_time) * (1 + TIE_TOLERANCE)
        assert all(sum(split[k:]) >= sum(earliest[k:]) for k in range(num_stages)), (split, earliest)
    assert moved >= 100  # ties are common here: the check is not vacuous


def test_memory_moves_layers_off_a_full_rank() -> None:
    # stage 0 is fast per layer but holds a large static part: time alone would give it most layers
    def stage_time(stage: int, count: int) -> float:
        return count * (1.0 if stage == 0 else 2.0)

    def stage_memory(stage: int, count: int) -> float:
        return (60.0 if stage == 0 else 0.0) + 10.0 * count

    free = partition_layers(12, 2, stage_time=stage_time)
    assert free == [8, 4]
    tight = partition_layers(12, 2, stage_time=stage_time, stage_memory=stage_memory, limit=100.0)
    assert tight == [4, 8]


def test_shared_ranks_count_every_stage_they_hold() -> None:
    # loop placement, 2 ranks × 2 stages: rank 0 holds stages 0 and 2
    def stage_memory(stage: int, count: int) -> float:
        return 10.0 * count

    split = partition_layers(
        8,
        4,
        stage_time=lambda stage, count: float(count),
        stage_memory=stage_memory,
        stage_ranks=[[0], [1], [0], [1]],
        num_ranks=2,
        limit=40.0,
    )
    assert split == [2, 2, 2, 2]
    with pytest.raises(PartitionError, match="do not fit"):
        partition_layers(
            9,
            4,
            stage_time=lambda stage, count: float(count),
            stage_memory=stage_memory,
            stage_ranks=[[0], [1], [0], [1]],
            num_ranks=2,
            limit=40.0,
        )


def test_interleaved_problem_is_partitioned_per_model_stage() -> None:
    problem = load_problem(
        {
            "pipeline": {"num_ranks": 2, "num_microbatches": 4, "stages_per_rank": 2, "placement": "v"},
            "model": {**UNEVEN_MODEL, "num_layers": 12},
            "cluster": {"accelerator": "A100-80GB"},
        }
    )
    assert problem.model is not None and problem.model.layers_per_stage is not None
    assert len(problem.model.layers_per_stage) == 4 and sum(problem.model.layers_per_stage) == 12
    assert problem.memory is not None and isinstance(problem.memory.static, list) and len(problem.memory.static) == 2


def test_too_few_layers() -> None:
    with pytest.raises(PartitionError, match="3 layers cannot fill 4 stages"):
        partition_layers(3, 4, stage_time=lambda stage, count: float(count))


def test_megatron_counts_the_embedding_and_the_loss_as_a_layer_each_and_refuses_what_does_not_divide() -> None:
    # Qwen3-235B's 94 layers over PP 8 (Megatron Bridge's recipe accounts for both): 96 / 8 = 12, ends 11
    assert megatron_partition(94, 8, account_for_embedding=True, account_for_loss=True) == [11] + [12] * 6 + [11]
    # Llama 3.1 405B's 126 layers over PP 8 x VP 8 chunks: 128 / 64 = 2, the first and last chunk 1
    assert megatron_partition(126, 64, account_for_embedding=True, account_for_loss=True) == [1] + [2] * 62 + [1]
    assert megatron_partition(36, 4) == [9, 9, 9, 9]
    assert megatron_partition(15, 4, account_for_loss=True) == [4, 4, 4, 3]
    with pytest.raises(PartitionError, match="do not split evenly"):
        megatron_partition(94, 8)
    with pytest.raises(PartitionError, match="without a layer"):
        megatron_partition(2, 4, account_for_embedding=True, account_for_loss=True)
