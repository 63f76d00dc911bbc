"""The service's limits: bounded queues (429 with Retry-After), a dead worker fails only its task,
drawings in a capped render process, bounded metric labels, one shape for a body that is not JSON (a 422),
the full Allow of a 405, the API token on every /v1 route, and `pipesched serve` refusing a public interface
without a token.

Real worker processes (killed with SIGKILL), real SQLite, the app's real lifespan.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pipesched.api.app import create_app
from pipesched.api.jobs import SolverPool, SolveTimeout, unstorable_reason
from pipesched.api.lanes import Lane, LaneFull, WorkerDied
from pipesched.api.settings import Settings, exposure_problem
from pipesched.api.storage import JobRow, Store, problem_key
from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.solve import solve
from tests.api.test_api import metric_value, wait_for_job
from tests.api.test_api_served import free_port
from tests.conftest import paper_problem, paper_settings, uniform_problem

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def problem_body(method: str = "1f1b", num_microbatches: int = 8, **changes: Any) -> dict[str, Any]:
    problem = uniform_problem(4, num_microbatches, p2p=0.1).with_changes(
        **{"solver.method": method, "solver.time_limit_s": 2.0, **changes}
    )
    return problem.model_dump(mode="json")


def long_job(seed: int, time_limit_s: float = 20.0) -> dict[str, Any]:
    """A job whose search runs its whole time limit (the paper's 1.5B setting at 1.2 × p·activation)."""
    setting = paper_settings()[0]
    return paper_problem(
        setting,
        **{
            "memory.limit": 1.2 * setting["num_ranks"] * setting["activation"],
            "solver.time_limit_s": time_limit_s,
            "solver.seed": seed,
        },
    ).model_dump(mode="json")


def wait_until(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s} s"
        time.sleep(0.05)


# --- the lane ------------------------------------------------------------------------------------


def test_a_killed_worker_fails_only_its_task_and_the_queue_runs_on_a_fresh_one() -> None:
    lane = Lane("test", workers=1, max_queued=2)
    try:
        running = lane.submit(time.sleep, 30.0, expected_s=30.0)
        queued = [lane.submit(math.factorial, n) for n in (5, 6)]
        with pytest.raises(LaneFull) as full:
            lane.submit(math.factorial, 7)
        assert full.value.retry_after_s >= 1
        assert "(3 of 3 places taken)" in str(full.value)  # running, waiting and reserved alike
        wait_until(lane.worker_pids, 60.0, "a worker process")
        (pid,) = lane.worker_pids()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDied):
            running.future.result(timeout=30)
        assert [ticket.future.result(timeout=60) for ticket in queued] == [120, 720]
        (fresh,) = lane.worker_pids()
        assert fresh != pid
    finally:
        lane.close()


def _imported(module: str) -> bool:
    return module in sys.modules


def test_a_solver_process_imports_the_search_libraries_before_its_first_task(tmp_path: Path) -> None:
    """A search's time limit starts inside its task: OR-Tools' first import (0.5–1.2 s here) belongs to the worker's
    start, not to the first search (a render or check worker imports nothing it does not need)."""
    pool = SolverPool(Store(f"sqlite:///{tmp_path / 'preload.sqlite3'}"), workers=1)
    render = Lane("render", workers=1, max_queued=1)
    try:
        first = pool.solves.submit(_imported, "ortools.sat.python.cp_model").future.result(timeout=120)
        assert first and pool.jobs.submit(_imported, "pipesched.optimizer.solvers.milp").future.result(timeout=120)
        assert not render.submit(_imported, "ortools.sat.python.cp_model").future.result(timeout=120)
    finally:
        pool.shutdown()
        render.close()


def test_an_aborted_task_frees_its_worker_for_the_next() -> None:
    lane = Lane("test", workers=1, max_queued=1)
    try:
        runaway = lane.submit(time.sleep, 60.0)
        following = lane.submit(math.factorial, 4)
        wait_until(lane.worker_pids, 60.0, "a worker process")
        started = time.monotonic()
        assert lane.abort(runaway)
        with pytest.raises(WorkerDied):
            runaway.future.result(timeout=30)
        assert following.future.result(timeout=60) == 24
        assert time.monotonic() - started < 30.0
        assert not lane.abort(runaway)
    finally:
        lane.close()


def test_a_closed_lane_drops_its_queue_and_kills_its_workers() -> None:
    lane = Lane("test", workers=1, max_queued=1)
    running = lane.submit(time.sleep, 30.0)
    queued = lane.submit(math.factorial, 5)
    wait_until(lane.worker_pids, 60.0, "a worker process")
    (pid,) = lane.worker_pids()
    lane.close()
    assert queued.future.cancelled()
    with pytest.raises(Exception) as ended:
        running.future.result(timeout=30)
    assert "shut down" in str(ended.value)
    wait_until(lambda: not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text(), 10, "kill")


# --- over HTTP -----------------------------------------------------------------------------------


@pytest.fixture()
def settings(tmp_path: Path) -> Settings:
    return Settings(
        database_url=f"sqlite:///{tmp_path / 'limits.sqlite3'}",
        solver_workers=1,
        max_queued_jobs=2,
        max_time_limit_s=30.0,
        max_render_actions=100,
    )


@pytest.fixture()
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def test_a_flood_of_jobs_gets_429_and_a_synchronous_solve_still_answers(client: TestClient, settings: Settings) -> None:
    store = Store(settings.database_url)
    try:
        answers = [client.post("/v1/jobs", json=long_job(seed)) for seed in range(6)]
        codes = [answer.status_code for answer in answers]
        # one job runs, max_queued_jobs wait, the rest are refused (nothing stored for them)
        assert codes == [202, 202, 202, 429, 429, 429], codes
        refused = answers[3]
        assert int(refused.headers["Retry-After"]) >= 1
        assert "PIPESCHED_MAX_QUEUED_JOBS" in refused.json()["detail"]
        assert sum(store.count_jobs_by_status().values()) == 3
        # the synchronous solve has its own process: it answers while the job lane is full
        started = time.monotonic()
        solved = client.post("/v1/schedules", json=problem_body())
        assert solved.status_code == 200, solved.text
        assert time.monotonic() - started < 30.0
        for answer in answers[:3]:
            client.delete(f"/v1/jobs/{answer.json()['id']}")
    finally:
        store.dispose()


def test_a_killed_solver_fails_its_job_and_the_queued_one_still_runs(client: TestClient) -> None:
    running = client.post("/v1/jobs", json=long_job(0)).json()["id"]
    queued = client.post("/v1/jobs", json=problem_body("zb-h1")).json()["id"]
    wait_until(lambda: client.get(f"/v1/jobs/{running}").json()["status"] == "running", 60, "the job running")
    pool = client.app.state.services.pool  # type: ignore[attr-defined]
    (pid,) = pool.jobs.worker_pids()
    os.kill(pid, signal.SIGKILL)
    failed = wait_for_job(client, running)
    assert failed["status"] == "failed" and "died" in failed["error"]
    done = wait_for_job(client, queued)
    assert done["status"] == "done" and done["result"]["method"] == "zb-h1"
    assert pool.jobs.worker_pids() and pool.jobs.worker_pids() != [pid]


def test_drawings_over_the_cap_are_413_naming_the_cap_and_json(client: TestClient) -> None:
    small = client.post("/v1/schedules", json=problem_body(num_microbatches=4)).json()  # 4·4·2 = 32 actions
    large = client.post("/v1/schedules", json=problem_body(num_microbatches=16)).json()  # 128 actions
    schedule_of_60 = client.post(
        "/v1/schedules",
        json=uniform_problem(3, 10, p2p=0.1).with_changes(**{"solver.method": "1f1b"}).model_dump(mode="json"),
    ).json()
    assert client.get(f"/v1/schedules/{small['id']}?format=png").content.startswith(b"\x89PNG")
    assert client.get(f"/v1/schedules/{small['id']}/view?compare=gpipe").status_code == 200
    for url in (
        f"/v1/schedules/{large['id']}?format=png",
        f"/v1/schedules/{large['id']}?format=svg",
        f"/v1/schedules/{large['id']}/view",
        f"/v1/schedules/{schedule_of_60['id']}/view?compare=gpipe",  # 60 actions, the comparison counted as 60 more
    ):
        refused = client.get(url)
        assert refused.status_code == 413, (url, refused.text)
        assert "PIPESCHED_MAX_RENDER_ACTIONS" in refused.json()["detail"] and "format=json" in refused.json()["detail"]
    assert client.get(f"/v1/schedules/{large['id']}?format=json").status_code == 200
    unknown = client.get(f"/v1/schedules/{small['id']}/view?compare=nope")
    assert unknown.status_code == 422 and unknown.json()["detail"][0]["loc"] == ["query", "compare"]
    assert client.get("/v1/schedules/nope?format=png").status_code == 404


def test_a_full_render_queue_is_429(settings: Settings) -> None:
    with TestClient(create_app(settings.model_copy(update={"max_queued_renders": 0}))) as client:
        schedule = client.post("/v1/schedules", json=problem_body(num_microbatches=4)).json()
        renders = client.app.state.services.renders  # type: ignore[attr-defined]
        blocker = renders.submit(time.sleep, 5.0)
        refused = client.get(f"/v1/schedules/{schedule['id']}?format=png")
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
        assert "format=json" in refused.json()["detail"]
        blocker.future.result(timeout=60)
        assert client.get(f"/v1/schedules/{schedule['id']}?format=png").status_code == 200


def test_metric_labels_stay_bounded_under_random_methods(client: TestClient) -> None:
    for index in range(40):
        client.request(f"X{index}RANDOM", "/v1/jobs")
        client.get(f"/no/such/path/{index}")
    text = client.get("/metrics").text
    assert "RANDOM" not in text and "/no/such" not in text
    assert metric_value(text, "pipesched_http_requests_total", method="other", route="/v1/jobs", status="405") == 40
    assert metric_value(text, "pipesched_http_requests_total", method="GET", route="unmatched", status="404") == 40


def test_a_body_that_is_not_json_is_a_422_list_of_errors_with_the_reason(client: TestClient) -> None:
    for body in (b"\xff\xfe{", b'{"pipeline": '):
        response = client.post("/v1/schedules", content=body, headers={"content-type": "application/json"})
        assert response.status_code == 422, response.text
        (detail,) = response.json()["detail"]
        assert detail["loc"] == ["body"] and detail["msg"] and detail["type"]
    unreadable = client.post("/v1/jobs", content=b"\xff\xfe{", headers={"content-type": "application/json"})
    assert "UnicodeDecodeError" in unreadable.json()["detail"][0]["msg"]


def test_the_405_on_a_job_allows_get_and_delete(client: TestClient) -> None:
    response = client.put("/v1/jobs/abc")
    assert response.status_code == 405
    assert {method.strip() for method in response.headers["allow"].split(",")} == {"GET", "DELETE"}
    # /v1/schedules/check is its own route, not a /v1/schedules/{schedule_id}: POST only
    options = client.options("/v1/schedules/check")
    assert options.status_code == 405 and options.headers["allow"] == "POST"
    assert client.options("/v1/schedules/abc").headers["allow"] == "GET"


def test_the_check_route_documents_its_422_and_429(client: TestClient) -> None:
    responses = client.get("/openapi.json").json()["paths"]["/v1/schedules/check"]["post"]["responses"]
    assert {"422", "429", "503", "504"} <= set(responses)
    unreadable = client.post(
        "/v1/schedules/check", content=b'{"problem": ', headers={"content-type": "application/json"}
    )
    assert unreadable.status_code == 422 and unreadable.json()["detail"][0]["loc"] == ["body"]


def test_a_body_that_is_not_sent_as_json_is_told_so(client: TestClient) -> None:
    import json

    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        answer = client.post(
            "/v1/schedules", content=json.dumps(problem_body()), headers={"content-type": content_type}
        )
        assert answer.status_code == 422, answer.text
        (detail,) = answer.json()["detail"]
        assert content_type in detail["msg"] and "Content-Type: application/json" in detail["msg"]
        assert detail["type"] == "content_type"


def test_a_body_not_sent_as_json_is_told_what_the_route_takes(client: TestClient) -> None:
    # docs/CALIBRATION.md's `curl -X POST $URL/v1/profiles -d @my_h100.json` (curl's -d sends a form) was told to
    # "send the problem as a JSON object": every route's body was called the problem.
    body = '{"name": "mine"}'
    for route, what in (
        ("/v1/profiles", "the profile"),
        ("/v1/plans", "the plan request"),
        ("/v1/jobs", "the problem"),
    ):
        cases = (
            (body, "application/x-www-form-urlencoded"),
            (b"", "application/json"),
            (b'{"name": ', "application/json"),
        )
        for content, content_type in cases:  # sent as a form, no body, not JSON
            answer = client.post(route, content=content, headers={"content-type": content_type})
            assert answer.status_code == 422, answer.text
            (detail,) = answer.json()["detail"]
            assert f"send {what}" in detail["msg"] and "as a JSON object" in detail["msg"], (route, content, detail)
    check = client.post("/v1/schedules/check", content=b"", headers={"content-type": "application/json"})
    assert "send the problem and the schedule" in check.json()["detail"][0]["msg"], check.text


def test_a_plan_on_impossible_links_or_memory_is_a_422_naming_the_field(client: TestClient) -> None:
    """A 1e-300 B/s link (every estimate infinite: once answered as "0 plans, all over memory") and a GPU of 1 byte
    (once blamed on cluster.accelerator as "a GPU's -2 GiB") are refused at once, each naming its own field."""
    request = {
        "model": {"preset": "llama3.1-8b"},
        "cluster": {"accelerator": "H100-SXM", "num_nodes": 2, "gpus_per_node": 8},
        "training": {"global_batch_size": 16},
        "search": {"time_limit_s": 2},
    }
    for field, value in (("inter_node_bandwidth_bytes_per_s", 1e-300), ("memory_bytes", 1)):
        answer = client.post("/v1/plans", json={**request, "cluster": {**request["cluster"], field: value}})
        assert answer.status_code == 422, answer.text
        (detail,) = answer.json()["detail"]
        assert detail["loc"] == ["body", "cluster", field], detail
    assert "memory_headroom_bytes" in detail["msg"] and "-2" not in detail["msg"]


def test_an_unforeseen_error_is_a_json_500_naming_it(settings: Settings) -> None:
    app = create_app(settings)

    @app.get("/broken")
    def broken() -> None:
        raise RuntimeError("a bug")

    with TestClient(app, raise_server_exceptions=False) as client:
        answer = client.get("/broken")
    assert answer.status_code == 500 and answer.headers["content-type"] == "application/json"
    assert "RuntimeError" in answer.json()["detail"]


def test_database_errors_are_told_apart_from_bugs() -> None:
    """503 for what says the database cannot be reached now, through the wrappers a queue library adds."""
    import psycopg
    from sqlalchemy.exc import IntegrityError, OperationalError

    from pipesched.api.storage import DatabaseUnavailable, is_unreachable

    refused = psycopg.OperationalError("connection refused")
    assert is_unreachable(refused) and is_unreachable(OperationalError("SELECT 1", {}, refused))
    wrapped = RuntimeError("Database error.")
    wrapped.__cause__ = refused  # procrastinate's ConnectorException wraps the driver's error so
    assert is_unreachable(wrapped) and is_unreachable(DatabaseUnavailable("down"))
    assert not is_unreachable(IntegrityError("INSERT", {}, ValueError("duplicate key")))
    assert not is_unreachable(ValueError("a bug"))


def _large_check_body(num_microbatches: int) -> dict[str, Any]:
    """1F1B on 8 ranks as action strings: 2000 microbatches make 32,000 actions, 450 KiB of JSON."""
    from pipesched.optimizer.families import get_family
    from pipesched.optimizer.problem import Problem

    problem = uniform_problem(8, num_microbatches, p2p=0.1).with_changes(**{"solver.method": "1f1b"})
    orders = [[str(action) for action in row] for row in get_family("1f1b").generate(Problem.model_validate(problem))]
    return {"problem": problem.model_dump(mode="json"), "schedule": orders}


def test_parallel_large_checks_keep_healthz_fast_and_the_rest_get_429(tmp_path: Path) -> None:
    """8 parallel 450 KiB checks on a real `pipesched serve`: one check process and two waiting places take three
    of them (each read only once admitted, simulated in the check process), five get 429 with Retry-After, and
    /healthz answers within 2 s throughout (one probe of slack under the suite's load)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from tests.api.test_api_served import ServedApi

    body = _large_check_body(2000)
    server = ServedApi(f"sqlite:///{tmp_path / 'checks.sqlite3'}", tmp_path / "serve.log")

    def check(_: int) -> httpx.Response:
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            return client.post("/v1/schedules/check", json=body)

    try:
        # The check process starts on the first check (the fork server, the optimizer's import): one small check
        # first, so the probes time /healthz beside the eight checks, not beside a cold process start (the
        # process runs 8 checks before it is replaced: this one and the three admitted below share it).
        warm = server.client.post("/v1/schedules/check", json=_large_check_body(8))
        assert warm.status_code == 200 and warm.json()["valid"], warm.text[:500]
        probe = HealthProbe(server.base_url)
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(check, range(8)))
        health = probe.stop()
    finally:
        server.stop()
    codes = sorted(answer.status_code for answer in answers)
    assert codes == [200] * 3 + [429] * 5, [answer.text[:200] for answer in answers]
    assert all(answer.json()["valid"] for answer in answers if answer.status_code == 200)
    refused = next(answer for answer in answers if answer.status_code == 429)
    assert int(refused.headers["Retry-After"]) >= 1 and "PIPESCHED_MAX_QUEUED_CHECKS" in refused.json()["detail"]
    assert health and {code for code, _ in health} == {200}
    # Quiet, every probe answers in under 0.1 s. Under the suite's own load (4 workers on 2 cores, 8 client
    # threads, the check process) single probes took 1.7 and 2.7 s: the bound is the 2 s the service's 503s keep
    # (docs/SERVICE.md), with one probe of slack for the machine.
    slow = [seconds for _, seconds in health if seconds >= 2.0]
    assert len(slow) <= 1 and max(seconds for _, seconds in health) < 4.0, sorted(s for _, s in health)[-5:]


def _probe_health(base_url: str, ready: Any, stop: Any, answers: Any) -> None:
    import httpx

    measured: list[tuple[int, float]] = []
    with httpx.Client(base_url=base_url, timeout=30) as client:
        while not stop.is_set():
            started = time.monotonic()
            measured.append((client.get("/healthz").status_code, time.monotonic() - started))
            ready.set()
            stop.wait(0.1)
    answers.put(measured)


class HealthProbe:
    """GET /healthz every 0.1 s from a process of its own (so the time is the server's, not this process's threads'
    wait for the GIL) until :meth:`stop`, which returns ``[(status, seconds), …]``."""

    def __init__(self, base_url: str) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._ready, self._stop, self._answers = context.Event(), context.Event(), context.Queue()
        self._process = context.Process(
            target=_probe_health, args=(base_url, self._ready, self._stop, self._answers), daemon=True
        )
        self._process.start()
        assert self._ready.wait(60), "the /healthz probe did not start"

    def stop(self) -> list[tuple[int, float]]:
        self._stop.set()
        measured: list[tuple[int, float]] = self._answers.get(timeout=60)
        self._process.join(timeout=30)
        return measured


def test_the_api_token_guards_every_v1_route(tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'token.sqlite3'}", api_token="s3cret-0123456789abcdef")
    app = create_app(settings)
    with TestClient(app) as client:
        checked = 0
        for template, operations in client.get("/openapi.json").json()["paths"].items():
            if not template.startswith("/v1"):
                continue
            path = template.replace("{schedule_id}", "x").replace("{job_id}", "x")
            for method in operations:
                response = client.request(method.upper(), path, json=problem_body())
                assert response.status_code == 401, (method, path, response.status_code)
                checked += 1
        assert checked >= 6


def test_a_stored_schedule_that_does_not_read_back_is_a_failed_job_not_a_500(
    client: TestClient, settings: Settings
) -> None:
    problem = load_problem(problem_body())
    schedule = solve(problem)
    assert unstorable_reason(schedule) is None
    assert "makespan" in (unstorable_reason(schedule.model_copy(update={"makespan": math.inf})) or "")
    store = Store(settings.database_url)
    try:
        job = store.create_job(problem, problem_key(problem))
        assert store.start_job(job.id, 0)
        stored = store.finish_job(job.id, 0, problem_key(problem), schedule)
        assert stored is not None
        with store.transaction() as session:
            from pipesched.api.storage import ScheduleRow

            row = session.get(ScheduleRow, stored.id)
            assert row is not None
            row.schedule_json = row.schedule_json.replace(f'"makespan":{schedule.makespan}', '"makespan":"nan ms"')
        answer = client.get(f"/v1/jobs/{job.id}")
        assert answer.status_code == 200 and answer.json()["status"] == "failed"
        assert "cannot be read back" in answer.json()["error"]
        assert store.job(job.id) is not None and isinstance(store.job(job.id), JobRow)
    finally:
        store.dispose()


# --- pipesched serve on a public interface -------------------------------------------------------


def test_exposure_needs_a_token_or_the_explicit_opt_out() -> None:
    assert exposure_problem(Settings(host="127.0.0.1")) is None
    assert exposure_problem(Settings(host="::1")) is None
    assert exposure_problem(Settings(host="0.0.0.0", api_token="t" * 16)) is None
    assert exposure_problem(Settings(host="0.0.0.0", allow_no_token=True)) is None
    message = exposure_problem(Settings(host="0.0.0.0"))
    assert message and "PIPESCHED_API_TOKEN" in message and "PIPESCHED_ALLOW_NO_TOKEN=1" in message


def test_serve_refuses_a_short_token_at_start(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "pipesched"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "pipesched.api.cli"]
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIPESCHED_")} | {
        "PIPESCHED_DATABASE_URL": f"sqlite:///{tmp_path / 'short.sqlite3'}",
        "PIPESCHED_API_TOKEN": "x",
    }
    result = subprocess.run(
        [*command, "serve", "--port", str(free_port())], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stdout + result.stderr
    message = " ".join(result.stderr.split())
    assert "PIPESCHED_API_TOKEN" in message and "fewer than 16" in message and "'x'" not in message
    assert Settings(api_token="").api_token is None  # an empty variable is no token


def test_serve_refuses_a_public_interface_without_a_token(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "pipesched"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "pipesched.api.cli"]
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIPESCHED_")} | {
        "PIPESCHED_DATABASE_URL": f"sqlite:///{tmp_path / 'open.sqlite3'}"
    }
    result = subprocess.run(
        [*command, "serve", "--host", "0.0.0.0", "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "PIPESCHED_API_TOKEN" in result.stderr and "PIPESCHED_ALLOW_NO_TOKEN=1" in result.stderr


def test_a_synchronous_timeout_says_whether_it_waited_or_ran(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'timeout.sqlite3'}")
    pool = SolverPool(store, 1, sync_workers=1, max_queued_solves=1)
    try:
        hard = load_problem(long_job(0, time_limit_s=8.0))
        # The first solve holds the only synchronous process; the second waits behind it.
        with pytest.raises(SolveTimeout, match=r"the solver ran 2 s without answering \(time limit 8 s"):
            pool.solve(hard, timeout_s=2.0)
        with pytest.raises(SolveTimeout, match=r"waited .* behind 1 other synchronous solves and never started"):
            pool.solve(load_problem(problem_body()), timeout_s=1.0)
    finally:
        pool.shutdown()
        store.dispose()


def test_a_late_solve_worker_takes_its_start_out_of_the_search_not_out_of_the_answers_limit() -> None:
    """A request that waited 3.7 s of its 4 s limit for a worker (a cold process, a queue) gets a search of what
    is left of limit + SEARCH_GRACE_S (0.8 s), not the 4 s its problem says: the same problem searches its whole
    limit when it starts at once (the memory limit keeps it from proving optimality). The answer's own phases
    after the search are the size gate's to bound (Problem's check against limit + 2 s), timed elsewhere."""
    from pipesched.api.solving import SEARCH_GRACE_S, run_solve
    from pipesched.optimizer.result import Schedule
    from tests.optimizer.test_time_limits import _problem

    # A process's first search imports the exact backends (OR-Tools: 0.4 s idle, 1.2 s beside two busy loops on 2
    # cores); the cold start is what the 3.7 s waited stands for, not the search: a small solve imports them first.
    run_solve(_problem(2, 2, 1, "loop", None, tl=0.5).model_dump_json(), 2.0)
    problem = _problem(1024, 4, 1, "loop", 10.0, tl=4.0)
    schedule = Schedule.model_validate_json(run_solve(problem.model_dump_json(), 6.0, time.time() - 3.7))
    assert schedule.status in ("optimal", "feasible")
    assert schedule.solve_time_s is not None and schedule.solve_time_s <= 4.0 + SEARCH_GRACE_S - 3.7 + 1.0
