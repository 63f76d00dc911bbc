"""Regression tests for review findings on the service, the CLI's serve command and the optimizer's helpers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import Settings
from tests.conftest import uniform_problem

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # starlette on its httpx TestClient


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    path = tmp_path_factory.mktemp("review") / "api.sqlite3"
    settings = Settings(database_url=f"sqlite:///{path}", solver_workers=1, max_time_limit_s=3.0)
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def test_view_compare_with_a_family_over_the_memory_limit_draws_it_flagged(client: TestClient) -> None:
    # 1F1B holds at most 4 microbatches' activations (400 bytes) on rank 0; GPipe holds all 8 (800).
    problem = uniform_problem(4, 8, p2p=0.1, limit=500.0, method="1f1b", time_limit_s=2.0)
    answer = client.post("/v1/schedules", json=problem.model_dump(mode="json")).json()
    assert answer["status"] == "feasible", answer
    page = client.get(f"/v1/schedules/{answer['id']}/view", params={"compare": "gpipe"})
    assert page.status_code == 200, page.text
    assert "OVER THE LIMIT" in page.text
    assert page.text.count("<svg") >= 2  # both schedules drawn
    # The over-the-limit drawing is not stored as the answer to the gpipe problem.
    gpipe = problem.with_changes(**{"solver.method": "gpipe"}).model_dump(mode="json")
    assert client.post("/v1/schedules", json=gpipe).json()["status"] == "infeasible"


def test_view_compare_outside_the_family_domain_or_auto_is_a_422_naming_compare(client: TestClient) -> None:
    problem = uniform_problem(4, 8, method="1f1b", time_limit_s=2.0, split_backward=False)
    schedule_id = client.post("/v1/schedules", json=problem.model_dump(mode="json")).json()["id"]
    for family in ("zb-h1", "auto", "no-such-family"):
        response = client.get(f"/v1/schedules/{schedule_id}/view", params={"compare": family})
        assert response.status_code == 422, (family, response.text)
        assert response.json()["detail"][0]["loc"] == ["query", "compare"]
