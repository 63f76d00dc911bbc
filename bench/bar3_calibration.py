"""Issue 25's bar 3: the calibration run's collectives beside the run's, from one fresh profile per launch.

Breadth-first (looped-bfs, two stages a rank) pp 2 × dp 2 FSDP on gpt-small: profile (as ``bench/issue25_bars.py
--bars 3`` does), then run looped-bfs ``--steps`` steps on the own executor. On a looped placement the calibration
order is breadth-first's own, so the two runs issue the same actions in the same order; what the profile writes as
``costs.unshard`` / ``costs.reduce_grad`` is read from the first, what the run report measures from the second. For
every process and step of both (the calibration's steps after its first, as the profile reads them; the run's every
step): its step time, every pass's start and end, the sum of its passes' spans, each communication action's span
(from its last dp peer's start, as the profile and the report join them), the part its passes overlapped (hidden)
and the passes beside it. One JSON line per launch with the profile's costs and the prediction of the same profile
with and without ``costs.overlap_slowdown`` written (each collective's and pass's predicted timeline). Run (heavy:
hold the team lock, ~2 min a launch): ``python bench/bar3_calibration.py --steps 8 --output FILE.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _collective_rows(pp: int, rank: int, steps: list[tuple[float, list[Any], list[Any]]]) -> list[dict[str, Any]]:
    """Per step of one process: ``(step ms, passes, joined communication)`` → its row (ms, one decimal)."""
    from pipesched.runtime.report import communication_overlap

    rows = []
    for k, (step_ms, actions, communication) in enumerate(steps):
        passes = [(a.start, a.end) for a in actions]
        spans = []
        for c in communication:
            beside = [a.action for a in actions if a.start < c.end and a.end > c.start]
            hidden = communication_overlap(passes, [(c.start, c.end)])[0] if c.end > c.start else 0.0
            spans.append([c.action, round(c.start, 1), round(c.end - c.start, 1), round(hidden, 1), beside])
        rows.append(
            {
                "rank": rank,
                "pp": pp,
                "step": k,
                "step_ms": round(step_ms, 1),
                "compute_ms": round(sum(end - start for start, end in passes), 1),
                "communication": spans,
                "passes": [[a.action, round(a.start, 1), round(a.end, 1)] for a in actions],
            }
        )
    return rows


def _calibration(results: list[Any]) -> list[dict[str, Any]]:
    """The calibration run's rows (its steps after the first, each collective from its last dp peer's start)."""
    rows = []
    for r in sorted(results, key=lambda r: r.rank):
        steps = list(zip(r.calibration_ms[1:], r.calibration_passes, r.calibration_joined, strict=False))
        rows += _collective_rows(r.pp_rank, r.rank, steps)
    return rows


def _run_rows(results: list[Any]) -> list[dict[str, Any]]:
    """The run's rows (every step, each collective from its last dp peer's start)."""
    from pipesched.runtime.records import joined_steps

    rows = []
    for pp in sorted({r.pp_rank for r in results}):
        group = sorted((r for r in results if r.pp_rank == pp), key=lambda r: r.dp_rank)
        joined = joined_steps([[s.communication for s in r.steps] for r in group])
        for result, communication in zip(group, joined, strict=True):
            steps = [(s.time_ms, s.actions, c) for s, c in zip(result.steps, communication, strict=False)]
            rows += _collective_rows(pp, result.rank, steps)
    return rows


def _safely(read: Any, *arguments: Any) -> Any:
    """``read(*arguments)``, or its error's text: a reading that fails does not lose the launch's other figures."""
    try:
        return read(*arguments)
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}


def _prediction(assemble: Any, arguments: tuple[Any, ...], write_slowdown: bool) -> dict[str, Any]:
    """The same profile's problem with or without the measured ``costs.overlap_slowdown`` written
    (``measure_model(..., overlap_slowdown=…)``, the per-pass overhead fitted again), looped-bfs solved on it: its
    step and, per pipeline rank, its (hidden, exposed) ms and each collective's predicted (start, end, hidden) and
    each pass's predicted (start, end)."""
    from pipesched.optimizer.solve import solve_family
    from pipesched.runtime.report import _predicted_overlap, communication_overlap

    skeleton, results, options, p2p_ms, limit, _, *rest = arguments
    found = assemble(skeleton, results, options, p2p_ms, limit, write_slowdown, *rest)
    schedule = solve_family(found.problem, "looped-bfs")
    collectives, passes = {}, {}
    for pp, rank in enumerate(schedule.ranks):
        spans = [(a.start, a.end) for a in rank.actions if a.kind in "FIWB"]
        collectives[pp] = [
            [str(a.action), round(a.start, 1), round(a.end, 1), communication_overlap(spans, [(a.start, a.end)])[0]]
            for a in rank.actions
            if a.kind in ("UNSHARD", "REDUCE_GRAD")
        ]
        passes[pp] = [[str(a.action), round(a.start, 1), round(a.end, 1)] for a in rank.actions if a.kind in "FIWB"]
    return {
        "slowdown": found.problem.costs.overlap_slowdown,
        "overhead_ms": found.calibration.overhead_ms if found.calibration else None,
        "step_ms": schedule.step_time,
        "predicted": {pp: _predicted_overlap(schedule, pp) for pp in range(len(schedule.ranks))},
        "collectives": collectives,
        "passes": passes,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    from pipesched.optimizer.solve import solve_family
    from pipesched.runtime import launch, profile
    from pipesched.runtime.options import TrainingOptions

    captured: dict[str, Any] = {}
    assemble, launch_jobs = profile._assemble, launch.launch_jobs

    def keep_results(skeleton: Any, results: list[Any], *rest: Any) -> Any:
        captured["profile"] = results
        captured["assemble"] = (skeleton, results, *rest)
        return assemble(skeleton, results, *rest)

    def keep_launch(*a: Any, **k: Any) -> Any:
        returned = launch_jobs(*a, **k)
        captured["run"] = returned
        return returned

    profile._assemble = keep_results  # type: ignore[assignment]
    launch.launch_jobs = keep_launch  # type: ignore[assignment]
    options = TrainingOptions(data_parallel=2, sharding="full")
    load_before = round(os.getloadavg()[0], 2)
    found = profile.measure_model(
        num_ranks=2, num_microbatches=8, stages_per_rank=2, model="gpt-small", repeats=args.repeats, training=options
    )
    schedule = solve_family(found.problem, "looped-bfs")
    run = TrainingOptions(steps=args.steps, lr=0.01, data_parallel=2, sharding="full")
    report = launch.run_schedule(
        schedule, backend="gloo", model="gpt-small", engine="pipesched", training=run, timeout_s=900
    )
    assert report is not None
    costs = found.problem.costs
    assert costs is not None
    record = {
        "tag": args.tag,
        "utc": time.strftime("%H:%M:%S", time.gmtime()),
        "load": [load_before, round(os.getloadavg()[0], 2)],
        "unshard": costs.unshard,
        "reduce_grad": costs.reduce_grad,
        "forward": costs.forward,
        "calibration_step_ms": found.calibration.measured_ms if found.calibration else None,
        "overhead_ms": found.calibration.overhead_ms if found.calibration else None,
        "predicted_step_ms": report.predicted_step_time_ms,
        "predicted": {
            r.rank: [r.predicted_communication_hidden_ms, r.predicted_communication_exposed_ms] for r in report.ranks
        },
        "measured": {r.rank: [r.communication_hidden_ms, r.communication_exposed_ms] for r in report.ranks},
        "predicted_collectives": {
            r.rank: [[c.action, c.predicted_start, c.predicted_end, c.predicted_hidden_ms] for c in r.collectives]
            for r in report.ranks
        },
        "overlap_slowdown": found.calibration.overlap.slowdown
        if found.calibration and found.calibration.overlap
        else None,
        "problem": found.problem.model_dump(mode="json"),
        "with_overlap_slowdown": _safely(_prediction, assemble, captured["assemble"], True),
        "without_overlap_slowdown": _safely(_prediction, assemble, captured["assemble"], False),
        "calibration": _calibration(captured["profile"]),
        "run": _run_rows(captured["run"][0]),
    }
    with args.output.open("a") as out:
        out.write(json.dumps(record) + "\n")
    print(f"calibration and run of {args.steps} steps written to {args.output}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
