"""Compute slowed beside communication (``costs.overlap_slowdown``): while a rank's communication stream runs a
collective, the rank's compute progresses at 1/(1 + slowdown) speed (``optimizer/simulate.py``)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from pydantic import ValidationError

from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.instance import compile_for_orders
from pipesched.optimizer.ir import Orders
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.simulate import InvalidSchedule, SimulationResult, simulate
from pipesched.optimizer.solve import solve
from tests.optimizer.test_data_parallel import dp_body

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _with_slowdown(problem: Problem, slowdown: float, **memory: Any) -> Problem:
    assert problem.costs is not None and problem.memory is not None
    return problem.model_copy(
        update={
            "costs": problem.costs.model_copy(update={"overlap_slowdown": slowdown}),
            "memory": problem.memory.model_copy(update=memory),
        }
    )


def _timed(problem: Problem, orders: Orders, slowdown: float, *, check_memory: bool = True) -> SimulationResult:
    changed = _with_slowdown(problem, slowdown)
    return simulate(compile_for_orders(changed, orders), orders, check_memory=check_memory)


def _two_rank_body(slowdown: float | None) -> dict[str, Any]:
    """pp 2 × dp 2, two stages per rank (loop), one microbatch, every pass 1 ms; only stage 3 reduces (2 ms)."""
    costs: dict[str, Any] = {
        "forward": 1.0,
        "backward_input": 1.0,
        "backward_weight": 1.0,
        "reduce_grad": [0.0, 0.0, 0.0, 2.0],
        "optimizer_step": 0.0,
    }
    if slowdown is not None:
        costs["overlap_slowdown"] = slowdown
    return {
        "pipeline": {"num_ranks": 2, "num_microbatches": 1, "stages_per_rank": 2, "placement": "loop"},
        "costs": costs,
        "memory": {"activation": 1.0},
        "data_parallel": {"size": 2, "sharding": "none"},
        "objective": "step_time",
        "solver": {"method": "looped-bfs", "time_limit_s": 2.0},
    }


def _times(schedule: Any) -> dict[tuple[int, str], tuple[float, float]]:
    return {(r.rank, a.action): (a.start, a.end) for r in schedule.ranks for a in r.actions}


@pytest.mark.parametrize(
    ("slowdown", "i_end", "w_end", "step"),
    [
        # 3REDUCE_GRAD runs 6–8 ms on rank 1 beside 1I0 (issued 6): 1 ms of work at half speed ends at 8, 1W0
        # runs alone 8–9, rank 0's 0I0 waits for 1I0's gradient (8–9), 0W0 9–10.
        (1.0, 8.0, 9.0, 10.0),
        # at 2/3 speed 1I0 ends at 7.5; 1W0 does 0.5 · 2/3 of its work by 8 and the last 2/3 alone: 8 + 2/3.
        (0.5, 7.5, 8.0 + 2 / 3, 9.5),
    ],
)
def test_one_collective_beside_one_pass_by_hand(slowdown: float, i_end: float, w_end: float, step: float) -> None:
    before = _times(solve(load_problem(_two_rank_body(None))))
    assert before[(1, "3REDUCE_GRAD")] == (6.0, 8.0) and before[(1, "1I0")] == (6.0, 7.0)
    schedule = solve(load_problem(_two_rank_body(slowdown)))
    after = _times(schedule)
    assert after[(1, "3REDUCE_GRAD")] == pytest.approx((6.0, 8.0))
    assert after[(1, "1I0")] == pytest.approx((6.0, i_end))
    assert after[(1, "1W0")] == pytest.approx((i_end, w_end))
    assert after[(0, "0I0")] == pytest.approx((i_end, i_end + 1.0))
    assert schedule.step_time == pytest.approx(step)
    # Rank 0 runs nothing beside a collective of its own (its reductions take 0 ms): unslowed.
    rank_0 = [end - start for (rank, _), (start, end) in after.items() if rank == 0 and end > start]
    assert rank_0 == pytest.approx([1.0] * len(rank_0)) and len(rank_0) == 6


def _random_case(rng: random.Random) -> tuple[Problem, Orders]:
    p, v = rng.choice([2, 3, 4]), rng.choice([1, 2])
    body = dp_body(
        p,
        rng.choice([p, 2 * p]),
        v,
        size=2,
        sharding=rng.choice(["none", "gradients", "full"]),
        unshard=[round(rng.uniform(0, 6), 3) for _ in range(p * v)],
        reduce_grad=[round(rng.uniform(0, 12), 3) for _ in range(p * v)],
        training={"post_validation": rng.random() < 0.3},
        method=rng.choice(["1f1b", "zb-h1", "gpipe"] if v == 1 else ["looped-bfs", "interleaved-1f1b"]),
    )
    body["costs"]["forward"] = [round(rng.uniform(0.5, 2), 3) for _ in range(p * v)]
    problem = load_problem(body)
    return problem, solve(problem).orders()


def _compute_work(
    sim: SimulationResult, problem: Problem, orders: Orders, slowdown: float, lane: int = 0
) -> list[float]:
    """Each compute action's (``lane`` 1: collective's) work recovered from its wall time: (wall − overlap) +
    overlap / (1 + slowdown), the overlap with the other lane of its rank."""
    inst = compile_for_orders(problem, orders)
    work = []
    for row in sim.orders:
        busy = [(sim.start[i], sim.end[i]) for i in row if inst.stream[i] == 1 - lane]
        for idx in row:
            if inst.stream[idx] == lane:
                a, b = sim.start[idx], sim.end[idx]
                overlap = sum(max(0.0, min(b, high) - max(a, low)) for low, high in busy)
                work.append((b - a - overlap) + overlap / (1 + slowdown))
    return work


@pytest.mark.parametrize("seed", range(8))
def test_more_slowdown_never_shortens_the_step_and_keeps_every_rule(seed: int) -> None:
    problem, orders = _random_case(random.Random(seed))
    base = _timed(problem, orders, 0.0)
    inst = compile_for_orders(problem, orders)
    # With slowdown 0 the timing is today's, bit for bit.
    assert simulate(inst, orders).start == base.start and simulate(inst, orders).end == base.end
    previous = base.step_time
    for slowdown in (0.05, 0.3, 1.0, 3.0):
        sim = _timed(problem, orders, slowdown)
        assert sim.step_time >= previous - 1e-9
        previous = sim.step_time
        keeps_every_rule(sim, inst)
        # A settled fixed point: every compute action does exactly its unslowed work.
        expected = [inst.duration[i] for row in sim.orders for i in row if inst.stream[i] == 0]
        assert _compute_work(sim, problem, orders, slowdown) == pytest.approx(expected, abs=1e-5)
    if problem.pipeline.stages_per_rank == 2:  # a rank's first stage computes beside its other stage's reduction
        assert previous > base.step_time + 1.0


def keeps_every_rule(sim: SimulationResult, inst: Any) -> None:
    """No action shorter than its cost, none before its inputs have arrived."""
    for idx, (start, end) in enumerate(zip(sim.start, sim.end, strict=True)):
        assert end - start >= inst.duration[idx] - 1e-9
        for pred, latency in inst.preds[idx]:
            assert start >= sim.end[pred] + latency - 1e-9


def test_without_collectives_beside_compute_nothing_changes() -> None:
    body = dp_body(4, 8, 1, sharding="none", unshard=0.0, reduce_grad=0.0, method="1f1b")
    problem = load_problem(body)
    orders = solve(problem).orders()
    base, slowed = _timed(problem, orders, 0.0), _timed(problem, orders, 2.0)
    assert slowed.start == base.start and slowed.end == base.end


def test_memory_and_deadlock_checks_still_reject() -> None:
    problem, orders = _random_case(random.Random(3))
    peak = max(_timed(problem, orders, 0.5).peak_memory)
    tight = _with_slowdown(problem, 0.5, limit=peak - 1.0)
    with pytest.raises(InvalidSchedule) as rejected:
        simulate(compile_for_orders(tight, orders), orders)
    assert rejected.value.reason == "memory_limit"
    two_rank = load_problem(_two_rank_body(None))
    rows = [list(row) for row in solve(two_rank).orders()]
    backward = next(k for k, action in enumerate(rows[0]) if str(action) == "0I0")
    rows[0].insert(1, rows[0].pop(backward))  # 0I0 before 2F0: it waits for 1I0, which waits for 2I0 after it
    with pytest.raises(InvalidSchedule) as stuck:
        _timed(two_rank, rows, 0.5)
    assert stuck.value.reason == "deadlock"


@pytest.mark.parametrize("bad", [-0.1, 11.0, "fast"])
def test_bad_slowdown_names_the_field(bad: Any) -> None:
    body = _two_rank_body(None)
    body["costs"]["overlap_slowdown"] = bad
    with pytest.raises(ValidationError, match="overlap_slowdown"):
        load_problem(body)
