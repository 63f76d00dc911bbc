"""Are collectives slower beside the passes? Breadth-first pp 2 × dp 2, each collective alone, in the calibration
run and in the run, with what ran beside it (issue 25).

Per launch: one profile of ``bench.runtime_bench``'s third shape (gpt-small, 2 pipeline ranks, 8 microbatches, two
stages per rank, FSDP2, the profile's default reading), looped-bfs solved on it, then ``--rounds`` runs of that
schedule (``--steps`` SGD steps each) on the own executor; every process's raw records are kept (``--raw DIR``, one
pickle per launch, gradients and parameters left out). Per pipeline rank and collective of the step, medians over
the steps after the first (both replicas):

* ``alone``: the profile's timing of the same stage's collective with no pass running (``RankProfile.unshard`` /
  ``reduce_grad``);
* ``calib`` / ``run``: its span from the last dp peer's start (the span the simulator times and the problem's
  ``costs.unshard`` / ``costs.reduce_grad`` are read from) in the calibration run and in the run, and ``beside``:
  how much of that span the process's own passes ran (its hidden time);
* per byte: each duration over the stage's unsharded weight bytes (stages 0 and 3 hold the embedding and the head,
  1 and 2 only blocks), so that a collective beside the passes and one alone compare at the same size.

Below the table: the run's span over the calibration's, collectives beside the passes (hidden more than half their
span in the calibration) against the others — whether the run charges an overlapped collective more than the
profile already does — and the run's hidden / exposed per process against the schedule's prediction.

Run: ``python -m bench.collective_overlap --launches 2 --raw /tmp/overlap`` (collects, then tabulates);
``python -m bench.collective_overlap --raw /tmp/overlap --no-collect`` (tabulates what is there).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import statistics
import time
from pathlib import Path
from typing import Any

NUM_RANKS, NUM_MICROBATCHES, STAGES_PER_RANK, DATA_PARALLEL = 2, 8, 2, 2
#: A collective counts as beside the passes when they ran through more than this share of its calibration span.
BESIDE_SHARE = 0.5


def collect(raw: Path, launches: int, rounds: int, steps: int, model: str, family: str = "looped-bfs") -> None:
    """``launches`` times: profile, solve ``family``, run it ``rounds`` times; raw records to
    ``raw/launch_<k>.pkl`` (after those already there)."""
    import tempfile

    from pipesched.optimizer.solve import solve_family
    from pipesched.runtime.launch import _report, launch_jobs, plan_runs
    from pipesched.runtime.options import TrainingOptions
    from pipesched.runtime.profile import ProfileSettings, _assemble, _skeleton, profile_rank
    from pipesched.runtime.records import RankJob
    from pipesched.runtime.training import train_rank

    options = TrainingOptions(data_parallel=DATA_PARALLEL, sharding="full")
    skeleton = _skeleton(NUM_RANKS, NUM_MICROBATCHES, STAGES_PER_RANK, "loop", options)
    raw.mkdir(parents=True, exist_ok=True)
    world = NUM_RANKS * DATA_PARALLEL
    first = len(list(raw.glob("launch_*.pkl")))
    for k in range(first, first + launches):
        before, started = os.getloadavg()[0], time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="pipesched-overlap-") as workdir:
            settings = ProfileSettings(skeleton, model, 0, 6, 2, options, workdir)
            returned = launch_jobs(profile_rank, [settings], world=world, timeout_s=900, replicas=DATA_PARALLEL)
        assert returned is not None
        profiled = returned[0]
        profile = _assemble(skeleton, profiled, options, None, None)
        schedule = solve_family(profile.problem, family)
        training = TrainingOptions(steps=steps, lr=0.01, data_parallel=DATA_PARALLEL, sharding="full")
        runs = plan_runs(
            [schedule] * rounds, model=model, engine="pipesched", training=[training] * rounds, seed=0, validate=True
        )
        with tempfile.TemporaryDirectory(prefix="pipesched-overlap-run-") as workdir:
            jobs = [
                RankJob(run.schedule, run.model, 0, run.engine, workdir, index, run.training, run.steady_steps)
                for index, run in enumerate(runs)
            ]
            per_job = launch_jobs(train_rank, jobs, world=world, timeout_s=900, replicas=DATA_PARALLEL)
        assert per_job is not None
        references: dict[str, Any] = {}
        reports = [
            _report(run, results, backend="gloo", seed=0, references=references)
            for run, results in zip(runs, per_job, strict=True)
        ]
        record = {
            "family": family,
            "profile": profiled,
            "problem": profile.problem,
            "schedule": schedule,
            "runs": [[dataclasses.replace(r, gradients={}, parameters={}) for r in results] for results in per_job],
            "verified": [report.verified for report in reports],
            "split": [
                [
                    (r.rank, r.communication_hidden_ms, r.communication_exposed_ms)
                    for r in sorted(report.ranks, key=lambda r: r.rank)
                ]
                for report in reports
            ],
            "load": (before, os.getloadavg()[0]),
            "seconds": time.perf_counter() - started,
        }
        (raw / f"launch_{k}.pkl").write_bytes(pickle.dumps(record))
        print(f"launch {k}: {record['seconds']:.0f} s, load {before:.1f} → {record['load'][1]:.1f}", flush=True)


def _spans(passes: list[list[Any]], joined: list[list[Any]]) -> dict[str, list[tuple[float, float]]]:
    """Per collective action of one process, per step: (its span from the last peer's start, the process's passes
    beside it), ms."""
    from pipesched.runtime.report import communication_overlap

    out: dict[str, list[tuple[float, float]]] = {}
    for step_passes, step_collectives in zip(passes, joined, strict=False):
        compute = [(a.start, a.end) for a in step_passes if _is_pass(a.action)]
        for c in step_collectives:
            if c.action.endswith("RESHARD"):
                continue
            hidden, _ = communication_overlap(compute, [(c.start, c.end)])
            out.setdefault(c.action, []).append((c.end - c.start, hidden))
    return out


def _planned(schedule: Any, pp: int) -> tuple[dict[str, Any], list[tuple[float, float]]]:
    """A schedule's collectives on pipeline rank ``pp`` by name, and its passes' spans."""
    actions = schedule.ranks[pp].actions
    return (
        {str(a.action): a for a in actions if a.kind in ("UNSHARD", "REDUCE_GRAD")},
        [(a.start, a.end) for a in actions if a.kind in "FIWB"],
    )


def _with_communication_slowdown(profiled: list[Any], schedule: Any) -> tuple[Any, Any]:
    """The launch's order timed on the profile with ``costs.communication_slowdown`` (the collectives' costs alone,
    the per-pass overhead fitted again with it), and the measured slowdown; ``(None, None)`` when none measured."""
    from pipesched.optimizer.result import build_schedule
    from pipesched.runtime.options import TrainingOptions
    from pipesched.runtime.profile import _assemble, _skeleton

    options = TrainingOptions(data_parallel=DATA_PARALLEL, sharding="full")
    skeleton = _skeleton(NUM_RANKS, NUM_MICROBATCHES, STAGES_PER_RANK, "loop", options)
    profile = _assemble(skeleton, profiled, options, None, None, write_communication_slowdown=True)
    communication = profile.calibration.communication if profile.calibration else None
    if communication is None:
        return None, None
    timed = build_schedule(profile.problem, schedule.orders(), method=schedule.method, backend="c", check_memory=False)
    return timed, communication


def _is_pass(action: str) -> bool:
    from pipesched.optimizer.ir import parse_action

    return parse_action(action).kind.value in ("F", "I", "W", "B")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def tabulate(raw: Path) -> list[str]:
    """Per launch the table of the module docstring, then the run / calibration ratios over every launch."""
    from pipesched.optimizer.ir import parse_action
    from pipesched.runtime.records import joined_steps
    from pipesched.runtime.report import communication_overlap

    lines: list[str] = []
    ratios: dict[bool, list[float]] = {True: [], False: []}
    per_byte: dict[tuple[str, bool], list[float]] = {}
    for path in sorted(raw.glob("launch_*.pkl"), key=lambda p: int(p.stem.split("_")[1])):
        record = pickle.loads(path.read_bytes())
        profiled, schedule = record["profile"], record["schedule"]
        slowed, communication = _with_communication_slowdown(profiled, schedule)
        lines.append(
            f"{path.name} ({record.get('family', 'looped-bfs')}): load {record['load'][0]:.1f} → "
            f"{record['load'][1]:.1f}, {record['seconds']:.0f} s, verified {record['verified']}"
        )
        if communication is not None:
            lines.append(
                f"  communication beside the passes: {communication.collectives} collectives overlapped "
                f"{communication.overlapped_ms:.0f} ms, +{communication.extra_ms:.0f} ms against alone "
                f"({communication.lone} lone): r {communication.ratio:.3f}, communication_slowdown "
                f"{communication.slowdown:.3f}; costs seen → alone: "
                + "; ".join(
                    f"{name} "
                    + " ".join(f"{a:.1f}→{b:.1f}" for a, b in zip(seen, communication.work[name], strict=True))
                    for name, seen in communication.seen.items()
                )
            )
        lines.append(
            "  pp  collective      bytes   alone  calib (beside)    run (beside)  predicted (beside)  with c (beside)  "
            "run/calib  ms/MB alone · calib · run"
        )
        for pp in range(NUM_RANKS):
            group = sorted((r for r in profiled if r.pp_rank == pp), key=lambda r: r.dp_rank)
            calibration: dict[str, list[tuple[float, float]]] = {}
            for r in group:
                for key, values in _spans(r.calibration_passes, r.calibration_joined).items():
                    calibration.setdefault(key, []).extend(values)
            run: dict[str, list[tuple[float, float]]] = {}
            for results in record["runs"]:
                replicas = sorted((r for r in results if r.pp_rank == pp), key=lambda r: r.dp_rank)
                joined = joined_steps([[s.communication for s in r.steps] for r in replicas])
                for r, steps in zip(replicas, joined, strict=True):
                    for key, values in _spans([s.actions for s in r.steps[1:]], steps[1:]).items():
                        run.setdefault(key, []).extend(values)
            planned, compute = _planned(schedule, pp)
            planned_c, compute_c = _planned(slowed, pp) if slowed is not None else ({}, [])
            for key in sorted(calibration, key=lambda k: (parse_action(k).kind.value, parse_action(k).stage)):
                action = parse_action(key)
                name = "unshard" if action.kind.value == "UNSHARD" else "reduce_grad"
                alone = _median([v for r in group for v in getattr(r, name).get(action.stage, [])])
                weight = group[0].weight_bytes.get(action.stage) or 0
                c_dur = _median([d for d, _ in calibration[key]])
                c_beside = _median([h for _, h in calibration[key]])
                r_dur = _median([d for d, _ in run.get(key, [])])
                r_beside = _median([h for _, h in run.get(key, [])])
                plan = planned.get(key)
                p_dur = plan.end - plan.start if plan else float("nan")
                p_beside = communication_overlap(compute, [(plan.start, plan.end)])[0] if plan else float("nan")
                plan_c = planned_c.get(key)
                c_span = plan_c.end - plan_c.start if plan_c else float("nan")
                c_hidden = communication_overlap(compute_c, [(plan_c.start, plan_c.end)])[0] if plan_c else float("nan")
                beside = c_beside > BESIDE_SHARE * c_dur
                ratios[beside].append(r_dur / c_dur)
                mb = weight / 1e6
                for label, value in (("alone", alone), ("calib", c_dur), ("run", r_dur)):
                    per_byte.setdefault((f"{name} {label}", beside), []).append(value / mb)
                lines.append(
                    f"  {pp:2d}  {key:13s} {mb:6.2f}MB {alone:6.1f} {c_dur:6.1f} ({c_beside:5.1f}) "
                    f"{r_dur:7.1f} ({r_beside:5.1f}) {p_dur:9.1f} ({p_beside:5.1f}) {c_span:8.1f} ({c_hidden:5.1f})"
                    f"     {r_dur / c_dur:5.2f}  "
                    f"{alone / mb:5.1f} · {c_dur / mb:5.1f} · {r_dur / mb:5.1f}"
                )
        for k, split in enumerate(record["split"]):
            lines.append(
                f"  round {k + 1}: hidden/exposed per process (median per step after the first): "
                + "; ".join(f"r{rank} {_median(h[1:]):.1f}/{_median(e[1:]):.1f}" for rank, h, e in split)
            )
        for label, timed in (("", schedule), (" with c", slowed)):
            if timed is None:
                continue
            predicted = []
            for pp, rank in enumerate(timed.ranks):
                comm = [(a.start, a.end) for a in rank.actions if a.kind in ("UNSHARD", "REDUCE_GRAD")]
                hidden, exposed = communication_overlap(
                    [(a.start, a.end) for a in rank.actions if a.kind in "FIWB"], comm
                )
                predicted.append(f"pp{pp} {hidden:.1f}/{exposed:.1f}")
            lines.append(
                f"  predicted{label}: step {timed.objective_value:.1f} ms, hidden/exposed " + "; ".join(predicted)
            )
        lines.append("")
    for beside, ratio in ratios.items():
        if ratio:
            lines.append(
                f"run / calibration span, collectives {'beside the passes' if beside else 'alone or mostly alone'}: "
                f"median {_median(ratio):.2f}, {min(ratio):.2f}–{max(ratio):.2f} ({len(ratio)} collective-launches)"
            )
    for (label, beside), rate in sorted(per_byte.items()):
        lines.append(
            f"ms per MB, {label:17s} {'beside' if beside else 'alone '}: median {_median(rate):5.1f} "
            f"({min(rate):.1f}–{max(rate):.1f}, {len(rate)})"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=2, help="profile + runs, this many times (default 2)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of the schedule per launch (default 2)")
    parser.add_argument("--steps", type=int, default=6, help="training steps per run (default 6)")
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--family", default="looped-bfs", help="the schedule run (default looped-bfs)")
    parser.add_argument("--raw", type=Path, required=True, help="where the launches' raw records are kept")
    parser.add_argument("--no-collect", action="store_true", help="only tabulate the records already in --raw")
    parser.add_argument("--output", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    if not args.no_collect:
        collect(args.raw, args.launches, args.rounds, args.steps, args.model, args.family)
    lines = tabulate(args.raw)
    print("\n".join(lines))
    if args.output is not None:
        args.output.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
