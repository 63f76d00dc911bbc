"""bench/moe_layer_device.py: its CPU check (``--device cpu --tiny``) measures every case and ``--predict``
reads what it wrote; the layer it times computes what a per-token mixture of experts computes; each case's
model input gives the case's rows per local expert at EP 8."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from bench.moe_layer_device import (
    CASES,
    EXPERT_PARALLEL,
    GPT_OSS_ALPHA,
    GPT_OSS_LIMIT,
    Case,
    _Layer,
    case_model,
    measure,
    predict,
)
from pipesched.optimizer.configs import ModelConfig
from pipesched.optimizer.cost.timing import expert_gemms


def test_the_tiny_cpu_run_measures_every_case_and_predict_reads_it(tmp_path: Path) -> None:
    output = tmp_path / "moe_layer.json"
    rows = measure("cpu", True, 1, 3, 600.0, output)
    assert [row["case"] for row in rows] == [case.name for case in CASES]
    for case, row in zip(CASES, rows, strict=True):
        measured, model = row["measured"], case_model(case, tiny=True)
        assert measured["layer_ms"] > 0 and measured["gemm_ms"] > 0
        assert set(measured["forward_stages_ms"]) == {"router", "permute", "experts", "combine"}
        assert measured["copies"] == model.seq_length * model.micro_batch_size * (model.num_experts_per_token or 1)
        routed = measured["rows_per_expert"]
        assert routed["min"] <= model_rows(model) <= routed["max"]
        assert measured["copies"] <= routed["padded_total"] < measured["copies"] + 16 * rows_groups(model)
    measured_beside_model, stages = predict(output).split("\n\nMeasured forward by stage")
    body = [line for line in measured_beside_model.splitlines() if line.startswith("| ") and "| case |" not in line]
    assert len(body) == len(CASES)
    for line, row in zip(body, rows, strict=True):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert cells[0] == row["case"] and cells[2] == row["gemm_path"]
        for ratio in (float(cells[6]), float(cells[9])):  # whole layer and grouped GEMMs, measured / predicted
            assert math.isfinite(ratio) and ratio > 0
    assert sum(line.startswith("| ") for line in stages.splitlines()) == 1 + len(CASES)


def model_rows(model: ModelConfig) -> float:
    """Rows per local expert the model gives (balanced routing)."""
    return expert_gemms(model, model.seq_length * model.micro_batch_size, 1, EXPERT_PARALLEL)[0][0]


def rows_groups(model: ModelConfig) -> int:
    """Local experts of one EP rank."""
    return (model.num_experts or 1) // EXPERT_PARALLEL


def test_each_case_gives_its_rows_per_expert_at_ep8() -> None:
    for case in CASES:
        model = case_model(case)
        tokens = model.seq_length * model.micro_batch_size
        rows, _, hidden = expert_gemms(model, tokens, 1, EXPERT_PARALLEL)[0]
        assert rows == case.rows_per_expert, case.name
        assert hidden == model.hidden_size


def _reference(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the router's k experts (index mod the local experts), weighted."""
    probabilities, indices = layer.route(x)
    out = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for slot in range(layer.top_k):
            expert = int(indices[token, slot]) % layer.local
            inner = x[token] @ layer.fc1[expert]
            if layer.fc1_bias is not None:
                inner = inner + layer.fc1_bias[expert]
            if layer.case.activation == "clamped":
                gate, up = inner[::2].clamp(max=GPT_OSS_LIMIT), inner[1::2].clamp(-GPT_OSS_LIMIT, GPT_OSS_LIMIT)
                hidden = (up + 1) * gate * torch.sigmoid(GPT_OSS_ALPHA * gate)
            else:
                gate, up = inner.chunk(2)
                hidden = torch.nn.functional.silu(gate) * up
            y = hidden @ layer.fc2[expert]
            if layer.fc2_bias is not None:
                y = y + layer.fc2_bias[expert]
            out[token] += probabilities[token, slot] * y
    return out


@pytest.mark.parametrize("case", [CASES[0], CASES[4]], ids=lambda case: case.name)
@pytest.mark.parametrize("path", ["grouped_mm", "loop"])
def test_the_layer_computes_a_per_token_mixture_of_experts(case: Case, path: str) -> None:
    model = case_model(case, tiny=True)
    layer = _Layer(model, case, torch.device("cpu"), torch.float32, path)
    x = torch.randn(
        model.seq_length * model.micro_batch_size, model.hidden_size, generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        torch.testing.assert_close(layer.forward(x), _reference(layer, x), rtol=1e-4, atol=1e-4)


def test_the_grouped_gemm_and_the_loop_give_the_same_gradients() -> None:
    model = case_model(CASES[0], tiny=True)
    x = torch.randn(
        model.seq_length * model.micro_batch_size, model.hidden_size, generator=torch.Generator().manual_seed(3)
    )
    gradients = []
    for path in ("grouped_mm", "loop"):
        layer = _Layer(model, CASES[0], torch.device("cpu"), torch.float32, path)
        layer.forward(x).square().sum().backward()
        gradients.append([p.grad for p in layer.parameters()])
    for grouped, looped in zip(*gradients, strict=True):
        torch.testing.assert_close(grouped, looped, rtol=1e-4, atol=1e-4)
