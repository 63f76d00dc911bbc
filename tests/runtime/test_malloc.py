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


@pytest.mark.skipif(os.uname().sysname != "Linux", reason="glibc's mallopt; page-fault counts as Linux keeps them")
def test_the_launchers_processes_reuse_freed_tensor_memory_and_glibc_defaults_fault_every_page(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    import ctypes

    from pipesched.runtime.launch import launch_jobs

    if not hasattr(ctypes.CDLL(None), "mallopt"):
        pytest.skip("no mallopt: not glibc")
    (tmp_path / "keep").mkdir()
    (tmp_path / "glibc").mkdir()
    monkeypatch.delenv("PIPESCHED_MALLOC", raising=False)
    kept = launch_jobs(_faults_per_allocation, [_Job(str(tmp_path / "keep"))], world=2, timeout_s=120)
    monkeypatch.setenv("PIPESCHED_MALLOC", "glibc")
    defaults = launch_jobs(_faults_per_allocation, [_Job(str(tmp_path / "glibc"))], world=2, timeout_s=120)
    assert kept is not None and defaults is not None
    for rank in range(2):
        # kept: the first allocations grow the heap (their pages fault once; here 7 of them), the last ones reuse it
        assert max(kept[0][rank][-4:]) < PAGES // 20, kept
        # glibc's defaults: every allocation a fresh mapping, every page of it faults again
        assert min(defaults[0][rank][1:]) > PAGES // 2, defaults


def test_pipesched_malloc_takes_keep_or_glibc_and_names_its_choices_otherwise(monkeypatch):
    from pipesched.runtime.launch import ScheduleError, malloc_setting

    monkeypatch.delenv("PIPESCHED_MALLOC", raising=False)
    assert malloc_setting() == "keep"
    monkeypatch.setenv("PIPESCHED_MALLOC", " GLIBC ")
    assert malloc_setting() == "glibc"
    monkeypatch.setenv("PIPESCHED_MALLOC", "jemalloc")
    with pytest.raises(ScheduleError, match="PIPESCHED_MALLOC='jemalloc': use one of keep, glibc"):
        malloc_setting()
