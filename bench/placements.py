"""The same model on other pipeline shapes: ``auto`` on loop ×1, loop ×2 and V at the same per-rank memory.

What ``pipesched compare --placements loop,v --stages-per-rank 1,2`` shows, on the Zero Bubble paper's 12
settings (``bench/data/zb_paper_settings.json``): each setting's one-stage-per-rank problem (objective
stage_span, split backward) at a limit of ``factor × num_ranks × activation`` per rank (factor 1: 1F1B's and
ZB-1p's memory) is re-cut by :func:`pipesched.optimizer.recut.recut_problem` (per-stage costs and activations
halved on twice as many stages, the limit kept) and solved by ``auto`` with 10 s (30 s at p = 32).

Run: ``python -m bench.placements [--quick] [--factor 1.0] [--output bench/results/placements.txt]``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pipesched.optimizer.problem import Problem
from pipesched.optimizer.recut import recut_problem
from pipesched.optimizer.solve import solve

SETTINGS_PATH = Path(__file__).resolve().parent / "data" / "zb_paper_settings.json"
SHAPES = (("loop", 2), ("v", 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 s per solve")
    parser.add_argument("--factor", type=float, default=1.0, help="limit in units of num_ranks × activation")
    parser.add_argument("--max-ranks", type=int, default=32)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    header = (
        f"{'model':<6}{'p':>4}{'m':>5}{'loop x1 ms':>13}{'loop x2 ms':>13}{'v x2 ms':>13}"
        f"{'x2/x1':>9}{'v/x1':>9}  found by (x1 · x2 · v)"
    )
    lines = [header, "-" * len(header)]
    print(header, flush=True)
    records = []
    started = time.perf_counter()
    for setting in json.loads(SETTINGS_PATH.read_text())["settings"]:
        p = setting["num_ranks"]
        if p > args.max_ranks:
            continue
        limit_s = 2.0 if args.quick else (10.0 if p <= 16 else 30.0)
        base = Problem.model_validate(
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
                    "limit": args.factor * p * setting["activation"],
                },
                "objective": "stage_span",
                "solver": {"method": "auto", "time_limit_s": limit_s},
            }
        )
        answers = [solve(base)]
        for placement, v in SHAPES:
            answers.append(solve(recut_problem(base, placement, v)[0]))  # type: ignore[arg-type]
        values = [a.objective_value or float("nan") for a in answers]
        line = (
            f"{setting['model']:<6}{p:>4}{setting['num_microbatches']:>5}"
            + "".join(f"{v:>13.3f}" for v in values)
            + f"{values[1] / values[0]:>9.4f}{values[2] / values[0]:>9.4f}  "
            + " · ".join(a.backend for a in answers)
        )
        lines.append(line)
        print(line, flush=True)
        records.append(
            {
                "model": setting["model"],
                "num_ranks": p,
                "num_microbatches": setting["num_microbatches"],
                "limit_factor": args.factor,
                "stage_span_ms": {"loop1": values[0], "loop2": values[1], "v2": values[2]},
                "backend": {"loop1": answers[0].backend, "loop2": answers[1].backend, "v2": answers[2].backend},
                "time_limit_s": limit_s,
            }
        )
    x2 = [r["stage_span_ms"]["loop2"] / r["stage_span_ms"]["loop1"] for r in records]
    v = [r["stage_span_ms"]["v2"] / r["stage_span_ms"]["loop1"] for r in records]
    summary = (
        f"{len(records)} settings in {time.perf_counter() - started:.0f} s: loop x2 / loop x1 "
        f"{min(x2):.4f}–{max(x2):.4f}, V / loop x1 {min(v):.4f}–{max(v):.4f}"
    )
    lines.append(summary)
    print(summary, flush=True)
    if args.output is not None:
        args.output.write_text("\n".join(lines) + "\n")
        args.output.with_suffix(".json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
