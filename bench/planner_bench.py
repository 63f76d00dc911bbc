"""Benchmark of the planner against torchtitan's published Llama 3.1 layouts on H100s.

Source: the pytorch/torchtitan repository, ``benchmarks/llama3_h100_202412_torchtitan.md`` (end of 2024,
torch 1963fc8, torchtitan 9dec370): Grand Teton hosts of 8 H100s (96 GB HBM2e, 2.4 TB/s, 500 W) with NVLink,
400 Gb/s RDMA per GPU, sequence length 8192. Rows used (TPS/GPU, memory GiB):

- Table 1, Llama 3.1 8B, 8 GPUs, FSDP 8, local batch 2 (global 16), selective AC: FSDP 5,762 / 82.4;
  FSDP + torch.compile 6,667 / 77.0.
- Table 3, Llama 3.1 8B, 128 GPUs, FSDP 128, local batch 2 (global 256), selective AC: 5,605 / 67.0;
  + torch.compile 6,514 / 62.0.
- Table 4, Llama 3.1 70B, 256 GPUs, FSDP 32 × TP 8, local batch 16 (global 512), full AC, torch.compile +
  Float8: 829 / 71.9.
- Table 5, Llama 3.1 405B, 512 GPUs, FSDP 8 × TP 8 × PP 8, local batch 32 (global 256), full AC,
  torch.compile + Float8 + AsyncTP: 1F1B 100 / 82.5; Interleaved 1F1B 128 / 72.7 (8 microbatches of 4:
  torchtitan 9dec370 splits the local batch into as many microbatches as pipeline ranks unless told otherwise,
  ``torchtitan/parallelisms/pipelining_utils.py``; two stages per rank assumed for the interleaved schedule).

For each: the planner's prediction for torchtitan's own layout (every dimension pinned in ``search``), the same
with the kernels not said (the default, kernels "unknown": what a request naming only the layout and precision
gets), and
the planner's best layout for the same model, GPUs, global batch, precision and kernels (8B ran eager:
``training.kernels: eager``; 70B and 405B ran torch.compile with Float8: ``training.precision: fp8``,
``training.kernels: compiled``). The cluster is the
benchmark's: H100s capped at 500 W, planned at the share of the SXM peak (989.5 TFLOP/s dense bf16) they
sustain as the calibration fits it to torchtitan's runs (``power_limited_peak``), 96 GiB at 2.4 TB/s,
NVLink 450 GB/s per direction inside a host, 50 GB/s per GPU between hosts; the H100-SXM profile calibrated by
``bench/calibration_bench.py`` (its 80% interval with every prediction). The best layout's gain is its
prediction over the prediction for torchtitan's layout, its interval the best plan's interval over that same
prediction. Every search's wall time is reported beside its ``time_limit_s``.

Run: ``python -m bench.planner_bench [--time-limit S] [--output FILE]`` (default 60 s per free search).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from pipesched.optimizer.calibration.predict import power_limited
from pipesched.optimizer.configs import ClusterConfig
from pipesched.optimizer.planner.rank import plan
from pipesched.optimizer.planner.request import Plan, PlanRequest

GIB = 1024**3
RESULTS = Path(__file__).resolve().parent / "results"

#: The benchmark's hosts (see the module docstring).
CLUSTER: dict[str, Any] = {
    "accelerator": "H100-SXM",
    "memory_bytes": 96 * GIB,
    "memory_bandwidth_bytes_per_s": 2.4e12,
    "gpus_per_node": 8,
    "intra_node_bandwidth_bytes_per_s": 450e9,
    "inter_node_bandwidth_bytes_per_s": 50e9,
}

#: The hosts' power limit per GPU, W (the benchmark page: Grand Teton, H100s capped at 500 W).
POWER_LIMIT_W = 500

#: (name, preset, nodes, global batch, torchtitan's layout as search pins, published TPS/GPU, memory GiB, note)
CASES: list[tuple[str, str, int, int, dict[str, list[Any]], float, float, str]] = [
    (
        "8B, 8 GPUs",
        "llama3.1-8b",
        1,
        16,
        {
            "pipeline_parallel": [1],
            "tensor_parallel": [1],
            "sharding": ["full"],
            "micro_batch_size": [2],
            "activation_recomputation": ["selective"],
        },
        5762,
        82.4,
        "Table 1, FSDP, bf16, eager (6,667 with torch.compile)",
    ),
    (
        "8B, 128 GPUs",
        "llama3.1-8b",
        16,
        256,
        {
            "pipeline_parallel": [1],
            "tensor_parallel": [1],
            "sharding": ["full"],
            "micro_batch_size": [2],
            "activation_recomputation": ["selective"],
        },
        5605,
        67.0,
        "Table 3, FSDP, bf16, eager (6,514 with torch.compile)",
    ),
    (
        "70B, 256 GPUs",
        "llama3.1-70b",
        32,
        512,
        {
            "pipeline_parallel": [1],
            "tensor_parallel": [8],
            "sharding": ["full"],
            "micro_batch_size": [16],
            "activation_recomputation": ["full"],
        },
        829,
        71.9,
        "Table 4, FSDP 32 × TP 8, compile + Float8",
    ),
    (
        "405B, 512 GPUs, 1F1B",
        "llama3.1-405b",
        64,
        256,
        {
            "pipeline_parallel": [8],
            "tensor_parallel": [8],
            "sharding": ["full"],
            "context_parallel": [1],  # torchtitan ran FSDP 8 without CP (its Table 6 adds CP)
            "stages_per_rank": [1],
            "micro_batch_size": [4],
            "activation_recomputation": ["full"],
            "method": ["1f1b"],
        },
        100,
        82.5,
        "Table 5, FSDP 8 × TP 8 × PP 8, compile + Float8 + AsyncTP",
    ),
    (
        "405B, 512 GPUs, interleaved",
        "llama3.1-405b",
        64,
        256,
        {
            "pipeline_parallel": [8],
            "tensor_parallel": [8],
            "sharding": ["full"],
            "context_parallel": [1],
            "stages_per_rank": [2],
            "placement": ["loop"],
            "micro_batch_size": [4],
            "activation_recomputation": ["full"],
            "method": ["interleaved-1f1b"],
        },
        128,
        72.7,
        "Table 5, as above, Interleaved 1F1B",
    ),
]


#: Precision and kernels of each case as torchtitan ran it (Tables 1 and 3: eager; 4 and 5: torch.compile +
#: Float8); a request that does not say gets kernels "unknown" (docs/CALIBRATION.md).
TRAINING: dict[str, dict[str, str]] = {
    "8B, 8 GPUs": {"kernels": "eager"},
    "8B, 128 GPUs": {"kernels": "eager"},
    "70B, 256 GPUs": {"precision": "fp8", "kernels": "compiled"},
    "405B, 512 GPUs, 1F1B": {"precision": "fp8", "kernels": "compiled"},
    "405B, 512 GPUs, interleaved": {"precision": "fp8", "kernels": "compiled"},
}


def request(
    preset: str, nodes: int, batch: int, time_limit_s: float, pins: dict[str, Any], training: dict[str, str]
) -> PlanRequest:
    """The plan request of one case, its hosts' H100s at the sustained peak of their 500 W power limit (as the
    calibration fits them: :func:`pipesched.optimizer.calibration.predict.power_limited`)."""
    cluster = power_limited(ClusterConfig.model_validate({**CLUSTER, "num_nodes": nodes}), POWER_LIMIT_W)
    return PlanRequest.model_validate(
        {
            "model": {"preset": preset},
            "cluster": cluster.model_dump(exclude_unset=True),
            "training": {"global_batch_size": batch, **training},
            "search": {"time_limit_s": time_limit_s, "top": 1, **pins},
        }
    )


def layout(plan_: Plan) -> str:
    """A short description of a plan's layout."""
    pipeline = (
        f"PP {plan_.pipeline_parallel} {plan_.method} v{plan_.stages_per_rank} {plan_.placement} × "
        if plan_.pipeline_parallel > 1
        else ""
    )
    context = f"CP {plan_.context_parallel} × " if plan_.context_parallel > 1 else ""
    return (
        f"{pipeline}TP {plan_.tensor_parallel} × {context}DP {plan_.data_parallel.size} "
        f"{plan_.data_parallel.sharding}, "
        f"mb {plan_.micro_batch_size}×{plan_.num_microbatches}, AC {plan_.activation_recomputation}"
    )


def run(time_limit_s: float) -> list[dict[str, Any]]:
    """Every case: the pinned (torchtitan) and the free search."""
    rows = []
    for name, preset, nodes, batch, pins, published, memory_gib, note in CASES:
        training = TRAINING.get(name, {})
        started = time.perf_counter()
        pinned = plan(request(preset, nodes, batch, min(time_limit_s, 20.0), pins, training)).answer
        pinned_s = time.perf_counter() - started
        started = time.perf_counter()
        free = plan(request(preset, nodes, batch, time_limit_s, {}, training)).answer
        free_s = time.perf_counter() - started
        ours = pinned.plans[0] if pinned.plans else None
        default = _default_request_prediction(preset, nodes, batch, min(time_limit_s, 20.0), pins, training)
        best = free.plans[0] if free.plans else None
        interval = ours.tokens_per_s_per_gpu_interval if ours else None
        rows.append(
            {
                "case": name,
                "note": note,
                "published_tokens_per_s_per_gpu": published,
                "published_memory_gib": memory_gib,
                "torchtitan_layout": layout(ours) if ours else pinned.error,
                "predicted_tokens_per_s_per_gpu": ours.tokens_per_s_per_gpu if ours else None,
                "predicted_interval": interval,
                "predicted_over_published": round(ours.tokens_per_s_per_gpu / published, 3) if ours else None,
                "published_in_interval": bool(interval and interval[0] <= published <= interval[1]),
                "best_gain": round(best.tokens_per_s_per_gpu / ours.tokens_per_s_per_gpu, 3) if best and ours else None,
                "best_gain_interval": (
                    [round(bound / ours.tokens_per_s_per_gpu, 3) for bound in best.tokens_per_s_per_gpu_interval]
                    if best and ours
                    else None
                ),
                "unknown_kernels": default,
                "unknown_kernels_over_published": round(default["tokens_per_s_per_gpu"] / published, 3)
                if default
                else None,
                "unknown_kernels_published_in_interval": bool(
                    default and default["interval"][0] <= published <= default["interval"][1]
                ),
                "time_limit_s": time_limit_s,
                "notes": free.notes,
                "predicted_memory_gib": round(ours.peak_memory_bytes / GIB, 1) if ours else None,
                "predicted_mfu": ours.mfu if ours else None,
                "pinned_search_s": round(pinned_s, 1),
                "best_layout": layout(best) if best else free.error,
                "best_tokens_per_s_per_gpu": best.tokens_per_s_per_gpu if best else None,
                "best_memory_gib": round(best.peak_memory_bytes / GIB, 1) if best else None,
                "best_mfu": best.mfu if best else None,
                "free_search_s": round(free_s, 1),
                "first_answer_s": free.first_answer_s,
                "searched": free.searched.model_dump(),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _default_request_prediction(
    preset: str, nodes: int, batch: int, time_limit_s: float, pins: dict[str, Any], training: dict[str, str]
) -> dict[str, Any] | None:
    """torchtitan's layout as a request that names its precision but not its kernels (kernels "unknown", the
    default: what a user or an outside check gets for a published layout given without its framework)."""
    said = {key: value for key, value in training.items() if key != "kernels"}
    answer = plan(request(preset, nodes, batch, time_limit_s, pins, said)).answer
    if not answer.plans:
        return None
    chosen = answer.plans[0]
    return {"tokens_per_s_per_gpu": chosen.tokens_per_s_per_gpu, "interval": chosen.tokens_per_s_per_gpu_interval}


def _interval(values: Any, digits: str = ",.0f") -> str:
    return f"{values[0]:{digits}}–{values[1]:{digits}}" if values else "—"


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of the rows."""
    lines = [
        "| case | published tok/s/GPU (GiB) | planner on torchtitan's layout: tok/s/GPU [80% interval] (GiB, MFU) "
        "| predicted / published | kernels not said (unknown): tok/s/GPU [80% interval], / published "
        "| planner's best layout | its tok/s/GPU (GiB, MFU) | gain over torchtitan's "
        "layout [interval] | search: first answer / total s (limit); enumerated, pruned memory / bound, simulated |",
        "|---|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for row in rows:
        searched = row["searched"]
        default = row["unknown_kernels"]
        unknown = (
            f"{default['tokens_per_s_per_gpu']:,.0f} [{_interval(default['interval'])}], "
            f"{row['unknown_kernels_over_published']:.2f}"
            if default
            else "—"
        )
        lines.append(
            f"| {row['case']} ({row['note']}) | {row['published_tokens_per_s_per_gpu']:,.0f} "
            f"({row['published_memory_gib']}) | {row['predicted_tokens_per_s_per_gpu'] or 0:,.0f} "
            f"[{_interval(row['predicted_interval'])}] ({row['predicted_memory_gib']}, {row['predicted_mfu'] or 0:.0%})"
            f" | {row['predicted_over_published'] or 0:.2f} | {unknown} | {row['best_layout']} | "
            f"{row['best_tokens_per_s_per_gpu'] or 0:,.0f} ({row['best_memory_gib']}, {row['best_mfu'] or 0:.0%}) | "
            f"{row['best_gain'] or 0:.2f}× [{_interval(row['best_gain_interval'], '.2f')}] | "
            f"{row['first_answer_s']} / {row['free_search_s']} ({row['time_limit_s']:g}); {searched['enumerated']}, "
            f"{searched['pruned_memory']} / {searched['pruned_bound']}, {searched['solved']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time-limit", type=float, default=60.0, help="search.time_limit_s of each free search")
    parser.add_argument("--output", type=Path, default=RESULTS / "planner_bench.md")
    args = parser.parse_args()
    rows = run(args.time_limit)
    text = table(rows)
    args.output.write_text(text + "\n")
    args.output.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
