"""A ``training.global_batch_tokens`` refused (1e30, a fraction, a string) is the batch's one error, over HTTP (422)
and on the command line (exit 2).

Before: beside the tokens' own message each answer also said ``training.global_batch_size: Field required``, a
second error the user had not made (no sequences are derived from tokens that are refused;
``bench/results/new_user_audit.md``, V23's last item)."""

from __future__ import annotations

import json
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
    "search": {"time_limit_s": 2},
}

#: (tokens given, what the one message says).
REFUSED: list[tuple[Any, str]] = [
    (1e30, "is out of range: global_batch_tokens takes a whole number"),
    (8192.5, "fractional part"),
    ("many", "valid integer"),
]


def _body(tokens: Any) -> dict[str, Any]:
    return {**BASE, "training": {"global_batch_tokens": tokens}}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    path = tmp_path_factory.mktemp("tokens") / "pipesched.sqlite3"
    with TestClient(create_app(Settings(database_url=f"sqlite:///{path}", solver_workers=1))) as test_client:
        yield test_client


@pytest.mark.parametrize(("tokens", "said"), REFUSED, ids=["1e30", "fraction", "string"])
def test_refused_tokens_are_the_one_422(client: TestClient, tokens: Any, said: str) -> None:
    answer = client.post("/v1/plans", json=_body(tokens))
    assert answer.status_code == 422, answer.text
    (error,) = answer.json()["detail"]
    assert error["loc"] == ["body", "training", "global_batch_tokens"]
    assert said in error["msg"], error["msg"]


def test_refused_tokens_on_the_command_line_are_one_error(tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_text(json.dumps(_body(1e30)))
    result = pipesched("plan", "plan.json", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "training.global_batch_tokens: 1e+30 is out of range" in result.stderr
    assert "global_batch_size" not in result.stderr, result.stderr


def test_a_batch_missing_and_other_errors_are_still_said(client: TestClient) -> None:
    """Only the size missing beside refused tokens goes: no batch at all still names both fields, and a refused
    token count beside another field's error keeps that error."""
    answer = client.post("/v1/plans", json={**BASE, "training": {}})
    assert answer.status_code == 422
    assert "global_batch_size (sequences) or global_batch_tokens" in answer.text
    body = _body(1e30)
    body["cluster"] = {**BASE["cluster"], "num_nodes": 0}
    answer = client.post("/v1/plans", json=body)
    assert answer.status_code == 422
    places = sorted(tuple(error["loc"][1:]) for error in answer.json()["detail"])
    assert places == [("cluster", "num_nodes"), ("training", "global_batch_tokens")], answer.text
