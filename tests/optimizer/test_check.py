"""`pipesched check` and `POST /v1/schedules/check`: schedules written elsewhere, timed or rejected with a grid."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pipesched.api.app import create_app
from pipesched.api.settings import Settings
from pipesched.optimizer.check import check_schedule, read_schedule
from pipesched.optimizer.families import get_family
from pipesched.optimizer.instance import compile_problem
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.simulate import simulate
from tests.conftest import REPO, data_parallel_problem

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

P, M = 4, 8
PROBLEM: dict[str, Any] = {
    "pipeline": {"num_ranks": P, "num_microbatches": M, "stages_per_rank": 2},
    "costs": {"forward": 1.0, "backward_input": 1.2, "backward_weight": 0.8, "p2p": 0.1},
    "memory": {"activation": 100, "retained_for_weight": 40, "limit": 1200},
    "objective": "makespan",
}


def _ours(problem: dict[str, Any], family: str) -> list[list[str]]:
    return [[str(a) for a in row] for row in get_family(family).generate(Problem.model_validate(problem))]


def _good() -> list[list[str]]:
    return _ours(PROBLEM, "interleaved-zb")


def _deadlock() -> list[list[str]]:
    rows = _good()
    # Rank 1 runs its first backward before the forward rank 2 needs from it, and rank 0 waits on it too.
    first_i = next(k for k, a in enumerate(rows[1]) if "I" in a)
    rows[1].insert(0, rows[1].pop(first_i))
    return rows


def _missing() -> list[list[str]]:
    rows = _good()
    rows[2].remove("2W3")
    return rows


def _duplicate() -> list[list[str]]:
    rows = _good()
    rows[3].insert(5, rows[3][0])
    return rows


def _over_memory() -> dict[str, Any]:
    return {**PROBLEM, "memory": {**PROBLEM["memory"], "limit": 700}}


def pipesched(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipesched.api.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "COLUMNS": "160"},
    )


# -- the checker ---------------------------------------------------------------------------------


def test_a_valid_schedule_gets_the_simulators_numbers() -> None:
    problem = Problem.model_validate(PROBLEM)
    orders, notes = read_schedule(json.dumps(_good()))
    result = check_schedule(problem, orders, notes)
    sim = simulate(compile_problem(problem), orders)
    assert result.valid and notes == []
    assert result.objective_value == pytest.approx(sim.makespan)
    assert result.peak_memory == pytest.approx(sim.peak_memory)
    assert result.bubble_rate == pytest.approx(sim.bubble_rate("makespan"))


@pytest.mark.parametrize(
    ("rows", "problem", "reason", "marked_rank"),
    [
        (_deadlock, lambda: PROBLEM, "deadlock", 1),
        (_missing, lambda: PROBLEM, "missing_action", 2),
        (_duplicate, lambda: PROBLEM, "duplicate_action", 3),
        (_good, _over_memory, "memory_limit", 0),
    ],
)
def test_broken_schedules_name_the_first_violation_and_mark_it(
    rows: Any, problem: Any, reason: str, marked_rank: int
) -> None:
    orders, _ = read_schedule(rows())
    result = check_schedule(Problem.model_validate(problem()), orders)
    assert not result.valid and result.violation is not None
    assert result.violation.reason == reason
    assert marked_rank in [rank for rank, _ in result.violation.marks]
    grid = result.to_dict()["violation"]["grid"]
    assert ">" in grid and "<" in grid and len(grid.splitlines()) == P + 2
    if reason == "deadlock":
        assert all({"rank", "action", "waits_for", "on_rank"} <= set(w) for w in result.violation.details["waits"])
    if reason == "duplicate_action":
        assert result.violation.marks == [(3, 0), (3, 5)]


def test_unknown_cells_are_bad_input_and_p2p_is_skipped_with_a_note() -> None:
    """SEND/RECV are skipped (the problem's p2p latency times them); the contract's communication actions are
    read, and set aside with a note by the check when the problem has no data parallelism."""
    with pytest.raises(ValueError, match="rank 1, step 2"):
        read_schedule("0F0,0B0\n1F0,1B0,1X0\n")
    orders, notes = read_schedule("0F0,1SEND_F0,,0B0\n1RECV_F0,1F0,1B0,1REDUCE_GRAD\n")
    assert [[str(a) for a in row] for row in orders] == [["0F0", "0B0"], ["1F0", "1B0", "1REDUCE_GRAD"]]
    assert len(notes) == 1 and all(f"1 {kind}" in notes[0] for kind in ("SEND_F", "RECV_F"))
    fused = {**PROBLEM, "pipeline": {"num_ranks": 2, "num_microbatches": 1}, "split_backward": False}
    result = check_schedule(Problem.model_validate(fused), orders, notes)
    assert result.valid, result.violation
    assert any("set aside 1 communication action(s) (REDUCE_GRAD)" in note for note in result.notes)


# -- PyTorch's own CSV files ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "v", "placement", "split"),
    [("InterleavedZeroBubble", 2, "loop", True), ("DualPipeV", 2, "v", True), ("Interleaved1F1B", 2, "loop", False)],
)
@pytest.mark.parametrize("csv_format", ["compute_only", "compute_comms"])
def test_torch_written_csv_is_timed(
    tmp_path: Path, name: str, v: int, placement: str, split: bool, csv_format: str
) -> None:
    """A CSV PyTorch writes itself (``_dump_csv``: blank cells for idle slots, OVERLAP_F_B pairs, and with comms
    SEND/RECV and REDUCE_GRAD) checks valid; DualPipeV's fused and split backward passes are timed as they are."""
    pytest.importorskip("torch")
    from pipesched.runtime.torch_orders import torch_compute_orders, torch_schedule

    path = tmp_path / "schedule.csv"
    torch_schedule(name, P, v, M)._dump_csv(str(path), csv_format)
    problem = {**PROBLEM, "pipeline": {**PROBLEM["pipeline"], "placement": placement}, "split_backward": split}
    orders, notes = read_schedule(path.read_text())
    result = check_schedule(Problem.model_validate(problem), orders, notes)
    assert result.valid, result.violation
    assert result.orders == torch_compute_orders(name, P, v, M)
    assert bool(notes) == (csv_format == "compute_comms")


# -- the command line ----------------------------------------------------------------------------


def test_cli_check_valid_invalid_and_bad_input(tmp_path: Path) -> None:
    problem_path = tmp_path / "problem.json"
    problem_path.write_text(json.dumps(PROBLEM))
    good, bad, garbage = tmp_path / "good.json", tmp_path / "bad.csv", tmp_path / "garbage.csv"
    good.write_text(json.dumps(_good()))
    bad.write_text("\n".join(",".join(row) for row in _deadlock()) + "\n")
    garbage.write_text("0F0,hello\n")

    result = pipesched("check", str(problem_path), str(good), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "valid" in result.stdout and "peak memory per rank" in result.stdout
    assert "valid · objective makespan · makespan " in result.stdout  # "valid · makespan X ms · makespan X ms" before

    result = pipesched("check", str(problem_path), str(bad), cwd=tmp_path)
    assert result.returncode == 1
    assert "deadlock" in result.stderr and "rank │" in result.stderr and ">" in result.stderr

    result = pipesched("check", str(problem_path), str(garbage), cwd=tmp_path)
    assert result.returncode == 2 and "rank 0, step 1" in result.stderr

    result = pipesched("check", str(problem_path), str(bad), "--json", cwd=tmp_path)
    assert result.returncode == 1 and json.loads(result.stdout)["violation"]["reason"] == "deadlock"


# -- HTTP ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    path = tmp_path_factory.mktemp("check") / "pipesched.sqlite3"
    settings = Settings(database_url=f"sqlite:///{path}", solver_workers=1, max_time_limit_s=2.0)
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def test_http_check(client: TestClient) -> None:
    answer = client.post("/v1/schedules/check", json={"problem": PROBLEM, "schedule": _good()})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["valid"] is True and body["objective_value"] > 0 and len(body["peak_memory"]) == P

    csv_text = "\n".join(",".join(row) for row in _missing())
    answer = client.post("/v1/schedules/check", json={"problem": PROBLEM, "schedule": csv_text})
    assert answer.status_code == 200
    assert answer.json()["valid"] is False and answer.json()["violation"]["reason"] == "missing_action"

    answer = client.post("/v1/schedules/check", json={"problem": PROBLEM, "schedule": [["0F0", "0Q1"]]})
    assert answer.status_code == 422 and "schedule" in answer.text
    answer = client.post("/v1/schedules/check", json={"problem": {"pipeline": {}}, "schedule": []})
    assert answer.status_code == 422


def test_a_data_parallel_problem_gets_its_collectives_placed_by_pipesched() -> None:
    """A compute-only schedule for a problem with data parallelism: pipesched adds UNSHARD/RESHARD/REDUCE_GRAD and
    the optimizer steps as its families do, says so, and times the step."""
    problem = Problem.model_validate(
        {
            **PROBLEM,
            "costs": {**PROBLEM["costs"], "unshard": 0.5, "reduce_grad": 0.7, "optimizer_step": 0.2},
            "memory": {"activation": 100, "retained_for_weight": 40, "weights": 50},
            "data_parallel": {"size": 4, "sharding": "full"},
        }
    )
    orders, notes = read_schedule(_good())
    result = check_schedule(problem, orders, notes)
    assert result.valid, result.violation
    assert any("collectives" in note for note in result.notes)
    assert any("REDUCE_GRAD" in action for row in result.orders for action in row)
    assert result.makespan > check_schedule(Problem.model_validate(PROBLEM), orders).makespan


def test_a_mixed_backward_schedule_on_a_data_parallel_problem() -> None:
    """PyTorch's DualPipeV order (fused B mixed with split I/W) checks valid with data parallelism too."""
    pytest.importorskip("torch")
    from pipesched.runtime.torch_orders import torch_compute_orders

    problem = Problem.model_validate(
        {
            **PROBLEM,
            "pipeline": {**PROBLEM["pipeline"], "placement": "v"},
            "costs": {**PROBLEM["costs"], "reduce_grad": 0.7, "unshard": 0.4},
            "memory": {"activation": 100, "retained_for_weight": 40, "weights": 50},
            "data_parallel": {"size": 2, "sharding": "full"},
        }
    )
    orders, notes = read_schedule(torch_compute_orders("DualPipeV", P, 2, M))
    result = check_schedule(problem, orders, notes)
    assert result.valid, result.violation
    assert sum(a.endswith("REDUCE_GRAD") for row in result.orders for a in row) == 2 * P


def test_a_solved_fused_data_parallel_schedule_checks_as_written() -> None:
    """The bug of issue 27: a solved fused 1F1B pp2 × dp2 schedule's own rows (UNSHARD … B … REDUCE_GRAD,
    RESHARD, OPTIMIZER_STEP) were rejected (its communication actions were read as split backward). They check
    valid now, timed as written: the same step_time; a REDUCE_GRAD moved to the wrong rank is refused."""
    from pipesched.optimizer.instance import backward_forms_of
    from pipesched.optimizer.solve import solve

    problem = data_parallel_problem(split_backward=False, method="1f1b")
    schedule = solve(problem)
    rows = [[action.action for action in rank.actions] for rank in schedule.ranks]
    assert rows[0][0] == "0UNSHARD" and rows[0][-1] == "OPTIMIZER_STEP" and "0B0" in rows[0]
    assert set(backward_forms_of(schedule.orders()).values()) == {False}
    orders, notes = read_schedule(json.dumps(rows))
    result = check_schedule(problem, orders, notes)
    assert result.valid, result.violation
    assert result.notes == [] and result.orders == rows
    assert result.objective_value == pytest.approx(schedule.step_time)
    moved = [list(row) for row in rows]
    moved[1].remove("1REDUCE_GRAD")
    moved[0].insert(-1, "1REDUCE_GRAD")
    result = check_schedule(problem, read_schedule(json.dumps(moved))[0])
    assert not result.valid and result.violation is not None and result.violation.reason == "wrong_rank"
