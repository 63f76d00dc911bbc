"""The profile's calibration (no torch): its order runs on every placement, with and without data parallelism, and
the per-pass overhead it fits is the one that makes the simulator meet a measured step."""

from __future__ import annotations

import pytest

from pipesched.optimizer.instance import compile_for_orders
from pipesched.optimizer.simulate import simulate
from pipesched.runtime.calibration import (
    calibration_orders,
    calibration_problem,
    collective_overlaps,
    fit_communication_slowdown,
    fit_overhead,
    fit_overlap_slowdown,
    with_overhead,
)
from pipesched.runtime.records import MeasuredAction
from tests.conftest import uniform_problem

SHAPES = [
    {"stages_per_rank": 1},
    {"stages_per_rank": 2},
    {"stages_per_rank": 2, "placement": "v"},
    {"stages_per_rank": 2, "placement": "bidirectional", "reduce_grad": 0.5},
    {"split_backward": False},
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: "-".join(map(str, shape.values())))
@pytest.mark.parametrize("data_parallel", [None, {"size": 2, "sharding": "full"}])
def test_the_calibration_order_runs_on_every_placement(shape, data_parallel):
    problem = calibration_problem(uniform_problem(3, 6, **shape), data_parallel)
    orders = calibration_orders(problem)
    result = simulate(compile_for_orders(problem, orders), orders, check_memory=False)  # raises when invalid
    # every rank runs all its forwards before its first backward (GPipe generalised), and ends with its step
    for row in orders:
        kinds = [a.kind.value for a in row if a.is_compute]
        assert kinds == sorted(kinds, key=lambda kind: kind != "F")
        assert row[-1].kind.value == "OPTIMIZER_STEP"
    assert {a.kind.value for row in orders for a in row if not a.is_compute} >= (
        {"UNSHARD", "REDUCE_GRAD", "RESHARD", "OPTIMIZER_STEP"} if data_parallel else {"OPTIMIZER_STEP"}
    )
    assert result.step_time > 0


def test_the_fitted_overhead_meets_the_measured_step():
    problem = calibration_problem(uniform_problem(2, 8, forward=[2.0, 3.0], p2p=0.2), None)
    orders = calibration_orders(problem)

    def step(overhead: float) -> float:
        shifted = with_overhead(problem, overhead)
        return simulate(compile_for_orders(shifted, orders), orders, check_memory=False).step_time

    measured = step(0.75)
    assert fit_overhead(problem, orders, measured) == pytest.approx(0.75, abs=1e-5)
    assert fit_overhead(problem, orders, step(0.0)) == pytest.approx(0.0, abs=1e-5)
    # a run faster than the pieces: a negative overhead, bounded by half the smallest forward
    assert -1.0 <= fit_overhead(problem, orders, 0.5 * step(0.0)) < 0
    shifted = with_overhead(problem, -2.5)
    assert min(shifted.stage_values(shifted.costs.backward_input)) == 0.0  # never below 0


def _records(
    slowdown: float, communication_slowdown: float = 0.0, **costs: object
) -> list[tuple[list[MeasuredAction], list[MeasuredAction]]]:
    """The simulator's calibration step of breadth-first pp 2 × dp 2 (stage 3's 4 ms reduction beside stage 1's
    first backwards) with ``slowdown`` (and ``communication_slowdown``, ``costs`` changed), as each rank's measured
    passes and collectives."""
    skeleton = uniform_problem(2, 8, stages_per_rank=2)
    changes = {
        "costs.reduce_grad": 4.0,
        "costs.overlap_slowdown": slowdown,
        "costs.communication_slowdown": communication_slowdown,
    } | {f"costs.{name}": value for name, value in costs.items()}
    problem = calibration_problem(skeleton, {"size": 2, "sharding": "full"}).with_changes(**changes)
    orders = calibration_orders(problem)
    inst = compile_for_orders(problem, orders)
    sim = simulate(inst, orders, check_memory=False)
    steps = []
    for row in sim.orders:
        records = [MeasuredAction(action=str(inst.actions[i]), start=sim.start[i], end=sim.end[i]) for i in row]
        passes = [r for r, i in zip(records, row, strict=True) if inst.stream[i] == 0]
        steps.append((passes, [r for r, i in zip(records, row, strict=True) if inst.stream[i] == 1]))
    return steps


@pytest.mark.parametrize("slowdown", [0.0, 0.25, 0.4, 1.5])
def test_the_overlap_slowdown_measured_on_a_step_is_the_one_it_ran_with(slowdown: float) -> None:
    fitted = fit_overlap_slowdown(_records(slowdown))
    assert fitted is not None and fitted.passes >= 1 and fitted.alone > fitted.passes
    assert fitted.slowdown == pytest.approx(slowdown, abs=1e-5)
    assert fitted.extra_ms == pytest.approx(fitted.overlapped_ms * slowdown / (1 + slowdown), abs=1e-5)


def test_the_overlap_slowdown_by_hand_and_what_it_leaves_out() -> None:
    def record(action: str, start: float, end: float) -> MeasuredAction:
        return MeasuredAction(action=action, start=start, end=end)

    alone = [record("1I1", 20.0, 30.0), record("1I2", 30.0, 40.0), record("1W1", 40.0, 44.0)]
    # 1I0 overlaps 10 ms of 3REDUCE_GRAD and takes 15 ms against 10 alone: r = 0.5, s = 1. 1W0 overlaps 0.5 ms
    # (below the minimum: left out); the RESHARD takes no compute; 1W1 has nothing overlapped to compare with.
    step = [record("1I0", 0.0, 15.0), record("1W0", 15.0, 19.0), *alone]
    communication = [record("3REDUCE_GRAD", 5.0, 15.5), record("3RESHARD", 19.0, 25.0)]
    fitted = fit_overlap_slowdown([(step, communication)])
    assert fitted is not None
    assert (fitted.passes, fitted.alone, fitted.overlapped_ms, fitted.extra_ms) == (1, 3, 10.0, 5.0)
    assert fitted.slowdown == pytest.approx(1.0)
    assert fit_overlap_slowdown([(alone, communication)]) is None
    faster = [record("1I0", 0.0, 8.0), *alone]  # beside a collective yet faster than alone: no negative slowdown
    assert fit_overlap_slowdown([(faster, [record("3REDUCE_GRAD", 0.0, 8.0)])]).slowdown == 0.0


UNSHARD = [3.0, 2.0, 2.0, 3.0]
REDUCE_GRAD = [4.0, 2.5, 2.5, 4.0]


@pytest.mark.parametrize("slowdown", [0.0, 0.5, 1.0, 3.0])
def test_the_communication_slowdown_measured_on_a_step_is_the_one_it_ran_with(slowdown: float) -> None:
    """The simulator's calibration step with collectives at 1/(1 + c) speed beside the passes: c comes back, and each
    collective's span less r × its overlap is its cost alone. The profile's own timings ``alone`` are half the
    costs (a lone collective in the run takes twice its timing alone: the scale the lone ones give)."""
    steps = _records(0.0, slowdown, unshard=UNSHARD, reduce_grad=REDUCE_GRAD)
    costs = {"UNSHARD": UNSHARD, "REDUCE_GRAD": REDUCE_GRAD}
    alone = {(kind, stage): values[stage] / 2 for kind, values in costs.items() for stage in range(4)}
    fitted = fit_communication_slowdown(steps, alone)
    assert fitted is not None and fitted.collectives >= 1 and fitted.lone >= 1
    assert fitted.slowdown == pytest.approx(slowdown, abs=1e-5)
    assert fitted.extra_ms == pytest.approx(fitted.overlapped_ms * fitted.ratio, abs=1e-5)
    for passes, collectives in steps:
        for measured, span, overlap in collective_overlaps(passes, collectives):
            kind, stage = measured.action[1:], int(measured.action[0])
            assert span - fitted.ratio * overlap == pytest.approx(costs[kind][stage], abs=1e-5)
    if slowdown:
        # what the profile writes: with the ratio, each stage's cost alone; without it, as the step saw it
        from pipesched.runtime.profile import _collective_steps

        rows = [c for _, c in steps]
        passes = [p for p, _ in steps]
        work = {key: v for step in _collective_steps(rows, passes, fitted.ratio) for key, v in step.items()}
        seen = {key: v for step in _collective_steps(rows) for key, v in step.items()}
        assert work == pytest.approx({(n.lower(), k): costs[n][k] for n in costs for k in range(4)}, abs=1e-5)
        assert max(seen[key] - work[key] for key in work) > 0.5  # an overlapped one took longer than its cost


def test_the_communication_slowdown_by_hand_and_what_it_leaves_out() -> None:
    def record(action: str, start: float, end: float) -> MeasuredAction:
        return MeasuredAction(action=action, start=start, end=end)

    passes = [record("1I0", 0.0, 10.0), record("1W0", 15.0, 19.0)]
    # 0UNSHARD alone: 6 ms against 3 timed alone (factor 2). 3REDUCE_GRAD beside 1I0 for 10 ms: 15 ms against
    # 2 × 5 = 10 alone, +5 over 10 overlapped: r = 0.5, c = 1. The RESHARD is no collective.
    communication = [record("3REDUCE_GRAD", 0.0, 15.0), record("3RESHARD", 15.0, 15.0), record("0UNSHARD", 20.0, 26.0)]
    alone = {("REDUCE_GRAD", 3): 5.0, ("UNSHARD", 0): 3.0}
    fitted = fit_communication_slowdown([(passes, communication)], alone)
    assert fitted is not None
    assert (fitted.collectives, fitted.lone, fitted.overlapped_ms, fitted.extra_ms) == (1, 1, 10.0, 5.0)
    assert (fitted.ratio, fitted.slowdown) == (0.5, 1.0)
    assert fit_communication_slowdown([([], communication)], alone) is None  # nothing beside a collective
    assert fit_communication_slowdown([(passes, communication[:1])], alone) is None  # no lone one to scale by
    quick = [record("3REDUCE_GRAD", 0.0, 8.0), record("0UNSHARD", 20.0, 26.0)]  # faster than alone: no negative c
    assert fit_communication_slowdown([(passes, quick)], alone).slowdown == 0.0
