"""Schedules with fused and split backward passes mixed (PyTorch's DualPipeV), and interleaved-zb, run on 4 gloo
ranks on both engines and match the reference gradients."""

from __future__ import annotations

import pytest

from pipesched.optimizer.families import get_family
from pipesched.optimizer.ir import parse_orders
from pipesched.optimizer.result import build_schedule
from tests.conftest import uniform_problem

torch = pytest.importorskip("torch")


def test_mixed_backward_and_interleaved_zb_run_and_verify() -> None:
    from pipesched.runtime.launch import run_schedules
    from pipesched.runtime.torch_orders import torch_compute_orders

    v_problem = uniform_problem(4, 8, stages_per_rank=2, placement="v")
    mixed = parse_orders(torch_compute_orders("DualPipeV", 4, 2, 8))
    assert {a.kind.value for row in mixed for a in row} == {"F", "I", "W", "B"}
    dualpipe = build_schedule(v_problem, mixed, method="dualpipe-v", backend="torch", check_memory=False)
    loop_problem = uniform_problem(4, 8, stages_per_rank=2)
    interleaved_zb = build_schedule(
        loop_problem,
        get_family("interleaved-zb").generate(loop_problem),
        method="interleaved-zb",
        backend="family",
        check_memory=False,
    )
    schedules = [dualpipe, dualpipe, interleaved_zb, interleaved_zb]
    engines = ["pipesched", "torch", "pipesched", "torch"]
    reports = run_schedules(schedules, engine=engines, model=["gpt-tiny"] * 4, timeout_s=120)
    for schedule, engine, report in zip(schedules, engines, reports, strict=True):
        assert report.verified is True, (schedule.method, engine, report)
        assert report.executed_order_matches, report.order_mismatches
        assert report.max_rel_grad_error <= 1e-5
        assert report.engine == engine
        for rank, expected in zip(report.ranks, schedule.ranks, strict=True):
            assert [a.action for a in rank.actions] == [a.action for a in expected.actions]
