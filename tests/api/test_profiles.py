"""``/v1/profiles``: listing the profiles and registering a calibrated one that plans then name."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from pipesched.api.app import create_app
from pipesched.api.settings import Settings
from pipesched.api.storage import Store
from pipesched.optimizer.cost.profile import builtin_catalogue
from tests.api.test_api_served import ServedApi


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    path = tmp_path_factory.mktemp("profiles") / "pipesched.sqlite3"
    with TestClient(create_app(Settings(database_url=f"sqlite:///{path}", solver_workers=1))) as test_client:
        yield test_client


def test_profiles_list_the_built_in_ones_with_their_interval(client: TestClient) -> None:
    body = client.get("/v1/profiles").json()
    by_name = {item["name"]: item for item in body["profiles"]}
    assert {"A100-80GB", "H100-SXM", "H200", "B200", "MI300X"} <= set(by_name)
    low, high = by_name["H100-SXM"]["interval_factors"]
    assert low < 1 < high
    assert by_name["MI300X"]["source"].startswith("not fitted")


def test_a_registered_profile_is_listed_and_used_by_plans(client: TestClient) -> None:
    h100 = builtin_catalogue().get("H100-SXM")
    assert h100 is not None
    mine = h100.model_copy(update={"name": "our-h100s", "gemm_efficiency": 0.5}).model_dump(mode="json")
    created = client.post("/v1/profiles", json=mine)
    assert created.status_code == 201, created.text
    assert created.json()["built_in"] is False
    names = [item["name"] for item in client.get("/v1/profiles").json()["profiles"]]
    assert "our-h100s" in names
    from pipesched.optimizer.planner.rank import plan
    from pipesched.optimizer.planner.request import PlanRequest

    def best(profile: str | None) -> float:
        cluster = {"accelerator": "H100-SXM", "num_nodes": 1, **({"profile": profile} if profile else {})}
        request = {
            "model": {"preset": "llama3.1-8b"},
            "cluster": cluster,
            "training": {"global_batch_size": 16},
            "search": {"time_limit_s": 5, "top": 1, "pipeline_parallel": [1]},
        }
        return plan(PlanRequest.model_validate(request)).answer.plans[0].tokens_per_s_per_gpu

    assert best("our-h100s") < best(None)


@pytest.mark.parametrize(
    ("change", "field"),
    [({"name": "H100-SXM"}, "name"), ({"name": "x", "accelerator": "H900"}, "accelerator")],
)
def test_bad_profiles_are_422_naming_the_field(client: TestClient, change: dict[str, str], field: str) -> None:
    h100 = builtin_catalogue().get("H100-SXM")
    assert h100 is not None
    answer = client.post("/v1/profiles", json={**h100.model_dump(mode="json"), **change})
    assert answer.status_code == 422
    assert answer.json()["detail"][0]["loc"][-1] == field


def test_a_plan_the_service_runs_uses_a_registered_profile(client: TestClient) -> None:
    """The plan search runs in a solver process, not the one that took the POST: the profile must reach it.

    Before the profiles were stored, this plan failed ("unknown profile 'worker-h100s'") after a 202."""
    h100 = builtin_catalogue().get("H100-SXM")
    assert h100 is not None
    mine = h100.model_copy(update={"name": "worker-h100s", "gemm_efficiency": 0.5}).model_dump(mode="json")
    assert client.post("/v1/profiles", json=mine).status_code == 201
    request = {
        "model": {"preset": "llama3.1-8b"},
        "cluster": {"accelerator": "H100-SXM", "num_nodes": 1, "profile": "worker-h100s"},
        "training": {"global_batch_size": 16},
        "search": {"time_limit_s": 3, "top": 1, "pipeline_parallel": [1], "tensor_parallel": [1]},
    }
    created = client.post("/v1/plans", json=request)
    assert created.status_code == 202, created.text
    deadline = time.monotonic() + 60
    while (answer := client.get(f"/v1/plans/{created.json()['id']}").json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, answer
        time.sleep(0.2)
    assert answer["status"] == "done", answer["error"]
    assert "worker-h100s" in answer["profile"], answer["profile"]


def test_a_registered_profile_is_stored_for_the_next_start(client: TestClient) -> None:
    """A restart (a new app on the same database) lists what was registered before, and keeps it on a 422."""
    h100 = builtin_catalogue().get("H100-SXM")
    assert h100 is not None
    mine = h100.model_copy(update={"name": "kept-h100s"}).model_dump(mode="json")
    assert client.post("/v1/profiles", json=mine).status_code == 201
    assert client.post("/v1/profiles", json={**mine, "accelerator": "H900"}).status_code == 422
    database_url = client.app.state.services.settings.database_url  # type: ignore[attr-defined]
    stored = {json.loads(text)["name"]: json.loads(text) for text in Store(database_url).profile_jsons()}
    assert stored["kept-h100s"]["accelerator"] == "H100-SXM"


def test_another_replica_on_the_same_database_uses_a_profile_at_once(tmp_path: Path) -> None:
    """Two ``pipesched serve`` processes on one database: a profile registered (then replaced) on one is listed
    and planned with on the other without a restart. Before, the other answered 422 "unknown profile" until it
    restarted, and kept a replaced profile's old figures."""
    database_url = f"sqlite:///{tmp_path / 'pipesched.sqlite3'}"
    first = ServedApi(database_url, tmp_path / "first.log")
    second = ServedApi(database_url, tmp_path / "second.log")
    try:
        h100 = builtin_catalogue().get("H100-SXM")
        assert h100 is not None
        mine = h100.model_copy(update={"name": "shared-h100s", "source": "our runs, week 1"}).model_dump(mode="json")
        assert first.client.post("/v1/profiles", json=mine).status_code == 201
        request = {
            "model": {"preset": "llama3.1-8b"},
            "cluster": {"accelerator": "H100-SXM", "num_nodes": 1, "profile": "shared-h100s"},
            "training": {"global_batch_size": 16},
            "search": {"time_limit_s": 3, "top": 1, "pipeline_parallel": [1], "tensor_parallel": [1]},
        }
        created = second.client.post("/v1/plans", json=request)
        assert created.status_code == 202, created.text
        deadline = time.monotonic() + 60
        while (answer := second.client.get(f"/v1/plans/{created.json()['id']}").json())["status"] in (
            "queued",
            "running",
        ):
            assert time.monotonic() < deadline, answer
            time.sleep(0.2)
        assert answer["status"] == "done", answer["error"]
        assert "shared-h100s" in answer["profile"], answer["profile"]

        replaced = {**mine, "source": "our runs, week 2"}
        assert first.client.post("/v1/profiles", json=replaced).status_code == 201
        listed = {item["name"]: item for item in second.client.get("/v1/profiles").json()["profiles"]}
        assert listed["shared-h100s"]["source"] == "our runs, week 2"
    finally:
        first.stop()
        second.stop()


def test_a_measurement_file_posted_as_a_profile_says_to_calibrate_it_first(client: TestClient) -> None:
    """POST /v1/profiles with calibrate's input (its rows) instead of its output had answered one 422 line per field
    a profile has; now one line that names the document and the command that makes a profile of it. A body that
    is a profile with a wrong field still gets the field's own line."""
    runs = {"rows": [{"id": "mine", "accelerator": "H100-SXM"}]}
    answer = client.post("/v1/profiles", json=runs)
    assert answer.status_code == 422
    assert answer.json()["detail"] == [
        {
            "loc": ["body"],
            "msg": "the body is a measurement file, not a profile: make a profile of its runs with `pipesched "
            "calibrate RUNS.json -o profile.json`, then give that",
            "type": "wrong_document",
        }
    ]
    mine = builtin_catalogue().profiles["H100-SXM"].model_dump(mode="json")
    mine.update(name="mine-wrong", max_measured_mfu="high")
    detail = client.post("/v1/profiles", json=mine).json()["detail"]
    assert [item["loc"] for item in detail] == [["body", "max_measured_mfu"]], detail
