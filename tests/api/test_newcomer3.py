"""A new user's afternoon, third round (Q18): the runtime's options as the help lists them, each bad value
answered with exit 2 and the option to fix, before any process starts."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.api.test_newcomer import PROBLEM, _free_port, pipesched

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


def test_run_on_two_nodes_needs_a_master_port(schedule_file: Path) -> None:
    """Without --master-port each node had picked a free port of its own and waited for the other forever."""
    pytest.importorskip("torch")
    result = pipesched("run", str(schedule_file), "--nnodes", "2", "--nproc-per-node", "2", cwd=schedule_file.parent)
    assert result.returncode == 2, result.stderr
    assert "--master-port" in result.stderr, result.stderr


def test_two_nodes_on_one_machine_run_and_verify(tmp_path: Path) -> None:
    """The multi-node flags as RUNTIME.md gives them, both nodes on this machine: the launchers had keyed their
    rendezvous by a run id each drew for itself, so the two never met (both waited past 120 s), and the torch
    engine's ranks read the schedule's CSV from node 0's temporary folder."""
    pytest.importorskip("torch")
    (tmp_path / "problem.json").write_text(json.dumps({**PROBLEM, "pipeline": {"num_ranks": 2, "num_microbatches": 4}}))
    solved = pipesched("solve", "problem.json", "--method", "1f1b", "-o", "schedule.json", cwd=tmp_path)
    assert solved.returncode == 0, solved.stderr
    port = str(_free_port())
    common = ["run", "schedule.json", "--nnodes", "2", "--nproc-per-node", "1", "--master-port", port]
    common += ["--timeout", "60"]
    with ThreadPoolExecutor(2) as pool:
        node1 = pool.submit(pipesched, *common, "--node-rank", "1", cwd=tmp_path)
        node0 = pool.submit(pipesched, *common, "--node-rank", "0", "-o", "report.json", cwd=tmp_path)
        first, second = node0.result(), node1.result()
    assert first.returncode == 0, first.stderr + first.stdout
    assert second.returncode == 0 and "node 1 done" in second.stdout, second.stderr + second.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["verified"] and [rank["rank"] for rank in report["ranks"]] == [0, 1]


@pytest.mark.parametrize("option", ["-o", "--trace"])
def test_run_refuses_an_unwritable_report_or_trace_before_starting(schedule_file: Path, option: str) -> None:
    """-o into a folder that does not exist had run every rank and then ended in a FileNotFoundError traceback
    (exit 1), the run's report lost; --trace had written the report and then failed the same way."""
    pytest.importorskip("torch")
    result = pipesched("run", str(schedule_file), option, "no-such-folder/out.json", cwd=schedule_file.parent)
    assert result.returncode == 2, result.stderr
    assert f"give {option} a path in an existing folder" in result.stderr and "Traceback" not in result.stderr
    assert "verified" not in result.stdout, result.stdout


def test_profile_refuses_an_unwritable_output_before_measuring(tmp_path: Path) -> None:
    """The profile had built the model and measured it for its whole run before -o failed."""
    pytest.importorskip("torch")
    (tmp_path / "marked.py").write_text(
        "from pathlib import Path\n\n\ndef build(num_stages, seed):\n    Path('built').touch()\n    return []\n"
    )
    result = pipesched("profile", "--num-ranks", "2", "--model", "marked:build", "-o", "no-such/p.json", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "give -o a path in an existing folder" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "built").exists()


def test_a_search_shortened_by_its_wait_is_not_the_cached_answer_to_the_whole_limit(tmp_path: Path) -> None:
    """A synchronous solve that waited behind another had its search shortened (its limit less the wait) and was
    stored under the key of the problem as asked: the same problem asked again on an idle service got that short
    search back as a cache hit, for good. A shortened search that proved nothing is now stored under the problem
    it searched (its shorter limit), and the whole limit is searched when asked again."""
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    from pipesched.api.app import create_app
    from pipesched.api.settings import Settings
    from tests.optimizer.test_time_limits import _problem

    settings = Settings(database_url=f"sqlite:///{tmp_path / 'cache.sqlite3'}", sync_solver_workers=1)
    first = _problem(1024, 4, 1, "loop", 10.0, tl=3.0).model_dump(mode="json")
    late = _problem(1000, 4, 1, "loop", 10.0, tl=3.0).model_dump(mode="json")
    with TestClient(create_app(settings)) as client:
        client.post("/v1/schedules", json=_problem(2, 2, 1, "loop", None, tl=0.5).model_dump(mode="json"))
        with ThreadPoolExecutor(2) as pool:
            ahead = pool.submit(client.post, "/v1/schedules", json=first)
            time.sleep(0.3)
            behind = pool.submit(client.post, "/v1/schedules", json=late)
            assert ahead.result().status_code == 200
            shortened = behind.result().json()
        assert shortened["status"] == "feasible", shortened["status"]
        assert shortened["problem"]["solver"]["time_limit_s"] < 3.0
        again = client.post("/v1/schedules", json=late)
        assert again.status_code == 200
        answer = again.json()
        assert answer["cache"] == "miss" and answer["problem"]["solver"]["time_limit_s"] == 3.0
        assert client.post("/v1/schedules", json=late).json()["cache"] == "hit"


def test_a_plan_cut_off_by_a_restart_still_shows_the_request_it_was_asked(tmp_path: Path) -> None:
    """A plan search the service was running when it stopped fails at the next start ("POST /v1/plans again"); its
    answer showed ``request: null`` though the request is stored, so a client could not ask it again from the
    answer."""
    from fastapi.testclient import TestClient

    from pipesched.api.app import create_app
    from pipesched.api.settings import Settings
    from pipesched.api.storage import Store
    from pipesched.optimizer.planner.request import PlanRequest

    url = f"sqlite:///{tmp_path / 'plans.sqlite3'}"
    request = PlanRequest.model_validate(
        {
            "model": {"preset": "llama3.1-8b"},
            "cluster": {"accelerator": "H100-SXM", "num_nodes": 2, "gpus_per_node": 8},
            "training": {"global_batch_size": 64},
        }
    )
    row = Store(url).create_plan(request.model_dump_json(), total=10)
    with TestClient(create_app(Settings(database_url=url, solver_workers=1))) as client:
        answer = client.get(f"/v1/plans/{row.id}").json()
    assert answer["status"] == "failed" and "POST /v1/plans again" in answer["error"]
    assert answer["request"] is not None and PlanRequest.model_validate(answer["request"]) == request
