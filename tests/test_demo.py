"""The main job end to end: `pipesched demo` as a user runs it, in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipesched.optimizer.problem import Problem
from pipesched.optimizer.solve import solve_family


@pytest.mark.slow
def test_demo_runs_to_a_verified_end(tmp_path: Path) -> None:
    # Exactly what the README's first command runs: the console script, no arguments, in a fresh folder.
    pipesched = Path(sys.executable).parent / "pipesched"
    result = subprocess.run([str(pipesched), "demo"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    (folder,) = tmp_path.glob("pipesched-demo-*")
    assert str(folder.name) in result.stdout.replace("\n", "")
    for name in ("problem.json", "schedule.json", "gantt.png", "schedule.csv", "report.json", "measured-trace.json"):
        assert (folder / name).stat().st_size > 0, name
    report = json.loads((folder / "report.json").read_text())
    assert report["verified"] is True
    assert report["engine"] == "torch"  # PyTorch's own runtime, wherever it can follow the schedule
    assert report["executed_order_matches"] is True
    assert report["max_rel_grad_error"] <= 1e-5
    schedule = json.loads((folder / "schedule.json").read_text())
    assert schedule["status"] in ("optimal", "feasible")
    limit = schedule["problem"]["memory"]["limit"]
    assert max(schedule["peak_memory"]) <= limit
    # The comparison is printed, and auto is no worse than either family shown beside it.
    assert "1f1b" in result.stdout and "zb-h1" in result.stdout
    problem = Problem.model_validate(schedule["problem"])
    for family in ("1f1b", "zb-h1"):
        other = solve_family(problem, family)
        assert other.status == "feasible"
        assert schedule["makespan"] <= other.makespan + 1e-6, family
    # The limit makes the choice matter: ZB-H2 would be faster than ZB-H1 but does not fit, and auto
    # beats 1F1B.
    zb_h2 = solve_family(problem, "zb-h2", enforce_memory=False)
    assert zb_h2.fits_memory is False
    assert schedule["makespan"] < solve_family(problem, "1f1b").makespan - 1e-6
    assert (folder / "gantt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
