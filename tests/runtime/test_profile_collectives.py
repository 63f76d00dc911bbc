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
    _calibration_collective_waits,
    _calibration_pass_medians,
    _join_calibration,
    _Measured,
    _skeleton,
    _steady_steps,
)
from pipesched.runtime.records import MeasuredAction

#: The collectives of every calibration step, (kind, stage) in this order, and per step after the first: its step time
#: (ms) and each collective's two replicas' durations (ms).
COLLECTIVES = (("UNSHARD", 0), ("REDUCE_GRAD", 0), ("UNSHARD", 1), ("REDUCE_GRAD", 1))
ROWS = [
    (2000.0, ((20, 22), (30, 34), (10, 10), (60, 64))),
    (2050.0, ((24, 26), (36, 32), (12, 14), (50, 52))),
    (1980.0, ((18, 20), (28, 30), (16, 12), (70, 66))),
    (2020.0, ((22, 24), (40, 38), (11, 13), (58, 62))),
    (3200.0, ((90, 95), (130, 120), (50, 40), (240, 250))),  # a load burst: 60 % slower, collectives 4× longer
]
STEPS = [(step_ms, dict(zip(COLLECTIVES, durations, strict=True))) for step_ms, durations in ROWS]


def _wall(kind: str, step: int, dp_rank: int, microbatch: int) -> float:
    """A calibration pass's wall time (ms): each kind its own, varying by step, replica and microbatch; 3× in the
    load burst."""
    wall = {"F": 30.0, "I": 40.0, "W": 20.0}[kind] + 2 * step + dp_rank + 0.5 * microbatch
    return 3 * wall if step == len(STEPS) - 1 else wall


def _records(lags: list[float] | None = None) -> tuple[_Measured, dict[tuple[str, int], list[float]]]:
    """Four processes (pp · 2 + dp; pipeline rank 0 holds stage 0, rank 1 stage 1: one stage per rank keeps the
    table small) and, per (collective, stage), every step's replica durations. ``lags``: per step, how much later
    replica 1 enters every collective than replica 0 (ms; default 0)."""
    options = TrainingOptions(data_parallel=2, sharding="full")
    skeleton = _skeleton(2, 4, 1, "loop", options)
    results = []
    for global_rank in range(4):
        pp_rank, dp_rank = divmod(global_rank, 2)
        result = RankProfile(global_rank, pp_rank, dp_rank, calibration_ms=[2500.0] + [t for t, _ in STEPS])
        for k, (_, durations) in enumerate(STEPS):
            step, start = [], 0.0
            lag = lags[k] if lags and dp_rank else 0.0
            for (kind, stage), values in durations.items():
                if stage == pp_rank:
                    step.append(
                        MeasuredAction(action=f"{stage}{kind}", start=start + lag, end=start + lag + values[dp_rank])
                    )
                    start += 100.0
            result.calibration_communication.append(step)
            result.calibration_passes.append(
                [
                    MeasuredAction(
                        action=f"{pp_rank}{kind}{j}",
                        start=0.0,
                        end=_wall(kind, len(result.calibration_passes), dp_rank, j),
                    )
                    for kind in ("F", "I", "W")
                    for j in range(4)
                ]
            )
        results.append(result)
    _join_calibration(results)
    return _Measured(skeleton, results), {key: [v for _, d in STEPS for v in d[key]] for key in STEPS[0][1]}


def test_a_step_far_slower_than_the_others_is_left_out():
    assert _steady_steps([t for t, _ in STEPS]) == [0, 1, 2, 3]
    assert _steady_steps([100.0, 101.0, 99.0, 100.0]) == [0, 1, 2, 3]  # none when none stands out
    assert _steady_steps([100.0, 100.0, 100.0, 101.0]) == [0, 1, 2, 3]  # nor when most steps are alike


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


def test_the_wait_for_the_last_replica_is_the_replicas_mean_over_the_steps_kept():
    lags = [4.0, 8.0, 2.0, 6.0, 50.0]  # replica 1 enters every collective this much later; the burst's left out
    waits = _calibration_collective_waits(_records(lags)[0])
    expected = statistics.median(lag / 2 for lag in lags[:4])  # replica 0 waits the lag, replica 1 nothing
    assert waits == {"unshard_wait": [expected, expected], "reduce_grad_wait": [expected, expected]}
    assert _calibration_collective_waits(_records()[0]) == {"unshard_wait": [0.0, 0.0], "reduce_grad_wait": [0.0, 0.0]}


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


def test_the_passes_from_the_calibration_run_are_the_medians_of_its_steps_kept():
    measured, _ = _records()
    medians = _calibration_pass_medians(measured)
    for kind in ("F", "I", "W"):
        steady = [_wall(kind, k, dp, j) for k in range(4) for dp in (0, 1) for j in range(4)]  # the burst left out
        assert medians[kind, 0] == medians[kind, 1] == pytest.approx(statistics.median(steady))


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"calibration_steps": 1}, "calibration_steps 1: give at least 2"),
        ({"collective_statistic": "mean"}, "collective_statistic 'mean'"),
        ({"pass_source": "alone"}, "pass_source 'alone': use one of timed, calibration"),
    ],
)
def test_a_profile_names_a_calibration_setting_out_of_range_before_starting_processes(option, message):
    from pipesched.runtime.profile import measure_model

    with pytest.raises(ValueError, match=message):
        measure_model(num_ranks=2, num_microbatches=4, **option)
