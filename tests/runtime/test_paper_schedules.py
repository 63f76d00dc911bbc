"""The papers' schedules as pipesched solves them, communication actions included, run verified on gloo:

* fused backward (B) with every communication action (issue 27, "Done when" 1): 1F1B as PipeDream-Flush and
  Megatron publish it (one fused backward per microbatch) on pipeline 2 × data-parallel 2 with FSDP solves,
  checks as written, plots and runs verified;
* breadth-first (looped-bfs, the order LGA shares) on pipeline 2 × data-parallel 2 with FSDP resharding after the
  forward: each stage gathered once for its run of forwards and once for its backwards, as the rows say;
* PipeDream-2BW on pipeline 2 × data-parallel 2 (sharding none: gradients all-reduced every step), solved as a
  repeating pattern with its reductions and update in its rows, runs 3 steps with the delayed update
  W(t+1) = W(t) − ν∇f(W(t−1)) and matches the single-process reference of that rule;
* BitPipe as its authors order it, with the replicas' eager gradient synchronisation (REDUCE_GRAD at d = 1)
  in its rows, runs verified on 2 processes (the own executor; the mirrored replicas' gradients are summed).

The three data-parallel runs share one launch of 4 processes.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from pipesched.optimizer.check import check_schedule, read_schedule
from pipesched.optimizer.ir import parse_action
from pipesched.optimizer.result import Schedule
from pipesched.optimizer.solve import solve
from tests.conftest import data_parallel_problem, uniform_problem

torch = pytest.importorskip("torch")


def fused_1f1b() -> Schedule:
    return solve(data_parallel_problem(split_backward=False, method="1f1b"))


def two_bw() -> Schedule:
    return solve(
        data_parallel_problem(
            split_backward=False,
            method="pipedream-2bw",
            data_parallel={"size": 2, "sharding": "none"},
            training={"flush": False, "weight_versions": 2},
            objective="step_period",
        )
    )


def breadth_first() -> Schedule:
    return solve(
        data_parallel_problem(
            split_backward=False,
            method="looped-bfs",
            pipeline={"num_ranks": 2, "num_microbatches": 4, "stages_per_rank": 2},
            data_parallel={"size": 2, "sharding": "full", "reshard_after_forward": True},
        )
    )


@pytest.fixture(scope="module")
def data_parallel_runs() -> dict[str, tuple[Schedule, Any]]:
    from pipesched.runtime.launch import run_schedules
    from pipesched.runtime.options import TrainingOptions

    schedules = {"fused": fused_1f1b(), "2bw": two_bw(), "breadth-first": breadth_first()}
    trainings = [
        TrainingOptions(data_parallel=2, sharding="full"),
        TrainingOptions(data_parallel=2, sharding="none", steps=3, lr=0.5, weight_update="2bw"),
        TrainingOptions(data_parallel=2, sharding="full", reshard_after_forward=True, steps=2, lr=0.1),
    ]
    reports = run_schedules(list(schedules.values()), engine="pipesched", training=trainings, timeout_s=240)
    return {name: (schedule, report) for (name, schedule), report in zip(schedules.items(), reports, strict=True)}


@pytest.mark.slow  # 4 torch processes over gloo, two runs (about 30 s on an idle 2-core machine)
def test_fused_1f1b_pp2_dp2_fsdp_solves_checks_plots_and_runs(data_parallel_runs) -> None:  # type: ignore[no-untyped-def]
    from pipesched.api.render import render_png, render_view_html

    schedule, report = data_parallel_runs["fused"]
    rows = [[action.action for action in rank.actions] for rank in schedule.ranks]
    kinds = {str(parse_action(cell).kind) for row in rows for cell in row}
    assert kinds == {"F", "B", "UNSHARD", "RESHARD", "REDUCE_GRAD", "OPTIMIZER_STEP"}

    checked = check_schedule(schedule.problem, *read_schedule(json.dumps(rows)))
    assert checked.valid, checked.violation
    assert checked.objective_value == pytest.approx(schedule.step_time)

    page = render_view_html(schedule)
    assert '"0REDUCE_GRAD"' in page and '"0B3"' in page
    assert render_png(schedule).startswith(b"\x89PNG")

    assert report.verified is True, report.model_dump(include={"max_rel_grad_error", "max_rel_param_error"})
    assert report.executed_order_matches
    assert report.predicted_step_time_ms == schedule.step_time
    assert report.data_parallel.model_dump() == {"size": 2, "sharding": "full", "world_size": 4}
    for rank in report.ranks:
        stage = rank.pp_rank
        assert [c.action for c in rank.communication] == [
            f"{stage}UNSHARD",
            f"{stage}REDUCE_GRAD",
            f"{stage}RESHARD",
        ]


@pytest.mark.slow  # shares the launch above
def test_pipedream_2bw_with_data_parallelism_runs_verified(data_parallel_runs) -> None:  # type: ignore[no-untyped-def]
    schedule, report = data_parallel_runs["2bw"]
    assert schedule.shape == "pattern"
    for rank in schedule.ranks:
        kinds = [a.kind for a in rank.actions]
        assert kinds.count("REDUCE_GRAD") == 1 and kinds.count("OPTIMIZER_STEP") == 1
    assert report.verified is True, report.model_dump(include={"max_rel_grad_error", "max_rel_param_error"})
    assert report.steps == 3
    assert report.max_rel_param_error_vs_synchronous is not None
    assert report.max_rel_param_error_vs_synchronous > 1e-3  # the delayed update is not the synchronous one


@pytest.mark.slow  # shares the launch above
def test_breadth_first_with_fsdp_resharding_runs_verified(data_parallel_runs) -> None:  # type: ignore[no-untyped-def]
    schedule, report = data_parallel_runs["breadth-first"]
    for rank in schedule.ranks:
        gathers = [a.action for a in rank.actions if a.kind == "UNSHARD"]
        assert len(gathers) == 3  # the rank's first stage twice (forwards, backwards), its last once
    assert report.verified is True, report.model_dump(include={"max_rel_grad_error", "max_rel_param_error"})
    assert report.executed_order_matches


@pytest.mark.slow  # 2 torch processes over gloo
def test_bitpipe_with_its_replica_synchronisation_runs_verified() -> None:
    from pipesched.runtime.launch import run_schedule

    problem = uniform_problem(
        2, 4, stages_per_rank=2, placement="bidirectional", split_backward=False, reduce_grad=0.5, method="bitpipe"
    )
    schedule = solve(problem)
    assert sum(a.kind == "REDUCE_GRAD" for rank in schedule.ranks for a in rank.actions) == 8
    report = run_schedule(schedule, timeout_s=180)
    assert report.verified is True, report.model_dump(include={"max_rel_grad_error", "order_mismatches"})
    assert report.executed_order_matches
