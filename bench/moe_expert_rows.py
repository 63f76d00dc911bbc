"""Rows per local expert against the held-out error: can a grouped-GEMM efficiency in M explain the MoE rows?

Issue 28's mixture-of-experts rows beyond 25% are predicted too fast. One candidate cause is the grouped expert
GEMM's efficiency at few rows per local expert (M) or small dimensions (N, K). The model already charges both
through the fitted d½ term (:func:`pipesched.optimizer.cost.timing.gemm_ms`: 2MNK/(peak·e)·(1 + d½(1/M + 1/N +
1/K))). This prints, for every held-out row with routed experts (``megatron_bridge_cp_ep`` and
``megatron_moe_model_zoo`` in ``optimizer/cost/calibration/data``, each on the layout its data file times), the
expert GEMM's (M, N, K) as :func:`pipesched.optimizer.cost.timing.expert_gemms` sizes it, the d½ slowdown the
model already applies to it, and the row's own-kernel error as ``bench/results/cpep_bench.md`` (committed, from
``python -m bench.cpep_bench``) gives it. A missing efficiency in M would show as the error growing as M falls;
rows with the same M, model and GPU but different errors say the cause is not a function of M. Nothing here
feeds the model.

    python -m bench.moe_expert_rows
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from bench.cpep_bench import load_rows
from pipesched.optimizer.configs import ClusterConfig, ModelConfig
from pipesched.optimizer.cost.stages import resolve_hardware
from pipesched.optimizer.cost.timing import expert_gemms

RESULTS = Path(__file__).resolve().parent / "results"
_ERROR = re.compile(r"^\| (\S+) \(\S+\) \|.*\| ([+\-−]?\d+)% \|\s*$")


def committed_errors() -> dict[str, str]:
    """Each row's own-kernel error in the committed ``cpep_bench.md`` (its first table: own kernels)."""
    errors: dict[str, str] = {}
    for line in (RESULTS / "cpep_bench.md").read_text().splitlines():
        match = _ERROR.match(line)
        if match and match.group(1) not in errors:
            errors[match.group(1)] = match.group(2)
    return errors


def expert_row(row: dict[str, Any]) -> dict[str, Any] | None:
    """The row's routed-expert GEMM (M, N, K) and the d½ slowdown the model gives it; None without experts."""
    model = ModelConfig.model_validate({**row["model"], "micro_batch_size": row["training"]["micro_batch_size"]})
    if not model.is_moe:
        return None
    layout = row["layout"]
    tokens = model.seq_length * model.micro_batch_size / layout.get("context_parallel", 1)
    shapes = expert_gemms(model, tokens, layout.get("tensor_parallel", 1), layout.get("expert_parallel", 1))
    m, n, k = shapes[0]
    hardware = resolve_hardware(ClusterConfig.model_validate({"accelerator": row["accelerator"], **row["cluster"]}))
    half = hardware.profile.gemm_shape_dimension
    return {"m": m, "n": n, "k": k, "slowdown": 1 + half * (1 / m + 1 / n + 1 / k), "half": half}


def main() -> None:
    errors = committed_errors()
    print("| row | GPU | EP | M (rows per local expert) | N × K (fc1) | d½ | model's slowdown | error (own kernels) |")
    print("|---|---|---:|---:|---|---:|---:|---:|")
    for row in load_rows(("megatron_bridge_cp_ep", "megatron_moe_model_zoo")):
        sized = expert_row(row)
        if sized is None:
            continue
        print(
            f"| {row['id']} | {row['accelerator']} | {row['layout'].get('expert_parallel', 1)} | {sized['m']:,.0f} "
            f"| {sized['n']:,.0f} × {sized['k']:,.0f} | {sized['half']:.0f} | {sized['slowdown']:.2f} "
            f"| {errors.get(row['id'], '?')}% |"
        )


if __name__ == "__main__":
    main()
