"""The measured figures speak of the simulator's spans: a collective from its last dp peer's start to its end (per
collective, predicted beside measured), and a steady no-flush run's simulated makespan over the last step, as its
measured makespan (no processes here)."""

from __future__ import annotations

import pytest

from pipesched.optimizer.solve import solve, solve_family
from pipesched.runtime.launch import executable_step
from pipesched.runtime.records import MeasuredAction, RankResult, StepRecord, joined_communication
from pipesched.runtime.report import _joined, collective_spans, communication_overlap
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


def test_each_collective_is_reported_predicted_beside_measured():
    """Breadth-first pp 2 × dp 2: each rank's UNSHARD and REDUCE_GRAD predicted (the schedule's span and the part of
    it beside the rank's passes) beside measured over the steps after the first, from the last peer's start."""
    problem = uniform_problem(2, 4, stages_per_rank=2).with_changes(
        **{
            "data_parallel": {"size": 2, "sharding": "full"},
            "costs.unshard": 2.0,
            "costs.reduce_grad": 3.0,
            "costs.optimizer_step": 1.0,
            "objective": "step_time",
        }
    )
    schedule = solve_family(problem, "looped-bfs")
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
