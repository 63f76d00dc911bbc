"""Breadth-first against depth-first pipelines with FSDP, in pipesched's model of the training step.

The claim (Lamy-Poirier, "Breadth-First Pipeline Parallelism", 2022): with fully sharded data parallelism a
looped breadth-first schedule gathers each stage's weights once per step and reduce-scatters each stage's
gradients right after its last backward, hidden behind the rest of the step, and so beats depth-first
schedules at a small batch per GPU (up to 43% over Megatron-LM on a 52B model).

Setting: a 52B-class GPT (64 layers, hidden 8192, 64 heads, sequence 2048, vocabulary 51200, bf16,
microbatch 1), pipeline p = 8, FSDP (sharding ``full``) over d data-parallel copies on an inter-node network
(25 GB/s per GPU, or 6.25 GB/s, 20 µs per ring step), A100-80GB. Costs, collectives
(:mod:`pipesched.optimizer.cost.collectives`) and memory are derived from the model. Two pipeline shapes: one
layer per stage (stages_per_rank 8, loop placement) for ``looped-bfs``, ``lga`` and ``interleaved-1f1b``;
eight layers per stage (stages_per_rank 1) for ``1f1b`` and ``zb-h1``; ``auto`` (objective step_time) on
both, the better one reported. The x axis is microbatches per GPU, m / p.

Each schedule runs with FSDP's weights either gathered for the whole step (``reshard_after_forward`` false:
every stage's weights held at once) or resharded (``reshard_after_forward`` true, "rs"): depth-first
schedules then re-gather a stage for every microbatch's forward and backward (FSDP2), breadth-first and LGA
once per run of microbatches (once for the forwards, once for the backwards) — the papers' fair baselines
(issue 27). Depth-first interleaving is also shown with every reduction after the flush
(``data_parallel.overlap_grad_reduce`` false: Megatron-LM as the breadth-first paper measured it).

Run: ``python -m bench.dp_bench [--quick] [--output bench/results/dp_bench]`` (writes .json, .md and .png).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.solve import solve, solve_family

MODEL = {
    "num_layers": 64,
    "hidden_size": 8192,
    "num_attention_heads": 64,
    "seq_length": 2048,
    "vocab_size": 51200,
    "micro_batch_size": 1,
    "dtype": "bf16",
}
CLUSTER = {"accelerator": "A100-80GB", "p2p_bandwidth_bytes_per_s": 25e9, "p2p_latency_ms": 0.02}
NUM_RANKS = 8
#: label → (family, stages per rank, reshard_after_forward, overlap_grad_reduce); "auto" solves both shapes.
VARIANTS: dict[str, tuple[str, int, bool, bool]] = {
    "looped-bfs": ("looped-bfs", 8, False, True),
    "looped-bfs rs": ("looped-bfs", 8, True, True),
    "lga rs": ("lga", 8, True, True),
    "interleaved-1f1b": ("interleaved-1f1b", 8, False, True),
    "interleaved-1f1b rs": ("interleaved-1f1b", 8, True, True),
    #: every REDUCE_GRAD after the flush: Megatron-LM as the breadth-first paper measured it.
    "interleaved, reduce after flush": ("interleaved-1f1b", 8, False, False),
    "1f1b": ("1f1b", 1, False, True),
    "1f1b rs": ("1f1b", 1, True, True),
    "zb-h1": ("zb-h1", 1, False, True),
    "auto": ("auto", 0, False, True),
    "auto rs": ("auto", 0, True, True),
}
METHODS = tuple(VARIANTS)
BREADTH_FIRST = ("looped-bfs", "looped-bfs rs", "lga rs")
MEGATRON_2022 = "interleaved, reduce after flush"


def problem(
    num_microbatches: int,
    stages_per_rank: int,
    *,
    data_parallel: int,
    recomputation: str,
    time_limit_s: float,
    bandwidth: float = 25e9,
    reshard_after_forward: bool = False,
    overlap_grad_reduce: bool = True,
) -> Problem:
    """The derived step_time problem for one shape."""
    return load_problem(
        {
            "pipeline": {
                "num_ranks": NUM_RANKS,
                "num_microbatches": num_microbatches,
                "stages_per_rank": stages_per_rank,
            },
            "model": {**MODEL, "activation_recomputation": recomputation},
            # every link at the bench's bandwidth: the data-parallel ring (intra- or inter-node) as the pipeline's
            "cluster": {
                **CLUSTER,
                "p2p_bandwidth_bytes_per_s": bandwidth,
                "intra_node_bandwidth_bytes_per_s": bandwidth,
                "inter_node_bandwidth_bytes_per_s": bandwidth,
                "collective_latency_ms": CLUSTER["p2p_latency_ms"],
            },
            "data_parallel": {
                "size": data_parallel,
                "sharding": "full",
                "reshard_after_forward": reshard_after_forward,
                "overlap_grad_reduce": overlap_grad_reduce,
            },
            "objective": "step_time",
            "solver": {"method": "auto", "time_limit_s": time_limit_s},
        }
    )


def run_point(
    num_microbatches: int, *, data_parallel: int, recomputation: str, time_limit_s: float, bandwidth: float
) -> dict[str, Any]:
    """Every variant at one microbatch count: step time (ms), peak memory (GiB), feasibility."""
    row: dict[str, Any] = {"num_microbatches": num_microbatches, "per_gpu": num_microbatches / NUM_RANKS}
    for label, (method, stages_per_rank, reshard, overlap) in VARIANTS.items():
        shapes = (8, 1) if method == "auto" else (stages_per_rank,)
        best: dict[str, Any] | None = None
        for spr in shapes:
            prob = problem(
                num_microbatches,
                spr,
                data_parallel=data_parallel,
                recomputation=recomputation,
                time_limit_s=time_limit_s,
                bandwidth=bandwidth,
                reshard_after_forward=reshard,
                overlap_grad_reduce=overlap,
            )
            started = time.perf_counter()
            schedule = solve(prob) if method == "auto" else solve_family(prob, method, enforce_memory=False)
            if schedule.status == "infeasible":
                continue
            entry = {
                "step_time_ms": schedule.step_time,
                "peak_memory_gib": max(schedule.peak_memory) / 2**30,
                "fits": bool(schedule.fits_memory),
                "stages_per_rank": spr,
                "gathers_per_rank": max(sum(a.kind == "UNSHARD" for a in rank.actions) for rank in schedule.ranks),
                "wall_s": round(time.perf_counter() - started, 2),
            }
            if method == "auto":
                entry |= {"lower_bound_ms": schedule.lower_bound, "backend": schedule.backend}
            if best is None or entry["step_time_ms"] < best["step_time_ms"]:
                best = entry
        row[label] = best
    return row


def table(rows: list[dict[str, Any]], title: str) -> str:
    """Markdown: step time per variant (ms; ✗ = over the memory limit), the best breadth-first variant's gain
    over the best depth-first one that fits."""
    head = "| m | m/p | " + " | ".join(METHODS) + " | bfs throughput vs best depth-first |"
    lines = [f"**{title}**", "", head, "|" + "---|" * (len(METHODS) + 3)]
    for row in rows:
        cells = []
        for method in METHODS:
            entry = row.get(method)
            if entry is None:
                cells.append("infeasible")
                continue
            mark = "" if entry.get("fits", True) else " ✗"
            cells.append(f"{entry['step_time_ms']:.0f} ({entry['peak_memory_gib']:.0f} GiB){mark}")
        fitting = [row[m]["step_time_ms"] for m in BREADTH_FIRST if row.get(m) and row[m]["fits"]]
        depth_first = [m for m in METHODS if m not in BREADTH_FIRST and not m.startswith("auto")]
        gains = []
        for names, label in (((MEGATRON_2022,), "Megatron-2022"), (depth_first, "best depth-first")):
            depth = [row[m]["step_time_ms"] for m in names if row.get(m) and row[m]["fits"]]
            if fitting and depth:
                gains.append(f"{100 * (min(depth) / min(fitting) - 1):+.1f}% vs {label}")
        gain = ", ".join(gains) if gains else ("bfs over memory" if not fitting else "—")
        lines.append(f"| {row['num_microbatches']} | {row['per_gpu']:g} | " + " | ".join(cells) + f" | {gain} |")
    return "\n".join(lines)


def figure(sections: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Step time per sample (ms per microbatch) against microbatches per GPU, one panel per section."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sections), figsize=(6.5 * len(sections), 4.2), squeeze=False)
    for ax, (title, rows) in zip(axes[0], sections.items(), strict=True):
        for method in METHODS:
            xs, ys = [], []
            for row in rows:
                entry = row.get(method)
                if entry is None or not entry.get("fits", True):
                    continue
                xs.append(row["per_gpu"])
                ys.append(entry["step_time_ms"] / row["num_microbatches"])
            ax.plot(xs, ys, marker="o", label=method, linestyle="--" if method == "auto" else "-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("microbatches per GPU (m / p)")
        ax.set_ylabel("step time per microbatch (ms)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.4)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer points, 2 s per auto solve")
    parser.add_argument("--output", default="bench/results/dp_bench", help="path without suffix")
    args = parser.parse_args()
    points = (8, 16, 32) if args.quick else (8, 16, 24, 32, 64)
    time_limit_s = 2.0 if args.quick else 8.0
    sections: dict[str, list[dict[str, Any]]] = {}
    configs = [
        ("FSDP d=16, 25 GB/s per GPU, full recomputation", 16, "full", 25e9),
        ("FSDP d=64, 6.25 GB/s per GPU, full recomputation", 64, "full", 6.25e9),
        ("FSDP d=16, 25 GB/s per GPU, selective recomputation", 16, "selective", 25e9),
    ]
    for title, d, recomputation, bandwidth in configs:
        rows = []
        for m in points:
            rows.append(
                run_point(
                    m, data_parallel=d, recomputation=recomputation, time_limit_s=time_limit_s, bandwidth=bandwidth
                )
            )
            print(title, m, {k: (v or {}).get("step_time_ms") for k, v in rows[-1].items() if isinstance(v, dict)})
        sections[title] = rows
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps(sections, indent=1))
    text = "\n\n".join(table(rows, title) for title, rows in sections.items())
    output.with_suffix(".md").write_text(text + "\n")
    figure(sections, output.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    main()
