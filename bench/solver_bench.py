"""Benchmark of the ``auto`` search on the Zero Bubble paper's 12 settings (objective stage_span).

Each setting is solved at memory limits 1.0, 1.25, 1.5, 2.0 and 3.0 × p·activation with
``time_limit_s`` 10 for p ≤ 16 and 30 for p = 32 (``--quick``: 2 and 5). One table: our stage span
beside the paper's ZB-1p (limit 1.0) and ZB-2p (limit 2.0), bubble rate, lower bound, gap, time to
the first feasible schedule, wall time and the backend that found the answer.

A second table (``--section small``) solves small instances (num_ranks × num_microbatches ≤ 64) with
the four models' profiled costs, at limits 1.0, 1.5 and 2.0 × p·activation and with none, for both
objectives, and counts how many are proven optimal (gap 0) within the time limit.

A third table (``--section bidirectional``) puts ``auto`` beside BitPipe (the authors' order, the
``bitpipe`` family) on two V-shaped replicas, uniform costs, with a limit of 2·p microbatches per rank.

Run: ``python -m bench.solver_bench [--quick] [--section paper|small|bidirectional|all] [--output FILE]``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.solve import Progress, solve, solve_family

SETTINGS_PATH = Path(__file__).resolve().parent / "data" / "zb_paper_settings.json"  # its source is named inside
LIMIT_FACTORS = (1.0, 1.25, 1.5, 2.0, 3.0)


def paper_problem(setting: dict[str, Any], limit_factor: float, time_limit_s: float) -> Problem:
    """The setting as a stage_span problem with limit ``limit_factor × num_ranks × activation`` bytes."""
    return load_problem(
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


SMALL_SHAPES = ((2, 8), (2, 16), (4, 4), (4, 8), (4, 16), (8, 4), (8, 8))
SMALL_LIMITS: tuple[float | None, ...] = (1.0, 1.5, 2.0, None)


def small_instances(settings: list[dict[str, Any]], time_limit_s: float) -> list[tuple[str, Problem]]:
    """Instances with num_ranks × num_microbatches ≤ 64, the first setting of each model's costs."""
    seen: set[str] = set()
    instances = []
    for setting in settings:
        if setting["model"] in seen:
            continue
        seen.add(setting["model"])
        for p, m in SMALL_SHAPES:
            for factor in SMALL_LIMITS:
                for objective in ("stage_span", "makespan"):
                    shaped = {**setting, "num_ranks": p, "num_microbatches": m}
                    problem = paper_problem(shaped, factor or 1.0, time_limit_s)
                    problem = problem.with_changes(
                        **{"objective": objective, "memory.limit": None if factor is None else problem.memory.limit}  # type: ignore[union-attr]
                    )
                    label = f"{setting['model']:>6} {p:>3} {m:>4} {factor or 0:>5.2f} {objective:>10}"
                    instances.append((label, problem))
    return instances


def run_small(settings: list[dict[str, Any]], time_limit_s: float) -> list[str]:
    """Solve the small instances; one line each plus a count of those proven optimal."""
    header = (
        f"{'model':>6} {'p':>3} {'m':>4} {'mem':>5} {'objective':>10} {'value_ms':>10} {'gap':>7} "
        f"{'wall_s':>7}  backend"
    )
    lines = ["", "small instances (p·m ≤ 64; mem 0 = no limit)", header, "-" * len(header)]
    for line in lines:
        print(line, flush=True)
    proven = 0
    instances = small_instances(settings, time_limit_s)
    for label, problem in instances:
        started = time.perf_counter()
        schedule = solve(problem)
        wall_s = time.perf_counter() - started
        proven += schedule.status == "optimal"
        line = (
            f"{label} {schedule.objective_value or float('nan'):>10.3f} "
            f"{schedule.gap if schedule.gap is not None else float('nan'):>7.4f} {wall_s:>7.2f}  {schedule.backend}"
        )
        print(line, flush=True)
        lines.append(line)
    summary = f"proven optimal: {proven} of {len(instances)} (time limit {time_limit_s:g} s each)"
    print(summary, flush=True)
    lines.append(summary)
    return lines


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print (and optionally save) the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="time limits 2 s (p ≤ 16) and 5 s (p = 32)")
    parser.add_argument(
        "--section", choices=("paper", "small", "bidirectional", "all"), default="all", help="which tables"
    )
    parser.add_argument("--output", type=Path, default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    settings = json.loads(SETTINGS_PATH.read_text())["settings"]
    lines: list[str] = []
    if args.section in ("paper", "all"):
        lines += run_paper(settings, quick=args.quick)
    if args.section in ("small", "all"):
        lines += run_small(settings, 2.0 if args.quick else 10.0)
    if args.section in ("bidirectional", "all"):
        lines += run_bidirectional(2.0 if args.quick else 10.0)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text("\n".join(lines) + "\n")


def run_paper(settings: list[dict[str, Any]], *, quick: bool) -> list[str]:
    """The paper's 12 settings at five memory limits; one line each and a summary."""
    header = (
        f"{'model':>6} {'p':>3} {'m':>4} {'mem':>5} {'ours_ms':>10} {'paper_ms':>10} {'vs_paper':>8} "
        f"{'bubble':>7} {'bound_ms':>10} {'gap':>7} {'first_s':>7} {'wall_s':>7}  backend"
    )
    lines = [header, "-" * len(header)]
    print(header, flush=True)
    compared = not_worse = better = 0
    over_limit = -math.inf
    slowest_first = 0.0
    for setting in settings:
        p = setting["num_ranks"]
        time_limit_s = (2.0 if p <= 16 else 5.0) if quick else (10.0 if p <= 16 else 30.0)
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
            if paper:
                compared += 1
                not_worse += ours is not None and ours <= paper + 1e-6
                better += ours is not None and ours < paper - 1e-6
            over_limit = max(over_limit, wall_s - time_limit_s)
            slowest_first = max(slowest_first, first[0] if first else math.inf)
    summary = (
        f"vs the paper (ZB-1p at 1.0, ZB-2p at 2.0): not worse in {not_worse} of {compared}, better in {better}; "
        f"slowest first feasible {slowest_first:.3f} s; most over the time limit {over_limit:+.2f} s"
    )
    print(summary, flush=True)
    lines.append(summary)
    return lines


BIDIRECTIONAL_SHAPES = ((4, 16), (8, 32), (16, 64))


def run_bidirectional(time_limit_s: float) -> list[str]:
    """auto against BitPipe on bidirectional placement (F = I = W = 1 ms per stage, p2p 0.05 ms, activation
    50 bytes per stage, limit 2·p microbatches per rank); fused and split backward."""
    header = (
        f"{'p':>3} {'m':>4} {'backward':>8} {'bitpipe_ms':>10} {'auto_ms':>10} {'ratio':>6} {'bound_ms':>10} "
        f"{'gap':>7} {'wall_s':>7}  backend"
    )
    lines = ["", "bidirectional placement: auto beside BitPipe (limit 2·p microbatches per rank)", header]
    lines.append("-" * len(header))
    for line in lines:
        print(line, flush=True)
    for p, m in BIDIRECTIONAL_SHAPES:
        for split in (False, True):
            problem = load_problem(
                {
                    "pipeline": {
                        "num_ranks": p,
                        "num_microbatches": m,
                        "stages_per_rank": 2,
                        "placement": "bidirectional",
                    },
                    # reduce_grad 0: the compute orders alone (the replicas' sync is priced in bench/bitpipe_bench.py)
                    "costs": {
                        "forward": 1.0,
                        "backward_input": 1.0,
                        "backward_weight": 1.0,
                        "p2p": 0.05,
                        "reduce_grad": 0.0,
                    },
                    "memory": {"activation": 50.0, "retained_for_weight": 18.0, "limit": 2 * p * 100.0},
                    "split_backward": split,
                    "solver": {"method": "auto", "time_limit_s": time_limit_s},
                }
            )
            bitpipe = solve_family(problem, "bitpipe", enforce_memory=False)
            started = time.perf_counter()
            schedule = solve(problem)
            wall_s = time.perf_counter() - started
            ours = schedule.makespan or float("nan")
            line = (
                f"{p:>3} {m:>4} {'split' if split else 'fused':>8} {bitpipe.makespan or float('nan'):>10.3f} "
                f"{ours:>10.3f} {ours / (bitpipe.makespan or float('nan')):>6.3f} "
                f"{schedule.lower_bound or float('nan'):>10.3f} "
                f"{schedule.gap if schedule.gap is not None else float('nan'):>7.4f} {wall_s:>7.2f}  {schedule.backend}"
            )
            print(line, flush=True)
            lines.append(line)
    return lines


if __name__ == "__main__":
    main()
