"""A compiled torchtitan run compiles its loss too (``pipesched.optimizer.cost.memory``, CROSS_ENTROPY_BYTES
"compiled"): torchtitan's H200 Float8 runs of June 2025 (``bench/data/calibration_holdout.json``, never fitted) ran
it compiled, its Dec 2024 H100 runs (fitted) eager. bench/results/fp8_peaks.md gives the numbers."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from pipesched.optimizer.calibration.predict import estimator, predict
from pipesched.optimizer.configs import ClusterConfig, ModelConfig, TensorParallel
from pipesched.optimizer.cost.calibration.measurements import Measurement, builtin_measurements, parse_measurements
from pipesched.optimizer.cost.memory import CROSS_ENTROPY_BYTES
from pipesched.optimizer.cost.stages import cross_entropy_of, head_block, resolve_hardware

HOLDOUT = Path(__file__).resolve().parents[2] / "bench" / "data" / "calibration_holdout.json"
LLAMA_8B = ModelConfig.model_validate({"preset": "llama3.1-8b", "seq_length": 8192, "micro_batch_size": 2})


def _with_loss(row: Measurement, compiled_loss: bool | None) -> Measurement:
    return row.model_copy(update={"software": row.software.model_copy(update={"compiled_loss": compiled_loss})})


def _h200_rows() -> list[Measurement]:
    entries = json.loads(HOLDOUT.read_text())["files"]
    rows = [row for entry in entries for row in parse_measurements(entry) if row.source == "torchtitan_h200_202506"]
    assert len(rows) == 2
    return rows


def test_a_compiled_plan_holds_the_bf16_logits_unless_its_loss_runs_eager_or_split() -> None:
    hardware = resolve_hardware(ClusterConfig(accelerator="H200"))
    compiled, eager = (
        LLAMA_8B.model_copy(update={"kernels": "compiled"}),
        LLAMA_8B.model_copy(update={"kernels": "eager"}),
    )
    assert cross_entropy_of(compiled, hardware) == "compiled"
    assert cross_entropy_of(eager, hardware) == "fp32"
    assert cross_entropy_of(compiled, hardware, tensor_parallel=2) == "fp32"  # loss parallel saves fp32 log-probs
    uncompiled = replace(hardware, software=hardware.software.model_copy(update={"pytorch_compiled_loss": False}))
    assert cross_entropy_of(compiled, uncompiled) == "fp32"
    logits, reserve = 8192 * 2 * 128256, hardware.profile.activation_memory_factor
    held, transient = CROSS_ENTROPY_BYTES["compiled"]
    block = head_block(compiled, hardware)
    assert block.transient_bytes == pytest.approx(transient * logits * reserve)
    assert head_block(eager, hardware).activation_bytes - block.activation_bytes == pytest.approx(
        (CROSS_ENTROPY_BYTES["fp32"][0] - held) * logits * reserve
    )
    split = head_block(compiled, hardware, TensorParallel(size=2))
    assert split.transient_bytes == pytest.approx(CROSS_ENTROPY_BYTES["fp32"][1] * logits / 2 * reserve)


@pytest.mark.slow  # four rows through the planner's evaluation
def test_the_h200_float8_peaks_move_by_the_losss_bytes_and_land_near_their_published_figures() -> None:
    for row in _h200_rows():
        assert row.software.compiled_loss is True  # torchtitan e7c0cae's build_cross_entropy_loss
        compiled, eager = predict(row), predict(_with_loss(row, False))
        assert compiled.peak_memory_bytes is not None and eager.peak_memory_bytes is not None
        reserve = estimator(row).hardware.profile.activation_memory_factor
        logits = row.model.seq_length * row.training.micro_batch_size * 128256
        moved = sum(CROSS_ENTROPY_BYTES["fp32"]) - sum(CROSS_ENTROPY_BYTES["compiled"])  # 12 - 4 B a logit
        assert eager.peak_memory_bytes - compiled.peak_memory_bytes == pytest.approx(moved * logits * reserve)
        published = row.measured.peak_memory_bytes or 0.0
        assert abs(math.log(published / compiled.peak_memory_bytes)) < 0.08  # was -0.29 with the loss eager
        assert compiled.tokens_per_s_per_gpu == eager.tokens_per_s_per_gpu  # the loss's time is not touched


def test_the_dec_2024_compiled_rows_say_their_loss_ran_eager() -> None:
    rows = [row for row in builtin_measurements() if row.source.startswith("torchtitan_h100_202412")]
    assert rows and all(row.software.compiled_loss is (False if row.software.compile else None) for row in rows)
