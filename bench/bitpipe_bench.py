"""BitPipe against the synchronous schedules it was compared with, in pipesched's model of the step.

The claim (Wu, Chen, Yu 2024, "BitPipe: Bidirectional Interleaved Pipeline Parallelism for Accelerating Large
Models Training", arXiv 2410.19367, abstract): 1.05–1.28× the training throughput of the state-of-the-art
synchronous approaches, GPT-style and BERT-style models, up to 32 GPUs.

Settings: the two launch scripts of the authors' repository (github.com/wuhouming/BitPipe, README.md), one node
of 8 GPUs, pipeline 8, no data parallelism, fp16, fused backward (Megatron's):

* GPT: 96 layers, hidden 3072, 32 heads, sequence 1024, microbatch 1, global batch 16 (m = 16);
* BERT: 64 layers, hidden 2560, 64 heads, sequence 512, microbatch 4, global batch 32 (m = 8).

The accelerator is ours to choose (the README does not name it): A100-80GB, NVLink 200 GB/s per direction
between GPUs (p2p and the replicas' all-reduce), 10 µs latency. Costs, memory and BitPipe's replica
all-reduce (``costs.reduce_grad``: a ring over the two mirrored ranks, fp32 gradients) are derived from the
model (:mod:`pipesched.optimizer.cost`). Baselines, each with its own stage count: ``gpipe`` and ``1f1b``
(DAPPLE / PipeDream-Flush) with one stage per rank, ``interleaved-1f1b`` (Megatron) with 2 and 4 stages per
rank (BitPipe's chunks per replica and per rank). The ratio is the best baseline's step time over BitPipe's
(the throughput ratio at the same batch).

A second table puts the authors' order beside interleaved 1F1B at uniform costs (p = 4, F = 1, B = 2 ms
per stage, the replicas' all-reduce 0.5 ms per stage), issue 27's bar.

Run: ``python -m bench.bitpipe_bench [--output bench/results/bitpipe_bench.md]``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.solve import solve_family

SETTINGS: dict[str, tuple[dict[str, Any], int]] = {
    "GPT-96 (m 16)": (
        {"num_layers": 96, "hidden_size": 3072, "num_attention_heads": 32, "seq_length": 1024, "vocab_size": 50304},
        16,
    ),
    "BERT-64 (m 8)": (
        {"num_layers": 64, "hidden_size": 2560, "num_attention_heads": 64, "seq_length": 512, "vocab_size": 28996},
        8,
    ),
}
MICRO_BATCH = {"GPT-96 (m 16)": 1, "BERT-64 (m 8)": 4}
CLUSTER = {
    "accelerator": "A100-80GB",
    "num_nodes": 1,
    "gpus_per_node": 8,
    "intra_node_bandwidth_bytes_per_s": 200e9,
    "p2p_bandwidth_bytes_per_s": 200e9,
    "p2p_latency_ms": 0.01,
    "collective_latency_ms": 0.01,
}
NUM_RANKS = 8
#: (method, stages per rank, placement)
METHODS = (
    ("bitpipe", 2, "bidirectional"),
    ("gpipe", 1, "loop"),
    ("1f1b", 1, "loop"),
    ("interleaved-1f1b", 2, "loop"),
    ("interleaved-1f1b", 4, "loop"),
)


def paper_problem(name: str, method: str, stages_per_rank: int, placement: str) -> Any:
    """The derived problem of one setting for one method's pipeline shape."""
    model, num_microbatches = SETTINGS[name]
    return load_problem(
        {
            "pipeline": {
                "num_ranks": NUM_RANKS,
                "num_microbatches": num_microbatches,
                "stages_per_rank": stages_per_rank,
                "placement": placement,
            },
            "model": {**model, "micro_batch_size": MICRO_BATCH[name], "dtype": "fp16"},
            "cluster": CLUSTER,
            "split_backward": False,
            "objective": "step_time",
            "solver": {"method": method},
        }
    )


def paper_table() -> list[str]:
    lines = [
        "| setting | method | stages/rank | step ms | peak GiB | fits the GPU | replica all-reduce ms/stage |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for name in SETTINGS:
        steps: dict[str, float] = {}
        for method, spr, placement in METHODS:
            problem = paper_problem(name, method, spr, placement)
            schedule = solve_family(problem, method, enforce_memory=False)
            assert problem.costs is not None and schedule.step_time is not None
            sync = problem.costs.reduce_grad
            sync_text = "—" if sync is None else f"{max(problem.stage_values(sync)):.2f}"
            label = f"{method} v={spr}" if method == "interleaved-1f1b" else method
            steps[label] = schedule.step_time
            peak = max(schedule.peak_memory) / 2**30
            lines.append(
                f"| {name} | {label} | {spr} | {schedule.step_time:.1f} | {peak:.1f} | "
                f"{'yes' if schedule.fits_memory else 'no'} | {sync_text} |"
            )
        baselines = {k: v for k, v in steps.items() if k != "bitpipe"}
        best = min(baselines, key=lambda k: baselines[k])
        ratios.append(
            f"- {name}: BitPipe {steps['bitpipe']:.1f} ms; best baseline {best} {baselines[best]:.1f} ms → "
            f"{baselines[best] / steps['bitpipe']:.2f}×; over interleaved v=2 "
            f"{baselines['interleaved-1f1b v=2'] / steps['bitpipe']:.2f}×, over 1F1B "
            f"{baselines['1f1b'] / steps['bitpipe']:.2f}×"
        )
    return [*lines, "", *ratios]


def uniform(num_microbatches: int, placement: str, reduce_grad: float | None) -> Any:
    """p = 4, two stages per rank, F = 1 ms, B = 2 ms (fused), no p2p, 100 bytes per activation, no limit."""
    costs: dict[str, Any] = {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0}
    if reduce_grad is not None:
        costs["reduce_grad"] = reduce_grad
    return load_problem(
        {
            "pipeline": {
                "num_ranks": 4,
                "num_microbatches": num_microbatches,
                "stages_per_rank": 2,
                "placement": placement,
            },
            "costs": costs,
            "memory": {"activation": 100.0},
            "split_backward": False,
        }
    )


def uniform_table() -> list[str]:
    lines = [
        "| m | bitpipe ms | interleaved-1f1b v=2 ms | ratio | bitpipe peak | interleaved peak |",
        "|---|---|---|---|---|---|",
    ]
    for m in (4, 8, 16):
        bitpipe = solve_family(uniform(m, "bidirectional", 0.5), "bitpipe")
        interleaved = solve_family(uniform(m, "loop", None), "interleaved-1f1b")
        assert bitpipe.makespan is not None and interleaved.makespan is not None
        lines.append(
            f"| {m} | {bitpipe.makespan:.1f} | {interleaved.makespan:.1f} | "
            f"{interleaved.makespan / bitpipe.makespan:.3f} | {max(bitpipe.peak_memory):.0f} | "
            f"{max(interleaved.peak_memory):.0f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=None, help="write the tables here (Markdown)")
    args = parser.parse_args()
    lines = [
        f"# python -m bench.bitpipe_bench, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "## The authors' settings (their README's launch scripts; A100-80GB assumed)",
        "",
        *paper_table(),
        "",
        "## Uniform costs, p = 4, F = 1 ms, B = 2 ms, replica all-reduce 0.5 ms per stage, no limit",
        "",
        *uniform_table(),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output is not None:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
