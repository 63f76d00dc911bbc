"""The launcher's processes freeze their Python objects before each job (``PIPESCHED_GC``, default ``freeze``): a full
garbage collection inside a job then walks only the objects the job made, not torch's and the launcher's (some 10⁵),
which had cost a gpt-small rank 110 ms in the middle of a pass (real processes over gloo)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest


@dataclass(frozen=True)
class _Job:
    workdir: str


def _collector_state(job: _Job, global_rank: int, device: Any, timeout_s: float) -> tuple[int, int]:
    """The objects in the permanent generation and those a full collection walks, at the job's start."""
    import gc

    return gc.get_freeze_count(), len(gc.get_objects())


def test_the_launchers_processes_freeze_their_objects_before_each_job_and_python_leaves_them(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from pipesched.runtime.launch import launch_jobs

    (tmp_path / "freeze").mkdir()
    (tmp_path / "python").mkdir()
    monkeypatch.delenv("PIPESCHED_GC", raising=False)
    jobs = [_Job(str(tmp_path / "freeze")), _Job(str(tmp_path / "freeze"))]
    frozen = launch_jobs(_collector_state, jobs, world=2, timeout_s=120)
    monkeypatch.setenv("PIPESCHED_GC", "python")
    left = launch_jobs(_collector_state, [_Job(str(tmp_path / "python"))], world=2, timeout_s=120)
    assert frozen is not None and left is not None
    for job in frozen:
        for permanent, walked in job:
            # torch imported: tens of thousands of objects frozen, a full collection walks a small rest
            assert permanent > 20_000 and walked < permanent // 5, frozen
    for permanent, walked in left[0]:
        assert permanent == 0 and walked > 20_000, left


def test_pipesched_gc_takes_freeze_or_python_and_names_its_choices_otherwise(monkeypatch):
    from pipesched.runtime.launch import ScheduleError, gc_setting

    monkeypatch.delenv("PIPESCHED_GC", raising=False)
    assert gc_setting() == "freeze"
    monkeypatch.setenv("PIPESCHED_GC", " PYTHON ")
    assert gc_setting() == "python"
    monkeypatch.setenv("PIPESCHED_GC", "off")
    with pytest.raises(ScheduleError, match="PIPESCHED_GC='off': use one of freeze, python"):
        gc_setting()
