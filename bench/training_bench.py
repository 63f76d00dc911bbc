"""Time per training step with and without a flush: PipeDream-2BW beside 1F1B (PipeDream-Flush), ZB-H1, ZB-H2
and ``auto``, at equal memory, on the Zero Bubble paper's 12 settings (``bench/data/zb_paper_settings.json``).

Time per step: ``step_time`` of a flushed schedule under optimizer post-validation (Zero Bubble §4: the
stage_span, the paper's own cost; the synchronous ``makespan`` is in the results file too), and
``step_period`` of a schedule without a flush (the steady state of the repeating pattern). No optimizer cost,
no data parallelism: the pipeline alone.

Columns: ``1f1b`` is PipeDream-Flush with a fused backward, as published (the paper's 1F1B figures);
``zb-h1``/``zb-h2`` split it; ``auto`` searches flushed schedules (objective stage_span, post-validated);
``2bw`` is PipeDream-2BW with a fused backward, as published; ``2bw-split`` the same order with I and W back to
back; ``auto-nf`` searches schedules without a flush (objective step_period, split backward) and
``bound-nf`` is its lower bound; ``2bw/best`` = 2bw over the best flushed column. Every 2BW figure is
one step stale: step t's gradient was computed on the weights of step t−1 (W(t+1) = W(t) − ν·∇f(W(t−1))).

Memory, in the settings file's units (bytes per s·b tokens): a stage's activation is the file's
``activation``; its weights are ``w = 24·h² / (s·b)`` (12·h² parameters per transformer layer — attention
4h², MLP 8h² — in bf16, embeddings left out; b = ``--microbatch-size``, 1 by default, the case where the
weights weigh most against the activations). Gradients and optimizer state are the same for every method
and are left out of both the static memory and the limit. Every method gets the same per-rank limit:

* ``0.5×``: ``p/2·activation + 2w`` — less than 1F1B and PipeDream-2BW need: only ``auto`` fits;
* ``1×``: ``p·activation + 2w`` — exactly what PipeDream-2BW needs (1F1B's p activations on rank 0, two
  weight copies); a flushed schedule holds one weight copy and may spend the other w on activations;
* ``2×``: ``2p·activation + 2w`` — the paper's ZB-2p activation budget plus the two copies.

Run: ``python -m bench.training_bench [--quick] [--microbatch-size B] [--output FILE]``; results in
``bench/results/training_bench.txt``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.result import Schedule
from pipesched.optimizer.solve import solve, solve_family

SETTINGS_PATH = Path(__file__).resolve().parent / "data" / "zb_paper_settings.json"  # its source is named inside
LEVELS = (0.5, 1.0, 2.0)
FLUSHED = ("1f1b", "zb-h1", "zb-h2")


def weight_bytes(setting: dict[str, Any], microbatch_size: int) -> float:
    """One copy of a stage's weights in the file's units: 24·h² / (s·b) (module docstring)."""
    h = setting["hidden_size"]
    return 24.0 * h * h / (setting["seq_length"] * microbatch_size)


def problem_for(
    setting: dict[str, Any],
    level: float,
    weights: float,
    *,
    flush: bool,
    time_limit_s: float,
    split_backward: bool = True,
) -> Problem:
    """The setting at memory level ``level`` (module docstring), with or without a flush."""
    p = setting["num_ranks"]
    return load_problem(
        {
            "pipeline": {"num_ranks": p, "num_microbatches": setting["num_microbatches"]},
            "costs": {
                "forward": setting["forward_ms"],
                "backward_input": setting["backward_input_ms"],
                "backward_weight": setting["backward_weight_ms"],
                "p2p": setting["p2p_ms"],
            },
            "memory": {
                "activation": setting["activation"],
                "retained_for_weight": setting["retained_for_weight"],
                "static": weights,
                "weights": weights,
                "limit": level * p * setting["activation"] + 2 * weights,
            },
            "split_backward": split_backward,
            "training": {"flush": flush, "post_validation": True},
            "objective": "stage_span" if flush else "step_period",
            "solver": {"method": "auto", "time_limit_s": time_limit_s},
        }
    )


def per_step(schedule: Schedule) -> float | None:
    """Time per step, ms: step_period without a flush, step_time (post-validated) with one; None if infeasible."""
    if schedule.status == "infeasible":
        return None
    return schedule.step_period if schedule.step_period is not None else schedule.step_time


def run(settings: list[dict[str, Any]], *, quick: bool, microbatch_size: int) -> list[dict[str, Any]]:
    rows = []
    for setting in settings:
        p = setting["num_ranks"]
        time_limit_s = (1.0 if p <= 16 else 2.0) if quick else (5.0 if p <= 16 else 10.0)
        weights = weight_bytes(setting, microbatch_size)
        for level in LEVELS:
            flushed = problem_for(setting, level, weights, flush=True, time_limit_s=time_limit_s)
            no_flush = problem_for(setting, level, weights, flush=False, time_limit_s=time_limit_s)
            row: dict[str, Any] = {
                "model": setting["model"],
                "p": p,
                "m": setting["num_microbatches"],
                "level": level,
                "limit": flushed.memory_limits[0],
                "weights_per_activation": weights / setting["activation"],
                "time_limit_s": time_limit_s,
            }
            fused = problem_for(setting, level, weights, flush=True, time_limit_s=time_limit_s, split_backward=False)
            for name in FLUSHED:
                # PipeDream-Flush (1F1B) as published runs a fused backward; ZB-H1/H2 split it.
                schedule = solve_family(fused if name == "1f1b" else flushed, name)
                row[name] = per_step(schedule)
                row[f"{name}_synchronous"] = None if schedule.status == "infeasible" else schedule.makespan
            started = time.perf_counter()
            auto_flushed = solve(flushed)
            row["auto_flush"] = per_step(auto_flushed)
            row["auto_flush_synchronous"] = auto_flushed.makespan
            row["auto_flush_wall_s"] = time.perf_counter() - started
            fused_no_flush = problem_for(
                setting, level, weights, flush=False, time_limit_s=time_limit_s, split_backward=False
            )
            two_bw = solve_family(fused_no_flush, "pipedream-2bw")  # as published: fused backward
            row["pipedream-2bw"] = per_step(two_bw)
            row["pipedream-2bw_peak"] = max(two_bw.peak_memory) if two_bw.peak_memory else two_bw.min_memory_limit
            row["pipedream-2bw_split"] = per_step(solve_family(no_flush, "pipedream-2bw"))
            started = time.perf_counter()
            auto = solve(no_flush)
            row["auto_no_flush"] = per_step(auto)
            row["auto_no_flush_bound"] = auto.lower_bound
            row["auto_no_flush_backend"] = auto.backend
            row["auto_no_flush_wall_s"] = time.perf_counter() - started
            row["ideal"] = setting["num_microbatches"] * (
                setting["forward_ms"] + setting["backward_input_ms"] + setting["backward_weight_ms"]
            )
            rows.append(row)
            print(_line(row), flush=True)
    return rows


HEADER = (
    f"{'model':>6} {'p':>3} {'m':>4} {'mem':>4} {'ideal':>9} {'1f1b':>9} {'zb-h1':>9} {'zb-h2':>9} "
    f"{'auto':>9} {'2bw':>9} {'2bw-split':>9} {'auto-nf':>9} {'bound-nf':>9} {'2bw/best':>8} {'wall_nf':>7}  "
    "backend-nf"
)


def _fmt(value: float | None) -> str:
    return f"{value:9.3f}" if value is not None else f"{'—':>9}"


def _line(row: dict[str, Any]) -> str:
    flushed = [row[name] for name in (*FLUSHED, "auto_flush") if row[name] is not None]
    best_flushed = min(flushed) if flushed else None
    ratio = (
        f"{row['pipedream-2bw'] / best_flushed:8.4f}"
        if row["pipedream-2bw"] is not None and best_flushed
        else f"{'—':>8}"
    )
    return (
        f"{row['model']:>6} {row['p']:>3} {row['m']:>4} {row['level']:>4.1f} {row['ideal']:9.3f} "
        f"{_fmt(row['1f1b'])} {_fmt(row['zb-h1'])} {_fmt(row['zb-h2'])} {_fmt(row['auto_flush'])} "
        f"{_fmt(row['pipedream-2bw'])} {_fmt(row['pipedream-2bw_split'])} "
        f"{_fmt(row['auto_no_flush'])} {_fmt(row['auto_no_flush_bound'])} "
        f"{ratio} {row['auto_no_flush_wall_s']:7.2f}  {row['auto_no_flush_backend']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="time limits 1 s / 2 s instead of 5 s / 10 s")
    parser.add_argument("--microbatch-size", type=int, default=1, help="b in the weights' share (default 1)")
    parser.add_argument("--output", type=Path, default=None, help="also write the table and rows (JSON) here")
    args = parser.parse_args()
    settings = json.loads(SETTINGS_PATH.read_text())["settings"]
    print(HEADER)
    print("-" * len(HEADER))
    rows = run(settings, quick=args.quick, microbatch_size=args.microbatch_size)
    if args.output is not None:
        lines = [HEADER, "-" * len(HEADER), *(_line(row) for row in rows)]
        args.output.write_text("\n".join(lines) + "\n\nrows:\n" + json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
