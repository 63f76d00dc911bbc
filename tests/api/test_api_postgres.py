"""The service on PostgreSQL: storage, the cache, jobs and restart recovery.

Uses ``PIPESCHED_TEST_POSTGRES_URL`` when set (CI: ``source .ci/postgres.sh``); otherwise starts a
throwaway server with ``.ci/postgres.sh`` when PostgreSQL's binaries are installed; else skips.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from pipesched.api.app import create_app
from pipesched.api.settings import Settings
from pipesched.api.storage import Base, Store, problem_key
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.solve import solve
from tests.api.test_api_served import free_port, problem_body, wait_for_jobs

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # starlette on its httpx TestClient

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / ".ci" / "postgres.sh"


def _postgres_binaries() -> bool:
    return bool(list(Path("/usr/lib/postgresql").glob("*/bin/initdb"))) or shutil.which("initdb") is not None


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    url = os.environ.get("PIPESCHED_TEST_POSTGRES_URL")
    if url:
        yield url
        return
    if not _postgres_binaries():
        pytest.skip("no PostgreSQL: set PIPESCHED_TEST_POSTGRES_URL or `source .ci/postgres.sh` (installs it)")
    # Directly under the temp dir: the server's user must reach it (pytest's own tmp dirs are private to root).
    directory = tempfile.mkdtemp(prefix="pipesched-pg-")
    env = {
        **os.environ,
        "PIPESCHED_PG_DIR": directory,
        "PIPESCHED_PG_PORT": str(free_port()),
    }
    started = subprocess.run(
        ["bash", "-c", f'source "{SCRIPT}" && echo "$PIPESCHED_TEST_POSTGRES_URL"'],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if started.returncode != 0:
        shutil.rmtree(directory, ignore_errors=True)
        pytest.skip(f"could not start PostgreSQL with .ci/postgres.sh: {started.stderr.strip()[-500:]}")
    try:
        yield started.stdout.strip().splitlines()[-1]
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, timeout=60)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def clean_url(postgres_url: str) -> str:
    """The database with the service's tables dropped (each test starts empty)."""
    engine = create_engine(postgres_url)
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except Exception as error:
        pytest.skip(f"PostgreSQL at PIPESCHED_TEST_POSTGRES_URL is not reachable: {error}")
    Base.metadata.drop_all(engine)
    engine.dispose()
    return postgres_url


def test_store_keeps_one_schedule_per_problem(clean_url: str) -> None:
    store = Store(clean_url)
    problem = Problem.model_validate(problem_body(8, "1f1b"))
    key = problem_key(problem)
    schedule = solve(problem)
    first, created = store.put_schedule(key, schedule)
    second, created_again = store.put_schedule(key, schedule)  # the unique key refuses a duplicate
    assert created and not created_again
    assert second.id == first.id and store.count_schedules() == 1
    assert store.schedule(first.id) == first
    store.dispose()


def test_a_cancelled_job_rolls_back_its_schedule(clean_url: str) -> None:
    store = Store(clean_url)
    problem = Problem.model_validate(problem_body(8, "gpipe"))
    job = store.create_job(problem, problem_key(problem))
    assert store.start_job(job.id, 0)
    store.cancel_job(job.id)
    assert store.finish_job(job.id, 0, problem_key(problem), solve(problem)) is None
    assert store.count_schedules() == 0
    assert store.job_status(job.id) == "cancelled"
    store.dispose()


def test_the_service_on_postgres(clean_url: str) -> None:
    settings = Settings(database_url=clean_url, solver_workers=2, max_time_limit_s=2.0)
    with TestClient(create_app(settings)) as client:
        assert client.get("/healthz").json()["database"] == "ok"
        first = client.post("/v1/schedules", json=problem_body(8, "1f1b"))
        assert first.status_code == 200 and first.headers["X-Pipesched-Cache"] == "miss"
        again = client.post("/v1/schedules", json=problem_body(8, "1f1b"))
        assert again.headers["X-Pipesched-Cache"] == "hit" and again.json()["id"] == first.json()["id"]
        ids = [client.post("/v1/jobs", json=problem_body(m, "auto", 1.0)).json()["id"] for m in (9, 10, 11, 12)]
        jobs = wait_for_jobs(client, ids)  # type: ignore[arg-type]
        assert [job["status"] for job in jobs] == ["done"] * 4
        metrics = client.get("/metrics").text
        assert 'pipesched_jobs{status="done"} 4.0' in metrics


def test_restart_recovery_on_postgres(clean_url: str) -> None:
    store = Store(clean_url)
    problem = Problem.model_validate(problem_body(8, "1f1b"))
    job = store.create_job(problem, problem_key(problem))
    assert store.start_job(job.id, 0)  # left running by a previous run
    settings = Settings(database_url=clean_url, solver_workers=1)
    with TestClient(create_app(settings)) as client:
        deadline = time.monotonic() + 60
        while client.get(f"/v1/jobs/{job.id}").json()["status"] != "done":
            assert time.monotonic() < deadline, client.get(f"/v1/jobs/{job.id}").json()
            time.sleep(0.05)
        assert client.get(f"/v1/jobs/{job.id}").json()["attempt"] == 1
    store.dispose()


def test_pipesched_serve_on_postgres_by_environment(clean_url: str, tmp_path: Path) -> None:
    """A real `pipesched serve` given PIPESCHED_DATABASE_URL stores in PostgreSQL: a solve answered over
    HTTP is in the database, and asking again is a cache hit."""
    from tests.api.test_api_served import ServedApi

    server = ServedApi(clean_url, tmp_path / "server.log", PIPESCHED_SOLVER_WORKERS="1")
    try:
        first = server.client.post("/v1/schedules", json=problem_body(7, "zb-h1"))
        assert first.status_code == 200, first.text
        again = server.client.post("/v1/schedules", json=problem_body(7, "zb-h1"))
        assert again.status_code == 200 and again.json()["cache"] == "hit"
        assert again.json()["id"] == first.json()["id"]
    finally:
        server.stop()
    store = Store(clean_url)
    try:
        stored = store.schedule(first.json()["id"])
        assert stored is not None and stored.method == "zb-h1"
    finally:
        store.dispose()


def test_stores_opened_together_create_the_tables_once(clean_url: str) -> None:
    """Front ends and workers starting together on an empty database: each creates the tables it lacks, under one
    lock (unlocked, two CREATE TABLEs of one name collide in PostgreSQL's catalogue)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        stores = list(pool.map(lambda _: Store(clean_url), range(8)))
    for store in stores:
        assert store.count_schedules() == 0
        store.dispose()
