"""Where PipeDream-2BW's steady step goes against 1F1B's, on one profile: per rank and step, the time in passes, the
rest, and each pass kind's median, measured beside predicted.

Profiles ``bench.runtime_bench``'s first shape (gpt-small, 2 pipeline ranks, 8 microbatches, one stage per rank),
solves 1F1B, ZB-H1 and the pipedream-2bw pattern on it (``--cases``), and runs them ``--rounds`` times interleaved in
one launch, the order turned each round (as the bench does, without its verification: the bench verifies the same
runs). Per case, rank and step after the first (2BW: and before its drain): ``step`` (1F1B: from the common start to the
end of the optimizer step; 2BW: from the
end of the rank's previous step to the end of this one), ``passes`` (the sum of the step's F/B durations, its
microbatches' passes wherever they ran) and ``rest`` (step − passes: waits for messages, the update, bookkeeping);
each the median over steps and rounds. Beside them the prediction's: the schedule's per-rank pass time per step
(the profile's costs, its fitted per-pass overhead included) and its step. Then per stage and kind the median pass
duration in each case against the profile's cost.

Run: ``python -m bench.two_bw_trace [--rounds 3] [--steps 6]``; results in ``bench/results/two_bw_trace.txt``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.runtime_bench import NUM_MICROBATCHES, NUM_RANKS, SHAPES, case_changes, round_order
from pipesched.optimizer.ir import parse_action
from pipesched.optimizer.solve import solve_family


def _per_step(results: list[Any], steady: bool) -> dict[int, list[tuple[float, ...]]]:
    """Per pipeline rank, ``(step, passes, waits, update, update's wait)`` ms of every step counted (module
    docstring): ``waits`` the passes' waits before their compute (their input's receive; 2BW: its update too, which
    runs before a pass), ``update`` the update's own work, ``update's wait`` its wait for the global check."""
    found: dict[int, list[tuple[float, ...]]] = {}
    for result in results:
        steps = result.steps[1:-1] if steady else result.steps[1:]
        for step in steps:
            passes = sum(a.duration_ms for a in step.actions)
            waits = sum(a.wait_ms or 0.0 for a in step.actions)
            found.setdefault(result.pp_rank, []).append(
                (step.time_ms, passes, waits, step.update_ms, step.update_wait_ms)
            )
    return found


def _pass_medians(results: list[Any]) -> dict[str, float]:
    """``"{stage}{kind}"`` → the median duration over every step after the first, ms."""
    samples: dict[str, list[float]] = {}
    for result in results:
        for step in result.steps[1:]:
            for record in step.actions:
                action = parse_action(record.action)
                samples.setdefault(f"{action.stage}{action.kind.value}", []).append(record.duration_ms)
    return {key: statistics.median(values) for key, values in sorted(samples.items())}


def _predicted_passes(schedule: Any) -> dict[int, float]:
    """Per rank, the schedule's pass time in one step (one row of the pattern, or the flushed step), ms."""
    return {
        rank.rank: sum(a.end - a.start for a in rank.actions if a.kind in ("F", "I", "W", "B"))
        for rank in schedule.ranks
    }


def trace(model: str, rounds: int, steps: int, repeats: int, labels: tuple[str, ...]) -> list[str]:
    """The tables (module docstring)."""
    from pipesched.runtime.launch import launch_jobs, plan_runs
    from pipesched.runtime.options import TrainingOptions
    from pipesched.runtime.profile import measure_model
    from pipesched.runtime.records import RankJob
    from pipesched.runtime.training import train_rank

    shape = SHAPES[0]
    cases = [c for c in shape.cases if c.label in labels]
    before = os.getloadavg()
    profile = measure_model(
        num_ranks=NUM_RANKS, num_microbatches=NUM_MICROBATCHES, model=model, repeats=repeats, training=TrainingOptions()
    )
    problem = profile.problem
    schedules = [solve_family(problem.with_changes(**case_changes(c, profile)), c.family) for c in cases]
    options = [
        TrainingOptions(steps=steps, lr=0.01, weight_update="2bw" if c.two_weight_versions else "sync") for c in cases
    ]
    order = [k for r in range(rounds) for k in round_order(len(cases), r)]
    runs = plan_runs(
        [schedules[k] for k in order],
        model=model,
        engine="pipesched",
        training=[options[k] for k in order],
        seed=0,
        validate=True,
    )

    with tempfile.TemporaryDirectory(prefix="pipesched-trace-") as workdir:
        jobs = [
            RankJob(run.schedule, run.model, 0, run.engine, workdir, k, run.training, run.steady_steps)
            for k, run in enumerate(runs)
        ]
        per_job = launch_jobs(train_rank, jobs, world=NUM_RANKS, timeout_s=900)
    assert per_job is not None
    after = os.getloadavg()
    costs = problem.costs
    lines = [
        f"two_bw_trace · {model} · p={NUM_RANKS} m={NUM_MICROBATCHES} · {steps} steps × {rounds} rounds · load average "
        f"{before[0]:.1f} before, {after[0]:.1f} after (2 cores)",
        f"profile: F {costs.forward} I {costs.backward_input} W {costs.backward_weight} (ms per stage, with the "
        f"calibration's per-pass overhead {profile.calibration.overhead_ms:+.2f}); optimizer_step "
        f"{costs.optimizer_step} ms",
        f"{'case':>5} {'rank':>4} {'step':>8} {'passes':>8} {'rest':>7}   predicted: {'step':>7} {'passes':>8}"
        "   rest: waits before passes (2BW: with its update), update's own work, update's wait for the check",
    ]
    medians = {}
    for k, (case, schedule) in enumerate(zip(cases, schedules, strict=True)):
        results = [r for job, case_of in zip(per_job, order, strict=True) if case_of == k for r in job]
        steady = case.two_weight_versions
        predicted_step = schedule.step_period if steady else schedule.step_time
        predicted_passes = _predicted_passes(schedule)
        for rank, samples in sorted(_per_step(results, steady).items()):
            columns = zip(*samples, strict=True)
            step, passes, waits, update, update_wait = (statistics.median(column) for column in columns)
            lines.append(
                f"{case.label:>5} {rank:>4} {step:8.1f} {passes:8.1f} {step - passes:7.1f}   "
                f"{'':>10} {predicted_step:7.1f} {predicted_passes[rank]:8.1f}"
                f"   {waits:6.1f} {update:6.1f} {update_wait:6.1f}"
            )
        for result in results:
            lines.append(
                f"{case.label:>5} rank {result.pp_rank} step/passes: "
                + " ".join(f"{s.time_ms:.0f}/{sum(a.duration_ms for a in s.actions):.0f}" for s in result.steps)
            )
        medians[case.label] = _pass_medians(results)
    lines.append("pass medians, ms: " + " · ".join(medians))
    for key in medians[cases[0].label]:
        lines.append(f"  {key:>4}: " + " · ".join(f"{m.get(key, float('nan')):6.1f}" for m in medians.values()))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--profile-repeats", type=int, default=6)
    parser.add_argument("--cases", default="1F1B,ZB-H1,2BW", help="the first shape's cases run, in this order")
    parser.add_argument("--output", type=Path, default=Path("bench/results/two_bw_trace.txt"))
    args = parser.parse_args()
    lines = trace(args.model, args.rounds, args.steps, args.profile_repeats, tuple(args.cases.split(",")))
    print("\n".join(lines))
    with args.output.open("a") as out:
        out.write("\n".join(lines) + "\n\n")


if __name__ == "__main__":
    main()
