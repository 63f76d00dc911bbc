"""Predicted beside measured on this machine: profile → solve → run, for 1F1B, ZB-H1, ZB-V, breadth-first with data
parallelism, and PipeDream-2BW — step time, hidden and exposed communication, static memory.

The closed loop (issue 25): for each pipeline shape, ``pipesched profile`` measures the model on the processes the
run starts (:func:`pipesched.runtime.profile.measure_model`: passes, activation and static memory as the runtime
allocates them, p2p fitted, collectives, the optimizer step); each family's schedule is built on that problem and
timed by the simulator (the prediction); then one launch runs every schedule of the shape for ``--steps`` SGD steps
on pipesched's own executor, verified against the single-process reference. Shapes (2 pipeline ranks, 8
microbatches, ``--model``, gpt-small by default):

* ``1F1B``, ``ZB-H1`` and ``2BW`` (the pipedream-2bw family's no-flush pattern, run in steady state with two weight
  versions): one stage per rank;
* ``ZB-V``: V placement, two stages per rank;
* ``BF×dp2``: breadth-first (looped-bfs, two stages per rank) × data-parallel 2 with FSDP2, 4 processes.

Every launch runs each case ``--rounds`` times, interleaved, the order turned by one case each round (1F1B, ZB-H1,
2BW; ZB-H1, 2BW, 1F1B; 2BW, 1F1B, ZB-H1; …), so that the cases of a shape share the machine's load alike and none
always runs first or last in its round (a load that rises or falls through a round would fall on one case); the
runs of one launch are checked against one reference per problem.

Measured step: the best step after the first over every round (``best``; its error against the prediction is the
issue's bar, −20 % … +25 %) and the median of the rounds' ``measured_step_time_ms`` (``median``: over the steps
after the first, and before the last of 2BW's steady run, its drain): every step counted holds the same work, m
microbatches and one update per stage. Hidden / exposed communication: per rank, the median over every round's
steps after the first of the time the rank's collectives ran beside its passes, and the rest, each collective from
its last dp peer's start (the simulator's span), against the schedule's timeline; ``wait``: the rank's median wait
for a slower replica before its collectives could start (in neither split). Static: weights, gradients and
optimizer state measured on every rank against the problem's ``memory.static`` (and the second weight version for
2BW). 2BW's gain: 1F1B's measured step minus 2BW's, best against best and per round (the median of the rounds'
differences of medians: the statistic the bar is read on — paired within a round, the two runs share its load; a
run's median leaves out a step's burst, the median over rounds a round's), against the predicted gain (1F1B's
``step_time`` minus 2BW's ``step_period``). A profile that measured a slowdown of compute beside its collectives (data
parallelism; ``pipesched profile`` writes it as
``costs.overlap_slowdown`` only with ``--overlap-slowdown``) also prints the same run against the prediction with
the other choice (the measured slowdown, or 0, and the per-pass overhead fitted again on the same calibration
step): step and hidden / exposed; likewise with the other choice of the collectives' wait for their last replica
(``costs.unshard_wait`` / ``costs.reduce_grad_wait``: the calibration run's, written only with ``pipesched profile
--replica-wait``, or none).

Timing on a shared 2-core machine is noisy: the load average is printed before and after every repeat; read the
rounds and repeats side by side.

Run: ``python -m bench.runtime_bench [--model gpt-small] [--steps 6] [--rounds 3] [--repeats 1] [--output FILE]``;
results in ``bench/results/runtime_bench.txt``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipesched.optimizer.result import Schedule
from pipesched.optimizer.solve import solve_family

NUM_RANKS = 2
NUM_MICROBATCHES = 8


@dataclass(frozen=True)
class Case:
    """One schedule of a shape: its label, family and the problem's changes (besides the profile's)."""

    label: str
    family: str
    changes: dict[str, Any] = field(default_factory=dict)
    two_weight_versions: bool = False


@dataclass(frozen=True)
class Shape:
    """A pipeline shape profiled once, and its cases."""

    name: str
    stages_per_rank: int
    placement: str
    data_parallel: int
    cases: tuple[Case, ...]


SHAPES = (
    Shape(
        "one stage per rank",
        1,
        "loop",
        1,
        (
            Case("1F1B", "1f1b"),
            Case("ZB-H1", "zb-h1"),
            Case(
                "2BW",
                "pipedream-2bw",
                {"training": {"flush": False, "weight_versions": 2}, "objective": "step_period"},
                two_weight_versions=True,
            ),
        ),
    ),
    Shape("V, two stages per rank", 2, "v", 1, (Case("ZB-V", "zb-v"),)),
    Shape("looped, two stages per rank, dp 2", 2, "loop", 2, (Case("BF×dp2", "looped-bfs"),)),
)


def _profile(shape: Shape, model: str, repeats: int, calibration: dict[str, Any]) -> Any:
    from pipesched.runtime.options import TrainingOptions
    from pipesched.runtime.profile import measure_model

    options = TrainingOptions(data_parallel=shape.data_parallel, sharding="full" if shape.data_parallel > 1 else "none")
    profile = measure_model(
        num_ranks=NUM_RANKS,
        num_microbatches=NUM_MICROBATCHES,
        stages_per_rank=shape.stages_per_rank,
        placement=shape.placement,
        model=model,
        repeats=repeats,
        training=options,
        **calibration,
    )
    return profile


def _same_steps(ranks: list[Any], suffix: str = "") -> dict[str, Any] | None:
    """One process over the rounds, read on the same steps: per step after the first (every round), the measured
    hidden / exposed ms against the run report's ``same_step_predicted_…{suffix}`` of that step (the simulator re-run
    with the step's passes as they ran); the medians of both and of the per-step errors (measured / predicted − 1).
    ``None`` when the reports carry no such prediction."""
    name = f"same_step_predicted_hidden_ms{suffix}"
    if not all(getattr(r, name) for r in ranks):
        return None
    pairs: dict[str, list[tuple[float, float]]] = {"hidden": [], "exposed": []}
    for report in ranks:
        for split in pairs:
            measured = getattr(report, f"communication_{split}_ms")
            predicted = getattr(report, f"same_step_predicted_{split}_ms{suffix}")
            pairs[split] += list(zip(measured, predicted, strict=True))[1:]
    found: dict[str, Any] = {}
    for split, values in pairs.items():
        found[f"{split}_ms"] = statistics.median(m for m, _ in values)
        found[f"predicted_{split}_ms"] = statistics.median(p for _, p in values)
        errors = [m / p - 1 for m, p in values if p > 0]
        found[f"{split}_error"] = statistics.median(errors) if errors else None
        found[f"{split}_within"] = sum(abs(e) <= 0.30 for e in errors), len(errors)
    return found


def _update_parts(ranks: list[Any], pattern: bool) -> dict[str, float]:
    """One process over the rounds: the median over the steps counted (:func:`steady_steps`) of its update's own
    time (``update``) and of each part of it (``StepRecord.update_parts_ms``; ``other``: the rest of the update)."""
    from pipesched.runtime.report import steady_steps

    steps = [
        (own, parts)
        for report in ranks
        for own, parts in steady_steps(list(zip(report.update_ms, report.update_parts_ms, strict=True)), pattern)
    ]
    if not steps or not all(parts for _, parts in steps):
        return {}
    names = sorted({name for _, parts in steps for name in parts})
    found = {"update": statistics.median(own for own, _ in steps)}
    found |= {name: statistics.median(parts.get(name, 0.0) for _, parts in steps) for name in names}
    found["other"] = statistics.median(
        own - sum(v for k, v in parts.items() if k != "run_delay") for own, parts in steps
    )
    return found


def _rank_row(ranks: list[Any], pattern: bool = False) -> dict[str, Any]:
    """One process over the rounds: hidden / exposed / replica wait as medians over every round's steps after the
    first, predicted beside (the profile's, and on the same steps: :func:`_same_steps`), static memory, the update's
    parts."""

    def median(values_of: Any) -> float:
        values = [v for rank in ranks for v in values_of(rank)[1:] or values_of(rank)]
        return statistics.median(values) if values else 0.0

    rank = ranks[0]
    collectives: dict[str, list[Any]] = {}
    for report in ranks:
        for span in report.collectives:
            if not span.action.endswith("RESHARD"):
                collectives.setdefault(span.action, []).append(span)
    return {
        "collectives": [
            {
                "action": action,
                "predicted": [spans[0].predicted_start, spans[0].predicted_end, spans[0].predicted_hidden_ms],
                "measured": [
                    statistics.median(getattr(s, name) for s in spans)
                    for name in ("measured_start", "measured_end", "measured_hidden_ms", "replica_wait_ms")
                ],
            }
            for action, spans in collectives.items()
        ],
        "rank": rank.rank,
        "same_steps": _same_steps(ranks),
        "same_steps_measured_collectives": _same_steps(ranks, "_measured_collectives"),
        "update_parts": _update_parts(ranks, pattern),
        "hidden_ms": median(lambda r: r.communication_hidden_ms),
        "exposed_ms": median(lambda r: r.communication_exposed_ms),
        "replica_wait_ms": median(lambda r: r.communication_replica_wait_ms),
        "predicted_hidden_ms": rank.predicted_communication_hidden_ms,
        "predicted_exposed_ms": rank.predicted_communication_exposed_ms,
        "static_measured": max(r.static_bytes_measured for r in ranks),
        "static_predicted": rank.static_bytes_predicted,
        "peak_activation_measured": max(r.peak_memory_bytes for r in ranks),
        "peak_activation_predicted": rank.predicted_peak_activation_bytes,
    }


def _row(case: Case, schedule: Schedule, reports: list[Any]) -> dict[str, Any]:
    """What the bench prints of one case over its rounds: predicted beside measured. ``best``: the fastest step
    after the first over every round; ``median``: the median of the rounds' medians (the report's
    ``measured_step_time_ms``)."""
    from pipesched.runtime.report import steady_steps

    predicted = reports[0].predicted_step_time_ms
    steady = [steady_steps(report.measured_step_times_ms, case.two_weight_versions) for report in reports]
    best = min(min(steps) for steps in steady)
    # Per round, per step counted, the most any process's passes waited for their core (the machine's other load).
    delays = [
        steady_steps([max(step) for step in zip(*(r.run_delay_ms for r in report.ranks), strict=True)], pattern)
        if all(r.run_delay_ms for r in report.ranks)
        else []
        for report, pattern in ((report, case.two_weight_versions) for report in reports)
    ]
    # Per round, the median over the steps counted of the step less its busiest process's passes: what the schedule
    # leaves idle or spends between passes, at whatever speed the machine ran the passes (the same work in every
    # case of the shape); predicted likewise from the schedule's timeline.
    rests = [
        statistics.median(
            steady_steps(
                [
                    step - max(per_rank)
                    for step, *per_rank in zip(
                        report.measured_step_times_ms, *(r.compute_ms for r in report.ranks), strict=True
                    )
                ],
                case.two_weight_versions,
            )
        )
        if all(r.compute_ms for r in report.ranks)
        else None
        for report in reports
    ]
    return {
        "case": case.label,
        "method": schedule.method,
        "round_rest_ms": rests,
        "predicted_rest_ms": predicted - max(_passes_per_step(schedule, rank) for rank in range(len(schedule.ranks))),
        "verified": all(report.verified for report in reports),
        "predicted_ms": predicted,
        "predicted_from": reports[0].predicted_step_time_from,
        "measured_ms": [report.measured_step_times_ms for report in reports],
        "round_medians_ms": [statistics.median(steps) for steps in steady],
        "round_run_delay_ms": delays,
        # per round, per process, the last step's passes (action, start, end ms): which ran beside another rank's
        "last_step_actions": [
            [[(a.action, a.start, a.end) for a in rank.actions] for rank in report.ranks] for report in reports
        ],
        "best_ms": best,
        "median_ms": statistics.median(report.measured_step_time_ms for report in reports),
        "best_error": best / predicted - 1 if predicted else None,
        "ranks": [
            _rank_row([report.ranks[k] for report in reports], case.two_weight_versions)
            for k in range(len(reports[0].ranks))
        ],
    }


def case_changes(case: Case, profile: Any) -> dict[str, Any]:
    """The case's changes to the profile's problem; PipeDream-2BW's case also takes the optimizer step under its own
    rule (the profile's step plus the copy into the second weight version, :attr:`Profile.two_version_optimizer_step`),
    where the shape was profiled under the synchronous rule: its update does that copy every step."""
    changes = dict(case.changes)
    if case.two_weight_versions and profile.two_version_optimizer_step is not None:
        changes["costs.optimizer_step"] = profile.two_version_optimizer_step
    return changes


def _passes_per_step(schedule: Schedule, rank: int) -> float:
    """The predicted time of one step's passes on pipeline rank ``rank`` (a pattern's period holds one step's)."""
    actions = schedule.ranks[rank].actions
    forwards = sum(1 for a in actions if a.kind == "F")
    stages = len({a.stage for a in actions if a.kind == "F"})
    busy = sum(a.end - a.start for a in actions if a.kind in ("F", "I", "W", "B"))
    return busy * schedule.problem.pipeline.num_microbatches * stages / forwards if forwards else 0.0


def run_shape(
    shape: Shape,
    *,
    model: str,
    steps: int,
    repeats: int,
    rounds: int,
    calibration: dict[str, Any] | None = None,
    other_slowdown: bool = True,
) -> list[dict[str, Any]]:
    """Profile the shape, build its cases' schedules on the profile, run them in one launch: ``rounds`` rounds of
    every case one after another, the order turned by one each round (:func:`round_order`), so that the cases
    share the machine's load alike. ``calibration``: the profile's calibration settings (``calibration_steps``,
    ``collective_statistic``, ``pass_source``; default: the profile's own). ``other_slowdown``: also predict with the
    other choice of the
    overlap slowdown (minutes of simulation when the measured slowdown is large)."""
    from pipesched.runtime.launch import run_schedules
    from pipesched.runtime.options import TrainingOptions

    started = time.perf_counter()
    profile = _profile(shape, model, repeats, calibration or {})
    problem = profile.problem
    profiled_s = time.perf_counter() - started
    schedules = [solve_family(problem.with_changes(**case_changes(case, profile)), case.family) for case in shape.cases]
    sharding = "full" if shape.data_parallel > 1 else "none"
    options = [
        TrainingOptions(
            steps=steps,
            lr=0.01,
            data_parallel=shape.data_parallel,
            sharding=sharding,
            weight_update="2bw" if case.two_weight_versions else "sync",
        )
        for case in shape.cases
    ]
    order = [k for r in range(rounds) for k in round_order(len(shape.cases), r)]
    reports = run_schedules(
        [schedules[k] for k in order],
        engine="pipesched",
        model=model,
        training=[options[k] for k in order],
        timeout_s=900,
    )
    rows = [
        _row(case, schedule, [report for report, case_of in zip(reports, order, strict=True) if case_of == k])
        for k, (case, schedule) in enumerate(zip(shape.cases, schedules, strict=True))
    ]
    calibration = profile.calibration
    alternatives = _alternatives(profile, other_slowdown)
    for row, case, schedule in zip(rows, shape.cases, schedules, strict=True):
        row["shape"], row["profile_s"] = shape.name, round(profiled_s, 1)
        row["optimizer_step"] = {
            "profiled": list(problem.costs.optimizer_step) if isinstance(problem.costs.optimizer_step, list) else [],
            "two_versions": profile.two_version_optimizer_step,
        }
        row["collective_costs"] = {  # the waits as measured, whether the problem carries them or not
            name: getattr(profile.problem.costs, name)
            for name in ("unshard", "reduce_grad")
            if shape.data_parallel > 1 and getattr(profile.problem.costs, name) is not None
        } | (calibration.replica_waits if calibration is not None else {})
        if calibration is not None:
            row["calibration"] = {
                "measured_ms": calibration.measured_ms,
                "predicted_ms": calibration.predicted_ms,
                "overhead_ms": calibration.overhead_ms,
            }
            if calibration.overlap is not None:
                row["calibration"]["overlap"] = dataclasses.asdict(calibration.overlap)
            if calibration.communication is not None:
                row["calibration"]["communication"] = dataclasses.asdict(calibration.communication)
        for key, (label, problem) in alternatives.items():
            alternative = solve_family(problem.with_changes(**case_changes(case, profile)), case.family)
            row[key] = _prediction(alternative) | {
                "label": label,
                "same_orders": alternative.orders() == schedule.orders(),
            }
    return rows


def _alternatives(profile: Any, other_slowdown: bool) -> dict[str, tuple[str, Any]]:
    """The profile's problem otherwise, each with the per-pass overhead fitted again on the same calibration step:
    ``other_slowdown`` (:func:`_other_slowdown`, when asked) and ``replica_waits`` (the other choice of the
    collectives' wait for their last replica, ``costs.unshard_wait`` / ``costs.reduce_grad_wait``: without it where
    the problem has it, with the calibration run's where it has not) and ``other_communication`` (the other choice
    of ``costs.communication_slowdown``, with the collectives' costs that go with it: alone, or as the calibration
    run saw them); key → (label, problem)."""
    found = {}
    other = _other_slowdown(profile) if other_slowdown else None
    if other is not None:
        found["other_slowdown"] = (f"with overlap_slowdown {other[1]:.3f}", other[0])
    costs, calibration = profile.problem.costs, profile.calibration
    if calibration is not None and (costs.unshard_wait is not None or costs.reduce_grad_wait is not None):
        waits = _refitted(profile, unshard_wait=None, reduce_grad_wait=None)
        found["replica_waits"] = ("without the replicas' waits", waits)
    elif calibration is not None and calibration.replica_waits:
        found["replica_waits"] = ("with the replicas' waits", _refitted(profile, **calibration.replica_waits))
    communication = calibration.communication if calibration is not None else None
    if communication is not None and costs.communication_slowdown:
        found["other_communication"] = (
            "without communication_slowdown (the collectives as the calibration run saw them)",
            _refitted(profile, communication_slowdown=0.0, **communication.seen),
        )
    elif communication is not None:
        found["other_communication"] = (
            f"with communication_slowdown {communication.slowdown:.3f} (the collectives' costs alone)",
            _refitted(profile, communication_slowdown=communication.slowdown, **communication.work),
        )
    return found


def _refitted(profile: Any, **costs: Any) -> Any:
    """The profile's problem with ``costs`` changed and the per-pass overhead fitted again on its calibration step.
    A pass the overhead took to 0 (stage 0's I, a no-op: a negative overhead clamps it) stays 0 without it, not
    ``-overhead``."""
    from pipesched.runtime.calibration import calibration_orders, fit_overhead, with_overhead

    calibration, problem = profile.calibration, profile.problem
    changes = {f"costs.{name}": value for name, value in costs.items()}
    for name in ("forward", "backward_input", "backward_weight"):
        values = problem.stage_values(getattr(problem.costs, name))
        changes[f"costs.{name}"] = [round(v - calibration.overhead_ms, 6) if v > 0 else 0.0 for v in values]
    raw = problem.with_changes(**changes)
    return with_overhead(raw, fit_overhead(raw, calibration_orders(raw), calibration.measured_ms))


def round_order(count: int, round_index: int) -> list[int]:
    """The cases' indices in round ``round_index``: ``0 … count − 1`` turned left by the round's index."""
    return [(round_index + k) % count for k in range(count)]


def _other_slowdown(profile: Any) -> tuple[Any, float] | None:
    """The profile's problem with the other choice of ``costs.overlap_slowdown`` (the measured slowdown where the
    problem has 0, 0 where it has the measured one) and the per-pass overhead fitted again on the same calibration
    step, with that slowdown; ``None`` when the profile measured none."""
    calibration = profile.calibration
    if calibration is None or calibration.overlap is None:
        return None
    slowdown = 0.0 if profile.problem.costs.overlap_slowdown else calibration.overlap.slowdown
    return _refitted(profile, overlap_slowdown=slowdown), slowdown


def _prediction(schedule: Schedule) -> dict[str, Any]:
    """A schedule's predicted step and, per pipeline rank, hidden / exposed communication (ms)."""
    from pipesched.runtime.report import communication_overlap

    ranks = []
    for rank in schedule.ranks:
        compute = [(a.start, a.end) for a in rank.actions if a.kind in ("F", "I", "W", "B")]
        communication = [(a.start, a.end) for a in rank.actions if a.kind in ("UNSHARD", "REDUCE_GRAD")]
        ranks.append(communication_overlap(compute, communication))
    return {"predicted_ms": schedule.objective_value, "ranks": ranks}


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:+.0f}%"


def format_rows(rows: list[dict[str, Any]]) -> list[str]:
    """The table: step predicted / best / median, error; per rank hidden / exposed and static, predicted beside."""
    lines = [
        f"{'case':>8} {'ok':>3} {'predicted':>10} {'best':>9} {'median':>9} {'error':>6}  "
        "per rank: hidden/exposed ms measured (predicted) · static measured/predicted"
    ]
    for row in rows:
        ranks = "; ".join(
            f"r{r['rank']} {r['hidden_ms']:.1f}/{r['exposed_ms']:.1f}"
            + (
                ""
                if r["predicted_hidden_ms"] is None
                else f" ({r['predicted_hidden_ms']:.1f}/{r['predicted_exposed_ms']:.1f})"
                f" wait {r['replica_wait_ms']:.0f}"
            )
            + f" {_percent(r['static_measured'] / r['static_predicted'] - 1 if r['static_predicted'] else None)}"
            for r in row["ranks"]
        )
        lines.append(
            f"{row['case']:>8} {'yes' if row['verified'] else 'NO':>3} {row['predicted_ms']:10.1f} "
            f"{row['best_ms']:9.1f} {row['median_ms']:9.1f} {_percent(row['best_error']):>6}  {ranks}"
        )
    for row in rows:
        if any(row.get("round_run_delay_ms", [])):
            lines.append(
                f"  {row['case']} per round: median step / the passes' wait for their core (ms per step, the most "
                "of any rank; median, max): "
                + "; ".join(
                    f"{median:.0f} / {statistics.median(delay):.0f}, {max(delay):.0f}" if delay else f"{median:.0f}"
                    for median, delay in zip(row["round_medians_ms"], row["round_run_delay_ms"], strict=True)
                )
            )
    for row in rows:
        lines += _collective_lines(row)
    for row in rows:
        lines += _same_step_lines(row)
    for row in rows:
        lines += _update_lines(row)
    shapes = {row["shape"]: row for row in rows}
    for name, row in shapes.items():
        calibration = row.get("calibration")
        if calibration is not None:
            lines.append(
                f"  {name}: profiled in {row['profile_s']:.0f} s; calibration run {calibration['measured_ms']:.1f} ms "
                f"per step against {calibration['predicted_ms']:.1f} ms from the pieces: "
                f"{calibration['overhead_ms']:+.2f} ms per pass"
                + (
                    "; optimizer_step "
                    + " ".join(f"{v:.1f}" for v in row["optimizer_step"]["profiled"])
                    + (
                        ""
                        if not row["optimizer_step"]["two_versions"]
                        else " (2BW's rule, with the second version's copy: "
                        + " ".join(f"{v:.1f}" for v in row["optimizer_step"]["two_versions"])
                        + ")"
                    )
                    if "optimizer_step" in row
                    else ""
                )
                + "".join(
                    f"; {name} " + " ".join(f"{v:.1f}" for v in values)
                    for name, values in row.get("collective_costs", {}).items()
                )
            )
        if calibration is not None and "overlap" in calibration:
            overlap = calibration["overlap"]
            lines.append(
                f"  {name}: compute beside communication: {overlap['passes']} passes beside a collective for "
                f"{overlap['overlapped_ms']:.1f} ms took {overlap['extra_ms']:+.1f} ms against the same passes alone "
                f"({overlap['alone']} passes): overlap_slowdown {overlap['slowdown']:.3f}"
            )
        if calibration is not None and "communication" in calibration:
            slowed = calibration["communication"]
            lines.append(
                f"  {name}: communication beside compute: {slowed['collectives']} collectives beside the passes for "
                f"{slowed['overlapped_ms']:.1f} ms took {slowed['extra_ms']:+.1f} ms against the same collectives "
                f"alone ({slowed['lone']} lone): communication_slowdown {slowed['slowdown']:.3f}; costs alone "
                + "; ".join(f"{k} " + " ".join(f"{v:.1f}" for v in values) for k, values in slowed["work"].items())
            )
    for row in rows:
        lines += _alternative_lines(row)
    by_case = {row["case"]: row for row in rows}
    if "1F1B" in by_case and "2BW" in by_case:
        lines += _gain_lines(by_case["1F1B"], by_case["2BW"])
    return lines


def _alternative_lines(row: dict[str, Any]) -> list[str]:
    """The same run against each other prediction (:func:`_alternatives`): the step's error and per pipeline rank
    the predicted hidden / exposed, beside the measured ones above."""
    lines = []
    for other in (row[key] for key in ("other_slowdown", "replica_waits", "other_communication") if key in row):
        predicted = other["predicted_ms"]
        pipeline_ranks = other["ranks"]
        per_rank = "; ".join(
            f"r{r['rank']} ({pipeline_ranks[k * len(pipeline_ranks) // len(row['ranks'])][0]:.1f}/"
            f"{pipeline_ranks[k * len(pipeline_ranks) // len(row['ranks'])][1]:.1f})"
            for k, r in enumerate(row["ranks"])
        )
        lines.append(
            f"  {row['case']} {other['label']}: predicted {predicted:.1f} ms, best "
            f"{_percent(row['best_ms'] / predicted - 1)}; hidden/exposed predicted {per_rank}"
            + ("" if other["same_orders"] else " (another order than the one run)")
        )
    return lines


def _same_step_lines(row: dict[str, Any]) -> list[str]:
    """Per process of a case with communication actions: hidden / exposed measured against the prediction of the
    same steps (the passes as each step ran them; the profile's collectives, then the collectives as measured too):
    medians, the median per-step error and the steps within 30 %."""
    lines = []
    for rank in row["ranks"]:
        for key, label in (
            ("same_steps", "the profile's collectives"),
            ("same_steps_measured_collectives", "the collectives as measured"),
        ):
            found = rank.get(key)
            if not found:
                continue
            lines.append(
                f"  {row['case']} r{rank['rank']} on the same steps ({label}): "
                + "; ".join(
                    f"{split} {found[f'{split}_ms']:.1f} ({found[f'predicted_{split}_ms']:.1f}) "
                    f"per step {_percent(found[f'{split}_error'])}, {found[f'{split}_within'][0]} of "
                    f"{found[f'{split}_within'][1]} within 30%"
                    for split in ("hidden", "exposed")
                )
            )
    return lines


def _update_lines(row: dict[str, Any]) -> list[str]:
    """Per process, where the update's own time went (medians over the steps counted, ms)."""
    lines = []
    for rank in row["ranks"]:
        parts = rank.get("update_parts") or {}
        if parts:
            lines.append(
                f"  {row['case']} r{rank['rank']} update {parts['update']:.1f} ms: "
                + ", ".join(f"{name} {value:.1f}" for name, value in parts.items() if name != "update")
            )
    return lines


def _collective_lines(row: dict[str, Any]) -> list[str]:
    """Per rank and communication action of a data-parallel case: predicted start–end and hidden ms beside the
    measured ones (medians over the rounds of the report's medians; ``wait``: for a slower replica)."""
    lines = []
    for rank in row["ranks"]:
        for span in rank.get("collectives", []):
            start, end, hidden = span["predicted"]
            m_start, m_end, m_hidden, wait = span["measured"]
            predicted = "—" if start is None else f"{start:7.1f}–{end:7.1f} hidden {hidden:5.1f}"
            lines.append(
                f"  {row['case']} r{rank['rank']} {span['action']:>13}: predicted {predicted} · measured "
                f"{m_start:7.1f}–{m_end:7.1f} hidden {m_hidden:5.1f} (wait {wait:.1f})"
            )
    return lines


def _gain_lines(flushed: dict[str, Any], steady: dict[str, Any]) -> list[str]:
    """2BW's gain over 1F1B, predicted (1F1B's ``step_time`` − 2BW's ``step_period``) beside measured two ways: best
    step against best step, and per round (the two ran one after the other) the difference of their medians."""
    predicted = flushed["predicted_ms"] - steady["predicted_ms"]
    per_round = [a - b for a, b in zip(flushed["round_medians_ms"], steady["round_medians_ms"], strict=True)]
    lines = []
    for name, measured in (
        ("best against best", flushed["best_ms"] - steady["best_ms"]),
        (f"median over {len(per_round)} rounds of the rounds' medians", statistics.median(per_round)),
    ):
        share = measured / predicted if predicted > 0 else float("nan")
        lines.append(
            f"2BW's gain over 1F1B, {name}: predicted {predicted:.1f} ms, measured {measured:.1f} ms "
            f"({100 * share:.0f}% of predicted; the bar: ≥ 50%)"
        )
    lines.append("  per round: " + ", ".join(f"{gain:+.0f}" for gain in per_round) + " ms")
    rests = [flushed.get("round_rest_ms") or [], steady.get("round_rest_ms") or []]
    if all(rests) and None not in rests[0] + rests[1]:
        gained = [a - b for a, b in zip(*rests, strict=True)]
        expected = flushed["predicted_rest_ms"] - steady["predicted_rest_ms"]
        lines.append(
            "2BW's gain over 1F1B outside the passes (per round the median step less its busiest process's passes, "
            f"1F1B's less 2BW's; median over rounds): predicted {expected:.1f} ms "
            f"(1F1B {flushed['predicted_rest_ms']:.1f}, 2BW {steady['predicted_rest_ms']:.1f}), measured "
            f"{statistics.median(gained):.1f} ms ({100 * statistics.median(gained) / expected:.0f}% of predicted); "
            "per round: " + ", ".join(f"{a:.0f} − {b:.0f} = {a - b:+.0f}" for a, b in zip(*rests, strict=True)) + " ms"
        )
    delays = [flushed.get("round_run_delay_ms") or [], steady.get("round_run_delay_ms") or []]
    if all(delays) and all(all(rounds) for rounds in delays):
        lines.append(
            "  per round, the passes' wait for their core (ms per step, the most of any rank; median / max), "
            "1F1B · 2BW: "
            + ", ".join(
                f"{statistics.median(a):.0f}/{max(a):.0f} · {statistics.median(b):.0f}/{max(b):.0f}"
                for a, b in zip(*delays, strict=True)
            )
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small", help="the model (default gpt-small)")
    parser.add_argument("--steps", type=int, default=6, help="training steps per run (default 6)")
    parser.add_argument("--repeats", type=int, default=1, help="the whole loop, this many times (default 1)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every case per launch, interleaved (default 3)")
    parser.add_argument("--profile-repeats", type=int, default=6, help="timed microbatches per pass (default 6)")
    parser.add_argument("--calibration-steps", type=int, default=None, help="the profile's (default its own)")
    parser.add_argument("--collective-statistic", default=None, help="the profile's (default its own)")
    parser.add_argument("--pass-source", default=None, help="the profile's (default its own)")
    parser.add_argument(
        "--no-other-slowdown", action="store_true", help="skip the prediction with the other overlap_slowdown"
    )
    parser.add_argument(
        "--communication-slowdown",
        action="store_true",
        help="the profile writes costs.communication_slowdown (the collectives' costs alone)",
    )
    parser.add_argument("--shapes", default="all", help="comma-separated shape indices (0, 1, 2), default all")
    parser.add_argument("--output", type=Path, default=None, help="also write the tables and rows (JSON) here")
    args = parser.parse_args()
    shapes = SHAPES if args.shapes == "all" else [SHAPES[int(i)] for i in args.shapes.split(",")]
    calibration = {
        name: value
        for name, value in (
            ("calibration_steps", args.calibration_steps),
            ("collective_statistic", args.collective_statistic),
            ("pass_source", args.pass_source),
            ("communication_slowdown", args.communication_slowdown or None),
        )
        if value is not None
    }
    lines: list[str] = []
    all_rows = []
    for repeat in range(args.repeats):
        before = os.getloadavg()
        rows = [
            row
            for shape in shapes
            for row in run_shape(
                shape,
                model=args.model,
                steps=args.steps,
                repeats=args.profile_repeats,
                rounds=args.rounds,
                calibration=calibration,
                other_slowdown=not args.no_other_slowdown,
            )
        ]
        after = os.getloadavg()
        header = (
            f"repeat {repeat + 1}/{args.repeats} · {args.model} · p={NUM_RANKS} m={NUM_MICROBATCHES} · "
            f"{args.steps} steps × {args.rounds} rounds · calibration {calibration or 'as the profile'} · "
            f"load average {before[0]:.1f} before, "
            f"{after[0]:.1f} after (2 cores)"
        )
        block = [header, *format_rows(rows), ""]
        print("\n".join(block), flush=True)
        lines += block
        all_rows.append({"load_before": before, "load_after": after, "rows": rows})
    if args.output is not None:
        args.output.write_text("\n".join(lines) + "\nrows:\n" + json.dumps(all_rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
