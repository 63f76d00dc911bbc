"""The peak's 80% interval: each plan answers ``peak_memory_bytes_interval`` from the calibration's leave-one-out
errors on published peaks (``AcceleratorProfile.peak_memory_log_error``, ``bench.calibration_bench --memory-only``);
the plan table and the HTTP answer show it with its source; a plan whose interval's high end passes the GPU's memory
less the headroom stays ranked and a note says how likely it runs out; the lower bound says what it bounds.

Before: ``peak_memory_bytes`` printed bare, no interval in the answer, no note, "bound ms" with no source."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from pipesched.api.app import create_app
from pipesched.api.cli import app as cli_app
from pipesched.api.settings import Settings
from pipesched.optimizer.calibration.calibrate import FEW_ROWS, calibrate
from pipesched.optimizer.calibration.peaks import held_out_interval, nested_coverage
from pipesched.optimizer.cost.calibration.measurements import fitting_measurements
from pipesched.optimizer.cost.profile import builtin_catalogue
from pipesched.optimizer.planner.rank import estimator_for, out_of_memory_chance, plan, reserved_limit_bytes
from pipesched.optimizer.planner.request import PlanAnswer, PlanRequest

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # starlette on its httpx TestClient

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"

#: Llama 3.1 70B on 32 H100s: the best plans' peaks lie within the interval's reach of the 75 GiB usable.
NEAR_THE_LIMIT: dict[str, Any] = {
    "model": {"preset": "llama3.1-70b"},
    "cluster": {"accelerator": "H100-SXM", "num_nodes": 4, "gpus_per_node": 8},
    "training": {"global_batch_size": 64},
    "search": {"time_limit_s": 4, "top": 3},
}
#: Llama 3.1 8B on 8 H100s, fully sharded, micro-batch 1 with full recomputation: far below the GPU's memory.
WITH_ROOM: dict[str, Any] = {
    "model": {"preset": "llama3.1-8b"},
    "cluster": {"accelerator": "H100-SXM", "num_nodes": 1, "gpus_per_node": 8},
    "training": {"global_batch_size": 16},
    "search": {
        "time_limit_s": 3,
        "top": 2,
        "micro_batch_size": [1],
        "activation_recomputation": ["full"],
        "sharding": ["full"],
    },
}


def test_the_interval_is_the_held_out_errors_tenth_to_ninetieth_percentile() -> None:
    errors = [step / 10 for step in range(11)]  # 0.0 … 1.0
    assert held_out_interval(errors) == (0.1, 0.9)
    inside = nested_coverage(errors)
    # each row judged by the others alone: the extremes and their neighbours fall outside, the middle inside
    assert inside[0] is False and inside[-1] is False
    assert all(inside[2:-2])


def test_the_shipped_interval_is_the_benchs_leave_one_out_percentiles() -> None:
    report = json.loads((RESULTS / "calibration_peak_interval.json").read_text())
    held_out = [row["loo_log_error"] for row in report["fitted_rows"]]
    expected = tuple(report["peak_memory_log_error"])
    assert expected == pytest.approx(held_out_interval(held_out), abs=2e-4)  # the report's errors are rounded
    for name, profile in builtin_catalogue().profiles.items():
        assert profile.peak_memory_log_error == expected, name
        assert f"leave one out over {len(held_out)} published peaks" in profile.peak_memory_source, name
    # every published peak above its prediction: the interval lies above the point estimate
    assert 0 < expected[0] < expected[1] < 0.5


def test_calibrate_takes_the_peak_interval_from_its_own_peaks_or_keeps_the_built_in() -> None:
    """``pipesched calibrate`` refits the memory factor to a user's peaks; with FEW_ROWS peaks the interval becomes
    theirs (before: the built-in one stayed whatever the rows said), with fewer the built-in one stays."""
    rows = [row for row in fitting_measurements() if row.measured.peak_memory_bytes][:FEW_ROWS]
    built_in = builtin_catalogue().profiles["H100-SXM"]
    mine = calibrate(rows)
    assert mine.peak_memory_source == f"leave one out over {FEW_ROWS} measured peaks (pipesched calibrate)"
    assert mine.peak_memory_log_error is not None and mine.peak_memory_log_error != built_in.peak_memory_log_error
    low, high = mine.peak_memory_log_error
    assert low <= high
    few = calibrate(rows[:1])
    assert few.peak_memory_log_error == built_in.peak_memory_log_error
    assert few.peak_memory_source == built_in.peak_memory_source


def test_how_likely_a_plan_runs_out_by_its_interval() -> None:
    interval = (0.0, 0.2)
    assert out_of_memory_chance(100.0, 100.0 * math.exp(0.1), interval) == pytest.approx(0.5)
    assert out_of_memory_chance(100.0, 99.0, interval) == 0.9  # the limit below the interval's low end
    assert out_of_memory_chance(100.0, 130.0, interval) == 0.1  # above its high end
    chances = [out_of_memory_chance(100.0, 100.0 * math.exp(x / 100), interval) for x in range(0, 21)]
    assert chances == sorted(chances, reverse=True)


def _peak_notes(answer: PlanAnswer) -> list[str]:
    return [note for note in answer.notes if note.startswith("peak memory:")]


def test_each_plan_carries_its_peak_interval_and_a_risky_one_a_note() -> None:
    request = PlanRequest.model_validate(NEAR_THE_LIMIT)
    answer = plan(request).answer
    estimator = estimator_for(request)
    low, high = estimator.hardware.profile.peak_memory_log_error or (0.0, 0.0)
    limit = reserved_limit_bytes(estimator)  # the interval is of the reserved peak: memory less the context only
    assert estimator.limit_bytes < limit < estimator.hardware.memory_bytes
    assert answer.plans
    risky = []
    for rank, item in enumerate(answer.plans, 1):
        peak = item.peak_memory_bytes
        assert peak <= estimator.limit_bytes  # the point estimate stays the rule
        assert item.peak_memory_bytes_interval == (round(peak * math.exp(low)), round(peak * math.exp(high)))
        if item.peak_memory_bytes_interval[1] > limit:
            risky.append(rank)
    assert risky, "no plan near the limit: pick a request whose peaks are"
    (note,) = _peak_notes(answer)
    for rank in risky:
        assert f" {rank} (" in note and "likely" in note, note
    assert "reserved peak" in note and "retries" in note
    assert "stays ranked" in note and "cluster.memory_headroom_bytes" in note
    assert answer.peak_memory_interval_source is not None
    assert "leave one out over 12 published peaks" in answer.peak_memory_interval_source
    roomy = plan(PlanRequest.model_validate(WITH_ROOM)).answer
    assert roomy.plans and not _peak_notes(roomy)
    assert all((p.peak_memory_bytes_interval or (0, math.inf))[1] < limit for p in roomy.plans)


def test_the_plan_table_shows_the_interval_its_source_and_what_the_bound_bounds(tmp_path: Path) -> None:
    config = tmp_path / "plan.json"
    config.write_text(json.dumps(WITH_ROOM))
    out = tmp_path / "plans.json"
    result = CliRunner().invoke(cli_app, ["plan", str(config), "-o", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    answer = json.loads(out.read_text())
    best = answer["plans"][0]
    low, high = best["peak_memory_bytes_interval"]
    cell = f"{best['peak_memory_bytes'] / 2**30:.1f} ({low / 2**30:.1f}–{high / 2**30:.1f})"
    assert "peak GiB (80%)" in result.output and cell in result.output, result.output
    assert f"peak (80% interval): {answer['peak_memory_interval_source']}" in " ".join(result.output.split())
    assert "bound ms: the model's own bound on the step" in result.output
    assert "not a measured figure" in " ".join(result.output.split())


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    path = tmp_path_factory.mktemp("peak") / "pipesched.sqlite3"
    with TestClient(create_app(Settings(database_url=f"sqlite:///{path}", solver_workers=1))) as test_client:
        yield test_client


def test_the_http_answer_carries_the_interval_and_its_source(client: TestClient) -> None:
    created = client.post("/v1/plans", json=WITH_ROOM)
    assert created.status_code == 202, created.text
    deadline = time.monotonic() + 90
    body = created.json()
    while time.monotonic() < deadline and body["status"] not in ("done", "failed"):
        time.sleep(0.2)
        body = client.get(f"/v1/plans/{created.json()['id']}").json()
    assert body["status"] == "done", body
    for item in body["plans"]:
        low, high = item["peak_memory_bytes_interval"]
        assert item["peak_memory_bytes"] < low < high
    assert "peak_memory_log_error" in body["peak_memory_interval_source"]
