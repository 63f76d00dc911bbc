"""The same model re-cut for another pipeline shape, and `pipesched compare --placements/--stages-per-rank`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.recut import recut_problem, recut_values
from tests.api.test_cli import pipesched

MODEL_PROBLEM = {
    "pipeline": {"num_ranks": 4, "num_microbatches": 8},
    "model": {
        "num_layers": 16,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "seq_length": 1024,
        "vocab_size": 50304,
        "micro_batch_size": 2,
        "dtype": "bf16",
    },
    "cluster": {"accelerator": "H100-SXM", "p2p_bandwidth_bytes_per_s": 50e9, "p2p_latency_ms": 0.01},
}


def test_recut_values_split_by_layers() -> None:
    assert recut_values([1.0] * 4, 8) == [0.5] * 8
    assert recut_values([1, 2, 3, 4, 5, 6], 4) == pytest.approx([2.0, 4.0, 6.5, 8.5])
    assert recut_values([2.0, 4.0], 4) == pytest.approx([1.0, 1.0, 2.0, 2.0])
    assert sum(recut_values([3.0, 1.0, 7.0], 5)) == pytest.approx(11.0)
    assert recut_values([0.1, 0.2, 0.3], 2, extensive=False) == [0.1, 0.2]


def test_recut_without_model_keeps_totals_limits_and_a_heavy_last_stage() -> None:
    problem = Problem.model_validate(
        {
            "pipeline": {"num_ranks": 4, "num_microbatches": 8},
            "costs": {"forward": [1.0, 1.0, 1.0, 2.0], "backward_input": 1.0, "backward_weight": 1.0, "p2p": 0.1},
            "memory": {"activation": 100, "retained_for_weight": 40, "limit": 800, "static": 50},
        }
    )
    for placement in ("loop", "v"):
        recut, how = recut_problem(problem, placement, 2)
        forward = recut.stage_values(recut.costs.forward)
        assert "split by layers" in how and len(forward) == 8
        assert sum(forward) == pytest.approx(5.0) and forward[-1] == pytest.approx(1.0)
        assert sum(recut.stage_values(recut.memory.activation)) == pytest.approx(400.0)
        assert recut.memory_limits == problem.memory_limits and recut.static_memory == problem.static_memory
    with pytest.raises(ValueError, match="stages_per_rank 2"):
        recut_problem(problem, "v", 3)


def test_recut_with_model_derives_again() -> None:
    problem = load_problem(MODEL_PROBLEM)
    recut, how = recut_problem(problem, "v", 2)
    assert how == "derived again from model and cluster"
    assert recut.pipeline.placement == "v" and len(recut.model.layers_per_stage) == 8
    assert sum(recut.model.layers_per_stage) == 16
    total = sum(problem.stage_values(problem.costs.forward))
    assert sum(recut.stage_values(recut.costs.forward)) == pytest.approx(total, rel=0.05)


def test_cli_compare_across_placements(tmp_path: Path) -> None:
    path = tmp_path / "problem.json"
    path.write_text(json.dumps(MODEL_PROBLEM))
    result = pipesched(
        "compare",
        str(path),
        "--placements",
        "loop,v",
        "--stages-per-rank",
        "1,2",
        "--no-auto",
        "-o",
        str(tmp_path / "table.json"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    records = json.loads((tmp_path / "table.json").read_text())
    shapes = {(r["placement"], r["stages_per_rank"]) for r in records}
    assert shapes == {("loop", 1), ("loop", 2), ("v", 2)}
    assert {"zb-v", "interleaved-zb", "1f1b"} <= {r["method"] for r in records}
    assert "derived again from model and cluster" in result.stdout
    bad = pipesched("compare", str(path), "--placements", "ring", cwd=tmp_path)
    assert bad.returncode == 2 and "--placements" in bad.stderr


def test_recut_keeps_each_collective_s_wait_for_its_last_replica() -> None:
    problem = load_problem(
        {
            "pipeline": {"num_ranks": 2, "num_microbatches": 4},
            "costs": {
                "forward": 2.0,
                "backward_input": 2.0,
                "backward_weight": 2.0,
                "reduce_grad": [4.0, 6.0],
                "reduce_grad_wait": [1.0, 3.0],
            },
            "memory": {"activation": 1.0},
            "data_parallel": {"size": 2, "sharding": "none"},
        }
    )
    recut, _ = recut_problem(problem, "loop", 2)
    assert recut.stage_values(recut.costs.reduce_grad) == pytest.approx([2.0, 2.0, 3.0, 3.0])  # split by layers
    assert recut.stage_values(recut.costs.reduce_grad_wait) == [1.0, 1.0, 3.0, 3.0]  # a wait, not split
