"""What a user trips on (the last audit, U19), on the installed ``pipesched`` command and real processes: a run of
another optimizer than its profile's; a Chrome trace of a run whose predicted ranks read like its measured ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.api.test_newcomer import pipesched

STATIC_NOTE = "note: the predicted static memory (memory.static) is adamw's"


@pytest.fixture(scope="module")
def adamw_schedule(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pipesched profile --optimizer adamw`` (2 gloo ranks, gpt-tiny), then ``pipesched solve --method 1f1b``."""
    pytest.importorskip("torch")
    folder = tmp_path_factory.mktemp("adamw-profile")
    profiled = pipesched(
        "profile", "--num-ranks", "2", "--num-microbatches", "4", "--optimizer", "adamw", "--repeats", "2",
        "-o", "problem.json", cwd=folder,
    )  # fmt: skip
    assert profiled.returncode == 0, profiled.stderr + profiled.stdout
    solved = pipesched("solve", "problem.json", "--method", "1f1b", "-o", "schedule.json", cwd=folder)
    assert solved.returncode == 0, solved.stderr
    return folder / "schedule.json"


def _run(schedule: Path, *options: str) -> tuple[str, dict]:
    result = pipesched("run", str(schedule), "--steps", "1", "--engine", "pipesched", *options, "-o", "report.json",
                       cwd=schedule.parent)  # fmt: skip
    assert result.returncode == 0, result.stderr + result.stdout
    return result.stdout, json.loads((schedule.parent / "report.json").read_text())


@pytest.mark.slow  # a profile (with its calibration run) and two runs on 2 gloo ranks: 60–120 s on 2 shared cores
def test_a_run_of_another_optimizer_than_its_profile_says_the_static_prediction_is_the_profiles(
    adamw_schedule: Path,
) -> None:
    """A profile made with --optimizer adamw, run with --optimizer sgd, had printed the profile's static memory (two
    AdamW moments per parameter more than SGD holds) as the run's prediction without a word (228552 B predicted,
    114176 B measured on rank 0). The profile now records its optimizer (memory.static_optimizer), a run without
    --optimizer steps that one (and holds the static memory predicted, byte for byte), and a run of another says
    that the static prediction is the profile's optimizer's."""
    problem = json.loads(adamw_schedule.read_text())["problem"]
    assert problem["memory"]["static_optimizer"] == "adamw"

    stdout, report = _run(adamw_schedule)
    assert report["training"]["optimizer"] == "adamw"
    assert all(rank["static_bytes_measured"] == rank["static_bytes_predicted"] for rank in report["ranks"])
    assert "note: the predicted static memory" not in stdout

    stdout, report = _run(adamw_schedule, "--optimizer", "sgd")
    assert report["training"]["optimizer"] == "sgd"
    # SGD keeps no state: half of AdamW's parameters + gradients + two moments, less its step counters
    assert all(rank["static_bytes_measured"] < rank["static_bytes_predicted"] / 1.9 for rank in report["ranks"])
    said = " ".join(stdout.split())
    assert STATIC_NOTE in said and "this run steps sgd" in said, stdout
    assert "Profile with --optimizer sgd" in said


def test_a_runs_chrome_trace_says_which_ranks_are_predicted_and_which_measured(adamw_schedule: Path) -> None:
    """``pipesched run --trace`` had named the predicted ranks "rank r", beside the measured "rank r (measured)": in
    Perfetto's list a user could not tell the prediction from the measurement without knowing the pid order."""
    result = pipesched("run", str(adamw_schedule), "--trace", "trace.json", cwd=adamw_schedule.parent)
    assert result.returncode == 0, result.stderr + result.stdout
    trace = json.loads((adamw_schedule.parent / "trace.json").read_text())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0 (predicted)", 1: "rank 1 (predicted)", 2: "rank 0 (measured)", 3: "rank 1 (measured)"}
    passes = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] in ("F", "I", "W", "B")]
    ran = {pid: sorted(e["name"] for e in passes if e["pid"] == pid) for pid in names}
    assert ran[0] == ran[2] and ran[1] == ran[3] and ran[0] and ran[1]  # the same passes, predicted and measured
