"""Scale out: `pipesched serve` front ends and `pipesched worker` processes over one PostgreSQL, on loopback.

Real processes throughout: two `serve` replicas with PIPESCHED_QUEUE=postgres, two workers (one solver
process each), the procrastinate queue in a real PostgreSQL (``PIPESCHED_TEST_POSTGRES_URL``, or a
throwaway server from ``.ci/postgres.sh``; skipped with the reason when there is none).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text

from pipesched.api.storage import Base, Store
from tests.api.test_api_postgres import SCRIPT, postgres_url  # noqa: F401  (the fixture)
from tests.api.test_api_served import ServedApi, free_port, wait_for_jobs
from tests.conftest import paper_problem, paper_settings

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

REPO = Path(__file__).resolve().parents[2]
#: Short enough for a test, long enough for a loaded machine's heartbeats (sent every third of it).
STALLED_AFTER_S = 5.0
#: From a worker's death to its job running again: stale heartbeat + sweep (2 s) + fetch poll (1 s), with slack.
RETRY_BOUND_S = STALLED_AFTER_S + 2.0 + 1.0 + 8.0


def _command() -> list[str]:
    script = Path(sys.executable).parent / "pipesched"
    return [str(script)] if script.exists() else [sys.executable, "-m", "pipesched.api.cli"]


def long_problem(seed: int, time_limit_s: float) -> dict[str, Any]:
    """The Zero Bubble paper's 6.2B p=8 m=24 at twice ZB-1p's memory: `auto` searches until its time limit."""
    setting = paper_settings()[3]
    problem = paper_problem(
        setting,
        **{
            "memory.limit": 2 * setting["num_ranks"] * setting["activation"],
            "solver.method": "auto",
            "solver.time_limit_s": time_limit_s,
            "solver.seed": seed,
        },
    )
    return problem.model_dump(mode="json")


class Worker:
    """``pipesched worker --processes 1`` in its own process group, logging to a file."""

    def __init__(self, database_url: str, log_path: Path, **env: str) -> None:
        self.log_path = log_path
        self.metrics_port = free_port()
        environ = {
            **os.environ,
            "PIPESCHED_DATABASE_URL": database_url,
            "PIPESCHED_WORKER_STALLED_AFTER_S": str(STALLED_AFTER_S),
            **env,
        }
        self._log = log_path.open("ab")
        self.process = subprocess.Popen(
            [*_command(), "worker", "--processes", "1", "--metrics-port", str(self.metrics_port)],
            cwd=REPO,
            env=environ,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while not re.search(r"solver process 0 started \(pid (\d+)\)", self.log()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pipesched worker did not start:\n{self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def solver_pids(self) -> list[int]:
        return [int(pid) for pid in re.findall(r"solver process 0 started \(pid (\d+)\)", self.log())]

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text

    def solved(self) -> set[str]:
        """Job ids this worker finished (its log's ``attempt N: done`` lines)."""
        return set(re.findall(r"job ([0-9a-f]{32}) attempt \d+: done on", self.log()))

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        self._log.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie of the worker (reaped by nobody here) counts as dead
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    return True


def clean_database(url: str) -> None:
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except Exception as error:
        pytest.skip(f"PostgreSQL at PIPESCHED_TEST_POSTGRES_URL is not reachable: {error}")
    Base.metadata.drop_all(engine)
    with engine.begin() as connection:
        if connection.execute(text("SELECT to_regclass('procrastinate_jobs') IS NOT NULL")).scalar():
            connection.execute(text("DELETE FROM procrastinate_jobs"))
            connection.execute(text("DELETE FROM procrastinate_workers"))
    engine.dispose()


class Cluster:
    """Two front ends and two workers on one database."""

    def __init__(self, url: str, directory: Path) -> None:
        self.url = url
        self.directory = directory
        self.workers: list[Worker] = []
        self.fronts: list[ServedApi] = []
        try:
            for index in range(2):
                self.workers.append(Worker(url, directory / f"worker{index}.log"))
            for index in range(2):
                self.fronts.append(ServedApi(url, directory / f"serve{index}.log", PIPESCHED_QUEUE="postgres"))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for front in self.fronts:
            front.stop()
        for worker in self.workers:
            worker.stop()


@pytest.fixture(scope="module")
def cluster(postgres_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:  # noqa: F811
    clean_database(postgres_url)
    running = Cluster(postgres_url, tmp_path_factory.mktemp("cluster"))
    yield running
    running.close()


def _wait_status(client: httpx.Client, job_id: str, statuses: tuple[str, ...], timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in statuses:
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.05)


def test_jobs_from_either_front_end_complete_on_either_worker(cluster: Cluster) -> None:
    a, b = cluster.fronts
    ids = []
    for seed in range(6):
        front = (a, b)[seed % 2]
        created = front.client.post("/v1/jobs", json=long_problem(seed, 1.0))
        assert created.status_code == 202, created.text
        ids.append(created.json()["id"])
    jobs = wait_for_jobs(b.client, ids)  # read through the other front end too
    assert [job["status"] for job in jobs] == ["done"] * 6, [job["error"] for job in jobs]
    assert all(job["result"]["status"] == "feasible" and job["attempt"] == 0 for job in jobs)
    # each job solved once, and both workers took some
    solved = [worker.solved() & set(ids) for worker in cluster.workers]
    assert solved[0] | solved[1] == set(ids) and not solved[0] & solved[1]
    assert solved[0] and solved[1], solved
    assert a.client.get(f"/v1/jobs/{ids[1]}").json() == b.client.get(f"/v1/jobs/{ids[1]}").json()
    # a synchronous solve through a front end runs on a worker too, and is stored once
    answer = a.client.post("/v1/schedules", json=long_problem(100, 0.5))
    assert answer.status_code == 200 and answer.json()["cache"] == "miss", answer.text
    again = b.client.post("/v1/schedules", json=long_problem(100, 0.5))
    assert again.json()["cache"] == "hit" and again.json()["id"] == answer.json()["id"]
    assert "synchronous solve" in cluster.workers[0].log() + cluster.workers[1].log()
    assert "pipesched_worker_database_up 1.0" in cluster.workers[0].metrics()


def test_cancel_stops_the_search_on_the_worker(cluster: Cluster) -> None:
    a, b = cluster.fronts
    job_id = a.client.post("/v1/jobs", json=long_problem(200, 30.0)).json()["id"]
    job = _wait_status(b.client, job_id, ("running",))
    assert job["status"] == "running"
    time.sleep(1.0)  # well inside the search
    asked = time.monotonic()
    cancelled = b.client.delete(f"/v1/jobs/{job_id}")
    assert cancelled.json()["status"] == "cancelled"
    deadline = time.monotonic() + 15
    pattern = f"job {job_id} attempt 0: cancelled on"
    while not any(pattern in worker.log() for worker in cluster.workers):
        assert time.monotonic() < deadline, "the worker's search did not stop within 15 s of the cancellation"
        time.sleep(0.05)
    assert time.monotonic() - asked < 10  # not the 30 s time limit
    final = a.client.get(f"/v1/jobs/{job_id}").json()
    assert final["status"] == "cancelled" and final["schedule_id"] is None


def test_fan_out_gathers_n_searches_within_the_limit(cluster: Cluster) -> None:
    from pipesched.api.fanout import FanOutProgress, solve_many
    from pipesched.api.queue import QueueRunner
    from pipesched.api.settings import Settings
    from pipesched.optimizer.problem import Problem

    settings = Settings(database_url=cluster.url, queue="postgres")
    store = Store(cluster.url)
    runner = QueueRunner(store, settings)
    try:
        problems = [Problem.model_validate(long_problem(300 + seed, 1.0)) for seed in range(4)]
        seen: list[FanOutProgress] = []
        result = solve_many(store, runner, problems, time_limit_s=20.0, progress=seen.append)
        assert result.statuses == ["done"] * 4
        assert all(s is not None and s.status == "feasible" for s in result.schedules)
        assert result.elapsed_s < 20.0
        assert seen[-1].finished == 4 and seen[-1].best == min(s.objective_value for s in result.schedules if s)
        assert any(0 < p.finished < 4 or p.counts["running"] for p in seen)  # progress in between
        # a budget shorter than the searches: what is unfinished at the limit is cancelled, on time
        slow = [Problem.model_validate(long_problem(400 + seed, 30.0)) for seed in range(3)]
        started = time.monotonic()
        cut = solve_many(store, runner, slow, time_limit_s=2.0)
        assert time.monotonic() - started < 2.0 + 2.0
        assert all(status in ("done", "cancelled") for status in cut.statuses)
        # the same problems again: answered from the store at once
        again = solve_many(store, runner, problems, time_limit_s=5.0)
        assert [s.id for s in again.schedules if s] == [s.id for s in result.schedules if s]
    finally:
        runner.shutdown()
        store.dispose()


def test_a_worker_killed_mid_search_loses_nothing(cluster: Cluster) -> None:
    """SIGKILL to the worker solving a job: another worker runs it again within the bound, as attempt 1; one
    schedule is stored; the killed worker's solver process ends with its supervisor."""
    a, b = cluster.fronts
    body = long_problem(500, 6.0)
    job_id = a.client.post("/v1/jobs", json=body).json()["id"]
    _wait_status(a.client, job_id, ("running",))
    deadline = time.monotonic() + 20
    victim = None
    while victim is None:
        victim = next((w for w in cluster.workers if f"job {job_id} attempt 0: solving" in w.log()), None)
        assert time.monotonic() < deadline
        time.sleep(0.05)
    survivor = next(w for w in cluster.workers if w is not victim)
    time.sleep(1.0)  # mid-search
    solver_pid = victim.solver_pids()[-1]
    killed = time.monotonic()
    os.kill(victim.process.pid, signal.SIGKILL)  # the supervisor only: its solver process must follow
    victim.process.wait(timeout=10)
    while _alive(solver_pid):
        assert time.monotonic() - killed < 5, "the solver process outlived its killed supervisor"
        time.sleep(0.05)
    job = _wait_status(b.client, job_id, ("done", "failed", "cancelled"), timeout_s=RETRY_BOUND_S + 30)
    assert job["status"] == "done" and job["attempt"] == 1, job
    retried = re.search(rf"(\S+ \S+) INFO pipesched.queue \[\d+\] job {job_id} attempt 1: solving", survivor.log())
    assert retried, survivor.log()[-2000:]
    assert f"job {job_id} attempt 1: done" in survivor.log()
    assert time.monotonic() - killed < RETRY_BOUND_S + 6.0 + 15  # retried, then a 6 s search
    assert "handed back to the queue" in survivor.log()
    assert "pipesched_worker_stalled_tasks_retried_total 1.0" in survivor.metrics()
    engine = create_engine(cluster.url)
    with engine.connect() as connection:
        stored = connection.execute(
            text("SELECT count(*) FROM schedules WHERE problem_hash = (SELECT problem_hash FROM jobs WHERE id = :id)"),
            {"id": job_id},
        ).scalar()
    engine.dispose()
    assert stored == 1
    # the cluster gets its second worker back for any later test
    victim.stop()
    cluster.workers[cluster.workers.index(victim)] = Worker(cluster.url, victim.log_path)


def test_a_worker_cut_off_from_the_database_backs_off_and_says_so(
    postgres_url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A second throwaway PostgreSQL, stopped under a running worker: its log and /metrics say so; started
    again, the worker takes work again."""
    directory = tempfile.mkdtemp(prefix="pipesched-pg-outage-")
    env = {**os.environ, "PIPESCHED_PG_DIR": directory, "PIPESCHED_PG_PORT": str(free_port())}

    def server(action: str) -> str:
        done = subprocess.run(
            ["bash", "-c", f'source "{SCRIPT}" {action} && echo "$PIPESCHED_TEST_POSTGRES_URL"'],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            pytest.skip(f"could not {action} a second PostgreSQL: {done.stderr[-300:]}")
        return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""

    url = server("start")
    worker = None
    try:
        worker = Worker(url, tmp_path / "worker.log")
        assert "pipesched_worker_database_up 1.0" in worker.metrics()
        server("stop")
        deadline = time.monotonic() + 30
        while "cannot reach the database" not in worker.log():
            assert time.monotonic() < deadline, worker.log()[-2000:]
            time.sleep(0.2)
        metrics = worker.metrics()
        assert "pipesched_worker_database_up 0.0" in metrics
        errors = float(re.search(r"^pipesched_worker_database_errors_total (\S+)", metrics, re.M).group(1))  # type: ignore[union-attr]
        assert errors >= 1
        assert re.search(r"retrying in \d+ s", worker.log())
        server("start")
        deadline = time.monotonic() + 60
        while "pipesched_worker_database_up 1.0" not in worker.metrics():
            assert time.monotonic() < deadline, worker.log()[-2000:]
            time.sleep(0.2)
        front = ServedApi(url, tmp_path / "serve.log", PIPESCHED_QUEUE="postgres")
        try:
            job_id = front.client.post("/v1/jobs", json=long_problem(600, 0.5)).json()["id"]
            assert _wait_status(front.client, job_id, ("done", "failed"), timeout_s=60)["status"] == "done"
        finally:
            front.stop()
    finally:
        if worker is not None:
            worker.stop()
        subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, timeout=60)
        import shutil

        shutil.rmtree(directory, ignore_errors=True)


# --- bad input: exit 2 naming the setting and the fix (no PostgreSQL needed) -----------------------------


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_command(), *args],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_worker_pointed_at_sqlite_exits_2(tmp_path: Path) -> None:
    done = _run(["worker"], PIPESCHED_DATABASE_URL=f"sqlite:///{tmp_path / 'x.sqlite3'}")
    assert done.returncode == 2, done.stderr
    message = " ".join(done.stderr.split())
    assert "PIPESCHED_DATABASE_URL" in message and "postgresql+psycopg://" in message
    assert "sqlite" in message


def test_a_worker_that_cannot_reach_its_database_exits_2() -> None:
    url = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/nowhere"
    done = _run(["worker"], PIPESCHED_DATABASE_URL=url)
    assert done.returncode == 2, done.stderr
    message = " ".join(done.stderr.split())
    assert "PIPESCHED_DATABASE_URL" in message and "cannot reach the database" in message


def test_an_unknown_queue_exits_2(tmp_path: Path) -> None:
    for command in (["worker"], ["serve", "--port", str(free_port())]):
        done = _run(command, PIPESCHED_QUEUE="redis", PIPESCHED_DATABASE_URL=f"sqlite:///{tmp_path / 'q.sqlite3'}")
        assert done.returncode == 2, (command, done.stderr)
        message = " ".join(done.stderr.split())
        assert "PIPESCHED_QUEUE" in message and "'local' or 'postgres'" in message


def test_serve_with_the_postgres_queue_on_sqlite_exits_2(tmp_path: Path) -> None:
    done = _run(
        ["serve", "--port", str(free_port())],
        PIPESCHED_QUEUE="postgres",
        PIPESCHED_DATABASE_URL=f"sqlite:///{tmp_path / 's.sqlite3'}",
    )
    assert done.returncode == 2, done.stderr
    message = " ".join(done.stderr.split())
    assert "PIPESCHED_DATABASE_URL" in message and "PIPESCHED_QUEUE" in message


def test_take_job_counts_attempts_and_shuts_out_the_stopped_attempt(tmp_path: Path) -> None:
    """What a worker does with a task (real SQLite here; the PostgreSQL tests above run it there): a queued
    job runs at its attempt; a job left running by a stopped worker is re-queued as the next attempt, which
    the old attempt can neither write progress to nor finish; past max_job_attempts it fails with the reason;
    an ended job is not run again."""
    from pipesched.api.storage import problem_key
    from pipesched.optimizer.problem import Problem
    from pipesched.optimizer.solve import solve

    store = Store(f"sqlite:///{tmp_path / 'take.sqlite3'}")
    problem = Problem.model_validate(long_problem(0, 0.2)).with_changes(**{"solver.method": "zb-h1"})
    key = problem_key(problem)
    job = store.create_job(problem, key)
    assert store.take_job(job.id, max_attempts=2) == 0 and store.start_job(job.id, 0)
    # the worker died; the retried task takes the job over
    assert store.take_job(job.id, max_attempts=2) == 1
    row = store.job(job.id)
    assert row is not None and row.status == "queued" and "retried after its worker stopped" in (row.message or "")
    assert store.start_job(job.id, 1)
    schedule = solve(problem)
    assert store.finish_job(job.id, 0, key, schedule) is None  # the stopped attempt cannot finish
    assert store.take_job(job.id, max_attempts=2) == 2 and store.start_job(job.id, 2)
    assert store.take_job(job.id, max_attempts=2) is None  # a third stop: out of attempts
    row = store.job(job.id)
    assert row is not None and row.status == "failed" and "stopped 3 times" in (row.error or "")
    assert store.count_schedules() == 0
    done = store.create_job(problem, key)
    assert store.take_job(done.id, 3) == 0 and store.start_job(done.id, 0)
    assert store.finish_job(done.id, 0, key, schedule) is not None
    assert store.take_job(done.id, 3) is None and store.job_status(done.id) == "done"
    store.dispose()
