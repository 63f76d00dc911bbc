"""The layer partition's time tie, judged by the schedule: every tied split of a published layout simulated.

For each row of ``ROWS`` (published layouts whose time-balanced split has a tie at its last level, the run's own
split not stated), the split the planner chooses (:func:`pipesched.optimizer.partition.break_tie`: a bounded descent
judged by the family's simulated peak) is set beside the model-order rule's (the latest stages, the partition's
default), the lowest index's (the rule before issue 24) and every other tied split, each predicted as the calibration
predicts the row (:func:`pipesched.optimizer.calibration.predict.predict`, its split pinned through
``layout.pipeline_split``, memory not enforced): the predicted peak over ranks and tokens/s per GPU. A row whose
tied splits would take more than ``ENUMERATION_S`` to predict (their number × one prediction's time) is not
enumerated.

Run: ``python -m bench.partition_tie [--output FILE]`` (about 15 minutes on a shared 2-core machine).
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from pathlib import Path

from pipesched.optimizer.calibration.predict import configuration, estimator, predict
from pipesched.optimizer.cost.calibration.measurements import Measurement, builtin_measurements
from pipesched.optimizer.cost.stages import derive_problem
from pipesched.optimizer.partition import LayerTie
from pipesched.optimizer.planner.evaluate import build_problem

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 1024**3

#: Rows with a time tie among several stages per rank (context/expert-parallel sources, held out of every fit).
ROWS = (
    "automodel-h100-deepseek-v3-256",
    "automodel-h100-deepseek-v3-1024",
    "mbridge2509-deepseek-v3-1024-h100-tp2pp8cp1vp4ep64-gbs8192-mbs1",
)
#: The most seconds a row's tied splits are predicted for (Megatron Bridge's 1,024-GPU row: 0.16 s a split).
ENUMERATION_S = 600.0


def pinned(row: Measurement, split: list[int]) -> Measurement:
    """``row`` with its layers split as ``split``."""
    return row.model_copy(update={"layout": row.layout.model_copy(update={"pipeline_split": split})})


def tie_of(row: Measurement) -> tuple[list[int], LayerTie | None]:
    """The planner's split of ``row`` and the tie its time-balanced partition had."""
    problem = build_problem(estimator(row), configuration(row), enforce_memory=False)
    assert problem.model is not None and problem.model.layers_per_stage is not None and problem.cluster is not None
    derived = derive_problem(
        problem.model.model_copy(update={"layers_per_stage": None}),
        problem.cluster,
        problem.pipeline,
        tensor_parallel=problem.tensor_parallel,
        data_parallel=problem.data_parallel,
        context_parallel=problem.context_parallel,
        expert_parallel=problem.expert_parallel,
    )
    return list(problem.model.layers_per_stage), derived.tie


def figures(row: Measurement, split: list[int]) -> tuple[float, float]:
    """Predicted peak (GiB) and tokens/s per GPU of ``row`` with ``split``."""
    prediction = predict(pinned(row, split))
    assert prediction.peak_memory_bytes is not None and prediction.tokens_per_s_per_gpu is not None
    return prediction.peak_memory_bytes / GIB, prediction.tokens_per_s_per_gpu


def report(row: Measurement) -> list[str]:
    """The row's lines of the table."""
    started = time.perf_counter()
    chosen, tie = tie_of(row)
    if tie is None:
        return [f"| {row.id} | no tie | | | | | | |"]
    count = math.comb(len(tie.stages), tie.extra)
    rule = figures(row, tie.split(tie.stages[-tie.extra :]))
    lowest = figures(row, tie.split(tie.stages[: tie.extra]))
    began = time.perf_counter()
    judged = figures(row, chosen)
    if count * (time.perf_counter() - began) > ENUMERATION_S:
        spread, rank = "not enumerated", "—"
    else:
        every = [figures(row, tie.split(taken)) for taken in itertools.combinations(tie.stages, tie.extra)]
        peaks = sorted(peak for peak, _ in every)
        spread = f"{peaks[0]:.2f} – {peaks[-1]:.2f}"
        rank = f"{sum(peak < judged[0] - 1e-9 for peak in peaks)} of {count} lower"
    return [
        f"| {row.id} | {len(tie.stages)} stages, {tie.extra} take one ({count:,} splits) | "
        f"{lowest[0]:.2f} GiB, {lowest[1]:,.1f} | {rule[0]:.2f} GiB, {rule[1]:,.1f} | "
        f"{judged[0]:.2f} GiB, {judged[1]:,.1f} | {spread} | {rank} | {time.perf_counter() - started:.0f} s |"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=RESULTS / "partition_tie.md")
    args = parser.parse_args()
    rows = {row.id: row for row in builtin_measurements()}
    lines = [
        "# The partition's time tie judged by the schedule (`python -m bench.partition_tie`)",
        "",
        "Peak over ranks and tokens/s per GPU as the calibration predicts each row (memory not enforced), with the",
        "lowest-index tie-break (before issue 24), the model-order rule (the latest stages: issue 24), the split the",
        "planner now chooses (the schedule's judge), and the range of the peak over every tied split.",
        "",
        "| row | tie | lowest index | model order (latest) | judged | every tied split, GiB | judged's rank | time |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in ROWS:
        lines += report(rows[name])
        print(lines[-1], flush=True)
    args.output.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
