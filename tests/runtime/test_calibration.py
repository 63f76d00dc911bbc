"""The profile's calibration (no torch): its order runs on every placement, with and without data parallelism, and
the per-pass overhead it fits is the one that makes the simulator meet a measured step."""

from __future__ import annotations

import pytest

from pipesched.optimizer.instance import compile_for_orders
from pipesched.optimizer.simulate import simulate
from pipesched.runtime.calibration import calibration_orders, calibration_problem, fit_overhead, with_overhead
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
