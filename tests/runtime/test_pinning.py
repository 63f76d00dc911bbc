"""Which core each process of a run is pinned to: with fewer cores than processes, the replicas of one pipeline
rank share its core (processes numbered ``pp · D + dp``), so that they run the same passes side by side and a
pipeline rank's bubble leaves its core idle; one replica keeps rank modulo the cores (the launcher: real processes over
gloo)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest

from pipesched.runtime.launch import pinned_core


def test_replicas_of_a_pipeline_rank_share_its_core_when_processes_outnumber_cores():
    # pp 2 × dp 2 on 2 cores: pipeline rank 0's replicas on core 0, pipeline rank 1's on core 1
    assert [pinned_core(rank, 4, 2, 2) for rank in range(4)] == [0, 0, 1, 1]
    # pp 4 × dp 2 on 2 cores: pipeline ranks 0 and 2 on core 0
    assert [pinned_core(rank, 8, 2, 2) for rank in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_one_replica_a_core_for_every_process_or_fewer_pipeline_ranks_than_cores_keep_rank_modulo_cores():
    assert [pinned_core(rank, 4, 1, 2) for rank in range(4)] == [0, 1, 0, 1]  # one replica: as before
    assert [pinned_core(rank, 4, 2, 16) for rank in range(4)] == [0, 1, 2, 3]  # a core each
    assert [pinned_core(rank, 4, 4, 2) for rank in range(4)] == [0, 1, 0, 1]  # dp 4, one pipeline rank


@dataclass(frozen=True)
class _Job:
    workdir: str


def _affinity(job: _Job, global_rank: int, device: Any, timeout_s: float) -> list[int]:
    return sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this platform")
def test_the_launcher_pins_replicas_of_a_pipeline_rank_together(tmp_path):
    pytest.importorskip("torch")
    from pipesched.runtime.launch import launch_jobs

    cores = sorted(os.sched_getaffinity(0))
    returned = launch_jobs(_affinity, [_Job(str(tmp_path))], world=4, timeout_s=120, replicas=2)
    assert returned is not None
    assert returned[0] == [[cores[pinned_core(rank, 4, 2, len(cores))]] for rank in range(4)]
    if len(cores) == 2:
        assert returned[0] == [[cores[0]], [cores[0]], [cores[1]], [cores[1]]]


def test_the_launcher_starts_its_processes_as_pipesched_start_method_says(tmp_path, monkeypatch):
    """``PIPESCHED_START_METHOD``: ``forkserver`` (default: forked from a server that imported torch once) or
    ``spawn``; a process started either way is pinned as above; another value is an error naming the variable."""
    pytest.importorskip("torch")
    from pipesched.runtime.launch import ScheduleError, launch_jobs, start_method

    monkeypatch.delenv("PIPESCHED_START_METHOD", raising=False)
    assert start_method() == "forkserver"
    monkeypatch.setenv("PIPESCHED_START_METHOD", "spawn")
    assert start_method() == "spawn"
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    returned = launch_jobs(_affinity, [_Job(str(tmp_path))], world=2, timeout_s=120)
    assert returned is not None and len(returned[0]) == 2
    if cores:
        assert returned[0] == [[cores[pinned_core(rank, 2, 1, len(cores))]] for rank in range(2)]
    monkeypatch.setenv("PIPESCHED_START_METHOD", "fork")
    with pytest.raises(ScheduleError, match="PIPESCHED_START_METHOD='fork': use one of forkserver, spawn"):
        launch_jobs(_affinity, [_Job(str(tmp_path / "bad"))], world=2, timeout_s=120)


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="Linux schedstat only")
def test_a_pass_beside_a_process_on_its_core_waits_for_it_and_the_wait_is_read():
    """What the runtime records as a pass's ``run_delay_ms``: the thread's time ready to run but waiting for its
    core. Alone on its core a busy loop waits almost nothing; beside a process spinning on the same core it waits
    for about the other's share (the scheduler splits the core)."""
    import subprocess
    import sys
    import time

    from pipesched.runtime.records import run_delay_ms

    core = min(os.sched_getaffinity(0))
    before_affinity = os.sched_getaffinity(0)

    def spin_delay(seconds: float) -> float:
        delayed = run_delay_ms()
        assert delayed is not None
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            pass
        after = run_delay_ms()
        assert after is not None and after >= delayed
        return after - delayed

    os.sched_setaffinity(0, {core})
    try:
        spinner = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import os,time\nos.sched_setaffinity(0,{{{core}}})\nt=time.time()+1.5\nwhile time.time()<t: pass",
            ]
        )
        try:
            time.sleep(0.1)
            beside = spin_delay(0.6)
        finally:
            spinner.wait()
    finally:
        os.sched_setaffinity(0, before_affinity)
    # sharing the core for 0.6 s of wall time: about 0.3 s waited (the other's half)
    assert beside > 150
