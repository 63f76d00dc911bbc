"""V-shaped families against their authors' figures: ZB-V, V-Half, V-Min (V placement); BitPipe in test_bitpipe.py.

Uniform costs T_F = T_I = T_W = 1 ms per stage, zero p2p, activation 100 bytes per stage (one
microbatch holds 200 bytes on a rank: its two stages), so 1F1B's peak p·M_B is ``2p · 100`` bytes.
"""

from __future__ import annotations

import math

import pytest

from pipesched.optimizer.families import get_family
from pipesched.optimizer.families.v_shape import capped_v_orders, v_block_orders
from pipesched.optimizer.families.zb_v import zbv_orders
from pipesched.optimizer.instance import compile_problem
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.simulate import SimulationResult, simulate
from tests.conftest import uniform_problem

ACTIVATION = 100.0
SETTINGS = [(p, k * p) for p in (4, 8) for k in (2, 3, 4)]


def _run(problem: Problem, name: str) -> SimulationResult:
    return simulate(compile_problem(problem), get_family(name).generate(problem))


def _v(p: int, m: int, **changes: object) -> Problem:
    return uniform_problem(p, m, stages_per_rank=2, placement="v", activation=ACTIVATION, **changes)  # type: ignore[arg-type]


def _one_f_one_b_rate(p: int, m: int) -> float:
    # Same per-stage costs with one stage per rank: bubble (p−1)(T_F+T_B) / makespan.
    return _run(uniform_problem(p, m), "1f1b").bubble_rate("makespan")


@pytest.mark.parametrize(("p", "m"), SETTINGS)
def test_zb_v_is_zero_bubble_at_one_f_one_b_memory(p: int, m: int) -> None:
    problem = _v(p, m)
    assert zbv_orders(problem) is not None  # the authors' generator, not the fallback
    sim = _run(problem, "zb-v")
    # Every rank runs its 6m passes without a gap (Zero Bubble paper, Sec. 6, Fig. 8) ...
    assert sim.stage_span == pytest.approx(sim.ideal)
    # ... so the makespan is the lower bound: rank p−1 cannot start before p−1 forwards.
    assert sim.makespan == pytest.approx(sim.ideal + (p - 1) * 1.0)
    assert sim.bubble_rate("makespan") <= (p - 1) / (6 * m + p - 1) + 1e-9
    # Peak: exactly 1F1B's p·M_B on the busiest rank, never above it.
    assert max(sim.peak_memory) == pytest.approx(2 * p * ACTIVATION)


@pytest.mark.parametrize("p2p", [0.05, 0.3])
def test_zb_v_with_uneven_costs_beats_the_capped_greedy(p2p: float) -> None:
    p, m = 4, 12
    problem = _v(p, m, forward=1.0, backward_input=1.3, backward_weight=0.7, p2p=p2p)
    sim = _run(problem, "zb-v")
    greedy = simulate(compile_problem(problem), capped_v_orders(problem, lambda ranks: ranks))
    assert max(sim.peak_memory) <= 2 * p * ACTIVATION + 1e-9
    assert sim.bubble_rate("stage_span") <= 0.6 * greedy.bubble_rate("stage_span")
    assert sim.bubble_rate("stage_span") < 0.1


@pytest.mark.parametrize(("p", "m"), SETTINGS)
def test_v_half_halves_memory_with_a_small_bubble(p: int, m: int) -> None:
    problem = _v(p, m)
    assert v_block_orders(problem, "half") is not None
    sim = _run(problem, "v-half")
    one_f_one_b_peak = 2 * p * ACTIVATION
    # Half of 1F1B's activation plus one microbatch (Qi et al. 2024, Sec. 4: V-Half ≈ pM_B/2).
    assert max(sim.peak_memory) <= one_f_one_b_peak / 2 + 2 * ACTIVATION + 1e-9
    assert sim.bubble_rate("makespan") <= 0.7 * _one_f_one_b_rate(p, m)


@pytest.mark.parametrize(("p", "m"), SETTINGS)
def test_v_min_thirds_memory_at_one_f_one_b_bubble(p: int, m: int) -> None:
    problem = _v(p, m)
    assert v_block_orders(problem, "min") is not None
    sim = _run(problem, "v-min")
    # A third of 1F1B's 2p stage activations, rounded up, plus one microbatch (two stages).
    assert max(sim.peak_memory) <= (math.ceil(2 * p / 3) + 2) * ACTIVATION + 1e-9
    assert max(sim.peak_memory) < 2 * p * ACTIVATION
    assert sim.bubble_rate("makespan") <= _one_f_one_b_rate(p, m) + 1e-9


@pytest.mark.parametrize(("name", "in_flight"), [("v-half", 3), ("v-min", 2)])
def test_v_blocks_with_fused_backward(name: str, in_flight: int) -> None:
    p, m = 4, 8
    problem = _v(p, m, split_backward=False)
    split = _run(_v(p, m), name)
    fused = _run(problem, name)
    # B frees the whole activation at once, so the fused peak is no higher than the split one.
    assert max(fused.peak_memory) <= max(split.peak_memory) + 1e-9
    # Without W to fill the blocks' W slots the bubble grows, but stays below the capped greedy's
    # at the same number of microbatches in flight (⌊p/2⌋+1, ⌊p/3⌋+1).
    greedy = simulate(compile_problem(problem), capped_v_orders(problem, lambda _: in_flight))
    assert fused.bubble_rate("makespan") < greedy.bubble_rate("makespan")
