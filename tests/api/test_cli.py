"""The command line as a user runs it: stdout carries the schedule when there is no -o, errors exit 2."""

from __future__ import annotations

import csv
import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

PROBLEM = {
    "pipeline": {"num_ranks": 4, "num_microbatches": 8},
    "costs": {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0, "p2p": 0.1},
    "memory": {"activation": 100, "retained_for_weight": 40, "limit": 400},
    "objective": "makespan",
}


def pipesched(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipesched.api.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "COLUMNS": "120"},
    )


@pytest.fixture()
def problem_file(tmp_path: Path) -> Path:
    path = tmp_path / "problem.json"
    path.write_text(json.dumps(PROBLEM))
    return path


def test_solve_without_output_writes_the_schedule_to_stdout(problem_file: Path) -> None:
    # "solver": null in the file plus --method: the override starts the section.
    problem_file.write_text(json.dumps({**PROBLEM, "solver": None}))
    result = pipesched("solve", str(problem_file), "--method", "zb-h1", cwd=problem_file.parent)
    assert result.returncode == 0, result.stderr
    schedule = json.loads(result.stdout)
    assert schedule["method"] == "zb-h1" and len(schedule["ranks"]) == 4
    assert "peak memory per rank" in result.stderr  # the summary goes to stderr


def test_solve_csv_to_stdout_is_pure_csv(problem_file: Path) -> None:
    result = pipesched("solve", str(problem_file), "--method", "1f1b", "--format", "csv", cwd=problem_file.parent)
    assert result.returncode == 0, result.stderr
    rows = list(csv.reader(io.StringIO(result.stdout)))
    assert len(rows) == 4 and rows[0][0] == "0F0" and all(len(row) == 3 * 8 for row in rows)


def test_unwritable_output_exits_2_naming_the_path(problem_file: Path) -> None:
    result = pipesched(
        "solve", str(problem_file), "--method", "1f1b", "-o", "/nonexistent/dir/s.json", cwd=problem_file.parent
    )
    assert result.returncode == 2
    assert "cannot write /nonexistent/dir/s.json" in result.stderr


def test_bad_field_exits_2_naming_the_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**PROBLEM, "costs": {**PROBLEM["costs"], "forward": [1.0, 2.0]}}))
    result = pipesched("solve", str(path), cwd=tmp_path)
    assert result.returncode == 2
    assert "costs.forward" in result.stderr and "one value per stage" in result.stderr


def test_family_outside_its_domain_exits_2(problem_file: Path) -> None:
    result = pipesched("solve", str(problem_file), "--method", "zb-v", cwd=problem_file.parent)
    assert result.returncode == 2 and "zb-v" in result.stderr


def test_infeasible_exits_1_with_the_least_limit(tmp_path: Path) -> None:
    path = tmp_path / "tight.json"
    path.write_text(json.dumps({**PROBLEM, "memory": {**PROBLEM["memory"], "limit": 50}}))
    result = pipesched("solve", str(path), "-o", str(tmp_path / "out.json"), cwd=tmp_path)
    assert result.returncode == 1
    answer = json.loads((tmp_path / "out.json").read_text())
    assert answer["status"] == "infeasible" and answer["min_memory_limit"] == [100.0] * 4


def test_compare_shows_peak_memory_per_rank(problem_file: Path) -> None:
    result = pipesched("compare", str(problem_file), "--time-limit", "1", cwd=problem_file.parent)
    assert result.returncode == 0, result.stderr
    assert "peak memory per rank" in result.stdout
    assert "zb-h1" in result.stdout and "auto" in result.stdout


@pytest.mark.parametrize(
    ("command", "kind", "fix"),
    [
        (["run", "{problem}"], "is a problem, not a schedule", "pipesched solve"),
        (["plot", "{problem}", "-o", "g.png"], "is a problem, not a schedule", "pipesched solve"),
        (["launch", "{request}", "-o", "job"], "is a plan request, not a plan answer", "pipesched plan"),
        (["solve", "{request}"], "is a plan request, not a problem", "pipesched plan"),
    ],
)
def test_a_file_of_another_kind_says_which_and_the_command_it_needs(
    problem_file: Path, command: list[str], kind: str, fix: str
) -> None:
    """A newcomer's first mistake, a problem given to `run`, had answered only "status: Field required" …"""
    request = problem_file.parent / "plan.json"
    request.write_text(json.dumps({"model": {"preset": "gpt2"}, "cluster": {}, "training": {"global_batch_size": 8}}))
    args = [arg.format(problem=problem_file, request=request) for arg in command]
    result = pipesched(*args, cwd=problem_file.parent)
    assert result.returncode == 2, result.stderr
    assert kind in result.stderr and fix in result.stderr, result.stderr


def test_run_with_zero_processes_per_node_exits_2_with_the_count_it_needs(problem_file: Path) -> None:
    """--nproc-per-node 0 had been read as not given and the run went ahead."""
    schedule = problem_file.parent / "schedule.json"
    solved = pipesched("solve", str(problem_file), "--method", "1f1b", "-o", str(schedule), cwd=problem_file.parent)
    assert solved.returncode == 0, solved.stderr
    result = pipesched("run", str(schedule), "--nproc-per-node", "0", cwd=problem_file.parent)
    assert result.returncode == 2, result.stderr
    assert "set --nproc-per-node 4" in result.stderr


def _started(cwd: Path, *args: str) -> subprocess.Popen[str]:
    """``pipesched ARGS`` started in ``cwd``, its stdout and stderr piped (not a terminal)."""
    return subprocess.Popen(
        [sys.executable, "-m", "pipesched.api.cli", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_ctrl_c_stops_a_plan_search_and_answers_with_the_plans_found_so_far(tmp_path: Path) -> None:
    """A user who stops a long plan search (Ctrl-C, SIGINT) gets the best plans found until then, written and
    printed with a note saying the search was stopped, and exit 0; before, the command died with 130 and nothing.
    Its stderr, not a terminal, logs each better plan (the bar shows only on a terminal)."""
    request = json.loads((REPO / "bench" / "data" / "plan_llama405b_512.json").read_text())
    request["search"]["time_limit_s"] = 300  # far beyond the interrupt: only the interrupt ends this search
    (tmp_path / "plan.json").write_text(json.dumps(request))
    process = _started(tmp_path, "plan", "plan.json", "-o", "answer.json")
    try:
        assert process.stderr is not None
        lines = []
        for line in process.stderr:  # not a terminal: a line for each better plan
            lines.append(line)
            if line.startswith("planning: best step"):
                break
        assert process.poll() is None, "".join(lines)
        process.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        stdout, rest = process.communicate(timeout=120)
    finally:
        process.kill()
    stderr = "".join(lines) + rest
    assert process.returncode == 0, stdout + stderr
    assert time.monotonic() - interrupted < 60.0
    assert "interrupted: the search stops" in stderr
    answer = json.loads((tmp_path / "answer.json").read_text())
    assert answer["plans"] and any("stopped by an interrupt (Ctrl-C)" in note for note in answer["notes"])
    assert "stopped by an interrupt" in stdout


def test_ctrl_c_stops_an_auto_solve_and_writes_the_best_schedule_found_so_far(tmp_path: Path) -> None:
    """`pipesched solve` of a large problem with a 300 s limit, interrupted as its search starts: the best schedule
    found so far (the search always holds one) is summarised and written, exit 0, long before the limit."""
    problem = dict(PROBLEM, pipeline={"num_ranks": 32, "num_microbatches": 60}, solver={"time_limit_s": 300})
    problem["memory"] = dict(PROBLEM["memory"], limit=2000)
    (tmp_path / "problem.json").write_text(json.dumps(problem))
    process = _started(tmp_path, "solve", "problem.json", "-o", "schedule.json")
    try:
        assert process.stderr is not None
        first = process.stderr.readline()
        assert first.startswith("searching (time limit 300 s)"), first
        process.send_signal(signal.SIGINT)  # the line is printed once the handler is set
        stdout, rest = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0, stdout + rest
    assert "interrupted: the search stops and answers with the best schedule found so far" in rest
    schedule = json.loads((tmp_path / "schedule.json").read_text())
    assert schedule["status"] == "feasible" and schedule["solve_time_s"] < 120
    assert len(schedule["ranks"]) == 32
