"""Absurd numbers in a plan request (V23): 1e30, 1e300, 10⁴⁰, Infinity and NaN (JSON as Python reads it) and
negative sizes in the model, cluster, training and search fields are refused naming the field, its whole range and
the fix, over HTTP (422) and on the command line (exit 2); and the plans table keeps each plan on one line.

Before: pydantic's "Unable to parse input string as an integer, exceeded maximum size" (1e30 for a whole number),
"Input should be a finite number" (inf, NaN), one side of the range at most; link latencies, the memory headroom
and the items of a search list took any number (inf latency, 10⁴⁰ microbatches)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pipesched.api.app import create_app
from pipesched.api.settings import Settings
from tests.api.test_newcomer import pipesched

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # starlette on its httpx TestClient

BASE: dict[str, Any] = {
    "model": {"preset": "llama3.1-8b"},
    "cluster": {"accelerator": "H100-SXM", "num_nodes": 1, "gpus_per_node": 8},
    "training": {"global_batch_size": 16},
    "search": {"time_limit_s": 2},
}

#: (field path, absurd value, the range the message names).
ABSURD: list[tuple[tuple[str | int, ...], Any, str]] = [
    (("model", "num_layers"), 1e30, "greater than or equal to 1 and at most 100,000"),
    (("model", "hidden_size"), 1e300, "at most 1,048,576"),
    (("model", "seq_length"), math.inf, "at most 16,777,216"),
    (("model", "vocab_size"), 10**400, "at most 16,777,216"),  # too large for a float: shown as 1e+400
    (("model", "num_key_value_heads"), 10**40, "at most 65,536"),
    (("model", "moe_load_imbalance"), math.nan, "greater than or equal to 1 and at most 64"),
    (("cluster", "num_nodes"), 1e30, "at most 100,000"),
    (("cluster", "gpus_per_node"), -5, "greater than or equal to 1 and at most 1,024"),
    (("cluster", "p2p_latency_ms"), math.inf, "greater than or equal to 0 and at most 1,000"),
    (("cluster", "memory_headroom_bytes"), 1e300, "at most 1e+30"),
    (("cluster", "collective_latency_ms"), 1e30, "at most 1,000"),
    (("training", "global_batch_size"), 1e30, "at most 10,000,000"),
    (("search", "time_limit_s"), math.inf, "greater than 0 and at most 3,600"),
    (("search", "top"), 1e300, "at most 100"),
    (("search", "pipeline_parallel", 0), 1e30, "greater than or equal to 1 and at most 10,000,000"),
    (("search", "micro_batch_size", 0), 10**40, "at most 10,000,000"),
]


def with_value(body: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    """``body`` (copied) with ``value`` at ``path`` (an int in the path: a one-item list there)."""
    body = json.loads(json.dumps(body))
    section, name = path[0], path[1]
    body[section][name] = [value] if len(path) > 2 else value
    return body


def assert_names_the_range(message: str, path: tuple[str | int, ...], bound: str) -> None:
    assert "out of range" in message and f"{path[1]} takes" in message, message
    assert bound in message and "give one in that range" in message, message


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    path = tmp_path_factory.mktemp("v23") / "pipesched.sqlite3"
    with TestClient(create_app(Settings(database_url=f"sqlite:///{path}", solver_workers=1))) as test_client:
        yield test_client


@pytest.mark.parametrize(("path", "value", "bound"), ABSURD, ids=[".".join(map(str, row[0])) for row in ABSURD])
def test_an_absurd_number_is_a_422_naming_the_fields_range(
    client: TestClient, path: tuple[str | int, ...], value: Any, bound: str
) -> None:
    body = json.dumps(with_value(BASE, path, value))  # Infinity and NaN as Python's json writes and reads them
    answer = client.post("/v1/plans", content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code == 422, answer.text
    (error,) = answer.json()["detail"]
    assert error["loc"] == ["body", *path]
    assert_names_the_range(error["msg"], path, bound)


def test_absurd_numbers_on_the_command_line_exit_2_naming_each_range(tmp_path: Path) -> None:
    body = BASE
    for path, value, _ in ABSURD:
        body = with_value(body, path, value)
    (tmp_path / "plan.json").write_text(json.dumps(body))
    result = pipesched("plan", "plan.json", "-o", "plans.json", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = {line.split(": ", 1)[0].strip(): line for line in result.stderr.splitlines() if ": " in line}
    for path, _, bound in ABSURD:
        assert_names_the_range(lines[".".join(map(str, path))], path, bound)


#: Llama 3.1 8B at 131,072 tokens on 64 H100s, context-parallel 8: the dp cell reads "4 gradients over d·c 32".
CONTEXT_PARALLEL = {
    "model": {"preset": "llama3.1-8b", "seq_length": 131072},
    "cluster": {"accelerator": "H100-SXM", "num_nodes": 8, "gpus_per_node": 8},
    "training": {"global_batch_size": 64},
    "search": {"time_limit_s": 2, "top": 3, "context_parallel": [8], "sharding": ["gradients"]},
}


def test_the_plans_table_keeps_each_plan_on_one_line(tmp_path: Path) -> None:
    """The dp cell "4 gradients over d·c 32" had wrapped "32" onto a second line of the 170-column table."""
    (tmp_path / "plan.json").write_text(json.dumps(CONTEXT_PARALLEL))
    result = pipesched("plan", "plan.json", "-o", "plans.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    plans = json.loads((tmp_path / "plans.json").read_text())["plans"]
    rows = [line for line in result.stdout.splitlines() if line.startswith("│")]
    assert len(rows) == len(plans) >= 2, result.stdout
    for plan, row in zip(plans, rows, strict=True):
        dp = plan["data_parallel"]
        assert f"{dp['size']} gradients over d·c {dp['size'] * plan['context_parallel']} " in row, result.stdout
        assert plan["method"] in row and f"{plan['step_time_ms']:.1f}" in row, result.stdout
    assert max(len(line) for line in result.stdout.splitlines() if line.startswith(("│", "┃"))) <= 170
