"""Scale out: `pipesched serve` front ends and `pipesched worker` processes over one PostgreSQL, on loopback.

Real processes throughout: two `serve` replicas with PIPESCHED_QUEUE=postgres, two workers (one solver
process each), the procrastinate queue in a real PostgreSQL (``PIPESCHED_TEST_POSTGRES_URL``, or a
throwaway server from ``.ci/postgres.sh``; skipped with the reason when there is none).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text

from pipesched.api.storage import Base, Store
from tests.api.test_api_postgres import SCRIPT, postgres_url  # noqa: F401  (the fixture)
from tests.api.test_api_served import ServedApi, free_port, wait_for_jobs
from tests.api.test_service_limits import HealthProbe
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

    def __init__(self, database_url: str, log_path: Path, *, wait: bool = True, **env: str) -> None:
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
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
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
            for index in range(2):  # started side by side
                self.workers.append(Worker(url, directory / f"worker{index}.log", wait=False))
            for index in range(2):
                self.fronts.append(ServedApi(url, directory / f"serve{index}.log", PIPESCHED_QUEUE="postgres"))
            for worker in self.workers:
                worker.wait_started()
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
    # the worker's /metrics (no token) listens on loopback only unless told otherwise
    assert f"metrics on 127.0.0.1 port {cluster.workers[0].metrics_port}" in cluster.workers[0].log()
    assert _listening_on(cluster.workers[0].metrics_port) == {"127.0.0.1"}


def _listening_on(port: int) -> set[str]:
    """The IPv4 addresses a TCP socket listens on at ``port`` (Linux's /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, local_port = local.split(":")
        if state == "0A" and int(local_port, 16) == port:
            found.add(".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


def test_synchronous_solves_on_busy_workers_answer_200_or_429_and_healthz_stays_fast(cluster: Cluster) -> None:
    """30 concurrent POST /v1/schedules at one front end while both workers run jobs: its 5 places (1 synchronous
    solver + 4 waiting) are taken, the other 25 get 429 with Retry-After; the admitted are solved once the workers
    free up (they go before queued jobs); /healthz answers within 1 s throughout. The workers stay busy until the
    25 refusals are in (their jobs are then deleted): with 10 s jobs that ended on their own, how many requests
    arrived after the jobs ended, and were admitted, depended on the machine's speed (11 of 30 with two busy loops
    on two cores, where the test asked for at most 10)."""
    a, b = cluster.fronts
    busy = [b.client.post("/v1/jobs", json=long_problem(1000 + seed, 120.0)).json()["id"] for seed in range(2)]
    bodies = [json.dumps(long_problem(1100 + seed, 0.3)).encode() for seed in range(30)]  # built before: sent at once
    for job_id in busy:
        _wait_status(b.client, job_id, ("running",))

    def solve(body: bytes) -> httpx.Response:
        with httpx.Client(base_url=a.base_url, timeout=180) as client:
            return client.post("/v1/schedules", content=body, headers={"content-type": "application/json"})

    probe = HealthProbe(a.base_url)
    with ThreadPoolExecutor(30) as pool:
        pending = [pool.submit(solve, body) for body in bodies]
        # The refusals come while the admitted wait; a 6th admission would leave fewer than 25 to come (the
        # jobs then end at their limit, the service's 60 s clamp, and the count below says how many were admitted).
        for finished, _ in enumerate(as_completed(pending, timeout=170), start=1):
            if finished == 25:
                break
        for job_id in busy:
            b.client.delete(f"/v1/jobs/{job_id}")
        answers = [future.result() for future in pending]
    health = probe.stop()
    codes = collections.Counter(answer.status_code for answer in answers)
    assert codes == {200: 5, 429: 25}, codes
    refused = next(answer for answer in answers if answer.status_code == 429)
    assert int(refused.headers["Retry-After"]) >= 1
    assert "PIPESCHED_MAX_QUEUED_SOLVES" in refused.json()["detail"] and "places taken" in refused.json()["detail"]
    assert {code for code, _ in health} == {200}
    assert max(seconds for _, seconds in health) < 1.0, sorted(seconds for _, seconds in health)[-5:]


def test_postgres_mode_bounds_its_job_queue_and_times_out_a_solve_no_worker_takes(cluster: Cluster) -> None:
    """With both workers busy: jobs beyond PIPESCHED_MAX_QUEUED_JOBS waiting in the database get 429 with a
    Retry-After from the running jobs' time left; a synchronous solve no worker takes within its time limit +
    PIPESCHED_MAX_SYNC_WAIT_S is a 504 (its task withdrawn), not a 500."""
    from fastapi.testclient import TestClient

    from pipesched.api.app import create_app
    from pipesched.api.settings import Settings

    settings = Settings(database_url=cluster.url, queue="postgres", max_queued_jobs=2, max_sync_wait_s=1.0)
    with TestClient(create_app(settings)) as client:
        busy = [client.post("/v1/jobs", json=long_problem(1200 + seed, 6.0)).json()["id"] for seed in range(2)]
        for job_id in busy:
            _wait_status(client, job_id, ("running",))
        answers = [client.post("/v1/jobs", json=long_problem(1300 + seed, 1.0)) for seed in range(3)]
        assert [answer.status_code for answer in answers] == [202, 202, 429], [a.text for a in answers]
        refused = answers[2].json()["detail"]
        assert "(2 of 2 places taken)" in refused and "PIPESCHED_MAX_QUEUED_JOBS" in refused
        assert 1 <= int(answers[2].headers["Retry-After"]) <= 6 + 2
        started = time.monotonic()
        timed_out = client.post("/v1/schedules", json=long_problem(1400, 0.5))
        assert timed_out.status_code == 504, timed_out.text
        assert "no worker answered" in timed_out.json()["detail"]
        assert time.monotonic() - started < 0.5 + 1.0 + 3.0
        for job_id in [*busy, *(answer.json()["id"] for answer in answers[:2])]:
            client.delete(f"/v1/jobs/{job_id}")
        for job_id in busy:
            _wait_status(client, job_id, ("cancelled",))


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
        # a synchronous solve's task that succeeded is deleted: its waiter looks for the schedule, no 500
        assert runner._task_failed(10**12) is False
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


class PrivatePostgres:
    """A throwaway PostgreSQL of this test's own (``.ci/postgres.sh`` on a free port and directory), so it can
    be crashed (``pg_ctl -m immediate``) and started again without touching the other tests' server."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="pipesched-pg-outage-")
        self.env = {**os.environ, "PIPESCHED_PG_DIR": self.directory, "PIPESCHED_PG_PORT": str(free_port())}
        self.url = self._script("start")

    def _script(self, action: str, **env: str) -> str:
        done = subprocess.run(
            ["bash", "-c", f'source "{SCRIPT}" {action} && echo "$PIPESCHED_TEST_POSTGRES_URL"'],
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            self.remove()
            pytest.skip(f"could not {action} a PostgreSQL of the test's own: {done.stderr[-300:]}")
        return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""

    def crash(self) -> None:
        """Stop it at once, as a crash or a pulled cable would (no shutdown checkpoint, clients cut off)."""
        self._script("stop", PIPESCHED_PG_STOP_MODE="immediate")

    def start(self) -> None:
        self._script("start")

    def remove(self) -> None:
        subprocess.run(["bash", str(SCRIPT), "stop"], env=self.env, capture_output=True, timeout=60)
        shutil.rmtree(self.directory, ignore_errors=True)


#: How long the outage test keeps the database down, s (twice the workers' STALLED_AFTER_S: every heartbeat is
#: stale when it returns).
OUTAGE_S = 10.0


def _outage_answers(client: httpx.Client, job_id: str) -> collections.Counter[str]:
    """One round of every kind of request while the database is down: 'path status' counts."""
    plan = {
        "model": {"preset": "llama3.1-8b"},
        "cluster": {"accelerator": "H100-SXM"},
        "training": {"global_batch_size": 8},
        "search": {"time_limit_s": 2},
    }
    requests = [
        ("GET", "/healthz", None),
        ("GET", f"/v1/jobs/{job_id}", None),
        ("DELETE", "/v1/jobs/nope", None),
        ("POST", "/v1/jobs", long_problem(990, 1.0)),
        ("POST", "/v1/schedules", long_problem(991, 0.5)),
        ("GET", "/v1/schedules/nope", None),
        ("POST", "/v1/plans", plan),
        ("GET", "/v1/plans/nope", None),
        ("GET", "/metrics", None),
    ]
    seen: collections.Counter[str] = collections.Counter()
    for method, path, body in requests:
        started = time.monotonic()
        answer = client.request(method, path, json=body)
        took = time.monotonic() - started
        assert answer.headers["content-type"].startswith(("application/json", "text/plain; version")), answer.text
        if answer.status_code == 503:
            assert int(answer.headers["Retry-After"]) >= 1 and answer.json()["detail"], answer.text
        if path == "/healthz":
            assert took < 3.0, f"/healthz took {took:.1f} s while the database was down"
        if path == "/metrics":
            assert "pipesched_database_up 0.0" in answer.text
        seen[f"{method} {path.split('/')[2] if path.count('/') > 1 else path} {answer.status_code}"] += 1
    return seen


@pytest.mark.slow  # about 40 s: two workers, a front end and a server of its own, a 10 s outage
def test_a_database_outage_loses_no_job_and_solves_each_once(tmp_path: Path) -> None:
    """1 front end + 2 workers; the database crashes (pg_ctl -m immediate) for 10 s, twice the workers'
    stalled-after time, under two running jobs. Meanwhile every database route answers 503 with Retry-After,
    never 500, and the workers say so. Started again: heartbeats resume, no live worker is taken for stalled,
    the two jobs and six submitted afterwards all finish within 60 s, each solved once, none retried."""
    database = PrivatePostgres()
    workers: list[Worker] = []
    front = None
    try:
        workers = [Worker(database.url, tmp_path / f"worker{index}.log", wait=False) for index in range(2)]
        front = ServedApi(database.url, tmp_path / "serve.log", PIPESCHED_QUEUE="postgres")
        for worker in workers:
            worker.wait_started()
        client = front.client
        during = [client.post("/v1/jobs", json=long_problem(700 + seed, 4.0)).json()["id"] for seed in range(2)]
        for job_id in during:
            _wait_status(client, job_id, ("running",))
        database.crash()
        crashed = time.monotonic()
        answers: collections.Counter[str] = collections.Counter()
        while time.monotonic() - crashed < OUTAGE_S:
            answers += _outage_answers(client, during[0])
        assert not [key for key in answers if key.endswith((" 500", " 502"))], answers
        assert answers["GET /healthz 503"] and answers["POST jobs 503"] and answers["POST schedules 503"], answers
        for worker in workers:
            assert "cannot reach the database" in worker.log()
            assert "pipesched_worker_database_up 0.0" in worker.metrics()
        database.start()
        restarted = time.monotonic()
        after = [client.post("/v1/jobs", json=long_problem(800 + seed, 1.0)) for seed in range(6)]
        assert [answer.status_code for answer in after] == [202] * 6, [answer.text for answer in after]
        jobs = wait_for_jobs(client, during + [answer.json()["id"] for answer in after], timeout_s=60)
        assert time.monotonic() - restarted < 60
        assert [(job["status"], job["attempt"]) for job in jobs] == [("done", 0)] * 8, jobs
        logs = workers[0].log() + workers[1].log()
        for job in jobs:
            assert len(re.findall(rf"job {job['id']} attempt \d+: solving on", logs)) == 1, job["id"]
        for worker in workers:
            assert "pipesched_worker_stalled_tasks_retried_total 0.0" in worker.metrics()
            assert "pipesched_worker_database_up 1.0" in worker.metrics()
            assert "heartbeats sent again" in worker.log()
        _assert_heartbeats_fresh(database.url, live=2)
    finally:
        if front is not None:
            front.stop()
        for worker in workers:
            worker.stop()
        database.remove()


def _assert_heartbeats_fresh(url: str, live: int) -> None:
    """At least ``live`` worker rows have a heartbeat younger than STALLED_AFTER_S."""
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            ages = connection.execute(
                text("SELECT EXTRACT(EPOCH FROM now() - last_heartbeat) FROM procrastinate_workers")
            ).scalars()
            fresh = [float(age) for age in ages if float(age) < STALLED_AFTER_S]
    finally:
        engine.dispose()
    assert len(fresh) >= live, fresh


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
