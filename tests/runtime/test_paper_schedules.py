"""The papers' schedules as pipesched solves them, communication actions included, run verified on gloo:

* fused backward (B) with every communication action (issue 27, "Done when" 1): 1F1B as PipeDream-Flush and
  Megatron publish it (one fused backward per microbatch) on pipeline 2 × data-parallel 2 with FSDP solves,
  checks as written, plots and runs verified on 4 processes;
* BitPipe as its authors order it, with the replicas' eager gradient synchronisation (REDUCE_GRAD at d = 1)
  in its rows, runs verified on 2 processes (the own executor; the mirrored replicas' gradients are summed).
"""

from __future__ import annotations

import json

import pytest

from pipesched.optimizer.check import check_schedule, read_schedule
from pipesched.optimizer.ir import parse_action
from pipesched.optimizer.solve import solve
from tests.conftest import data_parallel_problem, uniform_problem

torch = pytest.importorskip("torch")


@pytest.mark.slow  # 4 torch processes over gloo (about 15 s on an idle 2-core machine, more when it is shared)
def test_fused_1f1b_pp2_dp2_fsdp_solves_checks_plots_and_runs() -> None:
    from pipesched.api.render import render_png, render_view_html
    from pipesched.runtime.launch import run_schedule
    from pipesched.runtime.training import TrainingOptions

    problem = data_parallel_problem(split_backward=False, method="1f1b")
    schedule = solve(problem)
    rows = [[action.action for action in rank.actions] for rank in schedule.ranks]
    kinds = {str(parse_action(cell).kind) for row in rows for cell in row}
    assert kinds == {"F", "B", "UNSHARD", "RESHARD", "REDUCE_GRAD", "OPTIMIZER_STEP"}

    checked = check_schedule(problem, *read_schedule(json.dumps(rows)))
    assert checked.valid, checked.violation
    assert checked.objective_value == pytest.approx(schedule.step_time)

    page = render_view_html(schedule)
    assert '"0REDUCE_GRAD"' in page and '"0B3"' in page
    assert render_png(schedule).startswith(b"\x89PNG")

    report = run_schedule(
        schedule, engine="pipesched", training=TrainingOptions(data_parallel=2, sharding="full"), timeout_s=180
    )
    assert report["verified"] is True, {k: report[k] for k in ("max_rel_grad_error", "max_rel_param_error")}
    assert report["executed_order_matches"]
    assert report["predicted_step_time_ms"] == schedule.step_time
    assert report["data_parallel"] == {"size": 2, "sharding": "full", "world_size": 4}
    for rank in report["ranks"]:
        stage = rank["pp_rank"]
        assert [c["action"] for c in rank["communication"]] == [
            f"{stage}UNSHARD",
            f"{stage}REDUCE_GRAD",
            f"{stage}RESHARD",
        ]


@pytest.mark.slow  # 2 torch processes over gloo
def test_bitpipe_with_its_replica_synchronisation_runs_verified() -> None:
    from pipesched.runtime.launch import run_schedule

    problem = uniform_problem(
        2, 4, stages_per_rank=2, placement="bidirectional", split_backward=False, reduce_grad=0.5, method="bitpipe"
    )
    schedule = solve(problem)
    assert sum(a.kind == "REDUCE_GRAD" for rank in schedule.ranks for a in rank.actions) == 8
    report = run_schedule(schedule, timeout_s=180)
    assert report["verified"] is True, {k: report[k] for k in ("max_rel_grad_error", "order_mismatches")}
    assert report["executed_order_matches"]
