"""Bounded load on a real ``pipesched serve``: stored-schedule reads, cache-hit solves, concurrent jobs.

Starts the server on a loopback port with a fresh SQLite file, then:

1. seeds ``--schedules`` distinct stored schedules (POST /v1/schedules, 1F1B);
2. ``--gets`` GET /v1/schedules/{id} from ``--clients`` concurrent clients;
3. ``--hits`` POST /v1/schedules of already-solved problems (cache hits) from the same clients;
4. ``--jobs`` POST /v1/jobs of distinct problems (method auto) at once, polled until all end.

Each answer is checked (status code; the id asked for; every job done with a stored schedule):
"lost" counts requests without a correct answer. Prints one table; ``--output`` also writes it.

Usage: ``python -m bench.load_bench [--output bench/results/load_bench.txt]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent


def problem_body(num_microbatches: int, method: str, time_limit_s: float = 2.0) -> dict[str, Any]:
    """A 4-rank problem (forward 1 ms, backward_input 1 ms, backward_weight 1 ms, p2p 0.1 ms)."""
    return {
        "pipeline": {"num_ranks": 4, "num_microbatches": num_microbatches},
        "costs": {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0, "p2p": 0.1},
        "memory": {"activation": 100.0, "retained_for_weight": 40.0, "limit": 1000.0},
        "solver": {"method": method, "time_limit_s": time_limit_s},
    }


@dataclass
class Phase:
    name: str
    latencies_s: list[float] = field(default_factory=list)
    ok: int = 0
    errors: int = 0
    wall_s: float = 0.0

    def row(self) -> list[str]:
        count = self.ok + self.errors
        lat = sorted(self.latencies_s)
        p50 = statistics.median(lat) * 1000 if lat else float("nan")
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000 if lat else float("nan")
        return [
            self.name,
            str(count),
            str(self.ok),
            str(self.errors),
            f"{self.wall_s:.2f}",
            f"{count / self.wall_s:.1f}" if self.wall_s else "-",
            f"{p50:.1f}",
            f"{p99:.1f}",
        ]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(database_url: str, port: int, workers: int, log: Path) -> subprocess.Popen[bytes]:
    script = Path(sys.executable).parent / "pipesched"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "pipesched.api.cli"]
    env = {**os.environ, "PIPESCHED_DATABASE_URL": database_url, "PIPESCHED_SOLVER_WORKERS": str(workers)}
    process = subprocess.Popen(
        [*command, "serve", "--host", "127.0.0.1", "--port", str(port)],
        cwd=REPO,
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    raise RuntimeError(f"pipesched serve did not start:\n{log.read_text()[-2000:]}")


async def run_clients(count: int, clients: int, request: Any, phase: Phase) -> None:
    """``count`` calls of ``request(i)`` (returns True when the answer is right) over ``clients`` workers."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(count):
        queue.put_nowait(i)

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            started = time.perf_counter()
            try:
                good = await request(i)
            except httpx.HTTPError:
                good = False
            phase.latencies_s.append(time.perf_counter() - started)
            if good:
                phase.ok += 1
            else:
                phase.errors += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    phase.wall_s = time.perf_counter() - started


async def bench(base_url: str, args: argparse.Namespace) -> list[Phase]:
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        seed = Phase("seed: POST /v1/schedules (solve)")
        ids: list[str] = []

        async def solve_one(i: int) -> bool:
            response = await client.post("/v1/schedules", json=problem_body(8 + i, "1f1b"))
            if response.status_code != 200 or response.headers.get("X-Pipesched-Cache") != "miss":
                return False
            ids.append(response.json()["id"])
            return True

        await run_clients(args.schedules, 4, solve_one, seed)

        reads = Phase("GET /v1/schedules/{id}")

        async def read_one(i: int) -> bool:
            wanted = ids[i % len(ids)]
            response = await client.get(f"/v1/schedules/{wanted}")
            return response.status_code == 200 and response.json()["id"] == wanted

        await run_clients(args.gets, args.clients, read_one, reads)

        hits = Phase("POST /v1/schedules (cache hit)")

        async def hit_one(i: int) -> bool:
            response = await client.post("/v1/schedules", json=problem_body(8 + i % args.schedules, "1f1b"))
            return response.status_code == 200 and response.headers.get("X-Pipesched-Cache") == "hit"

        await run_clients(args.hits, args.clients, hit_one, hits)

        submits = Phase("POST /v1/jobs (submit)")
        job_ids: list[str] = []

        async def submit_one(i: int) -> bool:
            response = await client.post("/v1/jobs", json=problem_body(100 + i, "auto", args.job_time_limit_s))
            if response.status_code != 202:
                return False
            job_ids.append(response.json()["id"])
            return True

        jobs_started = time.perf_counter()
        await run_clients(args.jobs, args.jobs, submit_one, submits)
        finished = Phase(f"jobs queued → done ({args.jobs} at once)")
        pending = set(job_ids)
        while pending and time.perf_counter() - jobs_started < 600:
            for job_id in list(pending):
                job = (await client.get(f"/v1/jobs/{job_id}")).json()
                if job["status"] in ("done", "failed", "cancelled"):
                    pending.discard(job_id)
                    good = job["status"] == "done" and job["result"] is not None
                    finished.latencies_s.append(time.perf_counter() - jobs_started)
                    if good:
                        finished.ok += 1
                    else:
                        finished.errors += 1
            await asyncio.sleep(0.05)
        finished.errors += len(pending) + (args.jobs - len(job_ids))
        finished.wall_s = time.perf_counter() - jobs_started
        return [seed, reads, hits, submits, finished]


def render(phases: list[Phase], args: argparse.Namespace) -> str:
    header = ["phase", "requests", "ok", "lost", "wall s", "req/s", "p50 ms", "p99 ms"]
    rows = [header, *(phase.row() for phase in phases)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        f"pipesched load bench — {platform.node()} ({os.cpu_count()} CPUs), python {platform.python_version()}, "
        f"SQLite, solver_workers={args.workers}, {args.clients} concurrent clients, "
        f"load average at the end {os.getloadavg()[0]:.1f} (the machine is shared)",
        "  ".join(cell.ljust(width) for cell, width in zip(header, widths, strict=True)),
        "  ".join("-" * width for width in widths),
    ]
    for row in rows[1:]:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    lines.append("(jobs row: latency = time from the first submit until each job ended; lost = not done)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schedules", type=int, default=20)
    parser.add_argument("--gets", type=int, default=2000)
    parser.add_argument("--hits", type=int, default=400)
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--job-time-limit-s", type=float, default=2.0)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="pipesched-load-") as directory:
        port = free_port()
        log = Path(directory) / "server.log"
        server = start_server(f"sqlite:///{directory}/load.sqlite3", port, args.workers, log)
        try:
            phases = asyncio.run(bench(f"http://127.0.0.1:{port}", args))
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
    table = render(phases, args)
    print(table)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(table + "\n")


if __name__ == "__main__":
    main()
