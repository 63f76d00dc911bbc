"""``pipesched demo``: the main job end to end on this machine.

A model/cluster config for a small GPT on 4 ranks goes to the service (started here on loopback with
its embedded SQLite store); the ``auto`` schedule comes back and is printed beside 1F1B and ZB-H1;
the torch runtime runs it on 4 gloo processes and verifies it; the schedule, a Gantt chart, Chrome
traces and the run report land in a folder the demo names.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.result import Schedule

__all__ = ["DEMO_NUM_RANKS", "demo_problem", "run_demo"]

DEMO_NUM_RANKS = 4
DEMO_NUM_MICROBATCHES = 8

#: A small GPT that trains on CPU in seconds: 8 layers, so 2 per rank on 4 ranks.
DEMO_MODEL: dict[str, Any] = {
    "num_layers": 8,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 32,
    "vocab_size": 256,
    "micro_batch_size": 2,
    "dtype": "fp32",
}
#: Explicit numbers for a CPU-like "accelerator", so the predicted times are of the right order here.
DEMO_CLUSTER: dict[str, Any] = {
    "flops_per_s": 2.0e10,
    "memory_bandwidth_bytes_per_s": 1.0e10,
    "efficiency": 0.5,
    "p2p_bandwidth_bytes_per_s": 1.0e9,
    "p2p_latency_ms": 0.05,
    "memory_reserve_bytes": 0,
}
#: The memory limit sits at this many times 1F1B's activation peak above static: ZB-H1 fits,
#: ZB-H2 does not, and the choice of schedule matters.
DEMO_LIMIT_FACTOR = 1.5


def demo_problem(*, time_limit_s: float = 15.0, method: str = "auto") -> dict[str, Any]:
    """The demo's request body: the model/cluster config with a memory size that makes the choice matter.

    The accelerator memory is set so the derived per-rank limit equals the largest static memory
    plus ``DEMO_LIMIT_FACTOR`` × num_ranks × the first stage's activation (1F1B's peak is
    num_ranks × activation on rank 0).
    """
    probe = load_problem(
        {
            "pipeline": {"num_ranks": DEMO_NUM_RANKS, "num_microbatches": DEMO_NUM_MICROBATCHES},
            "model": DEMO_MODEL,
            "cluster": {**DEMO_CLUSTER, "memory_bytes": 1e15},
        }
    )
    assert probe.memory is not None
    activation = probe.stage_values(probe.memory.activation)[0]
    limit = max(probe.static_memory) + DEMO_LIMIT_FACTOR * DEMO_NUM_RANKS * activation
    return {
        "pipeline": {"num_ranks": DEMO_NUM_RANKS, "num_microbatches": DEMO_NUM_MICROBATCHES},
        "model": DEMO_MODEL,
        "cluster": {**DEMO_CLUSTER, "memory_bytes": limit},
        "split_backward": True,
        "objective": "makespan",
        "solver": {"method": method, "time_limit_s": time_limit_s},
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _service(database_path: Path, console: Console) -> Iterator[str]:
    """Run the HTTP service on a loopback port in a background thread; yield its base URL."""
    import uvicorn

    from pipesched.api.app import create_app
    from pipesched.api.settings import Settings

    port = _free_port()
    settings = Settings(host="127.0.0.1", port=port, database_url=f"sqlite:///{database_path}")
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="pipesched-demo-service", daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the demo service did not start")
        time.sleep(0.05)
    console.print(f"service on {base_url} (SQLite store {database_path})", highlight=False)
    try:
        yield base_url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _solve_job(client: httpx.Client, body: dict[str, Any], console: Console) -> dict[str, Any]:
    """POST a job and follow its progress until it is done."""
    response = client.post("/v1/jobs", json=body)
    response.raise_for_status()
    job_id = response.json()["id"]
    limit = float(body["solver"]["time_limit_s"])
    with Progress(
        TextColumn("[bold]auto search[/bold]"),
        BarColumn(),
        TextColumn("{task.fields[state]}"),
        TimeElapsedColumn(),
        console=console,
    ) as bar:
        task = bar.add_task("auto", total=limit, state="queued")
        # The job must end within its time limit plus queueing and start-up; never wait forever.
        deadline = time.monotonic() + limit + 120
        while True:
            if time.monotonic() > deadline:
                client.delete(f"/v1/jobs/{job_id}")
                raise RuntimeError(f"the auto job did not finish within {limit + 120:.0f} s; it was cancelled")
            job = client.get(f"/v1/jobs/{job_id}").json()
            progress = job.get("progress") or {}
            best, bound = progress.get("best_objective"), progress.get("lower_bound")
            state = (
                f"{job['status']} · best {'—' if best is None else f'{best:.2f}'} ms"
                f" · bound {'—' if bound is None else f'{bound:.2f}'} ms"
            )
            bar.update(task, completed=min(float(progress.get("elapsed_s") or 0.0), limit), state=state)
            if job["status"] in ("done", "failed", "cancelled"):
                bar.update(task, completed=limit)
                break
            time.sleep(0.25)
    if job["status"] != "done":
        raise RuntimeError(f"the auto job ended {job['status']}: {job.get('error')}")
    return dict(job["result"])


def _comparison_table(schedules: list[Schedule], console: Console) -> None:
    from pipesched.optimizer.units import common_unit, decimals_against_limit, format_bytes

    limits = schedules[0].problem.memory_limits
    unit_name, unit = common_unit([max(x.peak_memory) for x in schedules if x.peak_memory] + [limits[0]])
    # Peaks and limit in one unit and with enough decimals that a fitting peak never reads over the limit.
    peaks = [peak for x in schedules for peak in x.peak_memory]
    decimals = decimals_against_limit(peaks, limits[0], unit)
    shown_limit = (
        format_bytes(limits[0]) if limits[0] == float("inf") else f"{limits[0] / unit:.{decimals}f} {unit_name}"
    )
    title = f"{DEMO_NUM_RANKS} ranks · {DEMO_NUM_MICROBATCHES} microbatches · limit {shown_limit}"
    table = Table(title=title)
    table.add_column("method")
    table.add_column("status")
    table.add_column("makespan ms", justify="right")
    table.add_column("bubble rate", justify="right")
    table.add_column(f"peak {unit_name} per rank", justify="right", no_wrap=True)
    table.add_column("fits limit")
    for schedule in schedules:
        if schedule.status == "infeasible":
            table.add_row(schedule.method, "infeasible", "—", "—", "—", schedule.reason or "")
            continue
        table.add_row(
            schedule.method,
            schedule.status,
            f"{schedule.makespan:.3f}",
            f"{schedule.bubble_rate:.4f}",
            " ".join(f"{x / unit:.{decimals}f}" for x in schedule.peak_memory),
            "yes" if schedule.fits_memory else "no",
        )
    console.print(table)


def run_demo(
    output: Path | None = None, *, time_limit_s: float = 15.0, run: bool = True, console: Console | None = None
) -> dict[str, Any]:
    """Run the demo; returns a summary dict (paths, figures, verification).

    Raises:
        RuntimeError: when a step fails (the message says which).
    """
    console = console or Console()
    folder = output or Path.cwd() / f"pipesched-demo-{datetime.now():%Y%m%d-%H%M%S}"
    folder.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"folder": str(folder)}
    console.rule("[bold]pipesched demo")
    console.print(
        f"a small GPT ({DEMO_MODEL['num_layers']} layers, hidden {DEMO_MODEL['hidden_size']}) on {DEMO_NUM_RANKS} "
        f"ranks, {DEMO_NUM_MICROBATCHES} microbatches; memory limited to {DEMO_LIMIT_FACTOR}× 1F1B's activations",
        highlight=False,
    )
    body = demo_problem(time_limit_s=time_limit_s)
    (folder / "problem.json").write_text(json.dumps(body, indent=1))
    with _service(folder / "pipesched.db", console) as base_url, httpx.Client(base_url=base_url, timeout=120) as client:
        result = _solve_job(client, body, console)
        auto = Schedule.model_validate(result)
        schedules = [auto]
        for method in ("1f1b", "zb-h1"):
            response = client.post("/v1/schedules", json={**body, "solver": {"method": method, "time_limit_s": 5}})
            response.raise_for_status()
            schedules.append(Schedule.model_validate(response.json()))
        _comparison_table(schedules, console)
        schedule_id = auto.id
        (folder / "schedule.json").write_text(auto.model_dump_json(indent=1))
        console.print("fetching the Gantt chart, the torch CSV and the Chrome trace from the service", highlight=False)
        for fmt, name in (("png", "gantt.png"), ("csv", "schedule.csv"), ("chrome-trace", "predicted-trace.json")):
            response = client.get(f"/v1/schedules/{schedule_id}", params={"format": fmt})
            response.raise_for_status()
            (folder / name).write_bytes(response.content)
    summary["schedules"] = {
        s.method: {
            "status": s.status,
            "makespan": s.makespan,
            "bubble_rate": s.bubble_rate,
            "peak_memory": s.peak_memory,
        }
        for s in schedules
    }
    if run:
        from pipesched.optimizer.export import run_report_to_chrome_trace
        from pipesched.runtime.launch import print_run_summary, run_schedule

        console.rule("[bold]running the auto schedule on 4 gloo ranks")
        with console.status("starting 4 gloo processes, running the schedule and the single-process reference …"):
            report = run_schedule(
                auto, nproc_per_node=DEMO_NUM_RANKS, backend="gloo", model="problem", output=folder / "report.json"
            )
        print_run_summary(report)
        (folder / "measured-trace.json").write_text(json.dumps(run_report_to_chrome_trace(report)))
        summary["report"] = report
        if not report.get("verified"):
            raise RuntimeError(f"verification failed: see {folder / 'report.json'}")
    console.print(
        f"[bold green]done[/bold green]: schedule, Gantt chart, traces and run report in {folder}", highlight=False
    )
    return summary
