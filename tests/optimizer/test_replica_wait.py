"""A collective that waits for its last data-parallel replica (``costs.unshard_wait`` / ``costs.reduce_grad_wait``):
it starts that many ms after it could, its communication stream held meanwhile (``optimizer/simulate.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.solve import solve

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _body(**waits: Any) -> dict[str, Any]:
    """pp 2 × dp 2 with FSDP, two stages per rank (loop), two microbatches, every pass 1 ms, collectives 2 ms."""
    return {
        "pipeline": {"num_ranks": 2, "num_microbatches": 2, "stages_per_rank": 2, "placement": "loop"},
        "costs": {
            "forward": 1.0,
            "backward_input": 1.0,
            "backward_weight": 1.0,
            "unshard": 2.0,
            "reduce_grad": 2.0,
            "optimizer_step": 0.0,
            **waits,
        },
        "memory": {"activation": 1.0},
        "data_parallel": {"size": 2, "sharding": "full"},
        "objective": "step_time",
        "solver": {"method": "looped-bfs", "time_limit_s": 2.0},
    }


def _collectives(schedule: Any) -> dict[tuple[int, str], tuple[float, float]]:
    return {
        (r.rank, a.action): (a.start, a.end)
        for r in schedule.ranks
        for a in r.actions
        if a.kind in ("UNSHARD", "REDUCE_GRAD")
    }


def test_a_reduction_starts_its_wait_after_it_could_and_holds_its_stream() -> None:
    before = solve(load_problem(_body()))
    after = solve(load_problem(_body(reduce_grad_wait=[0.0, 0.0, 0.0, 3.0])))
    assert after.orders() == before.orders()
    spans, waited = _collectives(before), _collectives(after)
    start, end = spans[1, "3REDUCE_GRAD"]
    assert waited[1, "3REDUCE_GRAD"] == pytest.approx((start + 3.0, end + 3.0))
    # rank 1's next reduction, on the same stream, waits for the held one
    assert waited[1, "1REDUCE_GRAD"][0] >= waited[1, "3REDUCE_GRAD"][1]
    assert after.step_time >= before.step_time  # 3REDUCE_GRAD had slack: 1REDUCE_GRAD ends the step
    assert solve(load_problem(_body(reduce_grad_wait=3.0))).step_time > before.step_time
    for key in ("0UNSHARD", "2UNSHARD"):  # the other rank's and the gathers are untouched
        assert waited[0, key] == spans[0, key]


def test_a_gather_waits_as_a_reduction_does() -> None:
    before = _collectives(solve(load_problem(_body())))
    after = _collectives(solve(load_problem(_body(unshard_wait=1.5))))
    assert after[0, "0UNSHARD"] == pytest.approx((before[0, "0UNSHARD"][0] + 1.5, before[0, "0UNSHARD"][1] + 1.5))


def test_no_wait_is_the_schedule_without_one() -> None:
    none = solve(load_problem(_body()))
    zero = solve(load_problem(_body(unshard_wait=0.0, reduce_grad_wait=0.0)))
    assert _collectives(zero) == _collectives(none)
    assert zero.step_time == none.step_time


def test_a_no_flush_pattern_s_reductions_wait_too() -> None:
    body = _body(reduce_grad_wait=4.0)
    body |= {"training": {"flush": False, "weight_versions": 2}, "objective": "step_period"}
    body["data_parallel"] = {"size": 2, "sharding": "none"}
    body["pipeline"] = {"num_ranks": 2, "num_microbatches": 4}
    body["solver"] = {"method": "pipedream-2bw", "time_limit_s": 2.0}
    waited = solve(load_problem(body))
    plain = solve(load_problem(body | {"costs": _body()["costs"]}))
    assert waited.step_period >= plain.step_period
    assert waited.step_period > plain.step_period or waited.makespan > plain.makespan


@pytest.mark.parametrize("field", ["unshard_wait", "reduce_grad_wait"])
def test_a_negative_wait_is_refused(field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        load_problem(_body(**{field: -1.0}))
