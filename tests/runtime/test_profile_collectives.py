"""How a data-parallel profile reads its calibration run's collectives into ``costs.unshard`` / ``costs.reduce_grad``
(no processes: the calibration's records built by hand for breadth-first pp 2 × dp 2)."""

from __future__ import annotations

import statistics

import pytest

pytest.importorskip("torch")

from pipesched.runtime.options import TrainingOptions
from pipesched.runtime.profile import (
    COLLECTIVE_STATISTICS,
    RankProfile,
    _calibration_collective_costs,
    _join_calibration,
    _Measured,
    _skeleton,
    _steady_steps,
)
from pipesched.runtime.records import MeasuredAction

#: Per calibration step after the first: its step time (ms) and, per (collective, stage), the two replicas' durations.
STEPS = [
    (
        2000.0,
        {
            ("UNSHARD", 0): (20, 22),
            ("REDUCE_GRAD", 0): (30, 34),
            ("UNSHARD", 1): (10, 10),
            ("REDUCE_GRAD", 1): (60, 64),
        },
    ),
    (
        2050.0,
        {
            ("UNSHARD", 0): (24, 26),
            ("REDUCE_GRAD", 0): (36, 32),
            ("UNSHARD", 1): (12, 14),
            ("REDUCE_GRAD", 1): (50, 52),
        },
    ),
    (
        1980.0,
        {
            ("UNSHARD", 0): (18, 20),
            ("REDUCE_GRAD", 0): (28, 30),
            ("UNSHARD", 1): (16, 12),
            ("REDUCE_GRAD", 1): (70, 66),
        },
    ),
    (
        2020.0,
        {
            ("UNSHARD", 0): (22, 24),
            ("REDUCE_GRAD", 0): (40, 38),
            ("UNSHARD", 1): (11, 13),
            ("REDUCE_GRAD", 1): (58, 62),
        },
    ),
    # a load burst: the step 60 % slower, its collectives 4× longer
    (
        3200.0,
        {
            ("UNSHARD", 0): (90, 95),
            ("REDUCE_GRAD", 0): (130, 120),
            ("UNSHARD", 1): (50, 40),
            ("REDUCE_GRAD", 1): (240, 250),
        },
    ),
]


def _records() -> tuple[_Measured, dict[tuple[str, int], list[float]]]:
    """Four processes (pp · 2 + dp; pipeline rank 0 holds stage 0, rank 1 stage 1: one stage per rank keeps the
    table small) and, per (collective, stage), every step's replica durations."""
    options = TrainingOptions(data_parallel=2, sharding="full")
    skeleton = _skeleton(2, 4, 1, "loop", options)
    results = []
    for global_rank in range(4):
        pp_rank, dp_rank = divmod(global_rank, 2)
        result = RankProfile(global_rank, pp_rank, dp_rank, calibration_ms=[2500.0] + [t for t, _ in STEPS])
        for _, durations in STEPS:
            step, start = [], 0.0
            for (kind, stage), values in durations.items():
                if stage == pp_rank:
                    step.append(MeasuredAction(action=f"{stage}{kind}", start=start, end=start + values[dp_rank]))
                    start += 100.0
            result.calibration_communication.append(step)
        results.append(result)
    _join_calibration(results)
    return _Measured(skeleton, results), {key: [v for _, d in STEPS for v in d[key]] for key in STEPS[0][1]}


def test_a_step_far_slower_than_the_others_is_left_out():
    assert _steady_steps([t for t, _ in STEPS]) == [0, 1, 2, 3]
    assert _steady_steps([100.0, 101.0, 99.0, 100.0]) == [0, 1, 2, 3]  # none when none stands out


def test_the_pooled_median_is_every_sample_s_median():
    measured, samples = _records()
    costs = _calibration_collective_costs(measured, "pooled_median")
    assert costs["unshard"] == [statistics.median(samples["UNSHARD", k]) for k in (0, 1)]
    assert costs["reduce_grad"] == [statistics.median(samples["REDUCE_GRAD", k]) for k in (0, 1)]


def test_per_step_the_replicas_mean_and_the_median_of_the_steps_kept():
    measured, _ = _records()
    costs = _calibration_collective_costs(measured, "step_median")
    steady = [d for _, d in STEPS[:4]]  # the burst left out
    for name, kind in (("unshard", "UNSHARD"), ("reduce_grad", "REDUCE_GRAD")):
        assert costs[name] == pytest.approx([statistics.median(sum(d[kind, k]) / 2 for d in steady) for k in (0, 1)])


def test_the_step_total_keeps_each_rank_s_median_per_step_sum():
    measured, _ = _records()
    medians = _calibration_collective_costs(measured, "step_median")
    costs = _calibration_collective_costs(measured, "step_total")
    steady = [d for _, d in STEPS[:4]]
    for k in (0, 1):
        total = statistics.median(sum(sum(v) / 2 for (_, stage), v in d.items() if stage == k) for d in steady)
        assert costs["unshard"][k] + costs["reduce_grad"][k] == pytest.approx(total)
        # the proportions between a rank's collectives are the medians'
        ratio = costs["unshard"][k] / medians["unshard"][k]
        assert costs["reduce_grad"][k] / medians["reduce_grad"][k] == pytest.approx(ratio)


def test_an_unknown_statistic_is_named_with_the_choices():
    measured, _ = _records()
    with pytest.raises(ValueError, match="collective_statistic 'mean'.*" + ", ".join(COLLECTIVE_STATISTICS)):
        _calibration_collective_costs(measured, "mean")
