"""Do PipeDream-2BW's passes run slower than the same passes under 1F1B? Interleaved runs in one launch, every pass.

Issue 25's second bar compares 1F1B's measured step with PipeDream-2BW's (no flush, two weight versions) on one
profile. The runs' ``compute_ms`` (the sum of a rank's pass spans) read up to 40 % higher under 2BW for the same F/B
work; this bench asks whether that is the schedule (2BW's passes themselves slower) or the run-to-run drift of the
same passes. One profile (or ``--problem``, a saved problem), 1F1B and 2BW solved on it, then ``--rounds`` rounds of
both in ONE launch (the same processes, the same pinned cores), the order turned every round (ABBA); every pass of
every step is kept (the launch's raw per-rank results, not the report's last step), with:

* its duration, kind (F, I, W, B), stage, step and (2BW) weight slot (step mod 2: slot 1 is the second version);
* ``beside``: the share of its span during which the other pipeline rank's passes ran (both ranks' instants are
  from one barrier: a step's for 1F1B, the run's for 2BW's steady run) — compute beside compute;
* its ``run_delay_ms`` (time ready but waiting for its core).

Run (heavy: hold the team lock): ``python bench/two_bw_passes.py --rounds 4 --steps 4 --output FILE.jsonl``;
``python bench/two_bw_passes.py --summary FILE.jsonl`` prints per-kind medians side by side and the pairing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _problem(path: Path | None, repeats: int) -> Any:
    from pipesched.optimizer.problem import Problem

    if path is not None:
        return Problem.model_validate_json(path.read_text()), None
    from pipesched.runtime.options import TrainingOptions
    from pipesched.runtime.profile import measure_model

    profile = measure_model(
        num_ranks=2,
        num_microbatches=8,
        model="gpt-small",
        repeats=repeats,
        training=TrainingOptions(sharding="none"),
    )
    return profile.problem, profile.two_version_optimizer_step


def _schedules(problem: Any, two_version_step: Any) -> dict[str, Any]:
    from pipesched.optimizer.solve import solve_family

    changes: dict[str, Any] = {"training": {"flush": False, "weight_versions": 2}, "objective": "step_period"}
    if two_version_step is not None:
        changes["costs.optimizer_step"] = two_version_step
    return {
        "1f1b": solve_family(problem, "1f1b"),
        "2bw": solve_family(problem.with_changes(**changes), "pipedream-2bw"),
    }


def _train_counting_faults(job: Any, global_rank: int, device: Any, timeout_s: float) -> tuple[Any, dict[str, Any]]:
    """A rank's run (:func:`~pipesched.runtime.training.train_rank`) and what else its job took: minor page faults,
    the process's CPU time (all its threads, gloo's included) beside the wall time, the steal ticks of its pinned
    core (``/proc/stat``), and Python's garbage collections (ms in total, the longest, full collections)."""
    import gc
    import resource

    from pipesched.runtime.training import train_rank

    pauses: list[tuple[int, float]] = []
    started = [0.0]
    where: list[dict[str, Any]] = []

    def clock(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        ms = (time.perf_counter() - started[0]) * 1e3
        pauses.append((info["generation"], ms))
        if info["generation"] == 2:
            # which of the run's functions was allocating when the full collection came (innermost first)
            frames, frame = [], sys._getframe(1)
            while frame is not None and len(frames) < 40:
                frames.append(frame.f_code.co_name)
                frame = frame.f_back
            names = [n for n in frames if n in _WHERE]
            where.append({"ms": round(ms, 3), "in": names[:3], "top": frames[:4]})

    core = min(os.sched_getaffinity(0))
    before = (resource.getrusage(resource.RUSAGE_SELF), _steal_ms(core), time.perf_counter())
    gc.callbacks.append(clock)
    try:
        result = train_rank(job, global_rank, device, timeout_s)
    finally:
        gc.callbacks.remove(clock)
    after = resource.getrusage(resource.RUSAGE_SELF)
    counters = {
        "faults": after.ru_minflt - before[0].ru_minflt,
        "wall_ms": round((time.perf_counter() - before[2]) * 1e3, 1),
        "cpu_ms": round((after.ru_utime + after.ru_stime - before[0].ru_utime - before[0].ru_stime) * 1e3, 1),
        "steal_ms": round(_steal_ms(core) - before[1], 1),
        "core": core,
        "gc_ms": round(sum(ms for _, ms in pauses), 3),
        "gc_max_ms": round(max((ms for _, ms in pauses), default=0.0), 3),
        "gc_full": sum(1 for generation, _ in pauses if generation == 2),
        "gc_full_where": where,
    }
    return result, counters


#: Functions of the run that tell where a full collection came: setup, a step, a pass or the update.
_WHERE = {
    "train_rank",
    "run_step",
    "run_steady",
    "_run_action",
    "_compute",
    "forward",
    "backward",
    "step",
    "build_stage",
    "load_model",
    "__init__",
    "compile",
    "run",
    "_run_steady",
    "_forward",
    "_backward_input",
    "_backward_weight",
    "_communicate",
    "drain",
}


def _steal_ms(core: int) -> float:
    """Steal time of ``core`` since boot, ms (``/proc/stat``'s eighth column, USER_HZ ticks)."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(f"cpu{core} "):
            return int(line.split()[8]) * 1e3 / os.sysconf("SC_CLK_TCK")
    return 0.0


def _launch(cases: list[tuple[str, Any]], steps: int) -> list[list[tuple[Any, dict[str, Any]]]]:
    """Every case one job of one launch; each job's raw per-rank results and page faults."""
    from pipesched.runtime.launch import launch_jobs, plan_runs
    from pipesched.runtime.options import TrainingOptions
    from pipesched.runtime.records import RankJob

    options = [TrainingOptions(steps=steps, lr=0.01, weight_update=name) for name, _ in cases]
    schedules = [schedule for _, schedule in cases]
    runs = plan_runs(schedules, model="gpt-small", engine="pipesched", training=options, seed=0, validate=True)
    with tempfile.TemporaryDirectory(prefix="two-bw-passes-") as workdir:
        jobs = [
            RankJob(run.schedule, run.model, 0, run.engine, workdir, index, run.training, run.steady_steps)
            for index, run in enumerate(runs)
        ]
        per_job = launch_jobs(_train_counting_faults, jobs, world=2, timeout_s=900)
    assert per_job is not None
    return per_job


def _passes(results: list[Any], per_step: int, steady: bool) -> list[dict[str, Any]]:
    """Every pass of every step of both ranks, with the share of its span beside the other rank's passes."""
    from pipesched.optimizer.ir import parse_action

    rows = []
    spans = {r.pp_rank: [[(a.start, a.end) for a in step.actions] for step in r.steps] for r in results}
    for result in results:
        other = spans[1 - result.pp_rank]
        for k, step in enumerate(result.steps):
            theirs = [s for row in other for s in row] if steady else other[k]
            for a in step.actions:
                action = parse_action(a.action)
                span = a.end - a.start
                beside = sum(max(0.0, min(a.end, e) - max(a.start, s)) for s, e in theirs)
                rows.append(
                    {
                        "rank": result.pp_rank,
                        "step": k,
                        "kind": action.kind.value,
                        "stage": action.stage,
                        "slot": (action.microbatch // per_step) % 2 if steady else 0,
                        "ms": round(span, 4),
                        "beside": round(beside / span, 4) if span > 0 else 0.0,
                        "run_delay_ms": a.run_delay_ms,
                    }
                )
    return rows


def measure(args: argparse.Namespace) -> None:
    problem, two_version_step = _problem(args.problem, args.repeats)
    schedules = _schedules(problem, two_version_step)
    order: list[str] = []
    for k in range(args.rounds):
        order += ["1f1b", "2bw"] if k % 2 == 0 else ["2bw", "1f1b"]
    started = time.strftime("%H:%M:%S", time.gmtime())
    per_job = _launch([(name if name == "2bw" else "sync", schedules[name]) for name in order], args.steps)
    m = problem.pipeline.num_microbatches
    with args.output.open("a") as out:
        for index, (name, counted) in enumerate(zip(order, per_job, strict=True)):
            results = [result for result, _ in counted]
            record = {
                "tag": args.tag,
                "utc": started,
                "job": index,
                "case": name,
                "malloc": os.environ.get("PIPESCHED_MALLOC", "keep"),
                "minor_faults": [counters["faults"] for _, counters in counted],
                "counters": [counters for _, counters in counted],
                "predicted_ms": schedules[name].step_period if name == "2bw" else schedules[name].step_time,
                "step_ms": [max(r.steps[k].time_ms for r in results) for k in range(args.steps)],
                "passes": _passes(results, m, name == "2bw"),
            }
            out.write(json.dumps(record) + "\n")
    print(f"{len(order)} runs written to {args.output}")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summary(paths: list[Path], first: int) -> None:
    """Per kind and rank: the median pass of each schedule over every job (steps from ``first``), and paired by
    launch: the 2BW job's median over the adjacent 1F1B job's; then the duration against ``beside``."""
    records = [json.loads(line) for path in paths for line in path.read_text().splitlines() if line.strip()]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["tag"], r["utc"]), []).append(r)
    keys = sorted({(p["rank"], p["kind"]) for r in records for p in r["passes"]})
    print(
        "launch | job case | "
        + " | ".join(f"r{rank} {kind}" for rank, kind in keys)
        + " | steps ms | minor faults per rank"
    )
    ratios: dict[tuple[int, str], list[float]] = {key: [] for key in keys}
    for (tag, utc), jobs in groups.items():
        medians = []
        for job in jobs:
            row = {
                key: _median([p["ms"] for p in job["passes"] if (p["rank"], p["kind"]) == key and p["step"] >= first])
                for key in keys
            }
            medians.append((job["case"], row))
            cells = " | ".join(f"{row[key]:.1f}" for key in keys)
            steps = [round(s) for s in job["step_ms"]]
            delay = [round(sum(p["run_delay_ms"] or 0.0 for p in job["passes"] if p["rank"] == r)) for r in (0, 1)]
            print(f"{tag} {utc} | {job['job']} {job['case']} | {cells} | {steps} | {job.get('minor_faults')} | {delay}")
        for (a, ra), (_, rb) in zip(medians[::2], medians[1::2], strict=False):
            one, two = (ra, rb) if a == "1f1b" else (rb, ra)
            for key in keys:
                ratios[key].append(two[key] / one[key])
    _gains(groups)
    print("2BW's median pass over the adjacent 1F1B job's, per pair:")
    for key, values in ratios.items():
        above = sum(v > 1 for v in values)
        print(
            f"  r{key[0]} {key[1]}: {' '.join(f'{v:.3f}' for v in values)}; median {_median(values):.3f}, "
            f"2BW slower in {above}/{len(values)}"
        )
    _beside(records, first)


def _best(job: dict[str, Any]) -> float:
    """The best step after the first (2BW: and before its last, the drain), as issue 25's bar reads a run."""
    steps = job["step_ms"][1:-1] if job["case"] == "2bw" else job["step_ms"][1:]
    return min(steps)


def _gains(groups: dict[tuple[str, str], list[dict[str, Any]]]) -> None:
    """Per launch: each adjacent pair's measured gain (1F1B's best step − 2BW's) against the predicted gain."""
    for (tag, utc), jobs in groups.items():
        pairs = list(zip(jobs[::2], jobs[1::2], strict=False))
        gains, predicted = [], None
        for a, b in pairs:
            one, two = (a, b) if a["case"] == "1f1b" else (b, a)
            gains.append(_best(one) - _best(two))
            if "predicted_ms" in one:
                predicted = one["predicted_ms"] - two["predicted_ms"]
        met = (
            ""
            if predicted is None
            else f"; ≥ half the predicted {predicted:.0f}: {sum(g >= predicted / 2 for g in gains)}"
        )
        listed = " ".join(f"{g:+.0f}" for g in gains)
        print(f"{tag} {utc}: gain per pair (1F1B best − 2BW best) {listed}{met}/{len(gains)}")


def _beside(records: list[dict[str, Any]], first: int) -> None:
    """Pass durations binned by the share of their span beside the other rank's passes, per schedule."""
    bins = ((0.0, 0.2), (0.2, 0.8), (0.8, 1.01))
    print("median pass (ms, count) by the share of its span beside the other rank's passes:")
    for case in ("1f1b", "2bw"):
        for rank, kind in sorted({(p["rank"], p["kind"]) for r in records for p in r["passes"]}):
            cells = []
            for lo, hi in bins:
                values = [
                    p["ms"]
                    for r in records
                    if r["case"] == case
                    for p in r["passes"]
                    if p["rank"] == rank and p["kind"] == kind and p["step"] >= first and lo <= p["beside"] < hi
                ]
                cells.append(f"[{lo:.1f},{min(hi, 1):.1f}) {_median(values):.1f} ({len(values)})")
            print(f"  {case} r{rank} {kind}: " + "  ".join(cells))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--problem", type=Path, help="a saved problem (JSON) instead of a fresh profile")
    parser.add_argument("--tag", default="")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--summary", type=Path, nargs="*")
    parser.add_argument("--first", type=int, default=1, help="the summary's first step (0: every step)")
    args = parser.parse_args(argv)
    if args.summary:
        summary(args.summary, args.first)
        return
    if args.output is None:
        parser.error("--output is required")
    measure(args)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
