"""The profile times every pass beside a busy process: a profiling process done with its passes keeps its core busy
until every process is done, so that where processes share a core (a run's ranks do) no pass is timed alone (real
processes over gloo)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pytest

torch = pytest.importorskip("torch")

#: How long the late process sleeps before its barrier (s).
LATE_S = 0.6


@dataclass(frozen=True)
class _Job:
    workdir: str
    late_s: float


def _time_the_wait(job: _Job, global_rank: int, device: Any, timeout_s: float) -> tuple[float, float]:
    """One process: rank 1 comes ``late_s`` late; every process waits for the others as the profile does. Returns
    the main thread's CPU seconds during the wait and the wait's wall seconds."""
    import torch.distributed as dist

    from pipesched.runtime.profile import _busy_until_every_process_is_done

    dist.barrier()
    if global_rank == 1:
        time.sleep(job.late_s)
    cpu, wall = time.thread_time(), time.perf_counter()
    _busy_until_every_process_is_done(device)
    return time.thread_time() - cpu, time.perf_counter() - wall


def test_a_process_done_with_its_passes_keeps_its_core_busy_until_every_process_is_done(tmp_path):
    """Rank 0 is done 0.6 s before rank 1: it spends that wait computing (CPU time on its main thread), not blocked
    in the barrier, which would leave rank 1's last passes of the repeat alone on a shared core."""
    from pipesched.runtime.launch import launch_jobs

    returned = launch_jobs(_time_the_wait, [_Job(str(tmp_path), LATE_S)], world=2, timeout_s=120)
    assert returned is not None
    (early_cpu, early_wall), (_, late_wall) = returned[0]
    assert early_wall >= 0.8 * LATE_S > late_wall
    # blocked in a barrier it would take about 0 (0.0002 s of 0.6); busy, its share of a core: a CI run with other
    # test processes on the same 2 cores gave it 28%, a quiet machine about all of it
    assert early_cpu >= 0.1 * early_wall, (early_cpu, early_wall)


def test_the_second_version_copy_is_timed_after_a_sweep_of_twice_the_last_level_cache():
    """PipeDream-2BW's copy is timed as its run meets it, after other memory traffic: the sweep before each repeat is
    twice the CPU's last-level cache as Linux reports it (64 MiB where it does not), at most 1 GiB; none on a GPU."""
    from pathlib import Path

    from pipesched.runtime.profile import _SWEEP_DEFAULT_BYTES, _SWEEP_MOST_BYTES, _cache_sweep

    sweep = _cache_sweep(torch.device("cpu"))
    assert sweep is not None and sweep.dtype == torch.float32
    size = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
    if size.exists() and size.read_text().strip().endswith("K"):
        expected = min(2 * int(size.read_text().strip()[:-1]) * 1024, _SWEEP_MOST_BYTES)
    else:
        expected = _SWEEP_DEFAULT_BYTES
    assert sweep.numel() * 4 == expected
    assert _cache_sweep(torch.device("meta")) is None
