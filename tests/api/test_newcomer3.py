"""A new user's afternoon, third round (Q18): the runtime's options as the help lists them, each bad value
answered with exit 2 and the option to fix, before any process starts."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.api.test_newcomer import PROBLEM, pipesched

BAD_RUN_OPTIONS = [
    (["--nnodes", "0"], "--nnodes"),
    (["--nnodes", "2", "--node-rank", "5", "--nproc-per-node", "2"], "--node-rank"),
    (["--node-rank", "-1"], "--node-rank"),
    (["--timeout", "-1"], "--timeout"),
    (["--timeout", "0"], "--timeout"),
    (["--master-port", "70000"], "--master-port"),
]


@pytest.fixture(scope="module")
def schedule_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("q18")
    (folder / "problem.json").write_text(json.dumps(PROBLEM))
    solved = pipesched("solve", "problem.json", "--method", "1f1b", "-o", "schedule.json", cwd=folder)
    assert solved.returncode == 0, solved.stderr
    return folder / "schedule.json"


@pytest.mark.parametrize(("options", "named"), BAD_RUN_OPTIONS, ids=[" ".join(o) for o, _ in BAD_RUN_OPTIONS])
def test_run_refuses_bad_node_and_timeout_options_before_starting(
    schedule_file: Path, options: list[str], named: str
) -> None:
    """--nnodes 0 had ended in a ZeroDivisionError traceback (exit 1), --node-rank 5 of 2 nodes waited for a
    rendezvous that could never form (past 120 s), --timeout -1 started the processes and ended in a socket
    traceback (exit 1)."""
    pytest.importorskip("torch")
    started = time.monotonic()
    result = pipesched("run", str(schedule_file), *options, cwd=schedule_file.parent)
    assert result.returncode == 2, result.stderr
    assert named in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert time.monotonic() - started < 60


@pytest.mark.parametrize(
    ("options", "named"),
    [(["--device", "tpu"], "--device"), (["--repeats", "0"], "--repeats")],
    ids=["device tpu", "repeats 0"],
)
def test_profile_refuses_an_unknown_device_and_no_repeats(tmp_path: Path, options: list[str], named: str) -> None:
    """--device tpu had profiled on the CPU and written a problem as if nothing were wrong; --repeats 0 ended in
    "no median for empty data", naming no option."""
    pytest.importorskip("torch")
    result = pipesched("profile", "--num-ranks", "2", *options, "-o", "p.json", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert named in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "p.json").exists()

