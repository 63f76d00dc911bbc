"""``pipesched.client`` against a real ``pipesched serve`` on loopback: typed answers, the CLI's schedule, typed
errors with the service's sentences, a flood that meets 429, retries of 503 with backoff and a limit."""

from __future__ import annotations

import asyncio
import http.server
import io
import json
import threading
import time
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar

import pytest
from typer.testing import CliRunner

from pipesched.api.cli import app
from pipesched.api.schemas import JobStatus, ScheduleAnswer
from pipesched.client import AsyncClient, Client, InvalidRequest, RetryPolicy, Unauthorized, Unavailable
from pipesched.optimizer.result import Schedule
from tests.api.test_api_served import ServedApi, problem_body

TOKEN = "a-token-for-the-flood-test"
PLAN_REQUEST = {
    "model": {"preset": "llama3.1-8b"},
    "cluster": {"accelerator": "H100-SXM", "num_nodes": 2, "gpus_per_node": 8},
    "training": {"global_batch_size": 32},
    "search": {"time_limit_s": 4, "pipeline_parallel": [2], "method": ["1f1b", "zb-h1"], "top": 2},
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedApi]:
    directory = tmp_path_factory.mktemp("client")
    server = ServedApi(f"sqlite:///{directory / 'db.sqlite3'}", directory / "server.log", PIPESCHED_SOLVER_WORKERS="2")
    yield server
    server.stop()


def test_solve_returns_the_schedule_the_cli_returns(served: ServedApi, tmp_path: Path) -> None:
    body = problem_body(8, "zb-h1")
    with Client(served.base_url) as client:
        answer = client.solve(body)
    assert isinstance(answer, ScheduleAnswer) and answer.status in ("optimal", "feasible")
    (tmp_path / "problem.json").write_text(json.dumps(body))
    result = CliRunner().invoke(app, ["solve", str(tmp_path / "problem.json"), "-o", str(tmp_path / "out.json")])
    assert result.exit_code == 0, result.output
    local = Schedule.model_validate_json((tmp_path / "out.json").read_text())
    assert answer.makespan == pytest.approx(local.makespan)
    assert [[a.action for a in rank.actions] for rank in answer.ranks] == [
        [a.action for a in rank.actions] for rank in local.ranks
    ]


def test_submit_wait_reports_progress_and_returns_the_job(served: ServedApi) -> None:
    seen: list[str] = []
    with Client(served.base_url, poll_s=0.1) as client:
        job_id = client.submit(problem_body(12, "auto", 1.0))
        done = client.wait(job_id, progress=lambda status: seen.append(status.status))
        assert isinstance(done, JobStatus) and done.status == "done" and done.result is not None
        assert seen[-1] == "done" and client.job(job_id).schedule_id == done.schedule_id
        orders = [[a.action for a in rank.actions if a.kind in ("F", "I", "W", "B")] for rank in done.result.ranks]
        verdict = client.check(problem_body(12, "auto", 1.0), orders)
        assert verdict.valid and verdict.makespan == pytest.approx(done.result.makespan)


def test_a_422_raises_invalid_request_with_the_services_field_and_sentence(served: ServedApi) -> None:
    body = problem_body()
    body["pipeline"]["num_ranks"] = 0
    with Client(served.base_url) as client, pytest.raises(InvalidRequest) as caught:
        client.solve(body)
    assert caught.value.status_code == 422
    assert any("num_ranks" in map(str, error["loc"]) for error in caught.value.errors)
    assert "num_ranks" in str(caught.value)


def test_plan_then_launch_files_as_json_and_zip(served: ServedApi) -> None:
    with Client(served.base_url, poll_s=0.2) as client:
        plans = client.plan(PLAN_REQUEST)
        assert plans.status == "done" and plans.plans and plans.request is not None
        files = client.launch(plans.id or "", scheduler="kubernetes")
    assert files.scheduler_file == "job.yaml"
    assert set(files.files) == {"schedule.csv", "torchtitan.args", "job.yaml"}
    assert "nvidia.com/gpu" in files.files["job.yaml"]
    stored_csv = served.client.get(f"/v1/schedules/{plans.plans[0].schedule_id}", params={"format": "csv"}).text
    assert files.files["schedule.csv"] == stored_csv  # the stored schedule, not a new one
    archive = served.client.get(f"/v1/plans/{plans.id}/launch", params={"scheduler": "slurm", "format": "zip"})
    assert archive.status_code == 200 and archive.headers["content-type"] == "application/zip"
    with zipfile.ZipFile(io.BytesIO(archive.content)) as opened:
        assert set(opened.namelist()) == {"schedule.csv", "torchtitan.args", "job.sbatch"}
        assert opened.getinfo("job.sbatch").external_attr >> 16 == 0o755
    bad = served.client.get(f"/v1/plans/{plans.id}/launch", params={"plan": 7})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["query", "plan"]
    assert served.client.get("/v1/plans/nope/launch").status_code == 404


def test_async_client_solves(served: ServedApi) -> None:
    async def solve() -> ScheduleAnswer:
        async with AsyncClient(served.base_url) as client:
            return await client.solve(problem_body(6, "1f1b"))

    assert asyncio.run(solve()).method == "1f1b"


def test_a_flood_meets_429_and_every_job_lands_after_retry_after(tmp_path: Path) -> None:
    server = ServedApi(
        f"sqlite:///{tmp_path / 'db.sqlite3'}",
        tmp_path / "server.log",
        PIPESCHED_SOLVER_WORKERS="1",
        PIPESCHED_MAX_QUEUED_JOBS="0",
        PIPESCHED_API_TOKEN=TOKEN,
    )
    try:
        with Client(server.base_url) as anonymous, pytest.raises(Unauthorized):
            anonymous.submit(problem_body())
        with Client(server.base_url, token=TOKEN, retry=RetryPolicy(max_retries=30), poll_s=0.1) as client:
            with ThreadPoolExecutor(4) as pool:
                ids = list(pool.map(client.submit, [problem_body(m, "auto", 1.0) for m in range(20, 24)]))
            assert len(set(ids)) == 4 and client.retries[429] > 0
            assert all(client.wait(job_id).status == "done" for job_id in ids)
    finally:
        server.stop()


class Flaky(http.server.BaseHTTPRequestHandler):
    """Answers 503 to the first ``failures`` requests, then the contract's /healthz-like JSON."""

    failures: ClassVar[int] = 0
    seen: ClassVar[list[float]] = []

    def do_GET(self) -> None:
        Flaky.seen.append(time.monotonic())
        if len(Flaky.seen) <= Flaky.failures:
            self.send_response(503)
            body = b'{"detail": "the database cannot be reached"}'
        else:
            self.send_response(200)
            body = json.dumps({"id": "j1", "status": "queued"}).encode()
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize(("failures", "succeeds"), [(2, True), (4, False)])
def test_503_is_retried_with_backoff_up_to_the_limit(failures: int, succeeds: bool) -> None:
    Flaky.failures, Flaky.seen = failures, []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = Client(f"http://127.0.0.1:{server.server_address[1]}", retry=RetryPolicy(max_retries=3, backoff_s=0.1))
        if succeeds:
            assert client.request("GET", "/v1/jobs/j1").json()["id"] == "j1"
        else:
            with pytest.raises(Unavailable, match="database cannot be reached"):
                client.request("GET", "/v1/jobs/j1")
        gaps = [later - earlier for earlier, later in zip(Flaky.seen, Flaky.seen[1:], strict=False)]
        assert len(Flaky.seen) == min(failures + 1, 4)  # the limit: 3 retries
        assert gaps[0] >= 0.09 and gaps[1] >= 0.19  # 0.1 s, then doubled
    finally:
        server.shutdown()
