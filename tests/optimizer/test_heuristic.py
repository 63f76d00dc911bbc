"""The greedy heuristic and local search: valid orders within memory, never worse than their start."""

from __future__ import annotations

from pipesched.optimizer.instance import compile_problem
from pipesched.optimizer.simulate import simulate_indexed
from pipesched.optimizer.solvers.base import BackendStatus
from pipesched.optimizer.solvers.heuristic import HeuristicBackend, evaluate, greedy, greedy_variants, sequential_orders
from pipesched.optimizer.solvers.infeasible import min_memory_limit
from tests.conftest import paper_problem, paper_settings, uniform_problem


def test_greedy_variants_fit_memory_on_v_placement() -> None:
    problem = uniform_problem(3, 6, stages_per_rank=2, placement="v", p2p=0.2, limit=3 * 100.0, static=0.0)
    inst = compile_problem(problem)
    found = 0
    for variant in greedy_variants(inst):
        orders = greedy(inst, variant)
        if orders is not None:
            sim = simulate_indexed(inst, orders, check_memory=True)  # raises when over the limit
            assert sim.fits
            found += 1
    assert found > 0


def test_sequential_orders_peak_is_min_memory_limit() -> None:
    problem = uniform_problem(
        3, 4, stages_per_rank=2, placement="loop", activation=[10, 20, 30, 40, 50, 60], retained_for_weight=5.0
    )
    inst = compile_problem(problem)
    sim = simulate_indexed(inst, sequential_orders(inst))
    assert sim.peak_memory == min_memory_limit(inst)


def test_heuristic_reaches_zb_h1_at_one_p_activation() -> None:
    setting = paper_settings()[0]
    problem = paper_problem(setting, **{"memory.limit": setting["num_ranks"] * setting["activation"]})
    inst = compile_problem(problem)
    result = HeuristicBackend().solve(inst, objective="stage_span", time_limit_s=0.5)
    assert result.status == BackendStatus.FEASIBLE and result.orders is not None
    value = evaluate(inst, result.orders, "stage_span")
    assert value <= setting["published_stage_span_ms"]["ZB-H1"] + 1e-3
