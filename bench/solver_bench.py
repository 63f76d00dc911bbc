"""Benchmark of the ``auto`` search on the Zero Bubble paper's 12 settings (objective stage_span).

Each setting is solved at memory limits 1.0, 1.25, 1.5, 2.0 and 3.0 × p·activation with
``time_limit_s`` 10 for p ≤ 16 and 30 for p = 32 (``--quick``: 2 and 5). One table: our stage span
beside the paper's ZB-1p (limit 1.0) and ZB-2p (limit 2.0), bubble rate, lower bound, gap, time to
the first feasible schedule, wall time and the backend that found the answer.

Run: ``python -m bench.solver_bench [--quick] [--output bench/results/solver_bench.txt]``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from optimizer.problem import Problem
from optimizer.solve import Progress, solve

SETTINGS_PATH = Path(__file__).resolve().parent.parent.parent / "shared" / "bench" / "zb_paper_settings.json"
LIMIT_FACTORS = (1.0, 1.25, 1.5, 2.0, 3.0)


def paper_problem(setting: dict[str, Any], limit_factor: float, time_limit_s: float) -> Problem:
    """The setting as a stage_span problem with limit ``limit_factor × num_ranks × activation`` bytes."""
    return Problem.model_validate(
        {
            "pipeline": {"num_ranks": setting["num_ranks"], "num_microbatches": setting["num_microbatches"]},
            "costs": {
                "forward": setting["forward_ms"],
                "backward_input": setting["backward_input_ms"],
                "backward_weight": setting["backward_weight_ms"],
                "p2p": setting["p2p_ms"],
            },
            "memory": {
                "activation": setting["activation"],
                "retained_for_weight": setting["retained_for_weight"],
                "limit": limit_factor * setting["num_ranks"] * setting["activation"],
            },
            "split_backward": True,
            "objective": "stage_span",
            "solver": {"method": "auto", "time_limit_s": time_limit_s},
        }
    )


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print (and optionally save) the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="time limits 2 s (p ≤ 16) and 5 s (p = 32)")
    parser.add_argument("--output", type=Path, default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    settings = json.loads(SETTINGS_PATH.read_text())["settings"]
    header = (
        f"{'model':>6} {'p':>3} {'m':>4} {'mem':>5} {'ours_ms':>10} {'paper_ms':>10} {'vs_paper':>8} "
        f"{'bubble':>7} {'bound_ms':>10} {'gap':>7} {'first_s':>7} {'wall_s':>7}  backend"
    )
    lines = [header, "-" * len(header)]
    print(header, flush=True)
    for setting in settings:
        p = setting["num_ranks"]
        time_limit_s = (2.0 if p <= 16 else 5.0) if args.quick else (10.0 if p <= 16 else 30.0)
        for factor in LIMIT_FACTORS:
            problem = paper_problem(setting, factor, time_limit_s)
            first: list[float] = []

            def progress(update: Progress, first: list[float] = first) -> None:
                if update.best_objective is not None and not first:
                    first.append(update.elapsed_s)

            started = time.perf_counter()
            schedule = solve(problem, progress=progress)
            wall_s = time.perf_counter() - started
            published = setting["published_stage_span_ms"]
            paper = published.get("ZB-1p") if factor == 1.0 else published.get("ZB-2p") if factor == 2.0 else None
            ours = schedule.stage_span
            versus = f"{(ours - paper) / paper:+.2%}" if paper and ours else ""
            line = (
                f"{setting['model']:>6} {p:>3} {setting['num_microbatches']:>4} {factor:>5.2f} "
                f"{ours or float('nan'):>10.3f} {paper if paper else '':>10} {versus:>8} "
                f"{schedule.bubble_rate or 0.0:>7.4f} {schedule.lower_bound or float('nan'):>10.3f} "
                f"{schedule.gap if schedule.gap is not None else float('nan'):>7.4f} "
                f"{first[0] if first else float('nan'):>7.3f} {wall_s:>7.2f}  {schedule.backend}"
            )
            print(line, flush=True)
            lines.append(line)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
