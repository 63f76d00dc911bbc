"""The training step: no-flush schedules (PipeDream-2BW) as a repeating pattern, step_period, weight
versions, step_time under post-validation, and the bad inputs of ``training``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.families import FamilyDomainError, get_family
from pipesched.optimizer.instance import compile_problem
from pipesched.optimizer.ir import Action, ActionKind
from pipesched.optimizer.pattern import (
    SteadyStateEvaluator,
    check_pattern,
    steady_state,
    step_period_lower_bound,
    unroll,
)
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.simulate import InvalidSchedule, simulate
from pipesched.optimizer.solve import solve
from pipesched.optimizer.solvers.no_flush import canonical_pattern, no_flush_patterns
from tests.api.test_cli import pipesched


def problem(
    p: int = 4,
    m: int = 8,
    *,
    forward: float = 1.0,
    backward_input: float = 1.3,
    backward_weight: float = 0.7,
    p2p: float = 0.0,
    optimizer_step: float | list[float] | None = None,
    split_backward: bool = True,
    limit: float | None = None,
    static: float = 0.0,
    weights: float | None = None,
    training: dict[str, Any] | None = None,
    method: str = "pipedream-2bw",
    time_limit_s: float = 2.0,
    **extra: Any,
) -> Problem:
    body: dict[str, Any] = {
        "pipeline": {"num_ranks": p, "num_microbatches": m},
        "costs": {
            "forward": forward,
            "backward_input": backward_input,
            "backward_weight": backward_weight,
            "p2p": p2p,
            "optimizer_step": optimizer_step,
        },
        "memory": {"activation": 100.0, "retained_for_weight": 40.0, "limit": limit, "static": static},
        "split_backward": split_backward,
        "solver": {"method": method, "time_limit_s": time_limit_s},
        **extra,
    }
    if weights is not None:
        body["memory"]["weights"] = weights
    if training is not None:
        body["training"] = training
    return load_problem(body)


# -- PipeDream-2BW's steady state ------------------------------------------------------------------


@pytest.mark.parametrize("split_backward", [True, False])
@pytest.mark.parametrize("p2p", [0.0, 0.3, 2.5])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 4), (4, 8), (4, 9), (5, 12), (8, 16)])
def test_pipedream_2bw_step_period_equals_its_formula(p: int, m: int, p2p: float, split_backward: bool) -> None:
    """step_period = m·(F+I+W) + m·(p−1)/p · max(0, 2·p2p − W) (W read as 0 when fused): the round trip of
    p microbatches in flight on rank 0 against p pairs of work (family docstring)."""
    case = problem(p, m, p2p=p2p, split_backward=split_backward)
    schedule = solve(case)
    weight = 0.7 if split_backward else 0.0
    expected = m * 3.0 + m * (p - 1) / p * max(0.0, 2 * p2p - weight)
    assert schedule.step_period == pytest.approx(expected, abs=1e-6)
    assert schedule.step_time == schedule.step_period
    assert schedule.objective == "step_period" and schedule.method == "pipedream-2bw"
    # Rank 0 holds p microbatches in flight, as 1F1B.
    assert schedule.peak_memory[0] == pytest.approx(p * 100.0)


def test_the_optimizer_step_adds_once_per_step_with_split_backward() -> None:
    base = solve(problem(4, 8, p2p=0.2)).step_period
    assert base is not None
    assert solve(problem(4, 8, p2p=0.2, optimizer_step=7.0)).step_period == pytest.approx(base + 7.0)


def test_the_memory_bound_meets_2bw_at_p_activations_fused() -> None:
    """Little's law on rank 0: p in flight, round trip p(F+B) + 2(p−1)·p2p: the bound is 2BW's period."""
    case = problem(4, 8, p2p=0.5, split_backward=False, limit=400.0)
    period = solve(case).step_period
    assert step_period_lower_bound(case) == pytest.approx(period)
    auto = solve(case.with_changes(**{"solver.method": "auto"}))
    assert auto.status == "optimal" and auto.step_period == pytest.approx(period)


def test_the_pattern_has_the_documented_shape() -> None:
    case = problem(4, 8, split_backward=False)
    pattern = get_family("pipedream-2bw").generate(case)
    assert [str(a) for a in pattern[0]] == (
        [
            "0F3",
            "0B0",
            "0F4",
            "0B1",
            "0F5",
            "0B2",
            "0F6",
            "0B3",
            "0F7",
            "0B4",
            "0F8",
            "0B5",
            "0F9",
            "0B6",
            "0F10",
            "0B7",
        ]
    )
    assert [str(a) for a in pattern[3]][:4] == ["3F0", "3B0", "3F1", "3B1"]
    check_pattern(compile_problem(case), pattern)


def test_the_unrolled_run_is_k_complete_steps_the_simulator_accepts() -> None:
    case = problem(4, 8, p2p=0.1)
    pattern = get_family("pipedream-2bw").generate(case)
    orders = unroll(pattern, 8, 3)
    flat = case.with_changes(
        **{
            "pipeline.num_microbatches": 24,
            "training": {"flush": True},
            "objective": "makespan",
            "solver.method": "1f1b",
        }
    )
    sim = simulate(compile_problem(flat), orders)  # every action of 24 microbatches, once, no deadlock
    state = steady_state(case, pattern)
    assert state.converged and state.cyclicity == 1
    # Steps follow each other one period apart on every rank (the drained last step excluded).
    for t in range(2, state.steps - 1):
        for r in range(4):
            assert state.step_ends[t][r] - state.step_ends[t - 1][r] == pytest.approx(state.step_period)
    assert sim.makespan > 2 * state.step_period


def test_weight_versions_count_in_memory() -> None:
    with_weights = solve(problem(4, 8, static=1000.0, weights=300.0))
    assert with_weights.peak_memory[0] == pytest.approx(1000.0 + 300.0 + 4 * 100.0)
    whole_static = solve(problem(4, 8, static=1000.0))
    assert whole_static.peak_memory[0] == pytest.approx(2 * 1000.0 + 4 * 100.0)
    # The limit sees the second version: 1F1B's peak is not enough for 2BW.
    tight = solve(problem(4, 8, static=1000.0, weights=300.0, limit=1400.0))
    assert tight.status == "infeasible" and tight.min_memory_limit is not None
    assert tight.min_memory_limit[0] == pytest.approx(1700.0)


def test_a_pattern_that_needs_a_third_weight_version_is_rejected() -> None:
    case = problem(4, 8)
    pattern = get_family("pipedream-2bw").generate(case)
    inst = compile_problem(case)
    bad = [list(row) for row in pattern]
    bad[0] = [*bad[0][1:], bad[0][0]]  # ends with 0F3 of this step … after its own step ended
    bad[0][-1] = Action(0, ActionKind.FORWARD, 8 + 3)
    with pytest.raises(InvalidSchedule) as error:
        check_pattern(inst, bad)
    assert error.value.reason == "weight_versions"
    # Re-cut at the step boundary: a row of (action, step offset) running an F two steps ahead is refused.
    row = [(Action(0, ActionKind.FORWARD, 0), 2), (Action(0, ActionKind.BACKWARD, 0), 0)]
    assert canonical_pattern(row, 8) is None


def test_flushed_patterns_overlap_steps_and_auto_is_never_worse_than_2bw() -> None:
    for split in (True, False):
        for limit in (400.0, 500.0, None):
            case = problem(4, 8, p2p=0.5, backward_weight=0.5, split_backward=split, limit=limit)
            family = solve(case)
            auto = solve(case.with_changes(**{"solver.method": "auto", "solver.time_limit_s": 1.0}))
            assert family.step_period is not None and auto.step_period is not None
            assert auto.fits_memory and max(auto.peak_memory) <= (limit or math.inf)
            assert auto.step_period <= family.step_period + 1e-9
            assert auto.lower_bound is not None and auto.lower_bound <= auto.step_period + 1e-9
            # The busiest rank's work per step is a bound.
            assert auto.lower_bound >= 8 * (1.0 + 1.3 + 0.5) - 1e-9


def test_auto_answers_within_its_time_limit_on_a_v_placement() -> None:
    case = problem(4, 8, method="auto", training={"flush": False}, time_limit_s=1.0).model_dump(mode="json")
    case["pipeline"].update(stages_per_rank=2, placement="v")
    v = Problem.model_validate(case)
    names = [name for name, _ in no_flush_patterns(v)]
    assert "sequential" in names and any("zb-v" in name for name in names)
    schedule = solve(v)
    assert schedule.status in ("optimal", "feasible") and schedule.solve_time_s <= 1.0 + 2.0
    assert schedule.step_period is not None and schedule.step_period >= 8 * 3.0 * 2 - 1e-9


def test_the_evaluator_reuses_unrolled_instances() -> None:
    evaluator = SteadyStateEvaluator(problem(4, 8))
    assert evaluator.unrolled_instance(6) is evaluator.unrolled_instance(6)
    assert evaluator.unrolled_instance(6).num_microbatches == 48


# -- step_time of flushed schedules ---------------------------------------------------------------


def test_step_time_is_makespan_plus_optimizer_or_the_span_under_post_validation() -> None:
    optimizer = [0.0, 0.0, 0.0, 5.0]  # the last rank's update is the slow one
    synchronous = solve(problem(4, 8, p2p=0.2, training={"flush": True}, method="zb-h1", **_costs(optimizer)))
    assert synchronous.step_time == pytest.approx(synchronous.makespan + 5.0)
    assert synchronous.step_period is None
    post = solve(
        problem(4, 8, p2p=0.2, training={"flush": True, "post_validation": True}, method="zb-h1", **_costs(optimizer))
    )
    # Each rank's list ends with its OPTIMIZER_STEP (o_r ms): the step is the longest rank's own span.
    assert [r.actions[-1].action for r in post.ranks] == ["OPTIMIZER_STEP"] * 4
    spans = [r.actions[-1].end - r.actions[0].start for r in post.ranks]
    assert post.step_time == pytest.approx(max(spans))
    assert spans[3] == pytest.approx(post.ranks[3].actions[-2].end - post.ranks[3].actions[0].start + 5.0)
    assert post.step_time < synchronous.step_time  # the last rank started (p−1)·F later: its update hides
    free = solve(problem(4, 8, training={"flush": True, "post_validation": True}, method="zb-h1"))
    assert free.step_time == free.stage_span
    plain = solve(problem(4, 8, training={"flush": True}, method="zb-h1"))
    assert plain.step_time == plain.makespan


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "gpipe"])
@pytest.mark.parametrize("p2p", [0.0, 0.4])
def test_a_flushed_step_repeated_without_a_barrier_takes_its_stage_span(name: str, p2p: float) -> None:
    """Zero Bubble §4's claim, through the one simulator: with the end-of-step synchronisation gone, each rank
    starts its next step when its own passes end, and steps follow one stage_span apart (= step_time under
    post_validation)."""
    flushed = problem(4, 8, p2p=p2p, training={"flush": True, "post_validation": True}, method=name)
    schedule = solve(flushed)
    repeated = steady_state(
        problem(4, 8, p2p=p2p, method="auto", training={"flush": False}), get_family(name).generate(flushed)
    )
    assert repeated.step_period == pytest.approx(schedule.stage_span) == schedule.step_time
    assert schedule.stage_span is not None and schedule.makespan is not None


def _costs(optimizer: list[float]) -> dict[str, Any]:
    return {"optimizer_step": optimizer}


# -- bad input ------------------------------------------------------------------------------------

BAD_TRAINING = [
    ({"training": {"flush": False}, "method": "1f1b"}, ["training", "flush"], "ends every step with a pipeline flush"),
    ({"training": {"flush": True, "weight_versions": 2}, "method": "1f1b"}, ["training", "weight_versions"], "flush"),
    ({"training": {"flush": True}, "method": "pipedream-2bw"}, ["training", "flush"], "pipedream-2bw"),
    ({"training": {"flush": False, "weight_versions": 1}, "method": "auto"}, ["training", "weight_versions"], "2"),
    ({"objective": "step_period", "method": "1f1b", "training": {"flush": True}}, ["objective"], "flush"),
    ({"objective": "stage_span", "method": "auto", "training": {"flush": False}}, ["objective"], "step_period"),
]


@pytest.mark.parametrize(("changes", "loc", "words"), BAD_TRAINING)
def test_bad_training_names_the_field(changes: dict[str, Any], loc: list[str], words: str) -> None:
    with pytest.raises(ValidationError) as error:
        problem(**changes)
    assert any(list(e["loc"]) == loc and words in e["msg"] for e in error.value.errors()), error.value


def test_no_flush_with_sharded_data_parallelism_names_data_parallel_sharding() -> None:
    body = problem(4, 8, method="auto", training={"flush": False}).model_dump(mode="json")
    body["data_parallel"] = {"size": 2, "sharding": "full"}
    body["costs"].update(reduce_grad=1.0, unshard=1.0, optimizer_step=1.0)
    with pytest.raises(ValidationError) as error:
        Problem.model_validate(body)
    assert any(list(e["loc"]) == ["data_parallel", "sharding"] for e in error.value.errors()), error.value


def _two_bw_with_data_parallelism(reduce_grad: float, method: str = "pipedream-2bw") -> Problem:
    body = problem(4, 8, method=method, training={"flush": False}, split_backward=False).model_dump(mode="json")
    body["data_parallel"] = {"size": 2, "sharding": "none"}
    body["costs"].update(reduce_grad=reduce_grad, optimizer_step=0.3)
    return Problem.model_validate(body)


def test_pipedream_2bw_with_data_parallelism_reduces_every_step_behind_the_next() -> None:
    """PipeDream-2BW on d = 2 (Narayanan et al. 2020, §3: gradients all-reduced every step): each stage's
    REDUCE_GRAD follows its last backward of the step and the update waits until the rank's first forward two
    steps on, so a reduction shorter than the rank's step hides behind the next step's passes; a longer one
    makes the communication stream the bottleneck, which the lower bound says."""
    alone = solve(_two_bw_with_data_parallelism(0.0).with_changes(**{"data_parallel": None, "costs.reduce_grad": None}))
    hidden = solve(_two_bw_with_data_parallelism(6.0))
    assert hidden.status != "infeasible" and hidden.step_period == pytest.approx(alone.step_period)
    for rank in hidden.ranks:
        kinds = [a.kind for a in rank.actions]
        assert kinds.count("REDUCE_GRAD") == 1 and kinds.count("OPTIMIZER_STEP") == 1
        last_backward = max(k for k, a in enumerate(rank.actions) if a.kind == "B" and a.microbatch < 8)
        assert kinds.index("REDUCE_GRAD") == last_backward + 1
    # 40 ms of reduction per step: the update of step t, hence step t+2's first forward, waits for it.
    bound_limited = solve(_two_bw_with_data_parallelism(40.0))
    assert step_period_lower_bound(bound_limited.problem) == pytest.approx(40.0)
    assert bound_limited.step_period is not None and 40.0 < bound_limited.step_period < 40.0 + alone.step_period
    searched = solve(_two_bw_with_data_parallelism(6.0, method="auto"))
    assert searched.step_period is not None and searched.step_period <= hidden.step_period + 1e-9


def test_the_family_check_names_training_flush() -> None:
    flushed = problem(4, 8, training={"flush": True}, method="1f1b")
    with pytest.raises(FamilyDomainError, match=r"training\.flush false"):
        get_family("pipedream-2bw").generate(flushed)
    few = problem(4, 2, method="auto", training={"flush": False})
    with pytest.raises(FamilyDomainError, match="num_microbatches"):
        get_family("pipedream-2bw").generate(few)


def _body(method: str, **training: Any) -> dict[str, Any]:
    body = problem(4, 8, training={"flush": True}, method="1f1b").model_dump(mode="json")
    body["training"] = training
    body["solver"]["method"] = method
    return body


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_bad_training_is_422_over_http(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from pipesched.api.app import create_app
    from pipesched.api.settings import Settings

    settings = Settings(database_url=f"sqlite:///{tmp_path / 'db.sqlite3'}", solver_workers=1, max_time_limit_s=3.0)
    with TestClient(create_app(settings)) as client:
        flush_false = client.post("/v1/schedules", json=_body("1f1b", flush=False))
        assert flush_false.status_code == 422, flush_false.text
        detail = flush_false.json()["detail"]
        assert any(d["loc"][-2:] == ["training", "flush"] for d in detail), detail
        versions = client.post("/v1/schedules", json=_body("1f1b", flush=True, weight_versions=2))
        assert versions.status_code == 422
        assert any(d["loc"][-2:] == ["training", "weight_versions"] for d in versions.json()["detail"])
        good = client.post("/v1/schedules", json=_body("pipedream-2bw", flush=False))
        assert good.status_code == 200, good.text
        answer = good.json()
        assert answer["step_period"] == pytest.approx(8 * 3.0) and answer["objective"] == "step_period"
        assert answer["ranks"][0]["actions"][-1]["action"] == "0W7"


def test_bad_training_exits_2_on_the_cli(tmp_path: Path) -> None:
    path = tmp_path / "problem.json"
    path.write_text(json.dumps(_body("1f1b", flush=False)))
    result = pipesched("solve", str(path), cwd=tmp_path)
    assert result.returncode == 2 and "training.flush" in result.stderr
    path.write_text(json.dumps(_body("1f1b", flush=True, weight_versions=2)))
    result = pipesched("solve", str(path), cwd=tmp_path)
    assert result.returncode == 2 and "training.weight_versions" in result.stderr
    plain = tmp_path / "plain.json"
    body = _body("1f1b")
    del body["training"]
    plain.write_text(json.dumps(body))
    result = pipesched("solve", str(plain), "--method", "pipedream-2bw", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["step_period"] == pytest.approx(24.0)


def test_a_pattern_draws_and_traces_with_its_memory() -> None:
    """Plots and the Chrome trace cannot re-simulate a pattern on the one-step problem: its memory comes from
    the pattern (in flight when the shown copy starts, then each action), peaking where the run peaks."""
    from pipesched.api.render import render_svg
    from pipesched.optimizer.export import schedule_to_chrome_trace
    from pipesched.optimizer.pattern import pattern_memory_timelines

    schedule = solve(problem(4, 8, p2p=0.1, static=50.0, weights=20.0))
    timelines = pattern_memory_timelines(schedule)
    assert [max(b for _, b in t) for t in timelines] == pytest.approx(schedule.peak_memory)
    assert timelines[0][0][1] == pytest.approx(50.0 + 20.0 + 3 * 100.0)  # rank 0 enters with 0F8 … 0F10 in flight
    trace = schedule_to_chrome_trace(schedule)
    counters = [e["args"]["bytes"] for e in trace["traceEvents"] if e.get("name") == "memory" and e["pid"] == 0]
    assert max(counters) == pytest.approx(schedule.peak_memory[0])
    assert "<svg" in render_svg(schedule)[:400]
