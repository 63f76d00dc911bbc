"""Issue 25's bars as a checker reads them: one fresh profile per bar per launch, each run once, no rounds.

The runtime bench (``bench/runtime_bench.py``) reads the bars on its own protocol (several rounds per case,
interleaved, 6 steps each); a checker runs each bar once, as the issue states it. This script does that, ``--launches``
times, and writes one JSON line per launch and bar (raw figures, the load average before and after), so that which
bar misses, by what, on which rank and statistic, is read from many launches rather than one:

* ``1``: ``profile`` (gpt-small, 2 ranks, 8 microbatches, ``--repeats``) → solve ``1f1b`` and ``zb-h1`` → run each 4
  steps on the own executor: the best step after the first within −20 % … +25 % of predicted, static memory within
  15 % on every rank;
* ``2``: on the same profile PipeDream-2BW (no flush, two weight versions, its steady steps) against 1F1B: the
  measured gain (1F1B's step − 2BW's) at least half the predicted gain (1F1B's ``step_time`` − 2BW's ``step_period``);
  read on the best step (bar 1's statistic) and on the report's ``measured_step_time_ms`` (its median) — both kept;
* ``2p`` (with ``--bar2-pairs N``): bar 2 read from paired runs — on the same profile, 1F1B and 2BW as ``2N`` jobs
  of ONE launch (the same rank processes, the same pinned cores), the order turned every pair (ABBA: 1F1B 2BW,
  2BW 1F1B, …; ``pipesched.runtime.launch.run_schedules``), each job a 4-step run with its own report; per pair the
  gain (1F1B's best step − 2BW's, and the same on the reports' medians), met when the median pair's gain is at
  least half the predicted gain. Two separate launches (bar 2) drift 4–27 % apart in rank 1's passes
  (``bench/results/pass_drift.md``); adjacent jobs of one launch share that drift;
* ``3``: ``profile`` breadth-first (looped-bfs, two stages per rank) × dp 2 FSDP → solve → run 4 steps: every rank's
  ``communication_hidden_ms`` > 0 and hidden and exposed within 30 % of predicted (medians over the steps after the
  first, against the report's ``predicted_communication_*``);
* ``demo``: ``pipesched demo --quick`` (README's first command, its quick form): ``this-machine.json``'s error.

Run (heavy: hold the team lock; ~3–4 min a launch with every bar, about 20 s more per pair):
``python bench/issue25_bars.py --launches 1 --bars 1,2,3,demo --output bench/results/issue25_bars/FILE.jsonl``.
Run it as a script with the venv whose ``pipesched`` is to be measured (it imports nothing from ``bench``).
``python bench/issue25_bars.py --summary FILE.jsonl …`` prints the counts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STEPS = 4
STEP_BAR = (-0.20, 0.25)
STATIC_BAR = 0.15
SPLIT_BAR = 0.30
GAIN_SHARE = 0.5


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _profile(stages_per_rank: int, data_parallel: int, repeats: int, model: str) -> Any:
    from pipesched.runtime.options import TrainingOptions
    from pipesched.runtime.profile import measure_model

    options = TrainingOptions(data_parallel=data_parallel, sharding="full" if data_parallel > 1 else "none")
    return measure_model(
        num_ranks=2,
        num_microbatches=8,
        stages_per_rank=stages_per_rank,
        placement="loop",
        model=model,
        repeats=repeats,
        training=options,
    )


def _profiled(record: dict[str, Any], stages_per_rank: int, data_parallel: int, repeats: int, model: str) -> Any:
    """:func:`_profile`, its time and its calibration's step and per-pass overhead written into ``record``."""
    started = time.perf_counter()
    profile = _profile(stages_per_rank, data_parallel, repeats, model)
    record["profile_s"] = round(time.perf_counter() - started, 1)
    record["calibration"] = {
        "measured_ms": profile.calibration.measured_ms,
        "overhead_ms": profile.calibration.overhead_ms,
    }
    return profile


def _run(schedule: Any, model: str, data_parallel: int = 1, weight_update: str = "sync", steps: int = STEPS) -> Any:
    from pipesched.runtime.launch import run_schedule
    from pipesched.runtime.options import TrainingOptions

    options = TrainingOptions(
        steps=steps,
        lr=0.01,
        data_parallel=data_parallel,
        sharding="full" if data_parallel > 1 else "none",
        weight_update=weight_update,
    )
    return run_schedule(schedule, backend="gloo", model=model, engine="pipesched", training=options, timeout_s=900)


def _step_record(schedule: Any, report: Any, pattern: bool) -> dict[str, Any]:
    from pipesched.runtime.report import steady_steps

    steps = report.measured_step_times_ms
    best = min(steady_steps(steps, pattern))
    predicted = report.predicted_step_time_ms
    static = [r.static_bytes_measured / r.static_bytes_predicted - 1 for r in report.ranks if r.static_bytes_predicted]
    return {
        "predicted_ms": predicted,
        "steps_ms": steps,
        "best_ms": best,
        "median_ms": report.measured_step_time_ms,
        "best_error": best / predicted - 1,
        "static_errors": static,
        "verified": report.verified,
        "run_delay_ms": [r.run_delay_ms for r in report.ranks],
        "compute_ms": [r.compute_ms for r in report.ranks],
    }


def bars_1_2(model: str, repeats: int, with_2bw: bool, pairs: int = 0) -> list[dict[str, Any]]:
    """One profile of the one-stage-per-rank shape; 1F1B, ZB-H1 (and 2BW) solved on it, each run once; then, with
    ``pairs``, bar 2 again from that many paired 1F1B/2BW jobs of one launch on the same profile
    (:func:`paired_bar_2`)."""
    from pipesched.optimizer.solve import solve_family

    record: dict[str, Any] = {"bar": "1", "load_before": _load()}
    profile = _profiled(record, 1, 1, repeats, model)
    problem = profile.problem
    cases = {}
    for family in ("1f1b", "zb-h1"):
        schedule = solve_family(problem, family)
        cases[family] = _step_record(schedule, _run(schedule, model), False) | {"load_after": _load()}
    record["cases"] = cases
    step_ok = all(STEP_BAR[0] <= c["best_error"] <= STEP_BAR[1] for c in cases.values())
    static_ok = all(abs(e) <= STATIC_BAR for c in cases.values() for e in c["static_errors"])
    record["met"] = {"step": step_ok, "static": static_ok}
    record["load_after"] = _load()
    out = [record]
    if with_2bw:
        schedule = _two_bw(problem, profile.two_version_optimizer_step)
        two_bw = _step_record(schedule, _run(schedule, model, weight_update="2bw"), True)
        one = cases["1f1b"]
        predicted_gain = one["predicted_ms"] - two_bw["predicted_ms"]
        gains = {"best": one["best_ms"] - two_bw["best_ms"], "median": one["median_ms"] - two_bw["median_ms"]}
        out.append(
            {
                "bar": "2",
                "load_before": record["load_after"],
                "two_bw": two_bw,
                "predicted_gain_ms": predicted_gain,
                "gain_ms": gains,
                "met": {k: v >= GAIN_SHARE * predicted_gain for k, v in gains.items()},
                "load_after": _load(),
            }
        )
    if pairs:
        out.append(paired_bar_2(model, repeats, pairs, profile))
    return out


def _two_bw(problem: Any, two_version_step: Any) -> Any:
    """PipeDream-2BW on ``problem`` (no flush, two weight versions, its optimizer step with the second version's
    copy when the profile timed it), solved for its steady period."""
    from pipesched.optimizer.solve import solve_family

    changes: dict[str, Any] = {"training": {"flush": False, "weight_versions": 2}, "objective": "step_period"}
    if two_version_step is not None:
        changes["costs.optimizer_step"] = two_version_step
    return solve_family(problem.with_changes(**changes), "pipedream-2bw")


#: A pair is read as quiet when no rank of either job waited more than this for its core in a step (``run_delay_ms``):
#: section 1 of bench/results/issue25_bars.md found every case of bar 1 within its bar where no rank waited more than
#: 20 ms a step, and the processes outside the team lock the cause where they did.
QUIET_DELAY_MS = 20.0


def _most_delay(job: dict[str, Any]) -> float:
    """The most any rank of a job waited for its core in one step (ms; 0 where not reported)."""
    return max((max(delays or [0.0]) for delays in job["run_delay_ms"]), default=0.0)


def paired_bar_2(model: str, repeats: int, pairs: int, profile: Any = None) -> dict[str, Any]:
    """Bar 2 from ``pairs`` adjacent 1F1B/2BW pairs of one launch (ABBA), on ``profile`` (a fresh one if ``None``)."""
    from pipesched.optimizer.solve import solve_family
    from pipesched.runtime.launch import run_schedules
    from pipesched.runtime.options import TrainingOptions

    record: dict[str, Any] = {"bar": "2p", "load_before": _load(), "pairs": pairs}
    if profile is None:
        profile = _profiled(record, 1, 1, repeats, model)
    cases = {
        "1f1b": solve_family(profile.problem, "1f1b"),
        "2bw": _two_bw(profile.problem, profile.two_version_optimizer_step),
    }
    order = [name for k in range(pairs) for name in (("1f1b", "2bw") if k % 2 == 0 else ("2bw", "1f1b"))]
    updates = {"1f1b": "sync", "2bw": "2bw"}
    options = [TrainingOptions(steps=STEPS, lr=0.01, weight_update=updates[name]) for name in order]
    reports = run_schedules(
        [cases[name] for name in order], model=model, engine="pipesched", training=options, timeout_s=900
    )
    jobs = []
    for name, report in zip(order, reports, strict=True):
        assert report is not None
        jobs.append({"case": name} | _step_record(cases[name], report, name == "2bw"))
    gains: dict[str, list[float]] = {"best": [], "median": []}
    quiet = []
    for k in range(pairs):
        one, two = sorted(jobs[2 * k : 2 * k + 2], key=lambda job: job["case"])  # "1f1b" < "2bw"
        gains["best"].append(one["best_ms"] - two["best_ms"])
        gains["median"].append(one["median_ms"] - two["median_ms"])
        if max(_most_delay(one), _most_delay(two)) <= QUIET_DELAY_MS:
            quiet.append(k)
    predicted_gain = one["predicted_ms"] - two["predicted_ms"]
    medians = {k: statistics.median(v) for k, v in gains.items()}
    if quiet:
        medians["best, quiet pairs"] = statistics.median(gains["best"][k] for k in quiet)
    record |= {
        "order": order,
        "jobs": jobs,
        "predicted_gain_ms": predicted_gain,
        "gain_ms": gains,
        "quiet_pairs": quiet,
        "median_gain_ms": medians,
        "met": {k: v >= GAIN_SHARE * predicted_gain for k, v in medians.items()},
        "load_after": _load(),
    }
    return record


def bar_3(model: str, repeats: int, steps: int = STEPS) -> dict[str, Any]:
    """One profile of breadth-first pp 2 × dp 2 (FSDP); looped-bfs solved on it, run once."""
    from pipesched.optimizer.solve import solve_family

    record: dict[str, Any] = {"bar": "3", "load_before": _load(), "steps": steps}
    profile = _profiled(record, 2, 2, repeats, model)
    record["collective_costs"] = {
        "unshard": profile.problem.costs.unshard,
        "reduce_grad": profile.problem.costs.reduce_grad,
    }
    schedule = solve_family(profile.problem, "looped-bfs")
    report = _run(schedule, model, data_parallel=2, steps=steps)
    record |= _step_record(schedule, report, False)
    ranks, misses = [], []
    for rank in report.ranks:
        row: dict[str, Any] = {"rank": rank.rank}
        for split in ("hidden", "exposed"):
            per_step = getattr(rank, f"communication_{split}_ms")
            measured = statistics.median(per_step[1:] or per_step)
            predicted = getattr(rank, f"predicted_communication_{split}_ms")
            error = measured / predicted - 1 if predicted else None
            row[split] = {"per_step": per_step, "measured": measured, "predicted": predicted, "error": error}
            if error is None or abs(error) > SPLIT_BAR:
                misses.append(f"r{rank.rank} {split} {'—' if error is None else f'{100 * error:+.0f}%'}")
        if row["hidden"]["measured"] <= 0:
            misses.append(f"r{rank.rank} hidden 0")
        row["replica_wait_ms"] = rank.communication_replica_wait_ms
        row["same_step_predicted_hidden_ms"] = rank.same_step_predicted_hidden_ms
        row["same_step_predicted_exposed_ms"] = rank.same_step_predicted_exposed_ms
        ranks.append(row)
    record["ranks"] = ranks
    record["misses"] = misses
    record["met"] = {"split": not misses}
    record["load_after"] = _load()
    return record


def demo() -> dict[str, Any]:
    """``pipesched demo --quick`` with this interpreter's ``pipesched``; its ``this-machine.json``."""
    record: dict[str, Any] = {"bar": "demo", "load_before": _load()}
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        done = subprocess.run(
            [str(Path(sys.executable).with_name("pipesched")), "demo", "--quick", "-o", tmp],
            capture_output=True,
            text=True,
            check=False,
        )
        record["wall_s"] = round(time.perf_counter() - started, 1)
        found = Path(tmp) / "this-machine.json"
        if done.returncode != 0 or not found.exists():
            record["failed"] = done.stdout[-2000:] + done.stderr[-2000:]
            return record
        record |= json.loads(found.read_text())
        report = json.loads((Path(tmp) / "report.json").read_text())
        record["steps_ms"] = report.get("measured_step_times_ms")
    record["load_after"] = _load()
    return record


def _summary(paths: list[Path]) -> None:
    records = [json.loads(line) for path in paths for line in path.read_text().splitlines() if line.strip()]
    tags = sorted({r.get("tag", "") for r in records})
    for tag in tags:
        mine = [r for r in records if r.get("tag", "") == tag]
        print(f"== {tag}")
        for bar in ("1", "2", "2p", "3", "demo"):
            rows = [r for r in mine if r["bar"] == bar]
            if not rows:
                continue
            if bar == "demo":
                errors = [r["error"] for r in rows if "error" in r]
                print(
                    f"demo: {len(errors)} runs, error median {100 * statistics.median(errors):+.1f}%, "
                    f"range {100 * min(errors):+.0f} … {100 * max(errors):+.0f}%, "
                    f"mean |error| {100 * statistics.mean(abs(e) for e in errors):.1f}%: "
                    + ", ".join(f"{100 * e:+.0f}" for e in errors)
                )
                alone = [r["error_profile_alone"] for r in rows if "error_profile_alone" in r]
                if alone:
                    print(
                        f"  the same runs against the profile alone: median {100 * statistics.median(alone):+.1f}%, "
                        f"range {100 * min(alone):+.0f} … {100 * max(alone):+.0f}%, mean |error| "
                        f"{100 * statistics.mean(abs(e) for e in alone):.1f}%: "
                        + ", ".join(f"{100 * e:+.0f}" for e in alone)
                    )
                for r in rows:
                    print(
                        f"  {r.get('utc', '')} load {r['load_before']:.1f}→{r.get('load_after', 0):.1f}: "
                        f"predicted {r.get('predicted_step_ms', 0):.1f}, measured {r.get('measured_step_ms', 0):.1f}, "
                        f"wall {r['wall_s']:.0f} s"
                    )
                continue
            keys = sorted(rows[0]["met"])
            counts = ", ".join(f"{k} {sum(r['met'][k] for r in rows)}/{len(rows)}" for k in keys)
            print(f"bar {bar}: {counts}")
            for r in rows:
                load = f"load {r['load_before']:.1f}→{r['load_after']:.1f}"
                if bar == "1":
                    detail = ", ".join(
                        f"{f} {100 * c['best_error']:+.0f}% (pred {c['predicted_ms']:.0f}, best {c['best_ms']:.0f})"
                        for f, c in r["cases"].items()
                    )
                elif bar == "2p":
                    detail = (
                        f"predicted gain {r['predicted_gain_ms']:.0f}, per pair best "
                        + " ".join(f"{g:+.0f}" for g in r["gain_ms"]["best"])
                        + f" (median {r['median_gain_ms']['best']:+.0f}), median "
                        + " ".join(f"{g:+.0f}" for g in r["gain_ms"]["median"])
                        + f" (median {r['median_gain_ms']['median']:+.0f})"
                        + (
                            f"; quiet pairs {r['quiet_pairs']}: best median "
                            f"{r['median_gain_ms']['best, quiet pairs']:+.0f}"
                            if r.get("quiet_pairs")
                            else "; no quiet pair"
                        )
                    )
                elif bar == "2":
                    detail = (
                        f"predicted gain {r['predicted_gain_ms']:.0f}, best {r['gain_ms']['best']:+.0f}, "
                        f"median {r['gain_ms']['median']:+.0f}"
                    )
                else:
                    detail = (
                        f"step {100 * r['best_error']:+.0f}%; "
                        + " · ".join(
                            f"r{x['rank']} {x['hidden']['measured']:.0f}/{x['exposed']['measured']:.0f} "
                            f"({x['hidden']['predicted']:.0f}/{x['exposed']['predicted']:.0f})"
                            for x in r["ranks"]
                        )
                        + (f"; misses: {', '.join(r['misses'])}" if r["misses"] else "")
                    )
                print(f"  {r.get('utc', '')} {load}: {detail}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=1)
    parser.add_argument("--bars", default="1,2,3,demo", help="comma-separated: 1 (with 2), 2, 3, demo")
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--repeats", type=int, default=6, help="the profile's --repeats (README's command: 6)")
    parser.add_argument(
        "--bar3-steps", type=int, default=STEPS, help="bar 3's run (the issue names none; bar 1's 4 by default)"
    )
    parser.add_argument(
        "--bar2-pairs",
        type=int,
        default=0,
        help="also read bar 2 from this many adjacent 1F1B/2BW pairs of one launch (ABBA), on bar 1's profile",
    )
    parser.add_argument("--tag", default="")
    parser.add_argument("--output", type=Path, help="JSON lines, appended")
    parser.add_argument("--summary", type=Path, nargs="*", help="print the counts of these files and exit")
    args = parser.parse_args(argv)
    if args.summary:
        _summary(args.summary)
        return
    if args.output is None:
        parser.error("--output is required")
    import pipesched

    bars = set(args.bars.split(","))
    for launch in range(args.launches):
        records: list[dict[str, Any]] = []
        if bars & {"1", "2"}:
            records += bars_1_2(args.model, args.repeats, "2" in bars, args.bar2_pairs)
        if "3" in bars:
            records.append(bar_3(args.model, args.repeats, args.bar3_steps))
        if "demo" in bars:
            records.append(demo())
        for record in records:
            record |= {
                "tag": args.tag,
                "launch": launch,
                "utc": time.strftime("%H:%M:%S", time.gmtime()),
                "pipesched": str(Path(pipesched.__file__).parent),
            }
            with args.output.open("a") as out:
                out.write(json.dumps(record) + "\n")
            print(json.dumps({k: v for k, v in record.items() if k in ("bar", "met", "misses", "error", "utc")}))
            sys.stdout.flush()


if __name__ == "__main__":
    main()
