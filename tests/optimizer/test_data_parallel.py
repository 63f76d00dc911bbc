"""Data parallelism in the step: collective costs, communication actions, step_time, families and auto."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from pipesched.api.app import create_app
from pipesched.api.settings import Settings
from pipesched.optimizer.check import check_schedule, read_schedule
from pipesched.optimizer.configs import ClusterConfig
from pipesched.optimizer.cost.collectives import all_gather_ms, all_reduce_ms, reduce_scatter_ms
from pipesched.optimizer.cost.stages import resolve_hardware
from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.families import FamilyDomainError, applicable_families
from pipesched.optimizer.instance import compile_for_orders, compile_problem
from pipesched.optimizer.ir import ActionKind, format_orders, parse_action, parse_orders
from pipesched.optimizer.problem import DataParallel, Problem
from pipesched.optimizer.result import Schedule
from pipesched.optimizer.simulate import simulate
from pipesched.optimizer.solve import solve, solve_family
from tests.conftest import REPO, paper_problem, paper_settings

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MODEL_52B = {
    "num_layers": 64,
    "hidden_size": 8192,
    "num_attention_heads": 64,
    "seq_length": 2048,
    "vocab_size": 51200,
    "micro_batch_size": 1,
    "dtype": "bf16",
    "activation_recomputation": "full",
}
CLUSTER = {"accelerator": "A100-80GB", "p2p_bandwidth_bytes_per_s": 25e9, "p2p_latency_ms": 0.02}


def dp_body(
    num_ranks: int = 4,
    num_microbatches: int = 8,
    stages_per_rank: int = 1,
    *,
    size: int = 8,
    sharding: str = "full",
    unshard: float | list[float] = 3.0,
    reduce_grad: float | list[float] = 6.0,
    optimizer_step: float | list[float] = 1.0,
    method: str = "auto",
    **extra: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "pipeline": {"num_ranks": num_ranks, "num_microbatches": num_microbatches, "stages_per_rank": stages_per_rank},
        "costs": {
            "forward": 1.0,
            "backward_input": 1.0,
            "backward_weight": 1.0,
            "p2p": 0.1,
            "unshard": unshard,
            "reduce_grad": reduce_grad,
            "optimizer_step": optimizer_step,
        },
        "memory": {
            "activation": 100.0,
            "retained_for_weight": 40.0,
            "weights": 800.0,
            "gradients": 1600.0,
            "static": 4000.0,
        },
        "data_parallel": {"size": size, "sharding": sharding},
        "objective": "step_time",
        "solver": {"method": method, "time_limit_s": 2.0},
    }
    body.update(extra)
    return body


def test_ring_formulas() -> None:
    # 8 ranks, 1 GB, 100 GB/s, no latency: all-reduce 2·7/8·10 ms, reduce-scatter and all-gather 7/8·10 ms.
    assert all_reduce_ms(1e9, 8, 100e9, 0.0) == pytest.approx(17.5)
    assert reduce_scatter_ms(1e9, 8, 100e9, 0.0) == pytest.approx(8.75)
    assert all_gather_ms(1e9, 8, 100e9, 0.01) == pytest.approx(8.75 + 0.07)
    assert all_reduce_ms(1e9, 1, 100e9, 0.01) == 0.0


@pytest.mark.parametrize("setting", paper_settings(), ids=lambda s: f"{s['model']}-m{s['num_microbatches']}")
def test_without_data_parallelism_step_time_is_todays_objective(setting: dict[str, Any]) -> None:
    for post_validation in (False, True):
        problem = paper_problem(setting, objective="step_time", **{"training.post_validation": post_validation})
        for method in ("1f1b", "zb-h1", "zb-h2"):
            schedule = solve_family(problem, method, enforce_memory=False)
            expected = schedule.stage_span if post_validation else schedule.makespan
            assert schedule.step_time == expected
            assert all(a.kind in ("F", "I", "W", "B") for rank in schedule.ranks for a in rank.actions)


def test_missing_collective_costs_name_the_field() -> None:
    body = dp_body()
    del body["costs"]["unshard"], body["costs"]["reduce_grad"]
    with pytest.raises(ValidationError) as error:
        load_problem(body)
    text = str(error.value)
    assert "costs.reduce_grad" in text and "costs.unshard" in text and "omit the collectives" in text


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"costs": {"unshard": -1.0}}, "costs.unshard"),
        ({"costs": {"reduce_grad": [1.0, 2.0]}}, "costs.reduce_grad"),
        ({"data_parallel": {"sharding": "fsdp"}}, "data_parallel.sharding"),
        ({"data_parallel": {"sharding": "none", "reshard_after_forward": True}}, "data_parallel.reshard_after_forward"),
    ],
)
def test_bad_data_parallel_input_is_rejected(change: dict[str, Any], field: str) -> None:
    body = dp_body()
    for section, values in change.items():
        body[section].update(values)
    with pytest.raises(ValidationError) as error:
        load_problem(body)
    assert field in str(error.value)


def test_gradient_frees_must_fit_in_static() -> None:
    body = dp_body()
    body["memory"]["static"] = 1000.0
    with pytest.raises(ValidationError, match=r"memory\.static"):
        load_problem(body)


def test_non_finite_collective_cost_is_rejected() -> None:
    body = dp_body()
    body["costs"]["reduce_grad"] = float("inf")
    with pytest.raises(ValidationError, match="reduce_grad"):
        load_problem(body)


def test_communication_actions_round_trip_and_re_time() -> None:
    schedule = solve(load_problem(dp_body(method="1f1b")))
    rows = [[a.action for a in rank.actions] for rank in schedule.ranks]
    assert rows[0][0] == "0UNSHARD" and rows[0][-1] == "OPTIMIZER_STEP"
    assert "0REDUCE_GRAD" in rows[0] and "0RESHARD" in rows[0]
    assert format_orders(parse_orders(rows)) == rows
    step = next(a for a in schedule.ranks[0].actions if a.kind == "OPTIMIZER_STEP")
    assert step.stage is None and step.microbatch is None
    # Re-timed independently from the JSON alone.
    again = Schedule.model_validate_json(schedule.model_dump_json())
    sim = simulate(compile_problem(again.problem), again.orders())
    assert sim.step_time == pytest.approx(schedule.step_time)
    with pytest.raises(ValueError):
        parse_action("0UNSHARD1")


def test_collectives_overlap_compute_but_not_each_other() -> None:
    problem = load_problem(dp_body(method="looped-bfs", stages_per_rank=2, reduce_grad=5.0))
    schedule = solve(problem)
    for rank in schedule.ranks:
        comm = sorted((a.start, a.end) for a in rank.actions if a.kind in ("UNSHARD", "REDUCE_GRAD"))
        for (_, end), (start, _) in pairwise(comm):
            assert start >= end - 1e-9
        compute = sorted((a.start, a.end) for a in rank.actions if a.kind in ("F", "I", "W", "B"))
        for (_, end), (start, _) in pairwise(compute):
            assert start >= end - 1e-9
        by_name = {a.action: a for a in rank.actions}
        for a in rank.actions:
            if a.kind == "REDUCE_GRAD":
                last_w = max(x.end for x in rank.actions if x.kind == "W" and x.stage == a.stage)
                assert a.start >= last_w - 1e-9
                # The first stage's reduction on the rank runs while the other stage still computes.
        first_reduce = min(a.start for a in rank.actions if a.kind == "REDUCE_GRAD")
        last_compute = max(a.end for a in rank.actions if a.kind in ("F", "I", "W", "B"))
        assert first_reduce < last_compute
        assert by_name["OPTIMIZER_STEP"].start >= max(
            a.end for r in schedule.ranks for a in r.actions if a.kind != "OPTIMIZER_STEP"
        )


def test_post_validation_drops_the_synchronisation() -> None:
    # The last rank's optimizer step is slow; it ends its backwards first, and need not wait for rank 0.
    steps = [0.0, 0.0, 0.0, 10.0]
    synced = solve(load_problem(dp_body(method="1f1b", optimizer_step=steps)))
    post = solve(load_problem(dp_body(method="1f1b", optimizer_step=steps, training={"post_validation": True})))
    assert post.step_time < synced.step_time


def test_reshard_after_forward_regathers_per_microbatch_depth_first_and_per_run_breadth_first() -> None:
    """FSDP2's reshard_after_forward: a depth-first schedule (1F1B, GPipe) gathers a stage for every F and every
    backward (2m gathers: issue 27's fair baseline); breadth-first keeps a stage gathered over its run of
    microbatches (twice per step; once for a rank's last stage, whose backwards follow its forwards). Both
    re-simulate and check as written to their step time."""
    m, p = 8, 4
    step_times = {}
    for method, stages_per_rank in (("1f1b", 1), ("gpipe", 1), ("looped-bfs", 2)):
        body = dp_body(p, m, stages_per_rank, method=method)
        body["data_parallel"]["reshard_after_forward"] = True
        problem = load_problem(body)
        schedule = solve(problem)
        rows = [[a.action for a in rank.actions] for rank in schedule.ranks]
        for rank, row in enumerate(rows):
            for stage in range(rank, p * stages_per_rank, p):
                gathers = row.count(f"{stage}UNSHARD")
                assert gathers == row.count(f"{stage}RESHARD"), method
                assert gathers == 2 * m if method != "looped-bfs" else gathers == (1 if stage >= p else 2), method
        assert simulate(compile_for_orders(problem, schedule.orders()), schedule.orders()).step_time == pytest.approx(
            schedule.step_time
        )
        checked = check_schedule(problem, read_schedule(rows)[0])
        assert checked.valid and checked.objective_value == pytest.approx(schedule.step_time), checked.violation
        step_times[method] = schedule.step_time
    once = load_problem(dp_body(p, m, method="1f1b"))
    # Re-gathering costs time: each of the 2m gathers of 3 ms waits for the stage's previous pass here.
    assert step_times["1f1b"] > solve(once).step_time


@pytest.mark.parametrize(("stages_per_rank", "most_gathers"), [(4, 2), (2, 2 * 4)])
def test_breadth_first_keeps_runs_only_for_one_layer_stages(stages_per_rank: int, most_gathers: int) -> None:
    """With a model, FSDP under reshard_after_forward holds two units (memory.weights): a one-layer stage whole,
    so breadth-first gathers it once per run; a two-layer stage kept over a run would hold more than counted,
    so it is gathered per pass (2m for m = 4)."""
    problem = load_problem(
        {
            "pipeline": {"num_ranks": 4, "num_microbatches": 4, "stages_per_rank": stages_per_rank},
            "model": {
                "num_layers": 16,
                "hidden_size": 512,
                "num_attention_heads": 8,
                "seq_length": 256,
                "vocab_size": 1000,
            },
            "cluster": {"accelerator": "A100-80GB", "gpus_per_node": 8},
            "data_parallel": {"size": 2, "sharding": "full", "reshard_after_forward": True},
            "split_backward": False,
            "objective": "step_time",
            "solver": {"method": "looped-bfs"},
        }
    )
    schedule = solve(problem)
    counts = [sum(a.action == f"{s}UNSHARD" for a in r.actions) for r in schedule.ranks for s in range(16)]
    assert max(counts) == most_gathers


def test_a_pass_outside_its_stages_gathers_is_a_violation() -> None:
    body = dp_body(num_microbatches=4, method="1f1b")
    body["data_parallel"]["reshard_after_forward"] = True
    problem = load_problem(body)
    rows = [[a.action for a in rank.actions] for rank in solve(problem).ranks]
    rows[0].remove("0UNSHARD")  # the first F now runs outside every 0UNSHARD … 0RESHARD
    result = check_schedule(problem, read_schedule(rows)[0])
    assert not result.valid and result.violation is not None and result.violation.reason == "unframed_pass"
    assert "rank 0 runs 0F0 outside every 0UNSHARD" in result.violation.message


def test_gathered_weights_over_the_limit_are_infeasible_with_the_least_limit() -> None:
    body = dp_body()
    body["memory"]["limit"] = 4500.0  # static 4000 + one stage's gathered 700 bytes exceeds it
    schedule = solve(load_problem(body))
    assert schedule.status == "infeasible" and "gathered weights" in (schedule.reason or "")
    assert schedule.min_memory_limit is not None
    body["memory"]["limit"] = max(schedule.min_memory_limit)
    assert solve(load_problem(body)).status in ("optimal", "feasible")


def _random_problem(rng: random.Random) -> Problem:
    p = rng.choice([2, 3, 4])
    v = rng.choice([1, 2])
    m = rng.choice([p, 2 * p, 3 * p])
    num_stages = p * v
    body = dp_body(
        p,
        m,
        v,
        size=rng.choice([2, 8, 64]),
        sharding=rng.choice(["none", "optimizer", "gradients", "full"]),
        unshard=[round(rng.uniform(0, 6), 3) for _ in range(num_stages)],
        reduce_grad=[round(rng.uniform(0, 12), 3) for _ in range(num_stages)],
        optimizer_step=round(rng.uniform(0, 2), 3),
        training={"post_validation": rng.random() < 0.3},
        split_backward=rng.random() < 0.6,
    )
    body["costs"]["forward"] = [round(rng.uniform(0.5, 2), 3) for _ in range(num_stages)]
    body["solver"]["time_limit_s"] = 1.0
    if rng.random() < 0.5:
        body["memory"]["limit"] = 5800.0 + rng.uniform(0, 2000)
    return load_problem(body)


def test_auto_is_never_worse_than_any_family_under_step_time() -> None:
    rng = random.Random(14)
    for _ in range(8):
        problem = _random_problem(rng)
        auto = solve(problem)
        if auto.status == "infeasible":
            continue
        assert auto.lower_bound is not None and auto.lower_bound <= auto.step_time + 1e-6
        for family in applicable_families(problem):
            try:
                other = solve_family(problem, family.name)
            except FamilyDomainError:
                continue
            if other.status != "infeasible":
                assert auto.step_time <= other.step_time + 1e-6, (family.name, problem.model_dump())
                assert auto.lower_bound <= other.step_time + 1e-6


def test_first_answer_within_a_second_at_p32_d64() -> None:
    body = dp_body(32, 64, 1, size=64, sharding="full", method="auto")
    body["solver"]["time_limit_s"] = 3.0
    seen: list[float] = []
    schedule = solve(
        load_problem(body), progress=lambda p: seen.append(p.elapsed_s) if p.best_objective is not None else None
    )
    assert schedule.status in ("optimal", "feasible")
    assert seen and seen[0] < 1.0
    assert schedule.solve_time_s < 3.0 + 2.0


def test_derived_collectives_and_breadth_first_ahead_of_depth_first() -> None:
    document = {
        "pipeline": {"num_ranks": 8, "num_microbatches": 16, "stages_per_rank": 8},
        "model": MODEL_52B,
        # 16 GPUs span two 8-GPU nodes: the ring runs on the inter-node link with the collective latency per step.
        "cluster": {**CLUSTER, "inter_node_bandwidth_bytes_per_s": 25e9, "collective_latency_ms": 0.02},
        "data_parallel": {"size": 16, "sharding": "full"},
        "objective": "step_time",
    }
    problem = load_problem(document)
    assert problem.costs is not None and problem.memory is not None
    unshard = problem.stage_values(problem.costs.unshard)
    # One 64-layer model, 8 × 8 stages of one layer: 12·h² params per layer in bf16, 15/16 moved, over the slower
    # of NVLink and the two nodes' 8 NICs each at 25 GB/s (cost.collectives.group_link), at the achieved fractions
    profile = resolve_hardware(ClusterConfig(**document["cluster"])).profile
    nvlink = ClusterConfig(**CLUSTER).intra_node_bandwidth_bytes_per_s * profile.collective_efficiency_intra
    network = 8 * 25e9 * profile.collective_efficiency_inter * (15 / 16) / (1 / 2)
    layer_bytes = 2 * 12 * 8192**2
    expected = 15 / 16 * layer_bytes / min(nvlink, network) * 1e3 + 15 * 0.02
    assert unshard[1] == pytest.approx(expected, rel=0.01)
    assert problem.memory.weights is not None
    steps = {name: solve_family(problem, name).step_time for name in ("looped-bfs", "interleaved-1f1b", "lga")}
    assert steps["looped-bfs"] < steps["interleaved-1f1b"]
    assert steps["lga"] == steps["looped-bfs"]


def _assert_reductions_after_the_last_pass(schedule: dict[str, Any]) -> None:
    for rank in schedule["ranks"]:
        kinds = [a["kind"] for a in rank["actions"]]
        last_pass = max(k for k, kind in enumerate(kinds) if kind in ("F", "I", "W", "B"))
        reductions = [k for k, kind in enumerate(kinds) if kind == "REDUCE_GRAD"]
        assert reductions and min(reductions) > last_pass


def test_http_and_cli_solve_data_parallel_problems(tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'db.sqlite3'}", solver_workers=1, max_time_limit_s=3.0)
    with TestClient(create_app(settings)) as client:
        for method in ("auto", "1f1b", "interleaved-1f1b", "looped-bfs", "lga", "zb-h1", "gpipe"):
            spr = 2 if method in ("interleaved-1f1b", "looped-bfs", "lga") else 1
            answer = client.post("/v1/schedules", json=dp_body(stages_per_rank=spr, method=method))
            assert answer.status_code == 200, answer.text
            body = answer.json()
            assert body["step_time"] >= body["makespan"] and body["objective"] == "step_time"
            assert any(a["action"] == "0REDUCE_GRAD" for a in body["ranks"][0]["actions"])
        bad = dp_body()
        del bad["costs"]["reduce_grad"]
        answer = client.post("/v1/schedules", json=bad)
        assert answer.status_code == 422 and "reduce_grad" in answer.text
        # Megatron-LM before overlap_grad_reduce (the breadth-first paper's baseline): reductions after the flush.
        flushed = dp_body(stages_per_rank=2, method="interleaved-1f1b")
        flushed["data_parallel"]["overlap_grad_reduce"] = False
        answer = client.post("/v1/schedules", json=flushed)
        assert answer.status_code == 200, answer.text
        _assert_reductions_after_the_last_pass(answer.json())
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "COLUMNS": "120"}

    def cli_solve(body: dict[str, Any], *output: str) -> subprocess.CompletedProcess[str]:
        path = tmp_path / "problem.json"
        path.write_text(json.dumps(body))
        command = [sys.executable, "-m", "pipesched.api.cli", "solve", str(path), *output]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)

    run = cli_solve(dp_body(method="zb-h1"), "-o", str(tmp_path / "s.json"))
    assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "s.json").read_text())["step_time"] > 0
    run = cli_solve(flushed, "-o", str(tmp_path / "f.json"))
    assert run.returncode == 0, run.stderr
    _assert_reductions_after_the_last_pass(json.loads((tmp_path / "f.json").read_text()))
    run = cli_solve(bad)
    assert run.returncode == 2 and "reduce_grad" in run.stdout + run.stderr


def test_bitpipe_reduces_each_chunk_when_both_replicas_finished_it() -> None:
    body = dp_body(4, 8, 2, method="bitpipe", split_backward=False)
    body["pipeline"]["placement"] = "bidirectional"
    body["memory"]["static"] = 6000.0  # four stage ids per rank, each with its gradient buffer
    schedule = solve(load_problem(body))
    assert schedule.status != "infeasible"
    inst = compile_problem(schedule.problem)
    ends = {(a.action, r.rank): a for r in schedule.ranks for a in r.actions}
    num_stages = inst.num_stages
    for (text, _rank), timing in ends.items():
        action = parse_action(text)
        if action.kind != ActionKind.REDUCE_GRAD:
            continue
        mirror = action.stage + num_stages if action.stage < num_stages else action.stage - num_stages
        mirror_rank = inst.stage_ranks[mirror]
        last = max(a.end for a in schedule.ranks[mirror_rank].actions if a.kind == "B" and a.stage == mirror)
        assert timing.start >= last - 1e-9


def test_trace_plots_and_csv_show_the_communication_stream(tmp_path: Path) -> None:
    from pipesched.api.render import render_svg, render_view_html
    from pipesched.optimizer.export import orders_to_torch_csv, schedule_to_chrome_trace

    schedule = solve(load_problem(dp_body(method="looped-bfs", stages_per_rank=2)))
    trace = schedule_to_chrome_trace(schedule)
    comm = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["tid"] == 1]
    assert {e["cat"] for e in comm} == {"UNSHARD", "RESHARD", "REDUCE_GRAD"}
    assert any(e.get("args", {}).get("name") == "communication" for e in trace["traceEvents"])
    assert trace["otherData"]["step_time_ms"] == schedule.step_time
    svg = render_svg(schedule)
    assert 'id="rank-0-comm"' in svg and "comm" in svg
    page = render_view_html(schedule)
    assert 'class="act comm"' in page and "0REDUCE_GRAD" in page and "step_time" in page
    text = orders_to_torch_csv(schedule.orders())
    assert "UNSHARD" not in text and "OPTIMIZER_STEP" not in text and "0F0" in text


def test_the_data_parallel_group_has_one_home() -> None:
    document = {
        "pipeline": {"num_ranks": 8, "num_microbatches": 8, "stages_per_rank": 8},
        "model": MODEL_52B,
        "cluster": {**CLUSTER, "data_parallel_size": 8, "shard_optimizer_state": True},
        "data_parallel": {"size": 16, "sharding": "full"},
    }
    with pytest.raises(ValidationError) as error:
        load_problem(document)
    locs = {entry["loc"] for entry in error.value.errors()}
    assert locs == {("cluster", "data_parallel_size"), ("cluster", "shard_optimizer_state")}
    assert "data_parallel section" in error.value.errors()[0]["msg"]
    del document["cluster"]["data_parallel_size"], document["cluster"]["shard_optimizer_state"]
    assert load_problem(document).data_parallel_group == DataParallel(size=16, sharding="full")


def test_group_link_picks_intra_or_inter_node_bandwidth() -> None:
    from types import SimpleNamespace

    from pipesched.optimizer.cost.collectives import group_link

    cluster = SimpleNamespace(
        gpus_per_node=8,
        intra_node_bandwidth_bytes_per_s=450e9,
        inter_node_bandwidth_bytes_per_s=50e9,
        p2p_bandwidth_bytes_per_s=25e9,
    )
    assert group_link(cluster, 8) == (450e9, "intra-node")  # type: ignore[arg-type]
    # one rank of the group per node: its own NIC
    assert group_link(cluster, 4, tensor_parallel=8) == (50e9, "inter-node")  # type: ignore[arg-type]
    # two per node on two nodes: a node takes in half the buffer once, over its two NICs
    assert group_link(cluster, 4, tensor_parallel=4) == (pytest.approx(2 * 50e9 * (3 / 4) / (1 / 2)), "inter-node")  # type: ignore[arg-type]
    # eight per node on 16 nodes: each node takes in 15/16 of the buffer over its eight NICs
    assert group_link(cluster, 128) == (pytest.approx(8 * 50e9 * (127 / 128) / (15 / 16)), "inter-node")  # type: ignore[arg-type]
    assert group_link(SimpleNamespace(p2p_bandwidth_bytes_per_s=25e9), 64) == (25e9, "p2p link")  # type: ignore[arg-type]


def _check_timings(schedule: Schedule) -> None:
    """The schedule's own times, checked against the rules without the simulator."""
    problem = schedule.problem
    assert problem.costs is not None
    p2p = problem.costs.p2p
    actions = {(a.action, r.rank): a for r in schedule.ranks for a in r.actions}
    by_text: dict[str, Any] = {}
    for (text, rank), a in actions.items():
        by_text[text if a.kind != "OPTIMIZER_STEP" else f"{text}@{rank}"] = a
    for rank in schedule.ranks:
        for lane in (("F", "I", "W", "B", "OPTIMIZER_STEP"), ("UNSHARD", "REDUCE_GRAD")):
            bars = sorted((a.start, a.end) for a in rank.actions if a.kind in lane)
            assert all(nxt[0] >= cur[1] - 1e-6 for cur, nxt in pairwise(bars)), (rank.rank, lane)
    last_end = max(a.end for a in by_text.values() if a.kind != "OPTIMIZER_STEP")
    for text, a in by_text.items():
        if a.kind == "F":
            gather = by_text.get(f"{a.stage}UNSHARD")
            if gather is not None:
                assert a.start >= gather.end - 1e-6
            if a.stage > 0:
                before = by_text[f"{a.stage - 1}F{a.microbatch}"]
                latency = p2p if schedule.stage_to_rank[a.stage - 1] != schedule.stage_to_rank[a.stage] else 0.0
                assert a.start >= before.end + float(latency) - 1e-6
        elif a.kind == "REDUCE_GRAD":
            finals = [b for b in by_text.values() if b.kind in ("W", "B") and b.stage == a.stage]
            assert all(a.start >= b.end - 1e-6 for b in finals)
        elif a.kind == "OPTIMIZER_STEP":
            assert a.start >= last_end - 1e-6, text
    assert schedule.step_time == pytest.approx(max(a.end for a in by_text.values()))


@pytest.mark.parametrize("method", ["gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "looped-bfs", "lga", "auto"])
def test_every_family_and_auto_pass_an_independent_timing_check(method: str) -> None:
    spr = 2 if method in ("interleaved-1f1b", "looped-bfs", "lga") else 1
    body = dp_body(4, 8, spr, method=method)
    body["costs"]["p2p"] = 0.1
    schedule = solve(load_problem(body))
    assert schedule.status in ("optimal", "feasible")
    _check_timings(schedule)


@pytest.mark.parametrize(("kernels", "sharded_bytes"), [("unknown", 18), ("eager", 16)])
def test_fsdp_memory_counts_each_byte_once_with_one_units_unsharded_gradients(kernels: str, sharded_bytes: int) -> None:
    """Llama 3.1 8B, FSDP 8 (torchtitan's per-block fully_shard): gathered weights live in memory.weights only,
    unsharded gradients of one unit (the norm with the head, the largest) in memory.gradients, the rest sharded:
    as eager PyTorch's FSDP keeps it (fp32 parameters, gradients and moments, 16 B), or with the kernels not said
    the largest of the stacks that run it (Megatron-FSDP's 18 B with fp32 reduction)."""
    model = {
        "num_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "ffn_hidden_size": 14336,
        "ffn_type": "swiglu",
        "seq_length": 8192,
        "vocab_size": 128256,
        "micro_batch_size": 2,
        "dtype": "bf16",
        "attention": "flash",
        "activation_recomputation": "selective",
        "position_embedding": "rope",
        "norm": "rmsnorm",
        "tie_embeddings": False,
        "kernels": kernels,
    }
    problems = {}
    for reshard in (False, True):
        document = {
            "pipeline": {"num_ranks": 1, "num_microbatches": 1},
            "model": model,
            # room for the whole stage gathered (reshard_after_forward false): an accounting test, not a plan
            "cluster": {"accelerator": "H100-SXM", "memory_bytes": 141 * 1024**3},
            "data_parallel": {"size": 8, "sharding": "full", "reshard_after_forward": reshard},
        }
        problems[reshard] = load_problem(document)
    problem = problems[False]
    assert problem.memory is not None and problem.memory.weights is not None and problem.memory.gradients is not None
    embedding = 128256 * 4096
    parameters = problem.memory.weights[0] / 2  # the whole stage gathered in bf16 without resharding
    assert 7.9e9 < parameters < 8.1e9
    assert problem.memory.gradients[0] == pytest.approx(4 * (embedding + 4096), rel=1e-6)  # norm + head
    # static: 16 or 18 B/param sharded over 8, plus 7/8 of the one unit's fp32 gradients (REDUCE_GRAD frees them),
    # plus the loss's transient (torchtitan's fp32 logits' gradients, 8 B per logit element, at the allocator reserve)
    reserve = resolve_hardware(ClusterConfig(accelerator="H100-SXM")).profile.activation_memory_factor
    loss = 8 * 8192 * 2 * 128256 * max(reserve, 1.0)
    assert problem.static_memory[0] == pytest.approx(
        parameters * sharded_bytes / 8 + 7 / 8 * 4 * (embedding + 4096) + loss, rel=1e-6
    )
    resharded = problems[True]
    assert resharded.memory is not None and resharded.memory.weights is not None
    assert resharded.memory.weights[0] == pytest.approx(
        2 * 2 * (embedding + 4096), rel=1e-6
    )  # two units gathered at most
    assert resharded.static_memory == problem.static_memory
    schedule = solve_family(problem, "gpipe")
    # the peak holds static + the gathered 7/8 of the weights + activations, each once
    assert schedule.peak_memory[0] >= problem.static_memory[0] + 7 / 8 * problem.memory.weights[0]
    assert schedule.peak_memory[0] < 141 * 1024**3


def test_every_fsdp_unit_is_its_own_ring_and_pays_its_latency() -> None:
    from pipesched.optimizer.configs import ModelConfig
    from pipesched.optimizer.cost.collectives import data_parallel_costs

    def costs(sharding: str, largest_unit: float | None) -> Any:
        return data_parallel_costs(
            model=ModelConfig(**MODEL_52B),
            cluster=ClusterConfig(**CLUSTER, gpus_per_node=8, collective_latency_ms=0.01),
            stage_parameters=[1e9],
            stage_holders=[[0]],
            num_ranks=1,
            data_parallel_size=512,
            sharding=sharding,
            memory_bandwidth_bytes_per_s=2e12,
            stage_largest_unit=None if largest_unit is None else [largest_unit],
        )

    whole, units = costs("full", None), costs("full", 1e8)  # ten blocks of 1e8 parameters
    ring_steps = 511 * 0.01
    assert units.unshard_ms[0] - whole.unshard_ms[0] == pytest.approx(9 * ring_steps, rel=1e-6)
    assert units.reduce_grad_ms[0] - whole.reduce_grad_ms[0] == pytest.approx(9 * ring_steps, rel=1e-6)
    # DDP's all-reduce is not split by FSDP units
    assert costs("none", 1e8).reduce_grad_ms == costs("none", None).reduce_grad_ms


@pytest.mark.parametrize("method", ["1f1b", "zb-h1", "dualpipe-v"])
def test_peak_activations_leave_out_the_gathered_weights_the_peak_holds(method: str) -> None:
    """A rank's peak activations are its passes' bytes alone (what a run's saved-activation meter counts): without
    sharding they are the peak less static; with FSDP (sharding full) the peak also holds each UNSHARD's gathered
    weights, 800·7/8 B per stage here, which ``peak − static`` would count as activations."""
    from pipesched.optimizer.result import peak_activation_bytes

    spr = 2 if method == "dualpipe-v" else 1
    bodies = {sharding: dp_body(4, 8, spr, sharding=sharding, method=method) for sharding in ("none", "full")}
    for body in bodies.values():
        body["pipeline"]["placement"] = "v" if spr == 2 else "loop"
    schedules = {sharding: solve(load_problem(body)) for sharding, body in bodies.items()}
    plain, sharded = schedules["none"], schedules["full"]
    activations = peak_activation_bytes(plain)
    assert activations == [
        peak - static for peak, static in zip(plain.peak_memory, plain.problem.static_memory, strict=True)
    ]
    if method == "1f1b":  # p − r microbatches of 100 B on rank r
        assert activations == [400, 300, 200, 100]
    assert peak_activation_bytes(sharded) == activations  # the same passes in the same order: the same bytes
    gathered = 800 * 7 / 8 * spr
    for peak, static, held in zip(sharded.peak_memory, sharded.problem.static_memory, activations, strict=True):
        assert peak - static == pytest.approx(held + gathered)


def test_a_patterns_peak_activations_leave_out_its_second_weight_version() -> None:
    """PipeDream-2BW's pattern (no flush) holds static memory, its second weight version and its passes'
    activations: its peak activations are p − r microbatches of 100 B on rank r, whatever the weights."""
    from pipesched.optimizer.result import peak_activation_bytes

    body = dp_body(4, 8, size=1, sharding="none", method="pipedream-2bw")
    body["training"], body["objective"] = {"flush": False, "weight_versions": 2}, "step_period"
    schedule = solve_family(load_problem(body), "pipedream-2bw")
    assert schedule.shape == "pattern"
    assert peak_activation_bytes(schedule) == [400, 300, 200, 100]
    assert schedule.peak_memory == [4000 + 800 + held for held in (400, 300, 200, 100)]  # static, second version
