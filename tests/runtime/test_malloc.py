"""The launcher's processes keep the memory their tensors free (``PIPESCHED_MALLOC``, default ``keep``): a tensor
allocated again after one was freed reuses the heap's pages instead of a fresh ``mmap`` whose every page the kernel
zeroes on first touch (a minor page fault). With glibc's defaults a block above its dynamic mmap threshold's ceiling
(32 MiB on 64-bit) is mapped and unmapped every time; kept, it comes from the heap (real processes over gloo)."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from typing import Any

import pytest

#: 40 MiB of float32: above glibc's largest dynamic mmap threshold (32 MiB), so its defaults map it every time.
ELEMENTS = 10 * 2**20
PAGES = ELEMENTS * 4 // 4096
#: Allocations per process; the kept heap's last 4 are read.
ALLOCATIONS = 16


@dataclass(frozen=True)
class _Job:
    workdir: str


def _faults_per_allocation(job: _Job, global_rank: int, device: Any, timeout_s: float) -> list[int]:
    """Minor page faults of each allocation of a 40 MiB tensor, touched then freed (:data:`ALLOCATIONS` times)."""
    import torch

    faults = []
    for _ in range(ALLOCATIONS):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        tensor = torch.empty(ELEMENTS).fill_(1.0)
        del tensor
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return faults


def _kept_and_defaults(
    job: Any, tmp_path: Any, monkeypatch: Any, settings: tuple[str, str] = ("keep", "glibc")
) -> tuple[list[list[Any]], list[list[Any]]]:
    """``job`` in two launches of 2 processes, one per ``PIPESCHED_MALLOC`` setting (default: kept, the default,
    then glibc's defaults)."""
    from pipesched.runtime.launch import launch_jobs

    found = []
    for setting in settings:
        (tmp_path / setting).mkdir()
        monkeypatch.setenv("PIPESCHED_MALLOC", setting)
        found.append(launch_jobs(job, [_Job(str(tmp_path / setting))], world=2, timeout_s=120))
    assert found[0] is not None and found[1] is not None
    return found[0], found[1]


@pytest.mark.skipif(os.uname().sysname != "Linux", reason="glibc's mallopt; page-fault counts as Linux keeps them")
def test_the_launchers_processes_reuse_freed_tensor_memory_and_glibc_defaults_fault_every_page(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    import ctypes

    if not hasattr(ctypes.CDLL(None), "mallopt"):
        pytest.skip("no mallopt: not glibc")
    kept, defaults = _kept_and_defaults(_faults_per_allocation, tmp_path, monkeypatch)
    for rank in range(2):
        # kept: the first allocations grow the heap (their pages fault once; here 7 of them), the last ones reuse it
        assert max(kept[0][rank][-4:]) < PAGES // 20, kept
        # glibc's defaults: every allocation a fresh mapping, every page of it faults again
        assert min(defaults[0][rank][1:]) > PAGES // 2, defaults


def test_pipesched_malloc_takes_keep_glibc_or_one_arena_and_names_its_choices_otherwise(monkeypatch):
    from pipesched.runtime.launch import ScheduleError, malloc_setting

    monkeypatch.delenv("PIPESCHED_MALLOC", raising=False)
    assert malloc_setting() == "keep"
    monkeypatch.setenv("PIPESCHED_MALLOC", " GLIBC ")
    assert malloc_setting() == "glibc"
    monkeypatch.setenv("PIPESCHED_MALLOC", "one-arena")
    assert malloc_setting() == "one-arena"
    monkeypatch.setenv("PIPESCHED_MALLOC", "jemalloc")
    with pytest.raises(ScheduleError, match="PIPESCHED_MALLOC='jemalloc': use one of keep, glibc, one-arena"):
        malloc_setting()


def _arenas_after_a_thread_allocates(job: _Job, global_rank: int, device: Any, timeout_s: float) -> int:
    """The process's malloc arenas (``malloc_info``'s ``<heap nr=…>`` entries) after a second thread, as the
    communication stream is, allocated and freed a tensor."""
    import ctypes
    import threading

    import torch

    thread = threading.Thread(target=lambda: torch.ones(2**20).sum())
    thread.start()
    thread.join()
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    path = os.path.join(job.workdir, f"malloc-{global_rank}.xml")
    stream = ctypes.c_void_p(libc.fopen(path.encode(), b"w"))
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    with open(path) as found:
        return found.read().count("<heap nr=")


@pytest.mark.skipif(os.uname().sysname != "Linux", reason="glibc's arenas")
def test_one_arena_puts_every_thread_of_a_kept_process_on_the_one_kept_heap(tmp_path, monkeypatch):
    """``one-arena`` sets ``M_ARENA_MAX`` 1: a second thread (the communication stream's) allocates from the main
    heap, whose freed memory ``keep``'s settings keep, not from an arena of its own, whose 64 MiB heaps glibc unmaps
    when emptied whatever ``M_TRIM_THRESHOLD`` says (under ``keep`` a breadth-first pp 2 × dp 2 run's REDUCE_GRAD
    faulted on all 2,570 pages of its reduce-scatter input in the run's first steps; bench/results/issue25_bars.md,
    R24)."""
    pytest.importorskip("torch")
    import ctypes

    if not hasattr(ctypes.CDLL(None), "malloc_info"):
        pytest.skip("no malloc_info: not glibc")
    one, kept = _kept_and_defaults(_arenas_after_a_thread_allocates, tmp_path, monkeypatch, ("one-arena", "keep"))
    assert one == [[1, 1]]
    assert min(kept[0]) >= 2, kept
