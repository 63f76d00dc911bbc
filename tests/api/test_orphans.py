"""A real ``pipesched serve`` leaves no process behind: after SIGTERM and after SIGKILL of the server
alone (not its process group), its forkserver, resource tracker, solver and render processes end too.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.api.test_api_served import ServedApi, problem_body
from tests.conftest import paper_problem, paper_settings

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid``, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def descendants(root: int) -> set[int]:
    """Every live process whose chain of parents reaches ``root``."""
    parents = {pid: stat[1] for pid in _pids() if (stat := _stat(pid)) is not None}
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier and pid not in found}
        found |= frontier
    return found


def pointing_to(marker: str) -> set[int]:
    """Live processes whose command line or environment names ``marker`` (the server's database file)."""
    found = set()
    for pid in _pids():
        if pid == os.getpid():
            continue
        for part in ("cmdline", "environ"):
            try:
                if marker.encode() in Path(f"/proc/{pid}/{part}").read_bytes():
                    found.add(pid)
            except OSError:
                pass
    return found


def alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if (stat := _stat(pid)) is not None and stat[0] not in ("Z", "X")}


def busy_server(tmp_path: Path) -> tuple[ServedApi, str, list[str]]:
    """A server with a job running, one queued, a synchronous solve and a drawing done (every kind of process)."""
    database = tmp_path / "orphans.sqlite3"
    served = ServedApi(
        f"sqlite:///{database}", tmp_path / "server.log", PIPESCHED_SOLVER_WORKERS="1", PIPESCHED_MAX_TIME_LIMIT_S="60"
    )
    client = served.client
    solved = client.post("/v1/schedules", json=problem_body())
    assert solved.status_code == 200, solved.text
    assert client.get(f"/v1/schedules/{solved.json()['id']}?format=png").status_code == 200
    setting = paper_settings()[0]
    ids = []
    for seed in range(2):
        problem = paper_problem(
            setting,
            **{
                "memory.limit": 1.2 * setting["num_ranks"] * setting["activation"],
                "solver.time_limit_s": 30.0,
                "solver.seed": seed,
            },
        )
        created = client.post("/v1/jobs", json=problem.model_dump(mode="json"))
        assert created.status_code == 202, created.text
        ids.append(created.json()["id"])
    deadline = time.monotonic() + 60
    while client.get(f"/v1/jobs/{ids[0]}").json()["status"] != "running":
        assert time.monotonic() < deadline, served.log()
        time.sleep(0.1)
    return served, str(database), ids


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_no_process_outlives_the_server(tmp_path: Path, sig: signal.Signals) -> None:
    served, database, ids = busy_server(tmp_path)
    server = served.process.pid
    children = descendants(server)
    try:
        # forkserver, resource tracker, the job's, the synchronous solve's and the render's processes
        assert len(children) >= 4, children
        assert pointing_to(database) >= {server}
        os.kill(server, sig)  # the server alone: not its process group
        served.process.wait(timeout=30)
        deadline = time.monotonic() + 15
        while (left := alive(children) | (pointing_to(database) - {server})) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:200] for pid in left}
    finally:
        for pid in alive(children):
            os.kill(pid, signal.SIGKILL)
        served.client.close()
    if sig == signal.SIGTERM:
        # The queued job never ran after the shutdown: it waits, queued, for the next start.
        from pipesched.api.storage import Store

        store = Store(f"sqlite:///{database}")
        try:
            job = store.job(ids[1])
            assert job is not None and job.status == "queued", job and job.status
        finally:
            store.dispose()
