"""A context- or expert-parallel plan's 80% interval is its class's (issues 24, 28): the context/expert-parallel
check rows' held-out spread, united with the accelerator's dense one (``SoftwareProfile.parallel_log_error``,
written by ``python -m bench.calibration_bench --parallel-only --write``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from bench.calibration_bench import parallel_check
from bench.cpep_bench import request_for
from bench.unseen_rows_bench import load_rows
from pipesched.api.cli import app as cli_app
from pipesched.optimizer.calibration.catalogue import parallel_log_errors
from pipesched.optimizer.cost.profile import SoftwareProfile, builtin_catalogue, parallel_class
from pipesched.optimizer.planner.rank import plan
from pipesched.optimizer.planner.request import Plan, PlanAnswer, PlanRequest

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "calibration_parallel_intervals.json"


def _request(preset: str, batch: int, **pins: int) -> dict[str, Any]:
    search = {"time_limit_s": 10, "top": 1, "pipeline_parallel": [1], "micro_batch_size": [1]}
    search.update({name: [value] for name, value in pins.items()})
    return {
        "model": {"preset": preset},
        "cluster": {"accelerator": "H100-SXM", "num_nodes": 1, "gpus_per_node": 8},
        "training": {"global_batch_size": batch, "kernels": "fused"},
        "search": search,
    }


def _answer(request: dict[str, Any]) -> PlanAnswer:
    answer = plan(PlanRequest.model_validate(request)).answer
    assert answer.plans, answer.error
    return answer


def _log_interval(best: Plan) -> tuple[float, float]:
    low, high = best.tokens_per_s_per_gpu_interval
    return math.log(low / best.tokens_per_s_per_gpu), math.log(high / best.tokens_per_s_per_gpu)


def _assert_the_class_interval(best: Plan, name: str) -> None:
    catalogue = builtin_catalogue()
    dense = catalogue.profiles["H100-SXM"].held_out_log_error
    low, high = catalogue.software.parallel_log_error[name]
    assert parallel_class(best.context_parallel, best.expert_parallel) == name
    got = _log_interval(best)
    assert got == pytest.approx((min(dense[0], low), max(dense[1], high)), abs=2e-4)
    assert got[0] < dense[0] - 0.02  # wider than the dense rows' interval a plan carried before


def test_a_context_parallel_plans_interval_is_the_context_parallel_check_rows() -> None:
    # the unseen NeMo 25.02 Llama 3.1 8B TP 1 × CP 2 layout on 8 H100s, pinned as the bench plans it
    row = next(r for r in load_rows() if r["id"] == "dgxc2504-llama31-8b-8-cp2-bf16")
    answer = plan(request_for(row, 10.0)).answer
    assert answer.plans, answer.error
    _assert_the_class_interval(answer.plans[0], "context-parallel")
    assert any("context-parallel check runs" in note for note in answer.notes), answer.notes


def test_an_expert_parallel_plans_interval_is_the_expert_parallel_check_rows() -> None:
    answer = _answer(_request("qwen3-30b-a3b", 64, expert_parallel=8, tensor_parallel=1, context_parallel=1))
    best = answer.plans[0]
    _assert_the_class_interval(best, "expert-parallel")
    assert _log_interval(best)[1] > builtin_catalogue().profiles["H100-SXM"].held_out_log_error[1] + 0.05
    assert any("expert-parallel check runs" in note for note in answer.notes), answer.notes


def test_a_dense_plan_keeps_its_accelerators_interval_and_no_class_note() -> None:
    answer = _answer(_request("llama3.1-8b", 64, tensor_parallel=1, context_parallel=1, expert_parallel=1))
    assert _log_interval(answer.plans[0]) == pytest.approx(
        builtin_catalogue().profiles["H100-SXM"].held_out_log_error, abs=2e-4
    )
    assert not any("check runs" in note for note in answer.notes)


def test_the_plan_table_shows_the_class_interval(tmp_path: Path) -> None:
    request = _request("qwen3-30b-a3b", 64, expert_parallel=8, tensor_parallel=1, context_parallel=1)
    best = _answer(request).plans[0]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(request))
    result = CliRunner().invoke(cli_app, ["plan", str(path)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    low, high = best.tokens_per_s_per_gpu_interval
    assert f"{low:.0f}–{high:.0f}" in result.output, result.output
    assert "expert-parallel check runs" in " ".join(result.output.split())


def test_each_class_takes_the_weighted_percentiles_of_its_own_rows() -> None:
    classes = ["context-parallel"] * 3 + ["expert-parallel"] * 2 + [None]
    groups = [("a", "H100"), ("a", "H100"), ("b", "H100"), ("c", "B200"), ("d", "H100"), ("e", "H100")]
    errors = [-0.3, -0.2, 0.1, -0.5, 0.4, 9.0]
    intervals = parallel_log_errors(classes, groups, errors)
    # source a's two rows weigh one vote together, as source b's one row does; the dense row counts in no class
    assert intervals == {"context-parallel": (-0.3, 0.1), "expert-parallel": (-0.5, 0.4)}
    assert parallel_log_errors(["context-parallel"], [("a", "H100")], [0.2]) == {"context-parallel": (0.2, 0.2)}
    with pytest.raises(ValueError, match="one entry a row"):
        parallel_log_errors(classes, groups, errors[:-1])


def test_a_catalogue_without_the_class_intervals_keeps_the_accelerators() -> None:
    software = SoftwareProfile()
    assert software.parallel_log_error == {}
    assert software.layout_log_error((-0.1, 0.1), 2, 8) == (-0.1, 0.1)
    wide = software.model_copy(update={"parallel_log_error": {"expert-parallel": (-0.3, 0.05)}})
    assert wide.layout_log_error((-0.1, 0.1), 2, 8) == (-0.3, 0.1)  # EP with CP: the expert-parallel class
    assert wide.layout_log_error((-0.1, 0.1), 2, 1) == (-0.1, 0.1)  # no context-parallel interval written
    assert wide.layout_log_error((-0.1, 0.1), 1, 1) == (-0.1, 0.1)


def test_the_shipped_class_intervals_are_the_benchs_from_the_check_rows_alone() -> None:
    report = json.loads(RESULTS.read_text())
    rows = report["rows"]
    assert not any(row["id"].startswith("dgxc") for row in rows)  # the unseen rows are in no class interval
    recomputed = parallel_log_errors(
        [row["class"] for row in rows],
        [(row["source"], row["accelerator"]) for row in rows],
        [row["log_error"] for row in rows],
    )
    shipped = builtin_catalogue().software.parallel_log_error
    assert {name: tuple(value) for name, value in recomputed.items()} == shipped
    assert set(shipped) == {"context-parallel", "expert-parallel"}


def test_the_calibration_bench_derives_the_shipped_class_intervals_from_todays_predictions() -> None:
    # the check rows planned again under the shipped catalogue (the bench's --parallel-only): the model has not
    # moved since profiles.json's parallel_log_error was written, or this says to write it again
    report = parallel_check(builtin_catalogue())
    assert report["catalogue"].software.parallel_log_error == builtin_catalogue().software.parallel_log_error
    summary = report["summary"]
    assert summary["all"]["rows"] == len(report["rows"]) >= 50
    for name in ("context-parallel", "expert-parallel"):
        # the union holds every row the accelerator's interval held, and more
        assert summary[name]["in_class_interval"] > summary[name]["in_accelerator_interval"]
