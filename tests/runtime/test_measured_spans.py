"""The measured figures speak of the simulator's spans: a collective from its last dp peer's start to its end (per
collective, predicted beside measured), and a steady no-flush run's simulated makespan over the last step, as its
measured makespan (no processes here)."""

from __future__ import annotations

import pytest

from pipesched.optimizer.solve import solve, solve_family
from pipesched.runtime.launch import executable_step
from pipesched.runtime.records import MeasuredAction, RankResult, StepRecord, joined_communication
from pipesched.runtime.report import (
    _joined,
    _predicted_overlap,
    _same_step_predictions,
    collective_spans,
    communication_overlap,
    same_step_overlap,
)
from pipesched.runtime.verify import simulate_with_measured_costs
from tests.conftest import uniform_problem

pytest.importorskip("torch")


def _record(action: str, start: float, end: float) -> MeasuredAction:
    return MeasuredAction(action=action, start=start, end=end)


def test_a_collective_starts_when_its_last_peer_enters_it():
    """Replica 0 enters 2REDUCE_GRAD 270 ms before replica 1: until then it only waits for its peer. Both replicas'
    collective then spans 2163 → its end; a local RESHARD and each name's second occurrence are matched in order."""
    replica0 = [
        _record("0UNSHARD", 0.0, 24.0),
        _record("2REDUCE_GRAD", 1894.0, 2350.0),
        _record("2RESHARD", 2350, 2350),
    ]
    replica1 = [
        _record("0UNSHARD", 1.0, 27.0),
        _record("2REDUCE_GRAD", 2163.0, 2342.0),
        _record("2RESHARD", 2342, 2342),
    ]
    joined0, joined1 = joined_communication([replica0, replica1])
    assert [(r.start, r.end) for r in joined0] == [(1.0, 24.0), (2163.0, 2350.0), (2350.0, 2350.0)]
    assert [(r.start, r.end) for r in joined1] == [(1.0, 27.0), (2163.0, 2342.0), (2342.0, 2342.0)]
    # passes until 2776: the collective is hidden from its joined start on, its peer wait in neither split
    hidden, exposed = communication_overlap([(25.0, 2776.0)], [(r.start, r.end) for r in joined0])
    assert hidden == pytest.approx(2350.0 - 2163.0) and exposed == pytest.approx(24.0 - 1.0)
    twice = [_record("1REDUCE_GRAD", 10.0, 20.0), _record("1REDUCE_GRAD", 30.0, 40.0)]
    later = [_record("1REDUCE_GRAD", 15.0, 20.0), _record("1REDUCE_GRAD", 35.0, 40.0)]
    assert [(r.start, r.end) for r in joined_communication([twice, later])[0]] == [(15.0, 20.0), (35.0, 40.0)]


def test_the_steady_run_is_simulated_over_its_last_step():
    """A no-flush pattern unrolled over K = 3 steps: the simulated span of the last step's microbatches is shorter
    than the K steps' makespan and at least one step's work on a rank."""
    m = 4
    problem = uniform_problem(2, m).with_changes(
        **{"training.flush": False, "training.weight_versions": 2, "solver.method": "pipedream-2bw"}
    )
    unrolled = executable_step(solve(problem), 3)  # the order a steady run of K = 3 steps runs
    costs = {kind: [1.0, 1.0] for kind in "FIW"} | {"B": [0.0, 0.0]}
    whole = simulate_with_measured_costs(unrolled, costs)
    last = simulate_with_measured_costs(unrolled, costs, range(2 * m, 3 * m))
    assert whole is not None and last is not None
    assert 3 * m <= last < whole


def _breadth_first_dp2(communication_slowdown: float = 0.0):
    """Breadth-first pp 2 × dp 2, two stages per rank, 4 microbatches: UNSHARD and REDUCE_GRAD per stage."""
    problem = uniform_problem(2, 4, stages_per_rank=2).with_changes(
        **{
            "data_parallel": {"size": 2, "sharding": "full"},
            "costs.unshard": 2.0,
            "costs.reduce_grad": 3.0,
            "costs.optimizer_step": 1.0,
            "costs.communication_slowdown": communication_slowdown,
            "objective": "step_time",
        }
    )
    return solve_family(problem, "looped-bfs")


def test_each_collective_is_reported_predicted_beside_measured():
    """Breadth-first pp 2 × dp 2: each rank's UNSHARD and REDUCE_GRAD predicted (the schedule's span and the part of
    it beside the rank's passes) beside measured over the steps after the first, from the last peer's start."""
    schedule = _breadth_first_dp2()
    rank0 = schedule.ranks[0].actions
    reduce2 = next(a for a in rank0 if a.action == "2REDUCE_GRAD")
    # Replica 0 enters 2REDUCE_GRAD 5 ms before replica 1, then a pass runs on it for 1 ms of its joined span.
    steps = [
        [StepRecord([_record("0W0", 100.0, 101.0)], [_record("2REDUCE_GRAD", start, 104.0)]) for start in (95.0, 100.0)]
        for _ in range(3)
    ]
    results = [RankResult(rank=d, pp_rank=0, dp_rank=d, device="cpu", memory_measure="x") for d in (0, 1)]
    for replica, result in enumerate(results):
        result.steps = [step[replica] for step in steps]
    spans = collective_spans(schedule, results[0], _joined(results)[results[0].rank])
    (span,) = spans
    assert span.action == "2REDUCE_GRAD"
    assert (span.predicted_start, span.predicted_end) == (reduce2.start, reduce2.end)
    assert span.predicted_hidden_ms == pytest.approx(3.0)  # 0I0/0W0 run beside it on the schedule's timeline
    assert (span.measured_start, span.measured_end, span.measured_hidden_ms) == (100.0, 104.0, 1.0)
    assert span.replica_wait_ms == pytest.approx(5.0)


def _as_run(schedule, scale: float = 1.0, kinds: str = "FIWB") -> list[list[MeasuredAction]]:
    """Per pipeline rank, its actions of ``kinds`` as one step ran them: each at its planned duration × ``scale``."""
    return [
        [_record(a.action, a.start, a.start + scale * (a.end - a.start)) for a in rank.actions if a.kind in kinds]
        for rank in schedule.ranks
    ]


def _flat(pairs: list[tuple[float, float]]) -> list[float]:
    return [value for pair in pairs for value in pair]


def test_the_same_step_prediction_at_the_planned_passes_is_the_schedules():
    """Fed the passes (and the collectives) at their planned durations, the same-step prediction is the schedule's own
    hidden / exposed on every pipeline rank."""
    schedule = _breadth_first_dp2()
    planned = [_predicted_overlap(schedule, pp) for pp in range(2)]
    assert all(hidden and hidden > 0 for hidden, _ in planned)
    assert _flat(same_step_overlap(schedule, _as_run(schedule))) == pytest.approx(_flat(planned))
    collectives = _as_run(schedule, kinds=("UNSHARD", "REDUCE_GRAD", "RESHARD"))
    assert _flat(same_step_overlap(schedule, _as_run(schedule), collectives)) == pytest.approx(_flat(planned))


def test_the_same_step_prediction_slows_the_profiles_collectives_and_not_the_measured_ones():
    """With ``costs.communication_slowdown`` the schedule's overlapped collectives run longer than their costs; the
    same-step prediction at the planned passes stretches the problem's collectives as the schedule does, and takes
    collectives given at their (already stretched) measured spans as they are."""
    schedule = _breadth_first_dp2(communication_slowdown=1.0)
    plain = _breadth_first_dp2()
    spans = {a.action: a.end - a.start for rank in schedule.ranks for a in rank.actions if a.kind == "UNSHARD"}
    assert spans["2UNSHARD"] > 2.0 + 0.5 and spans["0UNSHARD"] == pytest.approx(2.0)  # beside 0F…, and alone
    planned = [_predicted_overlap(schedule, pp) for pp in range(2)]
    assert _flat(planned) != pytest.approx(_flat([_predicted_overlap(plain, pp) for pp in range(2)]))
    assert _flat(same_step_overlap(schedule, _as_run(schedule))) == pytest.approx(_flat(planned))
    collectives = _as_run(schedule, kinds=("UNSHARD", "REDUCE_GRAD", "RESHARD"))
    assert _flat(same_step_overlap(schedule, _as_run(schedule), collectives)) == pytest.approx(_flat(planned))


def test_the_same_step_prediction_follows_the_passes_and_collectives_as_they_ran():
    """Passes 4× faster: the second stage's UNSHARD (2 ms) outlasts the first stage's four forwards beside it (1 ms),
    so less is hidden than at the planned passes (the collectives keep the problem's costs: the total stays); a
    collective measured twice as long adds its extra time to the total."""
    schedule = _breadth_first_dp2()
    planned = [_predicted_overlap(schedule, pp) for pp in range(2)]
    fast = same_step_overlap(schedule, _as_run(schedule, 0.25))
    for (hidden, exposed), (fast_hidden, fast_exposed) in zip(planned, fast, strict=True):
        assert fast_hidden + fast_exposed == pytest.approx(hidden + exposed)
        assert fast_hidden < hidden
    reduce2 = next(a for a in schedule.ranks[0].actions if a.action == "2REDUCE_GRAD")
    longer = [[_record("2REDUCE_GRAD", reduce2.start, reduce2.start + 2 * (reduce2.end - reduce2.start))], []]
    (hidden, exposed), _ = same_step_overlap(schedule, _as_run(schedule), longer)
    assert hidden + exposed == pytest.approx(sum(planned[0]) + reduce2.end - reduce2.start)


def test_each_replica_is_predicted_from_its_own_passes():
    """Two replicas of breadth-first pp 2 × dp 2, three steps: replica 1's passes ran 4× faster in step 2. Each
    process gets one same-step prediction per step; replica 0's stay the schedule's, replica 1's step 2 hides less."""
    schedule = _breadth_first_dp2()
    planned = [_predicted_overlap(schedule, pp) for pp in range(2)]
    results = []
    for rank, (pp, dp) in enumerate([(0, 0), (1, 0), (0, 1), (1, 1)]):
        result = RankResult(rank=rank, pp_rank=pp, dp_rank=dp, device="cpu", memory_measure="x")
        for step in range(3):
            passes = _as_run(schedule, 0.25 if (dp, step) == (1, 2) else 1.0)[pp]
            result.steps.append(StepRecord(passes, _as_run(schedule, kinds=("UNSHARD", "REDUCE_GRAD"))[pp]))
        results.append(result)
    found = _same_step_predictions(schedule, results, _joined(results))
    for result in results:
        hidden = found[result.rank]["same_step_predicted_hidden_ms"]
        exposed = found[result.rank]["same_step_predicted_exposed_ms"]
        assert len(hidden) == len(exposed) == 3
        expected = planned[result.pp_rank]
        assert (hidden[0], exposed[0]) == pytest.approx(expected)
        if result.dp_rank == 1:
            assert hidden[2] < expected[0]
        else:
            assert (hidden[2], exposed[2]) == pytest.approx(expected)
