"""Signed callbacks from a real ``pipesched serve`` to a receiver on loopback: delivered within seconds, the
signature verifiable with the secret, a failed delivery retried and recorded on the job, bad URLs refused."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from fastapi.testclient import TestClient

from pipesched.api.app import create_app
from pipesched.api.callbacks import SIGNATURE_HEADER, verify_signature
from pipesched.api.settings import Settings
from tests.api.test_api_served import ServedApi, problem_body

SECRET = "webhook-secret-for-tests"

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # starlette on its httpx TestClient


class Receiver(http.server.BaseHTTPRequestHandler):
    """Records every POST; answers 500 to the first ``refusals`` of them."""

    refusals: ClassVar[int] = 0
    received: ClassVar[list[tuple[float, dict[str, str], bytes]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        Receiver.received.append((time.monotonic(), dict(self.headers), body))
        refused = len(Receiver.received) <= Receiver.refusals
        self.send_response(500 if refused else 204)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[str]:
    Receiver.refusals, Receiver.received = 0, []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    server.shutdown()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedApi]:
    directory = tmp_path_factory.mktemp("callbacks")
    server = ServedApi(
        f"sqlite:///{directory / 'db.sqlite3'}", directory / "server.log", PIPESCHED_WEBHOOK_SECRET=SECRET
    )
    yield server
    server.stop()


def wait_for(predicate: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s} s"
        time.sleep(0.05)


def test_a_finished_job_is_posted_signed_within_seconds(served: ServedApi, receiver: str) -> None:
    created = served.client.post("/v1/jobs", json={**problem_body(10, "zb-h1"), "callback_url": receiver})
    assert created.status_code == 202
    job_id = created.json()["id"]
    wait_for(lambda: Receiver.received)
    _, headers, body = Receiver.received[0]
    assert verify_signature(body, headers.get(SIGNATURE_HEADER), SECRET)
    assert not verify_signature(body, headers.get(SIGNATURE_HEADER), "another secret")
    sent = json.loads(body)
    assert sent["id"] == job_id and sent["status"] == "done" and sent["result"]["method"] == "zb-h1"
    wait_for(lambda: (served.client.get(f"/v1/jobs/{job_id}").json()["callback"] or {}).get("status") == "delivered")
    job = served.client.get(f"/v1/jobs/{job_id}").json()
    assert job["callback"]["attempts"] == 1 and job["callback"]["url"] == receiver
    assert {key: value for key, value in job.items() if key != "callback"} == sent


def test_a_refused_delivery_is_retried_with_backoff_and_recorded(served: ServedApi, receiver: str) -> None:
    Receiver.refusals = 2
    created = served.client.post("/v1/jobs", json={**problem_body(11, "1f1b"), "callback_url": receiver})
    job_id = created.json()["id"]
    wait_for(lambda: len(Receiver.received) >= 3)
    times = [entry[0] for entry in Receiver.received]
    assert times[1] - times[0] >= 0.9 and times[2] - times[1] >= 1.9  # 1 s, then 2 s
    assert Receiver.received[0][2] == Receiver.received[2][2]  # the same body, signed the same
    wait_for(lambda: served.client.get(f"/v1/jobs/{job_id}").json()["callback"]["status"] == "delivered")
    callback = served.client.get(f"/v1/jobs/{job_id}").json()["callback"]
    assert callback["attempts"] == 3 and callback["last_error"] is None


def test_a_plan_search_is_posted_when_done(served: ServedApi, receiver: str) -> None:
    request = {
        "model": {"preset": "llama3.1-8b"},
        "cluster": {"accelerator": "H100-SXM", "num_nodes": 1, "gpus_per_node": 8},
        "training": {"global_batch_size": 16},
        "search": {"time_limit_s": 3, "pipeline_parallel": [1], "top": 1},
        "callback_url": receiver,
    }
    created = served.client.post("/v1/plans", json=request)
    assert created.status_code == 202, created.text
    wait_for(lambda: Receiver.received, timeout_s=40)
    _, headers, body = Receiver.received[0]
    assert verify_signature(body, headers.get(SIGNATURE_HEADER), SECRET)
    sent = json.loads(body)
    assert sent["id"] == created.json()["id"] and sent["status"] == "done" and sent["plans"]
    assert "callback_url" not in sent["request"]


def test_non_http_urls_and_a_service_without_a_secret_are_refused(tmp_path: Path) -> None:
    signed = Settings(database_url=f"sqlite:///{tmp_path / 'a.sqlite3'}", webhook_secret=SECRET)
    with TestClient(create_app(signed)) as client:
        for url in ("ftp://example.org/hook", "file:///etc/passwd", "not a url"):
            answer = client.post("/v1/jobs", json={**problem_body(), "callback_url": url})
            assert answer.status_code == 422, url
            assert answer.json()["detail"][0]["loc"] == ["body", "callback_url"]
        assert "http://" in client.post("/v1/jobs", json={**problem_body(), "callback_url": "ftp://x/y"}).text
    unsigned = Settings(database_url=f"sqlite:///{tmp_path / 'b.sqlite3'}")
    with TestClient(create_app(unsigned)) as client:
        answer = client.post("/v1/jobs", json={**problem_body(), "callback_url": "http://127.0.0.1:9/hook"})
        assert answer.status_code == 422 and "PIPESCHED_WEBHOOK_SECRET" in answer.json()["detail"][0]["msg"]
        assert not any(client.app.state.services.store.count_jobs_by_status().values())  # nothing stored
