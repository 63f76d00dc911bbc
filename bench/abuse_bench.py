"""Abuse a real ``pipesched serve``: large drawings, parallel views, a job flood, bad bodies, random
methods, overflowing inputs; for each case the answers' status codes, the time, the slowest ``/healthz``
meanwhile and the memory of the server and its processes.

Memory: ``VmHWM`` (peak resident set) of the server process from ``/proc/<pid>/status`` after the case,
and the largest sum of ``VmRSS`` over the server and every descendant (forkserver, solver and render
processes), sampled every 0.1 s during the case.

With ``--postgres``: PostgreSQL mode, 1 front end (``PIPESCHED_QUEUE=postgres``) and 2 ``pipesched worker``
processes on a PostgreSQL server of the bench's own (``.ci/postgres.sh``, a free port): 45 concurrent
synchronous solves while the workers are busy, a 200-job flood, 16 parallel 911 KiB checks, a 10 s database
crash (``pg_ctl -m immediate``) under running jobs, and a worker killed mid-search — each job's attempts and
how often the workers solved it are read from the job rows and the workers' logs.

Usage: ``python -m bench.abuse_bench [--postgres] [--output bench/results/abuse_bench.txt]``
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import platform
import random
import signal
import socket
import string
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent


def problem_body(
    num_ranks: int = 4, num_microbatches: int = 8, method: str = "1f1b", time_limit_s: float = 2.0, **extra: Any
) -> dict[str, Any]:
    """A uniform problem: forward, backward_input, backward_weight 1 ms, p2p 0.1 ms, memory unlimited."""
    body: dict[str, Any] = {
        "pipeline": {"num_ranks": num_ranks, "num_microbatches": num_microbatches},
        "costs": {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0, "p2p": 0.1},
        "memory": {"activation": 100.0, "retained_for_weight": 40.0, "limit": 1e15},
        "solver": {"method": method, "time_limit_s": time_limit_s},
    }
    for key, value in extra.items():
        section, _, name = key.partition(".")
        body.setdefault(section, {})[name] = value
    return body


def hard_job(seed: int, time_limit_s: float = 10.0) -> dict[str, Any]:
    """The Zero Bubble paper's 1.5B setting (p = 8, m = 24) at 1.2 × p·activation: the search keeps
    improving for its whole time limit without meeting its lower bound, so each job holds a worker."""
    setting = json.loads((REPO / "bench" / "data" / "zb_paper_settings.json").read_text())["settings"][0]
    return {
        "pipeline": {"num_ranks": setting["num_ranks"], "num_microbatches": setting["num_microbatches"]},
        "costs": {
            "forward": setting["forward_ms"],
            "backward_input": setting["backward_input_ms"],
            "backward_weight": setting["backward_weight_ms"],
            "p2p": setting["p2p_ms"],
        },
        "memory": {
            "activation": setting["activation"],
            "retained_for_weight": setting["retained_for_weight"],
            "limit": 1.2 * setting["num_ranks"] * setting["activation"],
        },
        "objective": "stage_span",
        "solver": {"method": "auto", "time_limit_s": time_limit_s, "seed": seed},
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- the process tree's memory ---------------------------------------------------------------------


def _status_kib(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree(root: int) -> list[int]:
    """``root`` and every live descendant."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            with suppress(OSError, IndexError, ValueError):
                parents[int(name)] = int(Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[1])
    found = {root}
    grew = True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in found} - found
        found |= more
        grew = bool(more)
    return sorted(found)


def probe_health(base_url: str, ready: Any, stop: Any, answers: Any) -> None:
    """GET /healthz every 0.25 s until ``stop`` is set (``ready`` set once the first answered), then put
    ``[(code, seconds), …]`` on ``answers``.

    Runs in a process of its own, so the latency measured is the server's, not the bench's threads' wait for
    the GIL (a keep-alive connection a starved client left idle would also be closed under it)."""
    measured: list[tuple[str, float]] = []
    with httpx.Client(base_url=base_url, timeout=60) as client:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                code = str(client.get("/healthz").status_code)
            except httpx.HTTPError as error:
                code = type(error).__name__
            measured.append((code, time.perf_counter() - started))
            ready.set()
            stop.wait(0.25)
    answers.put(measured)


class Watch:
    """Samples the tree's summed VmRSS and probes /healthz (from a process of its own) while a case runs."""

    def __init__(self, root: int, base_url: str) -> None:
        self.root = root
        self.base_url = base_url
        self.peak_tree_kib = 0
        self.health_s: list[float] = []
        self.health_codes: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_tree_kib = max(self.peak_tree_kib, sum(_status_kib(pid, "VmRSS") for pid in tree(self.root)))
            self._stop.wait(0.1)

    @contextmanager
    def running(self) -> Iterator[Watch]:
        context = multiprocessing.get_context("spawn")
        ready, stop, answers = context.Event(), context.Event(), context.Queue()
        prober = context.Process(target=probe_health, args=(self.base_url, ready, stop, answers), daemon=True)
        prober.start()
        ready.wait(60)  # the case starts once the probe runs
        sampler = threading.Thread(target=self._sample)
        sampler.start()
        try:
            yield self
        finally:
            self._stop.set()
            stop.set()
            sampler.join()
            for code, seconds in answers.get(timeout=120):
                self.health_codes[code] += 1
                self.health_s.append(seconds)
            prober.join(timeout=30)


@dataclass
class Case:
    name: str
    codes: collections.Counter[str] = field(default_factory=collections.Counter)
    wall_s: float = 0.0
    server_hwm_mib: float = 0.0
    tree_peak_mib: float = 0.0
    health_max_ms: float = 0.0
    note: str = ""

    def row(self) -> str:
        codes = " ".join(f"{code}×{count}" for code, count in sorted(self.codes.items()))
        return (
            f"| {self.name} | {codes} | {self.wall_s:.2f} | {self.health_max_ms:.0f} | {self.server_hwm_mib:.0f} | "
            f"{self.tree_peak_mib:.0f} | {self.note} |"
        )


class Bench:
    def __init__(self, directory: Path, env: dict[str, str], database_url: str | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        script = Path(sys.executable).parent / "pipesched"
        command = [str(script)] if script.exists() else [sys.executable, "-m", "pipesched.api.cli"]
        database_url = database_url or f"sqlite:///{directory / 'abuse.sqlite3'}"
        environ = {**os.environ, "PIPESCHED_DATABASE_URL": database_url, **env}
        self.log = directory / "server.log"
        self.process = subprocess.Popen(
            [*command, "serve", "--host", "127.0.0.1", "--port", str(self.port)],
            cwd=REPO,
            env=environ,
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.client = httpx.Client(base_url=self.base_url, timeout=300)
        deadline = time.monotonic() + 60
        while True:
            try:
                if self.client.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"pipesched serve did not start:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.1)
        self.cases: list[Case] = []

    def case(self, name: str, work: Callable[[Case], None]) -> Case:
        result = Case(name)
        watch = Watch(self.process.pid, self.base_url)
        started = time.perf_counter()
        with watch.running():
            work(result)
        result.wall_s = time.perf_counter() - started
        result.server_hwm_mib = _status_kib(self.process.pid, "VmHWM") / 1024
        result.tree_peak_mib = watch.peak_tree_kib / 1024
        result.health_max_ms = max(watch.health_s, default=0.0) * 1000
        if set(watch.health_codes) - {"200"}:
            result.note += f" healthz {dict(watch.health_codes)}"
        self.cases.append(result)
        print(result.row(), flush=True)
        return result

    def parallel(self, result: Case, requests: list[Callable[[httpx.Client], httpx.Response]]) -> list[Any]:
        def one(request: Callable[[httpx.Client], httpx.Response]) -> Any:
            with httpx.Client(base_url=self.base_url, timeout=300) as client:
                try:
                    response = request(client)
                except httpx.HTTPError as error:
                    result.codes[type(error).__name__] += 1
                    return None
                result.codes[str(response.status_code)] += 1
                return response

        with ThreadPoolExecutor(len(requests)) as pool:
            return list(pool.map(one, requests))

    def stop(self) -> str:
        """SIGTERM; then the processes of its group still alive (should be none)."""
        members = tree(self.process.pid)
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)
        time.sleep(2)
        left = [pid for pid in members if pid != self.process.pid and Path(f"/proc/{pid}").exists()]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        return f"after SIGTERM: {len(members) - 1} child processes before, {len(left)} left"


def run(args: argparse.Namespace) -> str:
    directory = Path(tempfile.mkdtemp(prefix="pipesched-abuse-"))
    bench = Bench(directory, {"PIPESCHED_SOLVER_WORKERS": "2"})
    lines = [
        f"# abuse_bench: a real `pipesched serve` on loopback (SQLite, 2 job workers, 1 synchronous-solve "
        f"worker, 1 render worker), {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "",
        "| case | answers (status × count) | wall s | slowest /healthz ms | server VmHWM MiB | "
        "server + children peak RSS MiB | note |",
        "|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    client = bench.client

    # Schedules to draw: 200,000 actions (8 ranks × 12,500 microbatches × F, B) and 20,000 (× compare: 40,000).
    fused = {"split_backward": False}
    large = client.post("/v1/schedules", json={**problem_body(8, 12_500, time_limit_s=40.0), **fused}).json()
    medium = client.post("/v1/schedules", json={**problem_body(8, 1_250), **fused}).json()
    assert "id" in large and "id" in medium, (large, medium)
    seeded = (
        f"Seeding (two synchronous 1f1b solves of 200,000 and 20,000 actions, parsed and stored by the web "
        f"process): server VmHWM {_status_kib(bench.process.pid, 'VmHWM') / 1024:.0f} MiB before the first case."
    )
    print(seeded, flush=True)

    bench.case(
        "png of a 200,000-action schedule",
        lambda r: bench.parallel(r, [lambda c: c.get(f"/v1/schedules/{large['id']}?format=png")]),
    )
    bench.case(
        "6 parallel view?compare=gpipe, 200,000 actions",
        lambda r: bench.parallel(r, [lambda c: c.get(f"/v1/schedules/{large['id']}/view?compare=gpipe")] * 6),
    )
    bench.case(
        "6 parallel view?compare=gpipe, 20,000 actions",
        lambda r: bench.parallel(r, [lambda c: c.get(f"/v1/schedules/{medium['id']}/view?compare=gpipe")] * 6),
    )
    bench.case(
        "6 parallel png, 20,000 actions",
        lambda r: bench.parallel(r, [lambda c: c.get(f"/v1/schedules/{medium['id']}?format=png")] * 6),
    )

    def flood(result: Case) -> None:
        bodies = [hard_job(seed) for seed in range(100)]
        started = time.perf_counter()
        answers = bench.parallel(result, [lambda c, b=b: c.post("/v1/jobs", json=b) for b in bodies])
        flood_s = time.perf_counter() - started
        retry = sorted({a.headers.get("retry-after") for a in answers if a is not None and a.status_code == 429})
        started = time.perf_counter()
        solved = client.post("/v1/schedules", json=problem_body(4, 8, "1f1b"))
        result.note = (
            f"100 POST /v1/jobs in {flood_s:.2f} s (Retry-After {', '.join(r or '?' for r in retry) or '-'}); "
            f"then a 1f1b solve: {solved.status_code} in {time.perf_counter() - started:.2f} s"
        )
        for answer in answers:
            if answer is not None and answer.status_code == 202:
                client.delete(f"/v1/jobs/{answer.json()['id']}")

    bench.case("job flood: 100 POST /v1/jobs at once, then a synchronous solve", flood)

    def bad_bodies(result: Case) -> None:
        bodies: list[tuple[bytes, str]] = [
            (b"\xff\xfe{", "application/json"),
            (b'{"pipeline": ', "application/json"),
            (b"", "application/json"),
            (b"[1, 2, 3]", "application/json"),
            (b"pipeline=1", "application/x-www-form-urlencoded"),
            (b'{"pipeline": {"num_ranks": "many"}}', "application/json"),
            (b"{" * 100_000, "application/json"),
            (b"x" * 2_000_000, "application/json"),
        ]
        shapes = set()
        for body, media in bodies:
            for path in ("/v1/schedules", "/v1/jobs"):
                response = client.post(path, content=body, headers={"content-type": media})
                result.codes[str(response.status_code)] += 1
                detail = response.json().get("detail")
                shapes.add(f"{response.status_code}:{type(detail).__name__}")
        result.note = "detail shapes " + ", ".join(sorted(shapes))

    bench.case("bad bodies (8 kinds × 2 routes)", bad_bodies)

    def random_methods(result: Case) -> None:
        rng = random.Random(0)
        for _ in range(500):
            method = "".join(rng.choices(string.ascii_uppercase, k=8))
            path = rng.choice(["/v1/jobs", "/v1/schedules", f"/v1/jobs/{rng.randrange(10**9)}", f"/x/{rng.random()}"])
            result.codes[str(client.request(method, path).status_code)] += 1
        series = [line for line in client.get("/metrics").text.splitlines() if line.startswith("pipesched_http_")]
        result.note = f"{len(series)} pipesched_http_* series after"

    bench.case("500 random methods and paths", random_methods)

    def overflow(result: Case) -> None:
        huge = client.post("/v1/schedules", json=problem_body(4, 8, "1f1b", **{"costs.forward": 1e308}))
        result.codes[str(huge.status_code)] += 1
        started = time.perf_counter()
        wide = client.post("/v1/schedules", json=problem_body(64, 1, "auto", 1.0))
        result.codes[str(wide.status_code)] += 1
        result.note = (
            f"forward 1e308: {huge.status_code}; 64 ranks × 1 microbatch auto, 1 s limit: {wide.status_code} "
            f"in {time.perf_counter() - started:.2f} s"
        )

    bench.case("overflow inputs (forward 1e308; 64 ranks, 1 microbatch, auto, 1 s)", overflow)

    lines += [case.row() for case in bench.cases]
    lines += ["", seeded, bench.stop()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, help="Also write the table here.")
    parser.add_argument("--postgres", action="store_true", help="PostgreSQL mode: a front end and 2 workers.")
    args = parser.parse_args()
    if args.postgres:
        from bench.abuse_postgres import run_postgres

        text = run_postgres(args)
    else:
        text = run(args)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
    print(text.splitlines()[-1])


if __name__ == "__main__":
    main()
