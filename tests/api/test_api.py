"""The HTTP service in-process: httpx against the ASGI app (its lifespan runs the real solver pool)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pipesched.api.app import create_app
from pipesched.api.jobs import make_stop_check
from pipesched.api.settings import Settings
from pipesched.api.storage import Store, problem_key
from pipesched.optimizer.cost.profile import default_profile
from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.export import orders_to_torch_csv
from pipesched.optimizer.families import registry
from pipesched.optimizer.solve import solve
from tests.conftest import paper_problem, paper_settings, uniform_problem

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # starlette on its httpx TestClient

MAX_TIME_LIMIT_S = 3.0


def problem_body(method: str = "1f1b", time_limit_s: float = 2.0, **changes: Any) -> dict[str, Any]:
    """A 4-rank, 8-microbatch problem as a request body."""
    problem = uniform_problem(4, 8, p2p=0.1).with_changes(
        **{"solver.method": method, "solver.time_limit_s": time_limit_s, **changes}
    )
    return problem.model_dump(mode="json")


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus text exposition (0 when absent)."""
    wanted = ",".join(f'{key}="{value}"' for key, value in labels.items())
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head == (f"{name}{{{wanted}}}" if labels else name):
            return float(value)
    return 0.0


def wait_for_job(client: TestClient, job_id: str, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = client.get(f"/v1/jobs/{job_id}").json()
        if body["status"] in ("done", "failed", "cancelled"):
            return body
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish in {timeout_s} s")


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    path = tmp_path_factory.mktemp("api") / "pipesched.api.sqlite3"
    return Settings(
        database_url=f"sqlite:///{path}", solver_workers=2, max_time_limit_s=MAX_TIME_LIMIT_S, max_body_bytes=20_000
    )


@pytest.fixture(scope="module")
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def test_solve_answers_the_solvers_schedule_then_the_stored_one(client: TestClient) -> None:
    body = problem_body("1f1b")
    first = client.post("/v1/schedules", json=body)
    assert first.status_code == 200, first.text
    assert first.headers["X-Pipesched-Cache"] == "miss"
    answer = first.json()
    expected = solve(load_problem(body))
    assert answer["id"] and answer["cache"] == "miss"
    assert answer["status"] == expected.status
    assert answer["makespan"] == pytest.approx(expected.makespan)
    assert [r["actions"] for r in answer["ranks"]] == [[a.model_dump() for a in r.actions] for r in expected.ranks]

    before = client.get("/metrics").text
    again = client.post("/v1/schedules", json=body)
    assert again.status_code == 200
    assert again.headers["X-Pipesched-Cache"] == "hit"
    assert again.json()["cache"] == "hit"
    assert again.json()["id"] == answer["id"]
    after = client.get("/metrics").text
    hits = metric_value(after, "pipesched_cache_lookups_total", result="hit")
    assert hits == metric_value(before, "pipesched_cache_lookups_total", result="hit") + 1
    assert metric_value(after, "pipesched_solve_seconds_count", method="1f1b", mode="sync") >= 1


def test_the_cache_key_holds_the_method_and_the_time_limit(client: TestClient) -> None:
    first = client.post("/v1/schedules", json=problem_body("gpipe", time_limit_s=1.0)).json()
    other_limit = client.post("/v1/schedules", json=problem_body("gpipe", time_limit_s=1.5))
    other_method = client.post("/v1/schedules", json=problem_body("1f1b", time_limit_s=1.0))
    assert other_limit.headers["X-Pipesched-Cache"] == "miss"
    assert other_limit.json()["id"] != first["id"]
    assert other_method.json()["id"] != first["id"]
    assert other_method.json()["method"] == "1f1b" and first["method"] == "gpipe"
    assert max(other_method.json()["peak_memory"]) < max(first["peak_memory"])


def test_the_time_limit_is_clamped_to_the_service_maximum(client: TestClient) -> None:
    answer = client.post("/v1/schedules", json=problem_body("1f1b", time_limit_s=600.0))
    assert answer.status_code == 200
    assert answer.json()["problem"]["solver"]["time_limit_s"] == MAX_TIME_LIMIT_S
    clamped = client.post("/v1/schedules", json=problem_body("1f1b", time_limit_s=MAX_TIME_LIMIT_S))
    assert clamped.headers["X-Pipesched-Cache"] == "hit"
    assert clamped.json()["id"] == answer.json()["id"]


def test_formats_of_a_stored_schedule(client: TestClient) -> None:
    body = problem_body("1f1b")
    answer = client.post("/v1/schedules", json=body).json()
    schedule_id = answer["id"]
    as_json = client.get(f"/v1/schedules/{schedule_id}")
    assert as_json.status_code == 200 and as_json.json() == {k: v for k, v in answer.items() if k != "cache"}
    as_csv = client.get(f"/v1/schedules/{schedule_id}", params={"format": "csv"})
    assert as_csv.status_code == 200 and as_csv.headers["content-type"].startswith("text/csv")
    assert as_csv.text == orders_to_torch_csv(solve(load_problem(body)).orders())
    bad = client.get(f"/v1/schedules/{schedule_id}", params={"format": "xlsx"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["query", "format"]


@pytest.mark.parametrize(
    ("output_format", "media", "signature"),
    [
        ("chrome-trace", "application/json", b'"traceEvents"'),
        ("png", "image/png", b"\x89PNG\r\n\x1a\n"),
        ("svg", "image/svg+xml", b"<svg"),
    ],
    ids=["chrome-trace", "png", "svg"],
)
def test_rendered_formats(client: TestClient, output_format: str, media: str, signature: bytes) -> None:
    schedule_id = client.post("/v1/schedules", json=problem_body("1f1b")).json()["id"]
    response = client.get(f"/v1/schedules/{schedule_id}", params={"format": output_format})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith(media)
    assert len(response.content) > 100
    assert signature in response.content[:4000]


def test_view_with_a_comparison(client: TestClient) -> None:
    schedule_id = client.post("/v1/schedules", json=problem_body("1f1b")).json()["id"]
    page = client.get(f"/v1/schedules/{schedule_id}/view", params={"compare": "gpipe"})
    assert page.status_code == 200, page.text
    assert page.headers["content-type"].startswith("text/html")
    assert page.text.count("<svg") >= 2  # the schedule and gpipe's beside it
    unknown = client.get(f"/v1/schedules/{schedule_id}/view", params={"compare": "no-such-family"})
    assert unknown.status_code == 422 and unknown.json()["detail"][0]["loc"] == ["query", "compare"]


def test_a_model_and_cluster_request_answers_the_derived_costs_memory_and_partition(client: TestClient) -> None:
    model = {
        "num_layers": 10,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "seq_length": 512,
        "vocab_size": 32000,
        "micro_batch_size": 2,
    }
    cluster = {"accelerator": "H100-SXM", "p2p_bandwidth_bytes_per_s": 50e9, "p2p_latency_ms": 0.01}
    body = {
        "pipeline": {"num_ranks": 4, "num_microbatches": 8},
        "model": model,
        "cluster": cluster,
        "solver": {"method": "1f1b", "time_limit_s": 2.0},
    }
    response = client.post("/v1/schedules", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    solved = answer["problem"]
    derived = load_problem(body)
    assert derived.costs is not None and derived.memory is not None and derived.model is not None
    assert solved["costs"] == derived.costs.model_dump(mode="json")
    assert solved["memory"] == derived.memory.model_dump(mode="json")
    layers_per_stage = solved["model"]["layers_per_stage"]
    assert layers_per_stage == derived.model.layers_per_stage
    assert len(layers_per_stage) == 4 and sum(layers_per_stage) == model["num_layers"]
    assert all(count >= 1 for count in layers_per_stage)
    # Per-stage times, positive; the limit is the H100's 80 GiB less its profile's default headroom.
    assert len(solved["costs"]["forward"]) == 4 and min(solved["costs"]["forward"]) > 0
    headroom = default_profile("H100-SXM").headroom_bytes(80 * 1024**3)
    assert 0 < headroom < 8 * 1024**3
    assert solved["memory"]["limit"] == pytest.approx(80 * 1024**3 - headroom)
    assert answer["status"] in ("optimal", "feasible") and answer["makespan"] > 0
    # The problem as answered solves again to the same stored schedule (model/cluster kept as documentation).
    again = client.post("/v1/schedules", json=solved)
    assert again.headers["X-Pipesched-Cache"] == "hit" and again.json()["id"] == answer["id"]

    bad = {**body, "model": {**model, "num_attention_heads": 24}}  # 1024 / 24 is not a whole head size
    for path in ("/v1/schedules", "/v1/jobs"):
        rejected = client.post(path, json=bad)
        assert rejected.status_code == 422, rejected.text
        (detail,) = rejected.json()["detail"]
        assert detail["loc"] == ["body", "model", "num_attention_heads"]
        assert "do not divide hidden_size 1024" in detail["msg"]


def test_unknown_ids_are_404(client: TestClient) -> None:
    for path in ("/v1/schedules/nope", "/v1/schedules/nope/view", "/v1/jobs/nope"):
        response = client.get(path)
        assert response.status_code == 404, path
        assert "nope" in response.json()["detail"]
    assert client.delete("/v1/jobs/nope").status_code == 404


def test_an_infeasible_problem_is_an_answer_with_its_reason(client: TestClient) -> None:
    body = problem_body("gpipe", **{"memory.limit": 300.0})
    response = client.post("/v1/schedules", json=body)
    assert response.status_code == 200
    answer = response.json()
    assert answer["status"] == "infeasible" and answer["ranks"] == []
    assert "limit" in answer["reason"]
    csv = client.get(f"/v1/schedules/{answer['id']}", params={"format": "csv"})
    assert csv.status_code == 409 and "infeasible" in csv.json()["detail"]


def test_a_family_outside_its_domain_is_422_on_solver_method(client: TestClient) -> None:
    body = problem_body("1f1b", **{"pipeline.stages_per_rank": 2})
    for path in ("/v1/schedules", "/v1/jobs"):
        response = client.post(path, json=body)
        assert response.status_code == 422, response.text
        (detail,) = response.json()["detail"]
        assert detail["loc"] == ["body", "solver", "method"]
        assert "1f1b" in detail["msg"] and "auto" in detail["msg"]


def test_bad_input_names_the_field(client: TestClient) -> None:
    body = problem_body()
    body["pipeline"]["placement"] = [0, 1, 2]
    response = client.post("/v1/schedules", json=body)
    assert response.status_code == 422
    (detail,) = response.json()["detail"]
    assert detail == {"loc": ["body", "pipeline", "placement"], "msg": detail["msg"], "type": "value_error"}
    assert "expected 4 entries" in detail["msg"]

    missing = client.post("/v1/schedules", json={"pipeline": {"num_ranks": 2, "num_microbatches": 2}})
    assert missing.status_code == 422
    assert missing.json()["detail"][0]["loc"] == ["body", "costs"]
    assert "model and cluster" in missing.json()["detail"][0]["msg"]

    negative = problem_body()
    negative["pipeline"]["num_ranks"] = 0
    assert client.post("/v1/jobs", json=negative).json()["detail"][0]["loc"] == ["body", "pipeline", "num_ranks"]


def test_malformed_json_and_empty_body(client: TestClient) -> None:
    response = client.post("/v1/schedules", content=b'{"pipeline": ', headers={"content-type": "application/json"})
    assert response.status_code == 422
    assert "not valid JSON" in response.json()["detail"][0]["msg"]
    empty = client.post("/v1/jobs")
    assert empty.status_code == 422 and empty.json()["detail"][0]["loc"] == ["body"]


def test_a_body_over_the_limit_is_413(client: TestClient, settings: Settings) -> None:
    body = problem_body()
    body["costs"]["forward"] = [1.0] * 4
    padded = b'{"pad": "' + b"x" * settings.max_body_bytes + b'"}'
    response = client.post("/v1/schedules", content=padded, headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert str(settings.max_body_bytes) in response.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is counted while reading
        for _ in range(settings.max_body_bytes // 1000 + 2):
            yield b" " * 1000

    streamed = client.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413


def test_a_problem_over_the_size_limit_is_422(client: TestClient, settings: Settings) -> None:
    body = problem_body()
    body["pipeline"]["num_microbatches"] = settings.max_actions  # × 4 stages × 3 actions
    response = client.post("/v1/schedules", json=body)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "pipeline", "num_microbatches"]


def test_a_job_reports_progress_and_its_schedule(client: TestClient) -> None:
    body = problem_body("auto", time_limit_s=1.0, **{"pipeline.num_microbatches": 12})
    created = client.post("/v1/jobs", json=body)
    assert created.status_code == 202
    assert created.headers["Location"] == f"/v1/jobs/{created.json()['id']}"
    job = wait_for_job(client, created.json()["id"])
    assert job["status"] == "done", job
    result = job["result"]
    assert result["id"] == job["schedule_id"]
    assert result["status"] in ("optimal", "feasible")
    assert job["progress"]["best_objective"] == pytest.approx(result["makespan"])
    assert job["progress"]["lower_bound"] is not None and job["progress"]["lower_bound"] <= result["makespan"]
    stored = client.get(f"/v1/schedules/{job['schedule_id']}")
    assert stored.status_code == 200 and stored.json()["makespan"] == result["makespan"]

    # The same problem again: a job that is done at once, from the store.
    again = client.post("/v1/jobs", json=body)
    assert again.headers["X-Pipesched-Cache"] == "hit"
    assert again.json()["status"] == "done"
    assert client.get(f"/v1/jobs/{again.json()['id']}").json()["schedule_id"] == job["schedule_id"]


def test_a_burst_of_jobs_queues_and_a_cancelled_one_stores_nothing(client: TestClient, settings: Settings) -> None:
    store = Store(settings.database_url)
    schedules_before = store.count_schedules()
    ids = []
    # Six distinct problems on two workers, each searching its whole time limit (the paper's 1.5B setting
    # at 1.2 × p·activation, whose lower bound the search cannot meet): the last waits in the queue.
    setting = paper_settings()[0]
    for seed in range(6):
        problem = paper_problem(
            setting,
            **{
                "memory.limit": 1.2 * setting["num_ranks"] * setting["activation"],
                "solver.time_limit_s": 0.5,
                "solver.seed": seed,
            },
        )
        ids.append(client.post("/v1/jobs", json=problem.model_dump(mode="json")).json()["id"])
    cancelled = client.delete(f"/v1/jobs/{ids[-1]}")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    finished = [wait_for_job(client, job_id) for job_id in ids[:-1]]
    assert [job["status"] for job in finished] == ["done"] * 5
    last = client.get(f"/v1/jobs/{ids[-1]}").json()
    assert last["status"] == "cancelled" and last["schedule_id"] is None and last["result"] is None
    assert store.count_schedules() == schedules_before + 5
    # Cancelling a finished job leaves it as it is.
    assert client.delete(f"/v1/jobs/{ids[0]}").json()["status"] == "done"
    metrics = client.get("/metrics").text
    assert metric_value(metrics, "pipesched_jobs", status="cancelled") >= 1
    assert metric_value(metrics, "pipesched_jobs", status="done") >= 5
    store.dispose()


def test_cancelling_a_running_job_stops_its_search_and_stores_nothing(tmp_path: Path) -> None:
    # The paper's 1.5B setting at 1.2 × p·activation: the search keeps improving for its whole 30 s without
    # meeting its lower bound, so the worker is still busy long after the DELETE unless the cancellation stops it.
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'cancel.sqlite3'}", solver_workers=1, max_time_limit_s=30.0
    )
    setting = paper_settings()[0]
    problem = paper_problem(
        setting,
        **{"memory.limit": 1.2 * setting["num_ranks"] * setting["activation"], "solver.time_limit_s": 30.0},
    )
    store = Store(settings.database_url)
    try:
        with TestClient(create_app(settings)) as client:
            job_id = client.post("/v1/jobs", json=problem.model_dump(mode="json")).json()["id"]
            deadline = time.monotonic() + 30.0  # a worker process's start-up included
            job = client.get(f"/v1/jobs/{job_id}").json()
            while job["status"] != "running":
                assert job["status"] == "queued", job
                assert time.monotonic() < deadline, f"job not running within 30 s: {job}"
                time.sleep(0.05)
                job = client.get(f"/v1/jobs/{job_id}").json()
            # The search's first schedules come within a second; its progress shows them while it keeps going.
            deadline = time.monotonic() + 5.0
            while job["progress"]["best_objective"] is None:
                assert job["status"] == "running", job
                assert time.monotonic() < deadline, f"no best objective reported 5 s into the search: {job}"
                time.sleep(0.05)
                job = client.get(f"/v1/jobs/{job_id}").json()
            # Elapsed keeps counting while the search finds nothing new.
            while job["progress"]["elapsed_s"] < 0.5:
                assert job["status"] == "running", job
                assert time.monotonic() < deadline, f"elapsed_s not counting: {job}"
                time.sleep(0.05)
                job = client.get(f"/v1/jobs/{job_id}").json()
            assert job["status"] == "running", job
            progress = job["progress"]
            assert 0 < progress["lower_bound"] <= progress["best_objective"]
            assert progress["elapsed_s"] < 30.0
            assert job["schedule_id"] is None and job["result"] is None

            cancelled_at = time.monotonic()
            cancelled = client.delete(f"/v1/jobs/{job_id}")
            assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
            # The worker ends its search within a few polls, not at the 30 s limit.
            while client.get("/healthz").json()["jobs_in_flight"]:
                assert time.monotonic() - cancelled_at < 10.0, "the search kept running after the cancellation"
                time.sleep(0.05)
            job = client.get(f"/v1/jobs/{job_id}").json()
            assert job["status"] == "cancelled" and job["schedule_id"] is None and job["result"] is None
        assert store.count_schedules() == 0
        assert store.schedule_by_hash(problem_key(problem)) is None
    finally:
        store.dispose()


def test_should_stop_sees_a_cancellation_and_the_deadline(settings: Settings) -> None:
    store = Store(settings.database_url)
    problem = load_problem(problem_body("auto"))
    job = store.create_job(problem, problem_key(problem) + "-stop-check")
    assert store.start_job(job.id, 0)
    should_stop = make_stop_check(store, job.id, 0, time.monotonic() + 60)
    assert not should_stop()
    store.cancel_job(job.id)
    time.sleep(0.3)
    assert should_stop()
    assert store.finish_job(job.id, 0, "unused-key", solve(problem)) is None  # nothing stored for it
    assert store.schedule_by_hash("unused-key") is None
    assert make_stop_check(store, "other", 0, time.monotonic() - 1)()
    store.dispose()


def test_jobs_left_running_are_requeued_or_failed_at_startup(tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'restart.sqlite3'}", solver_workers=1, max_job_attempts=2)
    store = Store(settings.database_url)
    problem = load_problem(problem_body("1f1b"))
    interrupted = store.create_job(problem, problem_key(problem))
    assert store.start_job(interrupted.id, 0)  # a previous run died while solving it
    other = load_problem(problem_body("gpipe"))
    exhausted = store.create_job(other, problem_key(other))
    with store.transaction() as session:
        row = session.get(type(exhausted), exhausted.id)
        assert row is not None
        row.attempt = 2  # it lived through max_job_attempts restarts already
    with TestClient(create_app(settings)) as client:
        job = wait_for_job(client, interrupted.id)
        assert job["status"] == "done" and job["attempt"] == 1
        failed = client.get(f"/v1/jobs/{exhausted.id}").json()
        assert failed["status"] == "failed" and "restarted" in failed["error"]
    store.dispose()


def test_methods_list_the_registry_and_auto(client: TestClient) -> None:
    response = client.get("/v1/methods")
    assert response.status_code == 200
    methods = response.json()["methods"]
    assert [m["name"] for m in methods] == [*registry(), "auto"]
    assert all(m["domain"] and m["description"] for m in methods)


def test_health_and_metrics(client: TestClient) -> None:
    health = client.get("/healthz")
    assert health.status_code == 200 and health.json()["database"] == "ok"
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    requests = metric_value(metrics.text, "pipesched_http_requests_total", method="GET", route="/healthz", status="200")
    assert requests >= 1
    assert 'route="/v1/schedules/{schedule_id}"' in metrics.text  # templates, not raw ids


def test_the_api_token_guards_v1(tmp_path: Path) -> None:
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'token.sqlite3'}", solver_workers=1, api_token="s3cret-0123456789abcdef"
    )
    app: FastAPI = create_app(settings)
    with TestClient(app) as client:
        assert client.get("/v1/methods").status_code == 401
        wrong = client.get("/v1/methods", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.headers["WWW-Authenticate"] == "Bearer"
        assert client.post("/v1/jobs", json=problem_body()).status_code == 401
        assert client.get("/v1/methods", headers={"Authorization": "Bearer s3cret-0123456789abcdef"}).status_code == 200
        assert client.get("/healthz").status_code == 200


def test_the_openapi_schema_documents_errors_with_stable_operation_ids(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    operations = {
        op["operationId"]: op for path in schema["paths"].values() for op in path.values() if "operationId" in op
    }
    assert set(operations) == {
        "solve_schedule",
        "check_schedule",
        "get_schedule",
        "view_schedule",
        "create_job",
        "get_job",
        "cancel_job",
        "create_plan",
        "get_plan",
        "cancel_plan",
        "get_plan_launch",
        "list_profiles",
        "register_profile",
        "list_methods",
        "health",
        "metrics",
    }
    assert {"413", "422"} <= set(operations["solve_schedule"]["responses"])
    assert "400" not in operations["solve_schedule"]["responses"]  # bad input is a 422 (contract)
    assert "404" in operations["get_job"]["responses"]


def test_a_write_that_fails_midway_leaves_nothing_half_stored(settings: Settings) -> None:
    """The database refuses the second statement of finish_job (the job's UPDATE after the schedule's
    INSERT): the schedule row is rolled back with it, the job stays running, and a later finish stores both."""
    from sqlalchemy import event
    from sqlalchemy.exc import OperationalError

    store = Store(settings.database_url)
    problem = load_problem(problem_body("1f1b"))
    key = problem_key(problem) + "-half-stored"
    job = store.create_job(problem, key)
    assert store.start_job(job.id, 0)
    schedule = solve(problem)

    seen: list[str] = []

    def refuse_job_update(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        seen.append(" ".join(statement.split()[:3]).upper())
        if statement.lstrip().upper().startswith("UPDATE JOBS"):
            raise OperationalError(statement, parameters, Exception("disk I/O error (injected)"))

    event.listen(store.engine, "before_cursor_execute", refuse_job_update)
    try:
        with pytest.raises(OperationalError, match="injected"):
            store.finish_job(job.id, 0, key, schedule)
    finally:
        event.remove(store.engine, "before_cursor_execute", refuse_job_update)
    assert "INSERT INTO SCHEDULES" in seen and seen[-1] == "UPDATE JOBS SET"  # the schedule was written first
    assert store.schedule_by_hash(key) is None
    assert store.job_status(job.id) == "running"
    stored = store.finish_job(job.id, 0, key, schedule)
    assert stored is not None and store.schedule_by_hash(key) is not None
    assert store.job_status(job.id) == "done"
    store.dispose()
