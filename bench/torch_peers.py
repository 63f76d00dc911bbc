"""``auto`` beside PyTorch's built-in schedules, each at the memory that schedule uses.

For each of the Zero Bubble paper's 12 settings (``bench/data/zb_paper_settings.json``) and each pipeline
shape PyTorch supports — loop with 1 and 2 stages per rank, V — the model is re-cut (per-stage costs and
activations divided by the stages per rank: the same layers on twice as many stages), every PyTorch 2.13
schedule of that shape is read on stand-in stages (:mod:`pipesched.runtime.torch_orders`) and timed by
pipesched's simulator, and ``auto`` is solved with ``memory.limit`` set to that schedule's per-rank peak.
Objective stage_span; GPipe, 1F1B, Interleaved1F1B and LoopedBFS run fused backward passes (so does the
problem ``auto`` gets), the zero-bubble ones split (DualPipeV mixes both and is compared on the split problem).

Printed: auto / torch ratio (below 1: auto is shorter), both objectives and who found auto's answer.

Run: ``python -m bench.torch_peers [--quick] [--output bench/results/torch_peers.txt]`` (needs torch);
``--plot FILE.png`` draws the ratios (from this run, or from ``--from-json`` without solving again).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from pipesched.optimizer.problem import Problem
from pipesched.runtime.torch_orders import auto_versus_torch, peer_problem, torch_schedules_for

SETTINGS_PATH = Path(__file__).resolve().parent / "data" / "zb_paper_settings.json"
SHAPES = ((1, "loop"), (2, "loop"), (2, "v"))


def recut_problem(setting: dict[str, Any], stages_per_rank: int, placement: str) -> Problem:
    """The setting's model on ``num_ranks × stages_per_rank`` stages: costs and memory per stage divided by v."""
    v = stages_per_rank
    return Problem.model_validate(
        {
            "pipeline": {
                "num_ranks": setting["num_ranks"],
                "num_microbatches": setting["num_microbatches"],
                "stages_per_rank": v,
                "placement": placement,
            },
            "costs": {
                "forward": setting["forward_ms"] / v,
                "backward_input": setting["backward_input_ms"] / v,
                "backward_weight": setting["backward_weight_ms"] / v,
                "p2p": setting["p2p_ms"],
            },
            "memory": {
                "activation": setting["activation"] / v,
                "retained_for_weight": setting["retained_for_weight"] / v,
            },
            "objective": "stage_span",
        }
    )


def plot_ratios(records: list[dict[str, Any]], path: Path) -> None:
    """One panel per pipeline shape: auto/torch per PyTorch schedule (bars) for each paper setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = [(placement, v) for v, placement in SHAPES]
    settings = sorted({(r["num_ranks"], r["num_microbatches"], r["model"]) for r in records})
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.2 * len(shapes), 4.2), sharey=True)
    for ax, (placement, v) in zip(axes, shapes, strict=True):
        rows = [r for r in records if r["placement"] == placement and r["stages_per_rank"] == v]
        names = sorted({r["schedule"] for r in rows}, key=[s.name for s in torch_schedules_for(placement, v)].index)
        width = 0.8 / max(1, len(names))
        for k, name in enumerate(names):
            values = []
            for p, m, model in settings:
                match = [
                    r["ratio"]
                    for r in rows
                    if r["schedule"] == name
                    and (r["num_ranks"], r["num_microbatches"]) == (p, m)
                    and r["model"] == model
                ]
                values.append(match[0] if match else float("nan"))
            ax.bar([i + k * width for i in range(len(settings))], values, width, label=name)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(settings))])
        ax.set_xticklabels([f"{model}\np={p} m={m}" for p, m, model in settings], rotation=90, fontsize=7)
        ax.set_title(f"{placement}, {v} stage{'s' if v > 1 else ''} per rank")
        ax.legend(fontsize=7, loc="lower left")
    axes[0].set_ylabel("auto / PyTorch stage_span at PyTorch's memory")
    low = min([r["ratio"] for r in records] + [0.98])
    for ax in axes:
        ax.set_ylim(low - 0.005, 1.005)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 s per auto solve instead of 10 (30 at p = 32)")
    parser.add_argument("--max-ranks", type=int, default=32, help="skip settings with more ranks")
    parser.add_argument("--output", type=Path, help="also write the table here (and a .json beside it)")
    parser.add_argument("--plot", type=Path, help="draw the ratios into this PNG")
    parser.add_argument("--from-json", type=Path, help="plot the records of an earlier run instead of solving")
    args = parser.parse_args()
    if args.from_json is not None:
        if args.plot is None:
            parser.error("--from-json needs --plot")
        plot_ratios(json.loads(args.from_json.read_text()), args.plot)
        return
    settings = json.loads(SETTINGS_PATH.read_text())["settings"]
    header = (
        f"{'model':<6}{'p':>4}{'m':>5}  {'shape':<7}{'PyTorch schedule':<23}{'torch ms':>11}{'auto ms':>11}"
        f"{'auto/torch':>11}  found by"
    )
    lines = [header, "-" * len(header)]
    print(header, flush=True)
    records = []
    started = time.perf_counter()
    for setting in settings:
        p = setting["num_ranks"]
        if p > args.max_ranks:
            continue
        limit_s = 2.0 if args.quick else (10.0 if p <= 16 else 30.0)
        for v, placement in SHAPES:
            base = recut_problem(setting, v, placement)
            for spec in torch_schedules_for(placement, v):
                try:
                    result = auto_versus_torch(peer_problem(base, spec), spec, limit_s)
                except ValueError as error:
                    line = (
                        f"{setting['model']:<6}{p:>4}{setting['num_microbatches']:>5}  {placement}{v:<3}{spec.name:<23}"
                    )
                    line += f"  (PyTorch rejects this shape: {str(error).split(': ', 1)[-1][:60]})"
                    lines.append(line)
                    print(line, flush=True)
                    continue
                line = (
                    f"{setting['model']:<6}{p:>4}{setting['num_microbatches']:>5}  {placement + str(v):<7}"
                    f"{spec.name:<23}{result.torch_value:>11.3f}{result.auto_value:>11.3f}{result.ratio:>11.4f}"
                    f"  {result.backend}"
                )
                lines.append(line)
                print(line, flush=True)
                records.append(
                    {
                        "model": setting["model"],
                        "num_ranks": p,
                        "num_microbatches": setting["num_microbatches"],
                        "placement": placement,
                        "stages_per_rank": v,
                        "schedule": spec.name,
                        "torch_stage_span_ms": result.torch_value,
                        "auto_stage_span_ms": result.auto_value,
                        "ratio": result.ratio,
                        "torch_peak_memory": result.torch_peak,
                        "auto_peak_memory": result.auto_peak,
                        "backend": result.backend,
                        "time_limit_s": limit_s,
                    }
                )
    ratios = [r["ratio"] for r in records]
    summary = (
        f"{len(records)} comparisons in {time.perf_counter() - started:.0f} s: auto/torch worst {max(ratios):.4f}, "
        f"best {min(ratios):.4f}, mean {sum(ratios) / len(ratios):.4f}; auto shorter in "
        f"{sum(r < 1 - 1e-9 for r in ratios)}, equal in {sum(abs(r - 1) <= 1e-9 for r in ratios)}"
    )
    lines.append(summary)
    print(summary, flush=True)
    if args.output is not None:
        args.output.write_text("\n".join(lines) + "\n")
        args.output.with_suffix(".json").write_text(json.dumps(records, indent=1))
    if args.plot is not None:
        plot_ratios(records, args.plot)


if __name__ == "__main__":
    main()
