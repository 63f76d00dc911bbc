"""Peak activations of a run against the prediction from the same machine's profile, per family × engine × layout.

Issue 25 asks that ``pipesched profile`` measure "activation and static memory as the runtime allocates them" so
that the prediction of a run from that profile is what the run measures. Per layout (pipeline 2 × data-parallel 1
or 2 with FSDP2 sharding ``full``; one stage per rank in loop placement, two per rank in loop and in V placement)
this bench profiles the model on the run's processes (``measure_model``, no calibration run: only bytes matter
here), solves each family of that layout from the profile, runs all of them in one launch on each engine
(``pipesched``, the own executor, and ``torch``, PyTorch's ``_PipelineScheduleRuntime``), and prints per pipeline
rank the run's measured peak activations (``RankReport.peak_memory_bytes``: saved tensors live, the largest over
the rank's data-parallel peers) beside the prediction (``RankReport.predicted_peak_activation_bytes``) and the error
``measured / predicted − 1``.

    flock /work/team/heavy.lock nice -n 10 .venv/bin/python -m bench.activation_peak_bench [--model gpt-tiny]

About 4 minutes on 2 shared cores. Timing plays no part: every figure is bytes.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

#: (label, stages per rank, placement, families) of the layouts run, each with D = 1 and D = 2 (FSDP2, full).
LAYOUTS: list[tuple[str, int, str, list[str]]] = [
    ("loop ×1", 1, "loop", ["1f1b", "zb-h1"]),
    ("loop ×2", 2, "loop", ["interleaved-1f1b"]),
    ("v ×2", 2, "v", ["dualpipe-v", "zb-v"]),
]
ENGINES = ("pipesched", "torch")
NUM_RANKS = 2
NUM_MICROBATCHES = 8


@dataclass(frozen=True)
class Row:
    """One pipeline rank of one run: measured and predicted peak activations (bytes)."""

    layout: str
    data_parallel: int
    family: str
    engine: str
    pp_rank: int
    measured: int
    predicted: float

    @property
    def error(self) -> float:
        return self.measured / self.predicted - 1 if self.predicted else float("inf")


def measure(model: str, layouts: list[tuple[str, int, str, list[str]]], sizes: list[int]) -> list[Row]:
    """Profile, solve and run every (layout, D, family, engine); one row per pipeline rank."""
    from pipesched.optimizer.solve import solve_family
    from pipesched.runtime.launch import run_schedules
    from pipesched.runtime.options import TrainingOptions
    from pipesched.runtime.profile import measure_model

    rows: list[Row] = []
    for label, per_rank, placement, families in layouts:
        for size in sizes:
            training = TrainingOptions(steps=2, lr=0.05, data_parallel=size, sharding="full" if size > 1 else "none")
            profile = measure_model(
                num_ranks=NUM_RANKS,
                num_microbatches=NUM_MICROBATCHES,
                stages_per_rank=per_rank,
                placement=placement,
                model=model,
                repeats=2,
                warmup=1,
                training=training,
                calibrate=False,
            )
            schedules = [solve_family(profile.problem, family) for family in families]
            jobs = [(s, e) for s in schedules for e in ENGINES]
            reports = run_schedules(
                [s for s, _ in jobs],
                model=model,
                engine=[e for _, e in jobs],
                training=[training] * len(jobs),
                timeout_s=300,
            )
            for (schedule, engine), report in zip(jobs, reports, strict=True):
                assert report is not None and report.verified, (schedule.method, engine)
                for pp in range(NUM_RANKS):
                    peers = [r for r in report.ranks if r.pp_rank == pp]
                    predicted = peers[0].predicted_peak_activation_bytes
                    assert predicted is not None
                    rows.append(
                        Row(
                            label, size, schedule.method, engine, pp, max(r.peak_memory_bytes for r in peers), predicted
                        )
                    )
    return rows


def table(rows: list[Row]) -> str:
    """The rows as a fixed-width table, and the largest error in magnitude."""
    lines = [
        f"{'layout':<8} {'D':>1} {'family':<17} {'engine':<9} {'pp':>2} {'measured B':>11} {'predicted B':>11} "
        f"{'error':>7}"
    ]
    for r in rows:
        lines.append(
            f"{r.layout:<8} {r.data_parallel:>1} {r.family:<17} {r.engine:<9} {r.pp_rank:>2} {r.measured:>11,} "
            f"{r.predicted:>11,.0f} {100 * r.error:>+6.1f}%"
        )
    worst = max(rows, key=lambda r: abs(r.error))
    lines.append(
        f"largest |error|: {100 * worst.error:+.1f}% ({worst.layout}, D {worst.data_parallel}, {worst.family}, "
        f"{worst.engine}, pp {worst.pp_rank}); within 10%: {sum(abs(r.error) <= 0.10 for r in rows)} of {len(rows)}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--data-parallel", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    print(table(measure(args.model, LAYOUTS, args.data_parallel)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
