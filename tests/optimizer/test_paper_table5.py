"""The Zero Bubble paper's Table 5: 1F1B, ZB-H1 and ZB-H2 bubble rates on its 12 settings."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from pipesched.api.cli import app
from pipesched.optimizer.solve import solve_family
from tests.conftest import paper_problem, paper_settings

SETTINGS = paper_settings()
CASES = [
    pytest.param(
        setting, method, key, id=f"{setting['model']}-p{setting['num_ranks']}-m{setting['num_microbatches']}-{method}"
    )
    for setting in SETTINGS
    for method, key in (("1f1b", "1F1B"), ("zb-h1", "ZB-H1"), ("zb-h2", "ZB-H2"))
]


def _problem(setting: dict[str, Any], method: str):  # type: ignore[no-untyped-def]
    return paper_problem(setting, split_backward=method != "1f1b")


@pytest.mark.parametrize(("setting", "method", "key"), CASES)
def test_bubble_rate_and_stage_span_match_paper(setting: dict[str, Any], method: str, key: str) -> None:
    schedule = solve_family(_problem(setting, method), method)
    assert schedule.status == "feasible"
    assert schedule.bubble_rate is not None and schedule.stage_span is not None
    assert round(schedule.bubble_rate, 4) == setting["published_bubble_rate"][key]
    assert schedule.stage_span == pytest.approx(setting["published_stage_span_ms"][key], abs=1e-3)


@pytest.mark.parametrize(("method", "key"), [("1f1b", "1F1B"), ("zb-h1", "ZB-H1"), ("zb-h2", "ZB-H2")])
def test_cli_reproduces_table5(tmp_path, method: str, key: str) -> None:  # type: ignore[no-untyped-def]
    runner = CliRunner()
    for number, setting in enumerate(SETTINGS):
        problem_path = tmp_path / f"problem{number}.json"
        problem_path.write_text(_problem(setting, method).model_dump_json())
        out = tmp_path / f"out{number}.json"
        result = runner.invoke(app, ["solve", str(problem_path), "--method", method, "-o", str(out)])
        assert result.exit_code == 0, result.output
        written = json.loads(out.read_text())
        assert written["method"] == method
        assert round(written["bubble_rate"], 4) == setting["published_bubble_rate"][key]
