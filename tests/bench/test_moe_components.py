"""bench/moe_components.py: each part's share of a held-out MoE row's predicted step, and the factor that part
alone would need to close the row's gap, as the model times the row (no part is stubbed: the planner runs)."""

from __future__ import annotations

import pytest

from bench.cpep_bench import load_rows
from bench.moe_components import PARTS, components, table

GPU_BOUND = "mbridge260401-gpt-oss-120b-64-b200-tp1pp1cp1vp1ep8-gbs1280-mbs4"
HOST_BOUND = "mbridge2602-qwen3-30b-a3b-8-b200-tp1pp1cp1vp1ep8-gbs512-mbs1"


def _row(row_id: str) -> dict:
    return next(row for row in load_rows() if row["id"] == row_id)


def test_a_gpu_bound_rows_parts_each_take_a_share_and_the_factor_closes_its_gap() -> None:
    result = components(_row(GPU_BOUND), 10.0)
    parts = result["parts"]
    assert set(parts) == set(PARTS)
    assert parts["host floor"]["share"] == 0.0  # GPT-OSS at micro-batch 4: every MoE layer above its host floor
    shares = [parts[name]["share"] for name in ("all-to-all", "memory-bound", "layer GEMMs", "attention")]
    assert all(0.0 < share < 1.0 for share in shares)
    assert sum(shares) < 1.0
    # EP 8 inside a node: its all-to-alls ride NVLink; the network carries the gradients' reductions over 8 nodes
    assert parts["NVLink"]["share"] == pytest.approx(parts["all-to-all"]["share"], abs=0.01)
    assert parts["network"]["share"] > 0.1
    # a part s of the step, f times slower, makes the step 1 − s + s·f times the model's: the published step
    for name in ("all-to-all", "layer GEMMs"):
        share, needed = parts[name]["share"], parts[name]["needed_factor"]
        assert 1 - share + share * needed == pytest.approx(1 / result["ratio"], rel=0.01)


def test_a_host_bound_rows_layers_are_their_host_floor() -> None:
    parts = components(_row(HOST_BOUND), 10.0)["parts"]
    assert parts["host floor"]["share"] > 0.5
    # below the floor a GPU part can go without moving the layer's time
    assert parts["all-to-all"]["share"] == 0.0
    assert parts["layer GEMMs"]["share"] == 0.0


def test_the_table_gives_each_part_its_share_and_factor() -> None:
    result = components(_row(HOST_BOUND), 10.0)
    lines = table([result]).splitlines()
    assert len(lines) == 3
    assert lines[2].startswith(f"| {HOST_BOUND} | ")
    # no factor for a part with no share: all-to-all, layer GEMMs, attention, network, NVLink
    assert lines[2].count("—") == 5
