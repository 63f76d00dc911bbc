"""The layer partitioner (optimizer/partition.py): exact min-max split, memory, and what it buys a schedule."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from typing import Any

import pytest

from pipesched.optimizer.derive import load_problem, tie_judging_untimed
from pipesched.optimizer.partition import (
    TIE_TOLERANCE,
    LayerTie,
    PartitionError,
    TieVerdict,
    break_tie,
    even_partition,
    layer_tie,
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


def test_the_partition_names_its_last_levels_tie() -> None:
    # 5 equal layers over 4 equal stages: the fifth may go to any stage; the rule gives it to the latest
    def equal(stage: int, count: int) -> float:
        return float(count)

    split = partition_layers(5, 4, stage_time=equal)
    tie = layer_tie(split, equal)
    assert split == [1, 1, 1, 2] and tie == LayerTie(base=(1, 1, 1, 1), stages=(0, 1, 2, 3), extra=1, taken=(3,))
    assert tie.split(tie.taken) == split and tie.split([1]) == [1, 2, 1, 1]
    with pytest.raises(ValueError, match="take 1 of the tied stages"):
        tie.split([1, 2])
    # every stage reaches the level, or none is above the least: no choice
    assert layer_tie(partition_layers(8, 4, stage_time=equal), equal) is None
    assert layer_tie([1, 1, 1, 1], equal) is None

    # stage 0 is slower per layer (its levels 1.2, 2.4, 3.6): the last level, 3, ties the other three only
    def slow_first(stage: int, count: int) -> float:
        return count * (1.2 if stage == 0 else 1.0)

    split = partition_layers(9, 4, stage_time=slow_first)
    assert split == [2, 2, 2, 3] and layer_tie(split, slow_first) == LayerTie((2, 2, 2, 2), (1, 2, 3), 1, (3,))
    # times flat in the layers (stage 3's second and third layer cost nothing): not a one-layer choice
    assert layer_tie([1, 1, 1, 3], lambda stage, count: float(min(count, 2))) is None
    # a stage its rank's memory closed (stage 3: 15 + 10 > 24 bytes) ties by time; the memory bound leaves it out
    split = partition_layers(
        6, 4, stage_time=equal, stage_memory=lambda stage, count: 10.0 * count + 5.0 * (stage == 3), limit=24.0
    )
    tie = layer_tie(split, equal)
    assert split == [1, 2, 2, 1] and tie == LayerTie(base=(1, 1, 1, 1), stages=(0, 1, 2, 3), extra=2, taken=(1, 2))

    def judge(split: list[int]) -> TieVerdict:  # a layer costs its rank 10 bytes, but none on stage 3
        return TieVerdict([10.0 * count for count in split[:3]] + [0.0], 1.0)

    holders = [[0], [1], [2], [3]]
    assert break_tie(tie, judge, stage_ranks=holders)[3] == 2
    assert break_tie(tie, judge, stage_ranks=holders, fits=lambda split: split[3] == 1) == split


#: Microbatches in flight on each stage at two instants of its rank (rank = stage % 2). Within a rank a later stage
#: holds no more than an earlier one (stage 2 ≤ stage 0, 3 ≤ 1); across ranks the counts differ as a schedule
#: makes them, which the model order cannot see: stage 2 holds more than stage 1.
IN_FLIGHT = {0: [4, 3], 1: [1, 1], 2: [3, 2], 3: [1, 0]}


def judge_in_flight(split: list[int]) -> TieVerdict:
    """Rank r holds stages r and r + 2; a layer holds 1 byte of weights and 1 per microbatch in flight."""
    peaks = [
        max(sum(split[stage] * (1 + IN_FLIGHT[stage][instant]) for stage in (rank, rank + 2)) for instant in (0, 1))
        for rank in (0, 1)
    ]
    return TieVerdict(peaks, step_ms=1.0)


def test_a_tie_goes_where_the_judged_peak_is_lowest_and_each_rank_keeps_its_latest_stages() -> None:
    tie = LayerTie(base=(1, 1, 1, 1), stages=(0, 1, 2, 3), extra=2, taken=(2, 3))
    holders = [[0], [1], [0], [1]]
    # the model-order rule: stages 2 and 3; rank 0 takes a layer on stage 2 (3 in flight) and peaks at 13
    assert judge_in_flight(tie.split(tie.taken)).key()[0] == 13
    splits = [tie.split(taken) for taken in itertools.combinations(tie.stages, 2)]
    best = min(splits, key=lambda split: judge_in_flight(split).key())
    assert judge_in_flight(best).key()[0] == 9  # stages 1 and 3: rank 1 takes both
    assert break_tie(tie, judge_in_flight, stage_ranks=holders) == best == [1, 2, 1, 2]
    # judged never: the rule's split; the judge cannot judge: the rule's split
    assert break_tie(tie, judge_in_flight, stage_ranks=holders, should_stop=lambda: True) == [1, 1, 2, 2]
    assert break_tie(tie, lambda split: None, stage_ranks=holders) == [1, 1, 2, 2]
    # a split that does not fit the memory bound is not judged
    judged: list[list[int]] = []

    def recording(split: list[int]) -> TieVerdict:
        judged.append(split)
        return judge_in_flight(split)

    assert break_tie(tie, recording, stage_ranks=holders, fits=lambda split: split[1] == 1) == [1, 1, 2, 2]
    assert all(split[1] == 1 for split in judged)


#: A small model whose embedding and head keep stages 0 and 7 of 4 ranks × 2 chunks at one layer.
SMALL_MODEL = {
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "seq_length": 1024,
    "vocab_size": 32_000,
    "micro_batch_size": 2,
}


def chunked_problem(
    layers_per_stage: list[int] | None = None,
    method: str = "interleaved-1f1b",
    time_limit_s: float = 5.0,
    limit_gib: float | None = None,
) -> Problem:
    document: dict[str, Any] = {
        "pipeline": {"num_ranks": 4, "num_microbatches": 8, "stages_per_rank": 2},
        "model": {**SMALL_MODEL, "num_layers": 11, "layers_per_stage": layers_per_stage},
        "cluster": {"accelerator": "H100-SXM"},
        "solver": {"method": method, "time_limit_s": time_limit_s},
    }
    if limit_gib is not None:
        document["memory"] = {"limit": limit_gib * 2**30}
    return load_problem(document)


def test_a_time_tie_goes_to_the_fastest_split_that_fits_and_the_peak_decides_only_under_a_binding_limit() -> None:
    # 11 layers over 4 ranks × 2 chunks (loop: stage s on rank s % 4): stages 1–6 tie, three take a second layer;
    # the 20 tied splits' schedules run 33.5–39.8 ms and peak 3.56–4.85 GiB. With the H100's memory nothing binds:
    # the shortest step wins (the model-order split, 33.5 ms at 4.55 GiB; the lowest peak's split takes 37.8 ms,
    # 13% longer, which a plan ranked by its step must not pay for memory it does not need). Under a limit the
    # tied splits' schedules do not all fit, the fastest that fits wins; the peak decides only where none fits.
    tied = [[1, *middle, 1] for middle in itertools.product((1, 2), repeat=6) if sum(middle) == 9]
    problems = {tuple(split): chunked_problem(split) for split in tied}
    slowest = [max(compute_ms(problem)) for problem in problems.values()]
    assert len(tied) == 20 and max(slowest) <= min(slowest) * (1 + TIE_TOLERANCE)  # one slowest stage: all tied
    schedules = {split: solve(problem) for split, problem in problems.items()}
    steps = {split: schedule.makespan for split, schedule in schedules.items()}
    peaks = {split: max(schedule.peak_memory) for split, schedule in schedules.items()}
    latest = (1, 1, 1, 1, 2, 2, 2, 1)
    chosen = chunked_problem()
    assert chosen.model is not None and chosen.model.layers_per_stage is not None
    assert tuple(chosen.model.layers_per_stage) == latest and steps[latest] == min(steps.values())
    assert min(peaks.values()) < 0.8 * peaks[latest]  # a lower peak was there to take: not taken, nothing binds
    for limit_gib in (4.0, 3.8):
        bound = chunked_problem(limit_gib=limit_gib)
        assert bound.model is not None and bound.model.layers_per_stage is not None
        split = tuple(bound.model.layers_per_stage)
        fitting = [other for other in tied if peaks[tuple(other)] <= limit_gib * 2**30]
        assert peaks[split] <= limit_gib * 2**30 < peaks[latest]
        assert steps[split] == min(steps[tuple(other)] for other in fitting)
        assert solve(bound).peak_memory == solve(problems[split]).peak_memory  # the problem of the split it names
    # a split the request gives is kept; auto has no order to judge before its search: the model-order rule
    assert chunked_problem(list(latest), limit_gib=3.8).model.layers_per_stage == list(latest)
    assert chunked_problem(method="auto").model.layers_per_stage == list(latest)
    # judging keeps within its share of the time limit (0.1 ms here): what it cannot judge, it leaves
    assert chunked_problem(time_limit_s=1e-3, limit_gib=3.8).model.layers_per_stage == list(latest)
    # untimed (a calibration row's prediction): the same split whatever the clock, so whatever the machine's load
    with tie_judging_untimed():
        assert tuple(chunked_problem(time_limit_s=1e-3, limit_gib=3.8).model.layers_per_stage) == split


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
