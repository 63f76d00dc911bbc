"""The demo's closed loop, repeated (issue 25): profile this machine on the run's 4 gloo processes, re-time the
demo's chosen order from that profile, train it, and keep what each loop predicted and measured.

``pipesched demo`` prints one figure per run ("predicted X ms from its profile, measured Y ms"); over five runs it
landed +12, −18, +61, +24, +55 %. This bench runs the same two steps the demo's screen 3 runs
(:func:`pipesched.api.cli.demo._this_machine`, then :func:`pipesched.runtime.launch.run_schedule`) ``--loops``
times on one saved demo schedule and writes one JSON line per loop: the profile's settings, its prediction (step
time, compute makespan, the costs it fed the simulator), the run's per-step times, its compute makespan simulated
from its own measured passes (``simulated_makespan_from_measured_costs_ms``), the load average before and after.
That splits the demo's error into the profile's spread (same code, different prediction), the run's spread (its
steps, run to run) and a systematic part (the order's model given the run's own pass times).

Run (heavy: hold the team lock):
``python -m bench.demo_loop SCHEDULE.json --loops 4 --output bench/results/demo_loop.jsonl [--steps 3]``
where SCHEDULE.json is a demo run's ``schedule.json`` (``pipesched demo --no-run -o DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any


def one_loop(schedule: Any, steps: int, engine: str) -> dict[str, Any]:
    """Profile → re-time → run, as the demo does; the loop's record."""
    import tempfile

    from rich.console import Console

    from pipesched.api.cli.demo import DEMO_LR, DEMO_OPTIMIZER, _this_machine
    from pipesched.runtime.launch import run_schedule
    from pipesched.runtime.training import training_options

    options = training_options(schedule.problem, steps=steps, optimizer=DEMO_OPTIMIZER, lr=DEMO_LR)
    record: dict[str, Any] = {"load_before": os.getloadavg()[0], "steps": steps, "engine": engine}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        started = time.perf_counter()
        here = _this_machine(schedule, options, folder, Console(quiet=True))
        record["profile_s"] = time.perf_counter() - started
        profile = json.loads((folder / "profile.json").read_text())
        started = time.perf_counter()
        report = run_schedule(here, backend="gloo", model="problem", training=options, engine=engine)
        record["run_s"] = time.perf_counter() - started
    assert report is not None
    per_step = report.measured_step_times_ms
    best = min(per_step[1:]) if len(per_step) > 1 else per_step[0]
    record |= {
        "load_after": os.getloadavg()[0],
        "predicted_step_ms": here.step_time,
        "predicted_makespan_ms": here.makespan,
        "measured_step_times_ms": per_step,
        "measured_best_ms": best,
        "measured_median_ms": report.measured_step_time_ms,
        "error_best": best / here.step_time - 1,
        "error_median": report.measured_step_time_ms / here.step_time - 1,
        "run_predicted_makespan_ms": report.predicted_makespan_ms,
        "measured_makespan_ms": report.measured_makespan_ms,
        "simulated_makespan_from_measured_costs_ms": report.simulated_makespan_from_measured_costs_ms,
        "measured_costs_ms": report.measured_costs_ms,
        "profile_costs": profile.get("costs"),
        "verified": report.verified,
        "max_rel_param_error": report.max_rel_param_error,
        "engine_run": report.engine,
        "ranks": [
            {
                "rank": r.rank,
                "step_times_ms": r.step_times_ms,
                "compute_ms": r.compute_ms,
                "hidden_ms": r.communication_hidden_ms,
                "exposed_ms": r.communication_exposed_ms,
                "replica_wait_ms": r.communication_replica_wait_ms,
                "predicted_hidden_ms": r.predicted_communication_hidden_ms,
                "predicted_exposed_ms": r.predicted_communication_exposed_ms,
            }
            for r in report.ranks
        ],
    }
    return record


def main(argv: list[str] | None = None) -> None:
    from pipesched.optimizer.result import Schedule

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("schedule", type=Path, help="a demo run's schedule.json")
    parser.add_argument("--loops", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="training steps per run (the demo's 3)")
    parser.add_argument("--engine", default="auto", help="the run's engine (the demo's auto)")
    parser.add_argument("--tag", default="", help="a label written into every record")
    parser.add_argument("--output", type=Path, required=True, help="JSON lines, appended")
    args = parser.parse_args(argv)
    schedule = Schedule.model_validate_json(args.schedule.read_text())
    errors = []
    for k in range(args.loops):
        record = {"tag": args.tag, "loop": k, "utc": time.strftime("%H:%M:%S", time.gmtime())}
        record |= one_loop(schedule, args.steps, args.engine)
        errors.append(record["error_best"])
        with args.output.open("a") as out:
            out.write(json.dumps(record) + "\n")
        print(
            f"{args.tag} loop {k} {record['utc']} load {record['load_before']:.1f}→{record['load_after']:.1f}: "
            f"predicted {record['predicted_step_ms']:.1f} ms (makespan {record['predicted_makespan_ms']:.1f}), "
            f"steps {[round(s, 1) for s in record['measured_step_times_ms']]}, best {record['measured_best_ms']:.1f} "
            f"({100 * record['error_best']:+.0f}%), makespan measured {record['measured_makespan_ms']:.1f} "
            f"simulated from measured {record['simulated_makespan_from_measured_costs_ms']:.1f}; "
            f"profile {record['profile_s']:.0f} s run {record['run_s']:.0f} s",
            flush=True,
        )
    print(
        f"{args.tag}: error median {100 * statistics.median(errors):+.0f}%, range "
        f"{100 * min(errors):+.0f} … {100 * max(errors):+.0f}%"
    )


if __name__ == "__main__":
    main()
