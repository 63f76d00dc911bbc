"""Workers over PostgreSQL on loopback: throughput with 1 and 2 worker processes, and a killed worker replayed.

A real PostgreSQL (``--database-url``, else ``PIPESCHED_TEST_POSTGRES_URL``, else one started with
``.ci/postgres.sh``), one ``pipesched serve`` front end with ``PIPESCHED_QUEUE=postgres`` and
``pipesched worker --processes 1`` processes side by side.

1. **Throughput**: a batch of ``--jobs`` solves, each a fixed amount of work (``auto`` proving the Zero
   Bubble paper's p=32 m=96 setting optimal at its ZB-1p memory, about 1 s of CPU; a distinct
   ``solver.seed`` per job so none is a cache hit), submitted at once over HTTP; wall time from the
   first submit until the last job is ``done``, and jobs per second, with 1 and with 2 workers,
   alternated ``--repeats`` times (the machine is shared: the spread shows its noise).
2. **Faults**: ``--rounds`` times: two jobs that search for 3 s each start on the two workers; the
   supervisor of the one running the first job is killed with SIGKILL mid-search and a new worker is
   started in its place (as a service manager would). Counted: jobs lost (not ``done``), jobs stored
   twice, the killed job's attempt (must be 1), and the delay from the kill until its retry runs.

Usage: ``python -m bench.worker_bench [--output bench/results/worker_bench.txt]``
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

from pipesched.api.storage import Store
from tests.api.test_api_served import ServedApi, free_port
from tests.api.test_workers import Worker, clean_database, long_problem
from tests.conftest import paper_problem, paper_settings

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / ".ci" / "postgres.sh"


def fixed_work_problem(seed: int) -> dict[str, Any]:
    """p=32 m=96 (the paper's 28.3B costs) at p·activation: auto proves ZB-H1 optimal, about 1 s of CPU."""
    setting = paper_settings()[9]
    problem = paper_problem(
        setting,
        **{
            "memory.limit": setting["num_ranks"] * setting["activation"],
            "solver.method": "auto",
            "solver.time_limit_s": 30.0,
            "solver.seed": seed,
        },
    )
    return problem.model_dump(mode="json")


def wait_done(store: Store, ids: list[str], timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = [store.job(job_id) for job_id in ids]
        if all(row is not None and row.status in ("done", "failed", "cancelled") for row in rows):
            return {row.id: row for row in rows if row is not None}
        time.sleep(0.05)
    raise TimeoutError(f"jobs not finished within {timeout_s} s")


def throughput(url: str, directory: Path, workers: int, jobs: int, seed_base: int, log: Any) -> dict[str, float]:
    clean_database(url)
    started = [Worker(url, directory / f"tp{seed_base}-w{i}.log") for i in range(workers)]
    front = ServedApi(url, directory / f"tp{seed_base}-serve.log", PIPESCHED_QUEUE="postgres")
    store = Store(url)
    try:
        # warm-up: one job per worker (imports, first CP-SAT model), not measured
        warm = [
            front.client.post("/v1/jobs", json=long_problem(seed_base + 900 + i, 0.3)).json()["id"]
            for i in range(workers)
        ]
        wait_done(store, warm, 120)
        t0 = time.monotonic()
        ids = [front.client.post("/v1/jobs", json=fixed_work_problem(seed_base + i)).json()["id"] for i in range(jobs)]
        rows = wait_done(store, ids, 600)
        wall = time.monotonic() - t0
        done = sum(1 for row in rows.values() if row.status == "done")
        per_worker = [len(w.solved() & set(ids)) for w in started]
        log(
            f"  {workers} worker(s): {done}/{jobs} done in {wall:.2f} s, {done / wall:.2f} jobs/s, "
            f"per worker {per_worker}"
        )
        return {"wall_s": wall, "jobs_per_s": done / wall, "done": done}
    finally:
        store.dispose()
        front.stop()
        for worker in started:
            worker.stop()


def faults(url: str, directory: Path, rounds: int, stalled_after_s: float, log: Any) -> list[dict[str, Any]]:
    clean_database(url)
    env = {"PIPESCHED_WORKER_STALLED_AFTER_S": str(stalled_after_s)}
    workers = [Worker(url, directory / f"fault-w{i}.log", **env) for i in range(2)]
    front = ServedApi(url, directory / "fault-serve.log", PIPESCHED_QUEUE="postgres")
    store = Store(url)
    results: list[dict[str, Any]] = []
    spawned = 2
    try:
        for index in range(rounds):
            first = front.client.post("/v1/jobs", json=long_problem(10_000 + 2 * index, 3.0)).json()["id"]
            second = front.client.post("/v1/jobs", json=long_problem(10_001 + 2 * index, 3.0)).json()["id"]
            deadline = time.monotonic() + 60
            victim = None
            while victim is None:
                victim = next((w for w in workers if f"job {first} attempt 0: solving" in w.log()), None)
                if time.monotonic() > deadline:
                    raise TimeoutError("the first job did not start")
                time.sleep(0.02)
            time.sleep(1.0)  # mid-search
            killed = time.monotonic()
            os.kill(victim.process.pid, signal.SIGKILL)
            victim.process.wait(timeout=10)
            victim.stop()
            workers[workers.index(victim)] = Worker(url, directory / f"fault-w{spawned}.log", **env)
            spawned += 1
            retried_at = None
            while retried_at is None and time.monotonic() - killed < 120:
                row = store.job(first)
                if row is not None and row.attempt >= 1 and row.status in ("running", "done"):
                    retried_at = time.monotonic()
                time.sleep(0.02)
            rows = wait_done(store, [first, second], 120)
            engine = create_engine(url)
            with engine.connect() as connection:
                stored_twice = connection.execute(
                    text(
                        "SELECT count(*) FROM (SELECT problem_hash FROM schedules GROUP BY problem_hash "
                        "HAVING count(*) > 1) AS dup"
                    )
                ).scalar()
            engine.dispose()
            logs = "".join(w.log() for w in workers) + victim.log()
            result = {
                "round": index + 1,
                "lost": sum(1 for row in rows.values() if row.status != "done"),
                "stored_twice": int(stored_twice or 0),
                "attempt": rows[first].attempt,
                "finished_twice": int(f"job {first} attempt 0: done" in logs),
                "retry_delay_s": None if retried_at is None else retried_at - killed,
            }
            results.append(result)
            log(f"  round {index + 1}: {result}")
    finally:
        store.dispose()
        front.stop()
        for worker in workers:
            worker.stop()
    return results


def start_postgres(directory: str) -> tuple[str, dict[str, str]]:
    env = {**os.environ, "PIPESCHED_PG_DIR": directory, "PIPESCHED_PG_PORT": str(free_port())}
    done = subprocess.run(
        ["bash", "-c", f'source "{SCRIPT}" && echo "$PIPESCHED_TEST_POSTGRES_URL"'],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    return done.stdout.strip().splitlines()[-1], env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--database-url", default=os.environ.get("PIPESCHED_TEST_POSTGRES_URL"))
    parser.add_argument("--jobs", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--stalled-after", type=float, default=10.0, help="PIPESCHED_WORKER_STALLED_AFTER_S, s")
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "worker_bench.txt")
    args = parser.parse_args()
    lines: list[str] = []

    def log(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    own_server = None
    url = args.database_url
    if not url:
        own_server = tempfile.mkdtemp(prefix="pipesched-bench-pg-")
        url, own_env = start_postgres(own_server)
    directory = Path(tempfile.mkdtemp(prefix="pipesched-worker-bench-"))
    try:
        log(
            f"pipesched worker bench — {platform.node()} ({os.cpu_count()} CPUs), python {platform.python_version()}, "
            f"PostgreSQL on loopback, load average at start {os.getloadavg()[0]:.1f} (the machine is shared)"
        )
        log(f"throughput: {args.jobs} solves of about 1 s CPU each (auto, p=32 m=96 proven optimal), 1 front end")
        runs: dict[int, list[dict[str, float]]] = {1: [], 2: []}
        for repeat in range(args.repeats):
            for workers in (1, 2):
                runs[workers].append(throughput(url, directory, workers, args.jobs, 1000 * (repeat + 1) + workers, log))
        for workers in (1, 2):
            walls = [r["wall_s"] for r in runs[workers]]
            rates = [r["jobs_per_s"] for r in runs[workers]]
            log(
                f"  {workers} worker(s): median wall {statistics.median(walls):.2f} s, median "
                f"{statistics.median(rates):.2f} jobs/s (runs: {', '.join(f'{w:.2f}' for w in walls)} s)"
            )
        ratio = statistics.median(r["jobs_per_s"] for r in runs[2]) / statistics.median(
            r["jobs_per_s"] for r in runs[1]
        )
        log(f"  2 workers / 1 worker: {ratio:.2f}× the jobs per second")
        log(
            f"faults: {args.rounds} rounds, SIGKILL to the worker running a 3 s search 1 s in, "
            f"PIPESCHED_WORKER_STALLED_AFTER_S={args.stalled_after:g}"
        )
        rounds = faults(url, directory, args.rounds, args.stalled_after, log)
        delays = [r["retry_delay_s"] for r in rounds if r["retry_delay_s"] is not None]
        log(
            f"  jobs lost: {sum(r['lost'] for r in rounds)} of {2 * len(rounds)}; stored twice: "
            f"{sum(r['stored_twice'] for r in rounds)}; finished by the killed attempt: "
            f"{sum(r['finished_twice'] for r in rounds)}; killed job's attempt: "
            f"{sorted({r['attempt'] for r in rounds})}; kill → retry running: "
            f"{min(delays):.1f}–{max(delays):.1f} s (median {statistics.median(delays):.1f} s; bound "
            f"{args.stalled_after:g} + 2 + 1 s after the last heartbeat)"
        )
        log(f"load average at the end {os.getloadavg()[0]:.1f}")
    finally:
        if own_server:
            subprocess.run(["bash", str(SCRIPT), "stop"], env=own_env, capture_output=True, timeout=60)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
