"""How much a profile's prediction moves between profiles of the same shape, and which measured input moves it.

Profiles breadth-first pp 2 × dp 2 (``bench.runtime_bench``'s third shape: gpt-small, 2 pipeline ranks, 8
microbatches, FSDP2) ``--profiles`` times in a row, each with ``--calibration-steps`` calibration steps, and keeps
every process's raw records (``--raw DIR``, one pickle per profile). Then, per profile and per way of reading the
calibration run (``--statistic``, :data:`pipesched.runtime.profile.COLLECTIVE_STATISTICS`), the table: each stage's
``costs.unshard`` / ``costs.reduce_grad``, the fitted per-pass overhead, F / I / W medians
(``--pass-source``: timed on their own, or from the calibration run), and the predicted hidden /
exposed communication per pipeline rank of ONE fixed schedule (looped-bfs solved on the first profile, its orders
re-simulated on every profile's problem). Below it, the spread (max − min over the profiles) of each pipeline rank's
predicted hidden / exposed, and the same spread with one input held at its mean over the profiles (the collectives,
the passes, the overhead): the input whose holding shrinks the spread most is the one that moves the prediction.

Run: ``python -m bench.profile_spread --profiles 5 --raw /tmp/spread`` (collects, then tabulates);
``python -m bench.profile_spread --raw /tmp/spread --no-collect`` (tabulates what is there); results in
``bench/results/profile_spread.txt``.
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


def collect(raw: Path, profiles: int, calibration_steps: int, model: str) -> None:
    """``profiles`` profiles in a row, each process's records pickled to ``raw/profile_<k>.pkl``."""
    import tempfile

    from pipesched.runtime.launch import launch_jobs
    from pipesched.runtime.options import TrainingOptions
    from pipesched.runtime.profile import ProfileSettings, _skeleton, profile_rank

    options = TrainingOptions(data_parallel=DATA_PARALLEL, sharding="full")
    skeleton = _skeleton(NUM_RANKS, NUM_MICROBATCHES, STAGES_PER_RANK, "loop", options)
    raw.mkdir(parents=True, exist_ok=True)
    for k in range(profiles):
        before, started = os.getloadavg()[0], time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="pipesched-spread-") as workdir:
            settings = ProfileSettings(skeleton, model, 0, 6, 2, options, workdir, calibration_steps=calibration_steps)
            returned = launch_jobs(
                profile_rank, [settings], world=NUM_RANKS * DATA_PARALLEL, timeout_s=900, replicas=DATA_PARALLEL
            )
        assert returned is not None
        record = {
            "results": returned[0],
            "load": (before, os.getloadavg()[0]),
            "seconds": time.perf_counter() - started,
        }
        (raw / f"profile_{k}.pkl").write_bytes(pickle.dumps(record))
        print(f"profile {k}: {record['seconds']:.0f} s, load {before:.1f} → {record['load'][1]:.1f}", flush=True)


def _prediction(problem: Any, orders: Any) -> list[tuple[float, float]]:
    """Per pipeline rank, the predicted (hidden, exposed) ms of ``orders`` on ``problem``."""
    from pipesched.optimizer.result import build_schedule
    from pipesched.runtime.report import communication_overlap

    schedule = build_schedule(problem, orders, method="looped-bfs", backend="profile", check_memory=False)
    out = []
    for rank in schedule.ranks:
        compute = [(a.start, a.end) for a in rank.actions if a.kind in ("F", "I", "W", "B")]
        communication = [(a.start, a.end) for a in rank.actions if a.kind in ("UNSHARD", "REDUCE_GRAD")]
        out.append(communication_overlap(compute, communication))
    return out


def _assembled(record: dict[str, Any], statistic: str, steps: int | None, pass_source: str) -> Any:
    """The profile of ``record`` as ``_assemble`` makes it, from its first ``steps`` calibration steps (all: None)."""
    from pipesched.runtime.options import TrainingOptions
    from pipesched.runtime.profile import _assemble, _calibration_pass_medians, _Measured, _skeleton

    options = TrainingOptions(data_parallel=DATA_PARALLEL, sharding="full")
    skeleton = _skeleton(NUM_RANKS, NUM_MICROBATCHES, STAGES_PER_RANK, "loop", options)
    results = [
        dataclasses.replace(
            r,
            calibration_ms=r.calibration_ms[:steps],
            calibration_communication=r.calibration_communication[: None if steps is None else steps - 1],
            calibration_passes=r.calibration_passes[: None if steps is None else steps - 1],
        )
        for r in record["results"]
    ]
    profile = _assemble(skeleton, results, options, None, None, collective_statistic=statistic, pass_source=pass_source)
    medians = {(s.kind, s.stage): s.median for s in profile.spreads}
    if pass_source == "calibration":
        medians |= _calibration_pass_medians(_Measured(skeleton, results))
    return profile, medians


_PASSES = {"forward": "F", "backward_input": "I", "backward_weight": "W"}
_COLLECTIVES = ("unshard", "reduce_grad")


def _inputs(profile: Any, medians: dict[tuple[str, int], float]) -> dict[str, Any]:
    """A profile's inputs to the prediction: the collectives' costs, the passes' medians (``medians``, before the
    overhead) and the per-pass overhead."""
    costs = profile.problem.costs
    stages = range(profile.problem.pipeline.num_stages)
    return {
        **{name: list(getattr(costs, name)) for name in _COLLECTIVES},
        **{name: [medians[kind, k] for k in stages] for name, kind in _PASSES.items()},
        "overhead": profile.calibration.overhead_ms,
    }


def _problem(base: Any, inputs: dict[str, Any]) -> Any:
    """``base`` with ``inputs`` (:func:`_inputs`' keys) as its costs, the overhead added to every pass."""
    from pipesched.runtime.calibration import with_overhead

    changes = {f"costs.{name}": [round(v, 6) for v in inputs[name]] for name in (*_COLLECTIVES, *_PASSES)}
    return with_overhead(base.with_changes(**changes), inputs["overhead"])


def _mean(inputs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        name: statistics.mean(i[name] for i in inputs)
        if name == "overhead"
        else [statistics.mean(values) for values in zip(*(i[name] for i in inputs), strict=True)]
        for name in inputs[0]
    }


def tabulate(raw: Path, statistic: str, steps: int | None = None, pass_source: str = "timed") -> list[str]:
    """The table and the spreads (module docstring) for one way of reading the calibration run."""
    from pipesched.optimizer.solve import solve_family

    records = [pickle.loads(path.read_bytes()) for path in sorted(raw.glob("profile_*.pkl"))]
    assembled = [_assembled(record, statistic, steps, pass_source) for record in records]
    profiles = [profile for profile, _ in assembled]
    orders = solve_family(profiles[0].problem, "looped-bfs").orders()
    lines = [
        f"statistic {statistic!r}, passes {pass_source}, {steps or 'all'} calibration steps: per profile "
        "(load before → after, s): unshard / reduce_grad per stage · "
        "overhead per pass · F / I / W per stage (with the overhead) · predicted hidden/exposed r0 (pp 0), r2 (pp 1)"
    ]
    predictions = []
    for k, (record, profile) in enumerate(zip(records, profiles, strict=True)):
        costs = profile.problem.costs
        predicted = _prediction(profile.problem, orders)
        predictions.append(predicted)
        lines.append(
            f"  {k} ({record['load'][0]:.1f} → {record['load'][1]:.1f}, {record['seconds']:.0f} s): "
            f"U {_list(costs.unshard)} · R {_list(costs.reduce_grad)} · o {profile.calibration.overhead_ms:+.2f} · "
            f"F {_list(costs.forward)} I {_list(costs.backward_input)} W {_list(costs.backward_weight)} · "
            + ", ".join(f"pp{r} {h:.1f}/{e:.1f}" for r, (h, e) in enumerate(predicted))
        )
    lines.append("  spread (max − min) of predicted hidden/exposed per pipeline rank: " + _spread(predictions))
    inputs = [_inputs(profile, medians) for profile, medians in assembled]
    mean = _mean(inputs)
    for label, names in (
        ("collectives", _COLLECTIVES),
        ("reduce_grad", ("reduce_grad",)),
        ("unshard", ("unshard",)),
        ("passes", tuple(_PASSES)),
        ("overhead", ("overhead",)),
    ):
        held = [
            _prediction(_problem(p.problem, {**i, **{name: mean[name] for name in names}}), orders)
            for p, i in zip(profiles, inputs, strict=True)
        ]
        lines.append(f"  held at the mean: {label:>11}: " + _spread(held))
    return lines


def _list(values: Any) -> str:
    return "[" + " ".join(f"{v:.1f}" for v in values) + "]"


def _spread(predictions: list[list[tuple[float, float]]]) -> str:
    parts = []
    for rank in range(len(predictions[0])):
        hidden = [p[rank][0] for p in predictions]
        exposed = [p[rank][1] for p in predictions]
        parts.append(
            f"pp{rank} hidden {min(hidden):.1f}…{max(hidden):.1f} ({max(hidden) - min(hidden):.1f}), "
            f"exposed {min(exposed):.1f}…{max(exposed):.1f} ({max(exposed) - min(exposed):.1f})"
        )
    return "; ".join(parts)


def main() -> None:
    from pipesched.runtime.profile import COLLECTIVE_STATISTICS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--profiles", type=int, default=5)
    parser.add_argument("--calibration-steps", type=int, default=16)
    parser.add_argument("--raw", type=Path, required=True, help="where the profiles' raw records are kept")
    parser.add_argument("--no-collect", action="store_true", help="only tabulate the records already in --raw")
    parser.add_argument("--statistic", default="all", help="comma-separated COLLECTIVE_STATISTICS, or all")
    parser.add_argument("--steps", default="8,all", help="calibration steps read (a prefix of those run), e.g. 8,all")
    parser.add_argument("--pass-source", default="timed,calibration", help="comma-separated PASS_SOURCES")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    if not args.no_collect:
        collect(args.raw, args.profiles, args.calibration_steps, args.model)
    statistics_ = COLLECTIVE_STATISTICS if args.statistic == "all" else tuple(args.statistic.split(","))
    prefixes = [None if n == "all" else int(n) for n in args.steps.split(",")]
    lines = [
        line
        for source in args.pass_source.split(",")
        for steps in prefixes
        for statistic in statistics_
        for line in tabulate(args.raw, statistic, steps, source)
    ]
    print("\n".join(lines))
    if args.output is not None:
        args.output.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
