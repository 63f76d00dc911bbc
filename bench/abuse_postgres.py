"""PostgreSQL mode of :mod:`bench.abuse_bench` (``python -m bench.abuse_bench --postgres``).

1 front end (``pipesched serve`` with ``PIPESCHED_QUEUE=postgres``) and 2 ``pipesched worker --processes 1`` on a
PostgreSQL server of the bench's own (``.ci/postgres.sh`` on a free port, so it can be crashed), production's
``PIPESCHED_WORKER_STALLED_AFTER_S`` (10 s). Each case reports, beside the answers' status codes and the slowest
``/healthz``: how the jobs ended, their attempts (the job rows), how often the workers solved each (their logs'
``solving on`` lines) and the stalled-task retries the workers counted (their ``/metrics``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.abuse_bench import Bench, Case, hard_job
from tests.api.test_workers import PrivatePostgres, Worker, long_problem

__all__ = ["run_postgres"]

#: Production's default: a worker whose heartbeat is older is taken for dead.
STALLED_AFTER_S = "10"
OUTAGE_S = 10.0


class Setup:
    """The database, the workers and the front end."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.database = PrivatePostgres()
        self.workers: list[Worker] = []
        try:
            self.workers = [self._worker(index, wait=False) for index in range(2)]
            self.bench = Bench(directory, {"PIPESCHED_QUEUE": "postgres"}, self.database.url)
            for worker in self.workers:
                worker.wait_started()
        except BaseException:  # nothing of the bench's left running
            for worker in self.workers:
                worker.stop()
            self.database.remove()
            raise

    def _worker(self, index: int, *, wait: bool = True) -> Worker:
        return Worker(
            self.database.url, self.directory / f"worker{index}.log", wait=wait,
            PIPESCHED_WORKER_STALLED_AFTER_S=STALLED_AFTER_S,
        )  # fmt: skip

    def solves(self, job_id: str) -> int:
        """How many times the workers started solving ``job_id``."""
        pattern = rf"job {job_id} attempt \d+: solving on"
        return sum(len(re.findall(pattern, worker.log())) for worker in self.workers)

    def stalled_retries(self, workers: list[Worker] | None = None) -> float:
        """Stalled tasks the (live) workers handed back so far."""
        total = 0.0
        for worker in self.workers if workers is None else workers:
            found = re.search(r"^pipesched_worker_stalled_tasks_retried_total (\S+)", worker.metrics(), re.M)
            total += float(found.group(1)) if found else 0.0
        return total

    def jobs(self, ids: list[str], timeout_s: float = 120.0) -> list[dict[str, Any]]:
        """The jobs once all ended (or as they are at ``timeout_s``)."""
        client = self.bench.client
        deadline = time.monotonic() + timeout_s
        while True:
            jobs = [client.get(f"/v1/jobs/{job_id}").json() for job_id in ids]
            if all(job["status"] in ("done", "failed", "cancelled") for job in jobs) or time.monotonic() > deadline:
                return jobs
            time.sleep(0.2)

    def busy(self, seeds: range, time_limit_s: float) -> list[str]:
        """Jobs that keep both workers busy for ``time_limit_s``, once running."""
        ids = [self.bench.client.post("/v1/jobs", json=long_problem(seed, time_limit_s)).json()["id"] for seed in seeds]
        deadline = time.monotonic() + 60
        while any(self.bench.client.get(f"/v1/jobs/{i}").json()["status"] != "running" for i in ids):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        return ids

    def close(self) -> str:
        stopped = self.bench.stop()
        for worker in self.workers:
            worker.stop()
        self.database.remove()
        return stopped


def _job_summary(setup: Setup, jobs: list[dict[str, Any]]) -> str:
    statuses = collections.Counter(job["status"] for job in jobs)
    retried = sum(1 for job in jobs if job["attempt"] > 0)
    twice = sum(1 for job in jobs if setup.solves(job["id"]) > 1)
    return (
        f"{len(jobs)} jobs: {' '.join(f'{k}×{v}' for k, v in sorted(statuses.items()))}; attempt > 0: {retried}; "
        f"solved more than once: {twice}"
    )


def sync_flood(setup: Setup, result: Case) -> None:
    busy = setup.busy(range(2000, 2002), 8.0)
    started = time.perf_counter()
    answers = setup.bench.parallel(
        result, [lambda c, s=seed: c.post("/v1/schedules", json=long_problem(2100 + s, 0.3)) for seed in range(45)]
    )
    retry = sorted({a.headers.get("retry-after") for a in answers if a is not None and a.status_code == 429})
    result.note = (
        f"both workers busy with 8 s jobs; all answered in {time.perf_counter() - started:.1f} s "
        f"(Retry-After {', '.join(r or '?' for r in retry) or '-'})"
    )
    for job_id in busy:
        setup.bench.client.delete(f"/v1/jobs/{job_id}")


def job_flood(setup: Setup, result: Case) -> None:
    started = time.perf_counter()
    answers = setup.bench.parallel(
        result, [lambda c, seed=seed: c.post("/v1/jobs", json=hard_job(seed)) for seed in range(200)]
    )
    flood_s = time.perf_counter() - started
    retry = sorted({int(a.headers["retry-after"]) for a in answers if a is not None and a.status_code == 429})
    for answer in answers:
        if answer is not None and answer.status_code == 202:
            setup.bench.client.delete(f"/v1/jobs/{answer.json()['id']}")
    started = time.perf_counter()
    solved = setup.bench.client.post("/v1/schedules", json=long_problem(2200, 0.5))
    solve_s = time.perf_counter() - started
    result.note = (
        f"200 POST /v1/jobs in {flood_s:.1f} s (Retry-After {min(retry, default=0)}–{max(retry, default=0)} s); "
        f"accepted ones cancelled, then a synchronous solve: {solved.status_code} in {solve_s:.1f} s"
    )


def checks(setup: Setup, result: Case) -> None:
    from pipesched.optimizer.families import get_family
    from pipesched.optimizer.problem import Problem

    problem = {
        "pipeline": {"num_ranks": 8, "num_microbatches": 4000},
        "costs": {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0, "p2p": 0.1},
        "memory": {"activation": 100.0, "retained_for_weight": 40.0, "limit": 1e15},
    }
    orders = [[str(a) for a in row] for row in get_family("1f1b").generate(Problem.model_validate(problem))]
    body = json.dumps({"problem": problem, "schedule": orders}).encode()
    headers = {"content-type": "application/json"}
    setup.bench.parallel(
        result, [lambda c: c.post("/v1/schedules/check", content=body, headers=headers) for _ in range(16)]
    )
    result.note = f"each body {len(body) / 1024:.0f} KiB (1F1B, 8 ranks × 4,000 microbatches)"


def _outage_codes(client: httpx.Client, job_id: str, codes: collections.Counter[str]) -> None:
    for method, path, body in (
        ("GET", "/healthz", None),
        ("GET", f"/v1/jobs/{job_id}", None),
        ("POST", "/v1/jobs", long_problem(2300, 1.0)),
        ("POST", "/v1/schedules", long_problem(2301, 0.5)),
        ("GET", "/v1/schedules/nope", None),
        ("GET", "/v1/plans/nope", None),
        ("GET", "/metrics", None),
    ):
        try:
            codes[str(client.request(method, path, json=body, timeout=30).status_code)] += 1
        except httpx.HTTPError as error:
            codes[type(error).__name__] += 1


def outage(setup: Setup, result: Case) -> None:
    client = setup.bench.client
    during = setup.busy(range(2400, 2402), 4.0)
    retried_before = setup.stalled_retries()
    setup.database.crash()
    crashed = time.monotonic()
    while time.monotonic() - crashed < OUTAGE_S:
        _outage_codes(client, during[0], result.codes)
    setup.database.start()
    restarted = time.monotonic()
    after = [client.post("/v1/jobs", json=long_problem(2500 + seed, 1.0)).json().get("id") for seed in range(8)]
    jobs = setup.jobs(during + [job_id for job_id in after if job_id])
    finished_s = time.monotonic() - restarted
    time.sleep(5)
    result.note = (
        f"{_job_summary(setup, jobs)}; all ended {finished_s:.1f} s after the restart; stalled-task retries: "
        f"{setup.stalled_retries() - retried_before:.0f}; heartbeat ages 5 s later: {_heartbeat_ages(setup)} s"
    )


def _heartbeat_ages(setup: Setup) -> str:
    from sqlalchemy import create_engine, text

    engine = create_engine(setup.database.url)
    try:
        with engine.connect() as connection:
            ages = connection.execute(
                text("SELECT EXTRACT(EPOCH FROM now() - last_heartbeat) FROM procrastinate_workers ORDER BY 1")
            ).scalars()
            return ", ".join(f"{float(age):.1f}" for age in ages)
    finally:
        engine.dispose()


def worker_kill(setup: Setup, result: Case) -> None:
    client = setup.bench.client
    job_id = client.post("/v1/jobs", json=long_problem(2600, 6.0)).json()["id"]
    victim = None
    deadline = time.monotonic() + 60
    while victim is None and time.monotonic() < deadline:
        victim = next((w for w in setup.workers if f"job {job_id} attempt 0: solving" in w.log()), None)
        time.sleep(0.05)
    if victim is None:
        result.note = "no worker took the job within 60 s"
        return
    survivors = [worker for worker in setup.workers if worker is not victim]
    retried_before = setup.stalled_retries(survivors)
    time.sleep(1.0)
    os.kill(victim.process.pid, signal.SIGKILL)
    killed = time.monotonic()
    (job,) = setup.jobs([job_id])
    took = time.monotonic() - killed
    result.codes[job["status"]] += 1
    result.note = (
        f"the killed worker's job: {job['status']} as attempt {job['attempt']} {took:.1f} s after the kill, solved "
        f"{setup.solves(job_id)} times (killed + retry); stalled-task retries: "
        f"{setup.stalled_retries(survivors) - retried_before:.0f}"
    )
    index = setup.workers.index(victim)
    victim.stop()
    setup.workers[index] = setup._worker(index)


def run_postgres(args: argparse.Namespace) -> str:
    del args
    setup = Setup(Path(tempfile.mkdtemp(prefix="pipesched-abuse-pg-")))
    lines = [
        f"# abuse_bench --postgres: 1 `pipesched serve` (PIPESCHED_QUEUE=postgres, default limits) and 2 `pipesched "
        f"worker --processes 1` on a PostgreSQL of its own, loopback, PIPESCHED_WORKER_STALLED_AFTER_S="
        f"{STALLED_AFTER_S}; {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "",
        "| case | answers (status × count) | wall s | slowest /healthz ms | server VmHWM MiB | "
        "server + children peak RSS MiB | note |",
        "|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    bench = setup.bench
    try:
        bench.case("45 concurrent POST /v1/schedules, both workers busy", lambda r: sync_flood(setup, r))
        bench.case("job flood: 200 POST /v1/jobs at once", lambda r: job_flood(setup, r))
        bench.case("16 parallel POST /v1/schedules/check of 911 KiB", lambda r: checks(setup, r))
        bench.case(
            f"database crash: {OUTAGE_S:g} s down (pg_ctl -m immediate) under 2 running jobs, then 8 jobs",
            lambda r: outage(setup, r),
        )
        bench.case("a worker's supervisor killed (SIGKILL) mid-search", lambda r: worker_kill(setup, r))
    finally:
        stopped = setup.close()
    lines += [case.row() for case in bench.cases]
    lines += ["", stopped]
    return "\n".join(lines) + "\n"
