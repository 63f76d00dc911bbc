"""The unseen held-out rows (``bench/data/calibration_holdout_unseen.json``, round 18, and
``calibration_holdout_unseen_r19.json``, round 19) and their bench (``bench/unseen_rows_bench.py``): published runs
no earlier round looked at, kept out of every fit and check."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.unseen_rows_bench import errors, group, load_rows, record
from pipesched.optimizer.cost.calibration.measurements import builtin_measurements, parse_measurements

DATA = Path(__file__).resolve().parents[2] / "bench" / "data"
UNSEEN = DATA / "calibration_holdout_unseen.json"
UNSEEN_R19 = DATA / "calibration_holdout_unseen_r19.json"
OTHER_DATA = ("calibration_holdout.json", "calibration_holdout_external.json", "calibration_amd.json")


@pytest.mark.parametrize(
    ("path", "other", "least", "groups"),
    [
        # round 18: every row context- or expert-parallel, the issue-28 bar
        (UNSEEN, UNSEEN_R19, 10, {"context-parallel", "expert-parallel"}),
        # round 19: dense rows for issue 24's bar beside context- and expert-parallel ones for issue 28's
        (UNSEEN_R19, UNSEEN, 15, {"dense", "context-parallel", "expert-parallel"}),
    ],
    ids=["round18", "round19"],
)
def test_the_unseen_rows_parse_with_their_sources_and_share_no_source_with_any_other_data(
    path: Path, other: Path, least: int, groups: set[str]
) -> None:
    entries = json.loads(path.read_text())["files"]
    rows = [row for entry in entries for row in parse_measurements(entry)]
    assert len(rows) >= least and len({row.key for row in rows}) == len(rows)
    assert all(entry["source"]["commit"] and entry["source"]["url"].startswith("https://") for entry in entries)
    others = {row.source for row in builtin_measurements()}
    for name in (*OTHER_DATA, other.name):
        others |= {entry["source"]["id"] for entry in json.loads((DATA / name).read_text())["files"]}
    assert not {row.source for row in rows} & others  # never fitted, never in another check
    assert {group(row) for row in load_rows(path)} == groups


@pytest.mark.parametrize("path", [UNSEEN, UNSEEN_R19], ids=["round18", "round19"])
def test_each_unseen_figure_is_its_published_throughput_or_step_time_per_gpu(path: Path) -> None:
    for row in load_rows(path):
        gpus = row["cluster"]["num_nodes"] * row["cluster"]["gpus_per_node"]
        published, value = row["published"], row["measured"]["tokens_per_s_per_gpu"]
        if "throughput_tokens_per_s" in published:
            assert value == pytest.approx(published["throughput_tokens_per_s"] / gpus, abs=0.06), row["id"]
        tokens = row["training"]["global_batch_size"] * row["model"]["seq_length"]
        if "step_time_s" in published:  # sequence × GBS / step time, per GPU (within the table's rounding)
            assert value == pytest.approx(tokens / published["step_time_s"] / gpus, rel=2e-3), row["id"]


def test_the_bench_gives_each_row_its_error_and_the_interval_it_is_judged_by() -> None:
    row = next(r for r in load_rows() if r["id"] == "dgxc2504-llama31-8b-8-cp2-bf16")
    result = record(row, 10.0)  # the bench's own limit
    low, high = result["interval"]
    predicted, published = result["predicted_tokens_per_s_per_gpu"], result["published_tokens_per_s_per_gpu"]
    assert low < predicted < high and result["error"] == pytest.approx(predicted / published - 1, abs=1e-4)
    assert result["in_interval"] == (low <= published <= high)
    stats = errors([result, {**result, "error": -0.3, "in_interval": False}])
    assert stats["rows"] == 2 and stats["beyond_25"] == 1 + (abs(result["error"]) > 0.25)
    assert stats["median_abs_error"] == pytest.approx((abs(result["error"]) + 0.3) / 2, abs=1e-3)
    assert math.isclose(stats["in_interval"], result["in_interval"] / 2, abs_tol=1e-3)
