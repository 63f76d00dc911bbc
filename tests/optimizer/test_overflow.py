"""Overflowing or non-finite inputs are validation errors naming the field and the fix (422 over HTTP), never a
500; whatever is accepted solves into a schedule that serialises as strict JSON."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from pipesched.api.app import create_app
from pipesched.api.settings import Settings
from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.problem import MAX_STEP_MS
from pipesched.optimizer.solve import solve

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # starlette on its httpx TestClient

COSTS_BODY: dict[str, Any] = {
    "pipeline": {"num_ranks": 4, "num_microbatches": 8},
    "costs": {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0, "p2p": 0.1},
    "memory": {"activation": 100, "retained_for_weight": 40, "limit": 2000},
    "solver": {"method": "auto", "time_limit_s": 1},
}
MODEL_BODY: dict[str, Any] = {
    "pipeline": {"num_ranks": 4, "num_microbatches": 8},
    "model": {"num_layers": 8, "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 1024, "vocab_size": 50304},
    "cluster": {"accelerator": "H100-SXM"},
    "solver": {"method": "1f1b", "time_limit_s": 1},
}


def _with(body: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(body)
    for key, value in changes.items():
        target = out
        *parents, last = key.split(".")
        for part in parents:
            target = target[part]
        target[last] = value
    return out


# (body as JSON text, the field the error must name, a word of its fix)
CASES = [
    (json.dumps(_with(COSTS_BODY, **{"costs.forward": 1e308, "solver.method": "gpipe"})), ("costs", "forward"), "ms"),
    (json.dumps(_with(COSTS_BODY, **{"costs.forward": 1e308})), ("costs", "forward"), "milliseconds"),
    (json.dumps(_with(COSTS_BODY, **{"costs.p2p": 1e307})), ("costs", "p2p"), "milliseconds"),
    (
        json.dumps(_with(COSTS_BODY, **{"memory.activation": 1e308, "memory.limit": None})),
        ("memory", "activation"),
        "bytes",
    ),
    (json.dumps(_with(COSTS_BODY, **{"memory.static": 1e308, "memory.limit": None})), ("memory", "static"), "bytes"),
    (
        json.dumps(MODEL_BODY).replace('"hidden_size": 1024', '"hidden_size": 1' + "0" * 400),
        ("model", "hidden_size"),
        "at most 1,048,576",  # the range is named (V23), with thousands separators
    ),
    (json.dumps(_with(MODEL_BODY, **{"cluster.flops_per_s": 1e-300})), ("cluster", "flops_per_s"), "FLOP/s"),
    (json.dumps(_with(MODEL_BODY, **{"cluster.flops_per_s": 1.0})), ("cluster", "flops_per_s"), "FLOP/s"),
    (json.dumps(_with(MODEL_BODY, **{"cluster.efficiency": 5e-324})), ("cluster", "efficiency"), "fraction"),
    (
        json.dumps(_with(MODEL_BODY, **{"cluster.attention_efficiency": 1e-9})),
        ("cluster", "attention_efficiency"),
        "fraction",
    ),
    (json.dumps(_with(COSTS_BODY, **{"solver.time_limit_s": float("nan")})), ("solver", "time_limit_s"), "finite"),
]


@pytest.mark.parametrize(("text", "field", "fix"), CASES)
def test_solve_refuses_overflowing_inputs_naming_the_field(text: str, field: tuple[str, ...], fix: str) -> None:
    with pytest.raises(ValidationError) as raised:
        solve(load_problem(json.loads(text)))
    errors = raised.value.errors()
    assert any(tuple(e["loc"])[: len(field)] == field and fix in e["msg"] for e in errors), errors


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    path: Path = tmp_path_factory.mktemp("overflow") / "overflow.sqlite3"
    settings = Settings(database_url=f"sqlite:///{path}", solver_workers=1, max_time_limit_s=5.0)
    with TestClient(create_app(settings)) as test_client:
        yield test_client


@pytest.mark.parametrize(("text", "field", "fix"), CASES)
def test_http_answers_422_naming_the_field(client: TestClient, text: str, field: tuple[str, ...], fix: str) -> None:
    for path in ("/v1/schedules", "/v1/jobs"):
        response = client.post(path, content=text, headers={"content-type": "application/json"})
        assert response.status_code == 422, (path, response.status_code, response.text[:500])
        assert field[-1] in response.text and fix in response.text


def test_the_largest_accepted_costs_solve_into_strict_json() -> None:
    # Just under the cap: 8 microbatches × 4 stages × (F + I + W + 2·p2p).
    forward = 0.9 * MAX_STEP_MS / (8 * 4 * 3.2)
    body = _with(
        COSTS_BODY, **{"costs.forward": forward, "costs.backward_input": forward, "costs.backward_weight": forward}
    )
    schedule = solve(load_problem(body))
    assert schedule.status in ("optimal", "feasible")
    text = json.dumps(json.loads(schedule.model_dump_json()), allow_nan=False)  # no inf/NaN anywhere
    assert json.loads(text)["makespan"] > 0
