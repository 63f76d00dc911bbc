"""Published runs fit their GPU under the planner's memory model, and published peaks are predicted within a stated
held-out error (issue 24: the loss's logits and a recomputed layer are transients of the cost model, the fitted
``activation_memory_factor`` is the allocator's reserve with every run that ran fitting its GPU)."""

from __future__ import annotations

import json
import math
import statistics
from functools import cache
from pathlib import Path

import pytest

from pipesched.optimizer.calibration.peaks import leave_one_out, peak_lines
from pipesched.optimizer.calibration.predict import estimator, predict
from pipesched.optimizer.cost.calibration.measurements import (
    Measurement,
    builtin_measurements,
    fitting_measurements,
    parse_measurements,
)
from pipesched.optimizer.cost.profile import active_catalogue

HOLDOUT = Path(__file__).resolve().parents[2] / "bench" / "data" / "calibration_holdout.json"

#: Context/expert-parallel rows the memory model still puts above their GPU, and why (none of them eager or
#: compiled: the fitted factor does not reach them). A row that comes to fit must leave this list (DeepSeek-V3 on
#: 1,024 H100s, Megatron Bridge PP 8 × VP 4, and on 256, NeMo AutoModel PP 4 × VP 8, left it when the partition's
#: time tie went to the split whose schedule peaks lowest: 87.6 → 78.3 and 86.3 → 79.3 GiB; NeMo AutoModel's
#: Qwen3-30B-A3B on 8 H100s, GPT-OSS 20B on 8 and 120B on 64 when its bf16 model's FSDP2 state was charged as kept,
#: 2 + 2 + 4 bytes a parameter instead of ZeRO-3's 18: 88.1 → 52.6, 88.4 → 64.0, 90.6 → 73.6 GiB).
KNOWN_OVER = {
    "llama3_herd_table4/llama3-405b-8192-cp1-s8192": "Meta's layout is assumed (2 stages a rank, no recomputation, "
    "even stages; the paper balances the first and last stages' memory)",
    "llama3_herd_table4/llama3-405b-16384-cp1-s8192": "as above",
    "llama3_herd_table4/llama3-405b-16384-cp16-s131072": "as above",
    "deepseek_v3_report/deepseek-v3-2048-h800": "mixture of experts: DeepSeek's own framework (its recomputation "
    "of norms and up-projections and FP8 activation caching are not modelled; static 13.2 of 131.9 GiB)",
    "megatron_bridge_cp_ep/mbridge260401-deepseek-v3-256-b200-tp1pp8cp1vp2ep32-gbs4096-mbs1": "mixture of experts on "
    "the distributed optimizer (ZeRO-1): its activations, not its static state (49.6 of 200.7 GiB); the table does not "
    "publish the recomputation, read as none, where the recipe recomputes mla_up_proj and mlp",
    "megatron_moe_model_zoo/modelzoo-h100-235b-long-s16384-cp1": "mixture of experts on the distributed optimizer "
    "(ZeRO-1): activations of 16k to 128k tokens a sequence (static 32.1 of 106.3 GiB), Megatron's selective "
    "recomputation as modelled",
    "megatron_moe_model_zoo/modelzoo-h100-235b-long-s32768-cp2": "as above",
    "megatron_moe_model_zoo/modelzoo-h100-235b-long-s65536-cp4": "as above",
    "megatron_moe_model_zoo/modelzoo-h100-235b-long-s131072-cp8": "as above",
}


def _holdout() -> list[Measurement]:
    return [row for entry in json.loads(HOLDOUT.read_text())["files"] for row in parse_measurements(entry)]


def _key(row: Measurement) -> str:
    return f"{row.source}/{row.id}"


def _fraction(row: Measurement) -> float:
    peak = predict(row).peak_memory_bytes
    assert peak is not None, _key(row)
    return peak / estimator(row).hardware.memory_bytes


@cache
def _fractions() -> dict[str, float]:
    """Every catalogue row (fitted, context/expert-parallel) and held-out row: predicted peak / GPU memory."""
    return {_key(row): _fraction(row) for row in [*builtin_measurements(), *_holdout()]}


@pytest.mark.slow  # ~300 rows through the planner's evaluation, ~35 s on 2 cores: the claim is about every row
def test_every_published_run_fits_its_gpu() -> None:
    fractions = _fractions()
    over = {key: value for key, value in fractions.items() if value > 1.0}
    unexpected = {key: value for key, value in over.items() if key not in KNOWN_OVER}
    assert not unexpected, "predicted above the GPU they ran on:\n" + "\n".join(
        f"{key}: {value:.3f} of its memory" for key, value in sorted(unexpected.items(), key=lambda kv: -kv[1])
    )
    fitted = [key for key in KNOWN_OVER if key in fractions and fractions[key] <= 1.0]
    assert not fitted, f"these now fit their GPU: take them out of KNOWN_OVER: {fitted}"
    assert sum(key.startswith("mpt_llm_foundry/") for key in fractions) == 216


def test_fitted_runs_fit_their_gpu_at_the_shipped_factor() -> None:
    """MosaicML's fullest runs (the ones that bound the factor) and torchtitan's, at the shipped profiles."""
    rows = [row for row in fitting_measurements() if "3b-s8192" in row.id or "-1b-s2048" in row.id]
    rows += [row for row in fitting_measurements() if row.source == "torchtitan_h100_202412"]
    assert len(rows) > 20
    for row in rows:
        assert _fraction(row) <= 1.0, f"{_key(row)} predicted at {_fraction(row):.3f} of its GPU"


def test_published_peaks_within_stated_error() -> None:
    """torchtitan's published peaks (reserved memory): fitted rows leave-one-out within a median |log| of 0.12 and
    0.30 at most; held-out rows (context parallel, the H200 runs) at the shipped factor within 0.25 and 0.45."""
    catalogue = active_catalogue()
    fitted = [row for row in fitting_measurements() if row.measured.peak_memory_bytes]
    lines = peak_lines(fitted, catalogue)
    shipped = catalogue.profiles["H100-SXM"].activation_memory_factor
    # the rows without a peak (MosaicML's fullest) bound the factor: their ceiling is the shipped factor's grid step
    loo = [abs(error) for error in leave_one_out(lines, ceiling=shipped)]
    assert statistics.median(loo) <= 0.12 and max(loo) <= 0.30, loo
    others = [row for row in builtin_measurements() + _holdout() if row.measured.peak_memory_bytes]
    held_out = [row for row in others if row.source not in {"torchtitan_h100_202412"}]
    assert len(held_out) >= 8
    errors = [
        abs(math.log((row.measured.peak_memory_bytes or 1.0) / (predict(row).peak_memory_bytes or 1.0)))
        for row in held_out
    ]
    assert statistics.median(errors) <= 0.25 and max(errors) <= 0.45, errors
