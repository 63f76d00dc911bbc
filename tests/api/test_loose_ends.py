"""Loose ends a user meets (U21): what the plan table says of a sharding at data-parallel 1; a new user's day on
the service (a real ``pipesched serve`` on loopback with its own SQLite file): stopping a plan search, a schedule
to check in the wrong shape."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from rich.console import Console

from pipesched.api.cli.plan import print_plans
from pipesched.optimizer.planner.rank import plan
from pipesched.optimizer.planner.request import PlanRequest
from tests.api import test_newcomer
from tests.api.test_api_served import ServedApi
from tests.api.test_newcomer import pipesched

served = test_newcomer.served  # the fixture: a real `pipesched serve` on loopback with its own SQLite file

#: Llama 3.1 8B at 131K tokens on one node of 8 H100s, pinned to tensor 4 × context 2 (data-parallel 1).
CONTEXT_PARALLEL = {
    "model": {"preset": "llama3.1-8b", "seq_length": 131072},
    "cluster": {"accelerator": "H100-SXM", "num_nodes": 1, "gpus_per_node": 8},
    "training": {"global_batch_size": 1},
    "search": {
        "time_limit_s": 20,
        "top": 3,
        "pipeline_parallel": [1],
        "tensor_parallel": [4],
        "context_parallel": [2],
        "activation_recomputation": ["full"],
        "sharding": ["none", "optimizer", "full"],
    },
}


def test_a_sharding_at_data_parallel_1_with_context_parallelism_says_the_gpus_it_spans() -> None:
    """At d = 1 and c = 2 the plan table listed "1 none", "1 optimizer", "1 full" as three plans of one layout,
    which reads as the same thing three times; the weights are copied over the c ranks too and sharded over d·c
    (the three peaks differ), so the cell now says so: "1 full over d·c 2". Without context parallelism, d = 1
    is searched with sharding none only (one row)."""
    answer = plan(PlanRequest.model_validate(CONTEXT_PARALLEL)).answer
    assert {p.data_parallel.sharding for p in answer.plans} == {"none", "optimizer", "full"}
    assert len({p.peak_memory_bytes for p in answer.plans}) == 3
    out = Console(record=True, width=250)
    print_plans(answer, out)
    text = out.export_text()
    assert "1 full over d·c 2" in text and "1 optimizer over d·c 2" in text
    assert "1 none " in text and "none over" not in text
    alone = {
        **CONTEXT_PARALLEL,
        "search": {**CONTEXT_PARALLEL["search"], "context_parallel": [1], "tensor_parallel": [8]},
    }
    answer = plan(PlanRequest.model_validate({**alone, "model": {"preset": "llama3.1-8b", "seq_length": 8192}})).answer
    assert answer.plans and {p.data_parallel.sharding for p in answer.plans} == {"none"}


#: Llama 3.1 405B on 512 H100s: a search of over a thousand layouts that a 60 s limit does not finish here.
LONG_SEARCH = {
    "model": {"preset": "llama3.1-405b"},
    "cluster": {"accelerator": "H100-SXM", "num_nodes": 64, "gpus_per_node": 8},
    "training": {"global_batch_size": 512},
    "search": {"time_limit_s": 60},
}


def test_a_running_plan_search_is_cancelled_and_keeps_the_plans_it_found(served: ServedApi) -> None:
    """DELETE /v1/plans/{id} answered 405 Method Not Allowed: a plan search, once posted, ran its whole time limit
    (60 s here) with no way to stop it but the service's. Now it stops within a poll interval, its status is
    ``cancelled`` and its answer keeps the plans found until then with a note saying so (as Ctrl-C does to
    ``pipesched plan``); the Python client's ``cancel_plan`` does the same; an unknown id is a 404 that says where
    ids come from."""
    from pipesched.client import Client

    plan_id = served.client.post("/v1/plans", json=LONG_SEARCH).json()["id"]
    deadline = time.monotonic() + 45
    status = served.client.get(f"/v1/plans/{plan_id}").json()
    while not status["plans"] and time.monotonic() < deadline:  # running, with a first plan
        time.sleep(0.5)
        status = served.client.get(f"/v1/plans/{plan_id}").json()
    assert status["status"] == "running" and status["plans"], status
    asked = time.monotonic()
    with Client(served.base_url) as client:
        answer = client.cancel_plan(plan_id)
    assert answer.status == "cancelled"
    while time.monotonic() - asked < 20:
        status = served.client.get(f"/v1/plans/{plan_id}").json()
        if status["progress"]["phase"] == "done":
            break
        time.sleep(0.5)
    stopped_after = time.monotonic() - asked
    assert status["status"] == "cancelled" and status["progress"]["phase"] == "done", status
    assert stopped_after < 15  # the search's limit was 60 s
    assert status["plans"] and all(plan["schedule_id"] for plan in status["plans"] if plan["pipeline_parallel"] > 1)
    assert status["notes"][0].startswith(f"cancelled (DELETE /v1/plans/{plan_id}) after")
    again = served.client.delete(f"/v1/plans/{plan_id}")  # an ended search is answered as it is
    assert again.status_code == 200 and again.json()["status"] == "cancelled"
    missing = served.client.delete("/v1/plans/no-such-plan")
    assert missing.status_code == 404 and "POST /v1/plans first" in missing.json()["detail"]


PROBLEM = {
    "pipeline": {"num_ranks": 2, "num_microbatches": 2},
    "costs": {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0, "p2p": 0.1},
    "memory": {"activation": 100, "retained_for_weight": 40, "limit": 400},
}


@pytest.mark.parametrize(
    ("schedule", "said"),
    [
        ({"0": ["0F0"], "1": ["1F0"]}, "not an object: list the ranks in order"),
        (["0F0", "0I0"], "not one flat list of strings: put each rank's actions in a list of its own"),
        ([["0F0"], "1F0"], "not a list whose items are not each a list of strings"),
        (3, "not a number"),
    ],
)
def test_a_schedule_to_check_in_another_shape_gets_one_sentence_on_the_field(
    served: ServedApi, schedule: object, said: str
) -> None:
    """POST /v1/schedules/check with the schedule keyed by rank (my first guess) had answered one line per member of
    the field's union, at paths no request has (``body.schedule.list[list[str]].0: Input should be a valid list``,
    ``body.schedule.str: Input should be a valid string``); now one 422 line on ``body.schedule`` says what to send."""
    response = served.client.post("/v1/schedules/check", json={"problem": PROBLEM, "schedule": schedule})
    assert response.status_code == 422
    (detail,) = response.json()["detail"]
    assert detail["loc"] == ["body", "schedule"]
    assert detail["msg"].startswith("give one list of action strings per rank") and said in detail["msg"]
    good = [["0F0", "0F1", "0I0", "0W0", "0I1", "0W1"], ["1F0", "1I0", "1W0", "1F1", "1I1", "1W1"]]
    response = served.client.post("/v1/schedules/check", json={"problem": PROBLEM, "schedule": good})
    assert response.status_code == 200 and response.json()["valid"] is True, response.text


CALLBACK_NOTE = "callback_url is the service's (POST /v1/jobs or /v1/plans POSTs the finished answer there, signed)"


def test_a_request_file_with_a_callback_url_runs_on_the_command_line_with_a_note(tmp_path: Path) -> None:
    """The README's job and plan requests may carry "callback_url" for the service; the same file given to
    ``pipesched solve`` / ``pipesched plan`` had exited 2 with "callback_url: Extra inputs are not permitted".
    Now each answers, saying on stderr that the callback is the service's and is left out here."""
    job = tmp_path / "job.json"
    job.write_text(json.dumps({**PROBLEM, "callback_url": "https://example.org/hook"}))
    solved = pipesched("solve", "job.json", "-o", "schedule.json", cwd=tmp_path)
    assert solved.returncode == 0, solved.stderr
    assert CALLBACK_NOTE in " ".join(solved.stderr.split())
    assert json.loads((tmp_path / "schedule.json").read_text())["problem"]["pipeline"]["num_ranks"] == 2
    request = {
        "model": {"preset": "llama3.1-8b"},
        "cluster": {"accelerator": "H100-SXM", "num_nodes": 1, "gpus_per_node": 8},
        "training": {"global_batch_size": 16},
        "search": {"time_limit_s": 20, "pipeline_parallel": [1], "tensor_parallel": [1], "sharding": ["full"],
                   "micro_batch_size": [2], "activation_recomputation": ["selective"]},
        "callback_url": "https://example.org/hook",
    }  # fmt: skip
    (tmp_path / "plan.json").write_text(json.dumps(request))
    planned = pipesched("plan", "plan.json", "-o", "plans.json", cwd=tmp_path)
    assert planned.returncode == 0, planned.stderr
    assert CALLBACK_NOTE in " ".join(planned.stderr.split())
    assert json.loads((tmp_path / "plans.json").read_text())["plans"]


def test_registering_a_profile_under_a_name_taken_says_whose_it_replaced(served: ServedApi) -> None:
    """``pipesched calibrate`` names every H100 profile "H100-SXM-calibrated" unless told otherwise; a second team
    posting theirs replaced the first team's with the same 201 and nothing said, and the first team's next plans took
    the second's efficiencies. The answer now says whose profile it replaced (null for a new name)."""
    from pipesched.optimizer.cost.profile import builtin_catalogue

    h100 = builtin_catalogue().get("H100-SXM")
    assert h100 is not None
    ours = h100.model_copy(update={"name": "H100-SXM-calibrated", "source": "calibrated on team A's runs"})
    theirs = ours.model_copy(update={"source": "calibrated on team B's runs", "gemm_efficiency": 0.5})
    first = served.client.post("/v1/profiles", json=ours.model_dump(mode="json"))
    assert first.status_code == 201 and first.json()["replaced"] is None, first.text
    second = served.client.post("/v1/profiles", json=theirs.model_dump(mode="json"))
    assert second.status_code == 201 and second.json()["replaced"] == "calibrated on team A's runs", second.text
    listed = [p for p in served.client.get("/v1/profiles").json()["profiles"] if p["name"] == "H100-SXM-calibrated"]
    assert [p["source"] for p in listed] == ["calibrated on team B's runs"]


@pytest.mark.parametrize(
    ("route", "body", "said"),
    [
        ("/v1/jobs", "plan request", "the body is a plan request, not a problem: POST it to /v1/plans"),
        ("/v1/schedules", "plan request", "the body is a plan request, not a problem: POST it to /v1/plans"),
        ("/v1/plans", "problem", "the body is a problem, not a plan request: POST it to /v1/jobs"),
        ("/v1/plans", "measurement file", "the body is a measurement file, not a plan request: make a profile of its"),
    ],
)
def test_a_document_posted_to_the_route_of_another_names_the_route_that_takes_it(
    served: ServedApi, route: str, body: str, said: str
) -> None:
    """A plan request posted to /v1/jobs had answered "pipeline: Field required"; a problem posted to /v1/plans six
    lines (model, cluster, training required; pipeline, costs, memory not permitted). Now one 422 line says what the
    body is and where it goes, as POST /v1/profiles already did for a measurement file; a body of the route's own kind
    with a wrong field keeps the field's own line."""
    bodies = {
        "plan request": {
            "model": {"preset": "llama3.1-8b"},
            "cluster": {"accelerator": "H100-SXM", "num_nodes": 1, "gpus_per_node": 8},
            "training": {"global_batch_size": 16},
        },
        "problem": PROBLEM,
        "measurement file": {"rows": [{"id": "mine", "accelerator": "H100-SXM"}]},
    }
    response = served.client.post(route, json=bodies[body])
    assert response.status_code == 422
    (detail,) = response.json()["detail"]
    assert detail["loc"] == ["body"] and detail["type"] == "wrong_document" and detail["msg"].startswith(said), detail
    wrong_field = {**PROBLEM, "pipeline": {"num_ranks": 0, "num_microbatches": 2}}
    detail = served.client.post("/v1/jobs", json=wrong_field).json()["detail"]
    assert [item["loc"] for item in detail] == [["body", "pipeline", "num_ranks"]]
