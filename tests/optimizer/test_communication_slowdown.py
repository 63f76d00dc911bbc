"""Communication slowed beside compute (``costs.communication_slowdown``): while one of a rank's compute-stream
actions runs, the rank's UNSHARD and REDUCE_GRAD progress at 1/(1 + slowdown) speed (``optimizer/simulate.py``)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from pydantic import ValidationError

from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.instance import compile_for_orders, compile_problem
from pipesched.optimizer.ir import Orders
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.simulate import SimulationResult, simulate
from pipesched.optimizer.solve import solve
from pipesched.optimizer.solvers.step import step_lower_bound
from tests.optimizer.test_overlap_slowdown import _compute_work, _random_case, _times, _two_rank_body, keeps_every_rule

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _body(slowdown: float | None, compute_slowdown: float | None = None) -> dict[str, Any]:
    """``_two_rank_body``'s pp 2 × dp 2 (every pass 1 ms), stage 3's reduction (2 ms) issued beside rank 1's last two
    passes and stage 0's (1 ms) after rank 0's last pass, with nothing beside it."""
    body = _two_rank_body(compute_slowdown)
    body["costs"]["reduce_grad"] = [1.0, 0.0, 0.0, 2.0]
    if slowdown is not None:
        body["costs"]["communication_slowdown"] = slowdown
    return body


def _timed(problem: Problem, orders: Orders, slowdown: float) -> SimulationResult:
    assert problem.costs is not None
    changed = problem.model_copy(
        update={"costs": problem.costs.model_copy(update={"communication_slowdown": slowdown})}
    )
    return simulate(compile_for_orders(changed, orders), orders)


@pytest.mark.parametrize(
    ("slowdown", "reduce_end"),
    [
        # 3REDUCE_GRAD issued at 6 beside 1I0 (6–7) and 1W0 (7–8): 1 ms of its 2 at half speed by 8, the rest alone.
        (1.0, 9.0),
        # at 2/3 speed: 4/3 ms done by 8, the last 2/3 alone.
        (0.5, 8.0 + 2 / 3),
    ],
)
def test_an_overlapped_collective_stretches_and_a_lone_one_does_not(slowdown: float, reduce_end: float) -> None:
    before = _times(solve(load_problem(_body(None))))
    assert before[(1, "3REDUCE_GRAD")] == (6.0, 8.0)
    assert before[(1, "1I0")] == (6.0, 7.0) and before[(1, "1W0")] == (7.0, 8.0)
    assert before[(0, "0REDUCE_GRAD")] == (9.0, 10.0) and before[(0, "0W0")] == (8.0, 9.0)
    schedule = solve(load_problem(_body(slowdown)))
    after = _times(schedule)
    assert after[(1, "3REDUCE_GRAD")] == pytest.approx((6.0, reduce_end))
    # the next reduction on rank 1's communication stream waits for it
    assert after[(1, "1REDUCE_GRAD")][0] == pytest.approx(reduce_end)
    # rank 0's reduction runs after its last pass, with nothing beside it: its cost, unstretched
    assert after[(0, "0REDUCE_GRAD")] == (9.0, 10.0)
    # compute is not slowed (overlap_slowdown 0): every pass as before
    passes = {key: span for key, span in before.items() if key[1][1] in "FIW"}
    assert {key: after[key] for key in passes} == passes
    assert schedule.step_time == pytest.approx(10.0)  # rank 0's reduction still ends the step


def test_both_ways_at_once_settle() -> None:
    """With compute slowed beside the collective too, both stretch: 1I0 and 1W0 at 1/2 speed while 3REDUCE_GRAD
    runs, 3REDUCE_GRAD at 1/2 speed while they run; the fixed point has each do exactly its work."""
    schedule = solve(load_problem(_body(1.0, compute_slowdown=1.0)))
    after = _times(schedule)
    start, end = after[(1, "3REDUCE_GRAD")]
    i_start, i_end = after[(1, "1I0")]
    w_start, w_end = after[(1, "1W0")]
    # compute is busy 6 → w_end, the collective 6 → end: both at half speed while both run
    both = min(end, w_end) - 6.0
    assert (end - 6.0 - both) + both / 2 == pytest.approx(2.0)
    assert (w_end - 6.0 - both) + both / 2 == pytest.approx(2.0)
    assert (start, i_start, w_start) == pytest.approx((6.0, 6.0, i_end))
    assert end > 8.0 and w_end > 8.0


@pytest.mark.parametrize("seed", range(8))
def test_more_slowdown_never_shortens_the_step_and_keeps_every_rule(seed: int) -> None:
    problem, orders = _random_case(random.Random(seed))
    inst = compile_for_orders(problem, orders)
    base = simulate(inst, orders)
    # With slowdown 0 the timing is today's, bit for bit.
    zero = _timed(problem, orders, 0.0)
    assert zero.start == base.start and zero.end == base.end
    bound = step_lower_bound(problem, compile_problem(problem))
    previous = base.step_time
    for slowdown in (0.05, 0.3, 1.0, 3.0):
        sim = _timed(problem, orders, slowdown)
        assert sim.step_time >= previous - 1e-9
        assert sim.step_time >= bound - 1e-9  # a lower bound of the problem stays one
        previous = sim.step_time
        keeps_every_rule(sim, inst)
        # A settled fixed point: every collective does exactly its unslowed work; compute is not slowed.
        expected = [inst.duration[i] for row in sim.orders for i in row if inst.stream[i] == 1]
        assert _compute_work(sim, problem, orders, slowdown, lane=1) == pytest.approx(expected, abs=1e-5)
        passes = [i for row in sim.orders for i in row if inst.stream[i] == 0]
        assert [sim.end[i] - sim.start[i] for i in passes] == pytest.approx([inst.duration[i] for i in passes])


@pytest.mark.parametrize("bad", [-0.1, 11.0, "fast"])
def test_bad_slowdown_names_the_field(bad: Any) -> None:
    body = _body(None)
    body["costs"]["communication_slowdown"] = bad
    with pytest.raises(ValidationError, match="communication_slowdown"):
        load_problem(body)
