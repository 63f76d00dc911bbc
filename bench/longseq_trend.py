"""NeMo's long-sequence Llama 2 7B table, with and without context parallelism: does the error grow with CP?

NeMo's "Long Sequence Performance" table (NeMo 24.03.01 on DGX-H100, FP8; ``nemo_long_sequence`` in
``optimizer/cost/calibration/data``) gives, beside its six runs with context parallelism (held out in
``bench/cpep_bench.py``), the runs without it at 4k, 8k and 16k tokens with their layouts (TP × PP × DP, CP 1):

- 4k: 4 GPUs, TP 1, PP 1, DP 4, 768 TFLOPS/GPU;
- 8k: 8 GPUs, TP 1, PP 2, DP 4, 730 TFLOPS/GPU;
- 16k: 16 GPUs, TP 2, PP 1, DP 8, 660 TFLOPS/GPU

(NVIDIA/NeMo ``docs/source/performance/performance_long_sequence.md`` at 19fadb67b0, the source of the data
file). Their batch is not printed; the six CP runs all take 4,194,304 tokens per step (128 × 32k … 4 × 1M), so
the three are given that too (an assumption, stated here). Tokens/s are derived from TFLOPS with the same
non-causal count as the data file (:func:`pipesched.optimizer.cost.flops.model_flops_per_token`).

Each row is timed by the planner on its layout (:func:`pipesched.optimizer.calibration.predict.predict`, memory
not enforced) and set beside the causal attention core's share of the row's FLOPs. A least-squares line through
the three rows without CP (error against that share) extrapolated to the six with CP says whether the CP runs lose
anything the same table's runs without CP do not: a CP mechanism the model misses would put the CP rows above
that line, more so as CP grows. Nothing here feeds the model.

Run: ``python -m bench.longseq_trend [--output FILE]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from pathlib import Path
from typing import Any

from pipesched.optimizer.calibration.predict import predict
from pipesched.optimizer.configs import ModelConfig
from pipesched.optimizer.cost.calibration.measurements import Measurement
from pipesched.optimizer.cost.flops import model_flops_per_token

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "optimizer" / "cost" / "calibration" / "data" / "nemo_long_sequence.json"
RESULTS = Path(__file__).resolve().parent / "results"

#: The table's runs without context parallelism: (sequence k tokens, GPUs, TFLOPS/GPU, TP, PP, DP).
WITHOUT_CP = ((4, 4, 768.0, 1, 1, 4), (8, 8, 730.0, 1, 2, 4), (16, 16, 660.0, 2, 1, 8))
#: Tokens per step of every run with CP in the table (its batch × sequence), assumed for those without.
TOKENS_PER_STEP = 4 * 1024 * 1024


def without_cp_rows(template: dict[str, Any]) -> list[dict[str, Any]]:
    """The table's CP-1 runs as rows shaped like the data file's (module docstring)."""
    rows = []
    for k, gpus, tflops, tp, pp, dp in WITHOUT_CP:
        row = copy.deepcopy(template)
        seq = k * 1024
        row["id"] = f"nemo-longseq-llama2-7b-{k}k-cp1"
        row["model"]["seq_length"] = seq
        row["cluster"].update(num_nodes=max(1, gpus // 8), gpus_per_node=min(8, gpus))
        row["layout"].update(tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp, context_parallel=1)
        row["layout"]["sequence_parallel"] = tp > 1
        batch = TOKENS_PER_STEP // seq
        row["training"].update(global_batch_size=batch, num_microbatches=batch // dp)
        per_token = model_flops_per_token(ModelConfig.model_validate(row["model"]))
        row["measured"] = {"model_tflops_per_gpu": tflops, "tokens_per_s_per_gpu": tflops * 1e12 / per_token}
        rows.append(row)
    return rows


def measure(row: dict[str, Any]) -> dict[str, Any]:
    """The row's predicted and published tokens/s per GPU, error and causal attention share of its FLOPs."""
    model = ModelConfig.model_validate(row["model"])
    causal = model_flops_per_token(model, causal=True)
    attention = model_flops_per_token(model) - causal  # the non-causal count adds the causal core once more
    published = row["measured"]["tokens_per_s_per_gpu"]
    predicted = predict(Measurement.model_validate(row), time_limit_s=2.0).tokens_per_s_per_gpu or 0.0
    layout = row["layout"]
    return {
        "id": row["id"],
        "tp_cp": f"TP {layout['tensor_parallel']} × CP {layout['context_parallel']}",
        "attention_share": attention / causal,
        "published": published,
        "predicted": predicted,
        "error": predicted / published - 1,
    }


def table(results: list[dict[str, Any]]) -> str:
    """Markdown: every row, and each CP row against the line through the rows without CP."""
    base = [r for r in results if r["tp_cp"].endswith("CP 1")]
    fit = statistics.linear_regression([r["attention_share"] for r in base], [r["error"] for r in base])
    line = [
        "| row | layout | attention share (causal FLOPs) | published tok/s/GPU | predicted | error | line through "
        "the CP-1 rows | CP row − line |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        expected = fit.intercept + fit.slope * r["attention_share"]
        beyond = "" if r in base else f"{100 * (r['error'] - expected):+.1f} pt"
        line.append(
            f"| {r['id']} | {r['tp_cp']} | {r['attention_share']:.1%} | {r['published']:,.0f} | "
            f"{r['predicted']:,.0f} | {r['error']:+.1%} | {expected:+.1%} | {beyond} |"
        )
    return "\n".join(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=RESULTS / "longseq_trend.md")
    args = parser.parse_args()
    cp_rows = json.loads(DATA.read_text())["rows"]
    results = [measure(row) for row in without_cp_rows(cp_rows[0]) + cp_rows]
    text = table(results)
    args.output.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
