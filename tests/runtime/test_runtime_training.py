"""Training beyond one step on 2 gloo ranks (real torch processes): K steps with torch.optim on every rank
matched against a single-process reference following the same rule — synchronous, post-validated
(speculative steps, clipping by the global norm, rollback on a NaN), PipeDream-2BW's delayed update — on
PyTorch's runtime and on the own executor. All cases share one launch (process start costs seconds).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipesched.optimizer.families import get_family
from pipesched.optimizer.result import Schedule, build_schedule
from tests.conftest import uniform_problem

torch = pytest.importorskip("torch")

NUM_RANKS = 2
NUM_MICROBATCHES = 4
#: AdamW normalises every element's gradient, so an element whose exact gradient is zero (gpt-tiny's
#: attention key bias: softmax ignores it) moves by ±lr on rounding noise; the user model has none.
ADAMW_MODEL = "tests.runtime.user_pipeline_model:tiny_stages"


def family_schedule(name: str, **problem_options) -> Schedule:
    problem = uniform_problem(NUM_RANKS, NUM_MICROBATCHES, **problem_options)
    if name == "pipedream-2bw":  # no flush: the family's repeating pattern, as `pipesched solve` answers it
        from pipesched.optimizer.solve import solve

        return solve(
            problem.with_changes(**{"training.flush": False, "training.weight_versions": 2, "solver.method": name})
        )
    return build_schedule(
        problem, get_family(name).generate(problem), method=name, backend="family", check_memory=False
    )


CASES = {
    "adamw-torch": ("1f1b", "torch", {}, ADAMW_MODEL, {"steps": 3, "optimizer": "adamw", "lr": 1e-2}),
    "adamw-pipesched": ("zb-h1", "pipesched", {}, ADAMW_MODEL, {"steps": 3, "optimizer": "adamw", "lr": 1e-2}),
    "sgd-bitpipe": (
        "bitpipe",
        "pipesched",
        {"stages_per_rank": 2, "placement": "bidirectional", "reduce_grad": 0.0},
        "gpt-tiny",
        {"steps": 2, "lr": 0.1},
    ),
    "post-validation": (
        "zb-h1",
        "pipesched",
        {},
        "gpt-tiny",
        {"steps": 3, "lr": 0.1, "post_validation": True, "max_grad_norm": 0.8},
    ),
    "nan-rollback": (
        "1f1b",
        "torch",
        {},
        "gpt-tiny",
        {"steps": 3, "lr": 0.1, "post_validation": True, "inject_nan": (1, 2)},
    ),
    "2bw": ("1f1b", "pipesched", {}, "gpt-tiny", {"steps": 4, "lr": 0.5, "weight_update": "2bw"}),
    # A no-flush pattern with the 2BW rule runs in steady state (two weight versions): the own executor.
    "2bw-family": ("pipedream-2bw", "auto", {}, "gpt-tiny", {"steps": 4, "lr": 0.5, "weight_update": "2bw"}),
    "2bw-family-adamw-clipped": (
        "pipedream-2bw",
        "pipesched",
        {},
        ADAMW_MODEL,
        {"steps": 4, "optimizer": "adamw", "lr": 1e-2, "weight_update": "2bw", "max_grad_norm": 0.5},
    ),
}


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[Schedule, dict]]:
    from pipesched.runtime.launch import run_schedules
    from pipesched.runtime.options import TrainingOptions

    schedules = [family_schedule(name, **options) for name, _, options, _, _ in CASES.values()]
    reports = run_schedules(
        schedules,
        engine=[engine for _, engine, _, _, _ in CASES.values()],
        model=[model for _, _, _, model, _ in CASES.values()],
        training=[TrainingOptions(**training) for *_, training in CASES.values()],
        timeout_s=120,
    )
    return dict(zip(CASES, zip(schedules, reports, strict=True), strict=True))


@pytest.mark.parametrize("case", list(CASES))
def test_k_steps_match_the_reference(runs, case):
    from pipesched.runtime.launch import executable_step

    schedule, report = runs[case]
    training = CASES[case][4]
    assert report.steps == training["steps"]
    assert report.verified is True, report.model_dump(include={"max_rel_param_error", "max_rel_grad_error", "losses"})
    assert report.max_rel_param_error <= 1e-5
    assert report.max_rel_grad_error <= 1e-5
    assert report.executed_order_matches
    assert report.missing_gradients == []
    assert report.loss == pytest.approx(report.reference_loss, rel=1e-5)
    # Training moved the loss: each step's loss is that of new parameters.
    assert len(set(report.losses)) == training["steps"]
    # a flushed step: its step time (the makespan here); a no-flush pattern: its steady-state period
    expected = schedule.step_period if schedule.shape == "pattern" else executable_step(schedule).step_time
    assert report.predicted_step_time_ms == expected
    assert report.measured_step_time_ms > 0
    assert len(report.measured_step_times_ms) == training["steps"]
    for rank in report.ranks:
        assert rank.peak_memory_bytes > 0 and rank.static_bytes_measured > 0
        # D = 1: nothing to reduce but a bidirectional placement's mirrored stages (BitPipe's eager sum)
        assert (rank.measured_communication_ms > 0) == (case == "sgd-bitpipe")
        assert rank.predicted_communication_ms is None  # no communication actions in the schedule
        # the own executor times each pass's wait for its core (Linux schedstat); PyTorch's runtime does not
        if report.engine == "pipesched":
            assert len(rank.run_delay_ms) == training["steps"] and all(d >= 0 for d in rank.run_delay_ms)
            assert all(a.run_delay_ms is not None and a.run_delay_ms >= 0 for a in rank.actions)
        else:
            assert rank.run_delay_ms == []
        # a flushed step's passes ran for less than the step (the rest: the schedule's idle time and the update)
        assert len(rank.compute_ms) == training["steps"] and all(busy > 0 for busy in rank.compute_ms)
        if schedule.shape != "pattern":
            assert all(busy < step for busy, step in zip(rank.compute_ms, rank.step_times_ms, strict=True))
        # every step's update did its own work (the norm's partial sum at least) apart from its wait for the check
        assert len(rank.update_ms) == len(rank.update_wait_ms) == training["steps"]
        assert all(own > 0 for own in rank.update_ms) and all(wait >= 0 for wait in rank.update_wait_ms)
        # where the update went: its norm's partial sum and its optimizer step, timed apart, within its own time
        assert len(rank.update_parts_ms) == training["steps"]
        for own, parts in zip(rank.update_ms, rank.update_parts_ms, strict=True):
            assert parts["norm"] > 0 and parts.get("step", 0.0) >= 0
            assert sum(v for k, v in parts.items() if k != "run_delay") <= own + 0.5


def test_adamw_steps_change_the_parameters(runs):
    """The AdamW reference is not a no-op: the K-step parameters are far from the initial ones."""
    from pipesched.runtime.models import load_model
    from pipesched.runtime.options import TrainingOptions
    from pipesched.runtime.verify import reference_training

    schedule, report = runs["adamw-torch"]
    # A fresh model per reference: the user model's build_stage hands out the same modules each call.
    one = reference_training(
        load_model(ADAMW_MODEL, schedule.problem),
        NUM_MICROBATCHES,
        TrainingOptions(steps=1, optimizer="adamw", lr=1e-2),
    )
    three = reference_training(
        load_model(ADAMW_MODEL, schedule.problem),
        NUM_MICROBATCHES,
        TrainingOptions(steps=3, optimizer="adamw", lr=1e-2),
    )
    moved = max(float((three.parameters[k] - one.parameters[k]).abs().max()) for k in one.parameters)
    assert moved > 1e-3
    assert report.reference_loss == pytest.approx(three.losses[-1], rel=1e-12)


def test_post_validation_equals_synchronous_with_clipping(runs):
    """Post-validated steps (speculative, then rolled back and redone where the global norm clips) end at the
    synchronous-with-clipping parameters (the verified reference); clipping was active, and without it the
    parameters would differ."""
    from pipesched.runtime.models import load_model
    from pipesched.runtime.options import TrainingOptions
    from pipesched.runtime.verify import reference_training

    schedule, report = runs["post-validation"]
    assert report.training["clip_norm"] == 0.8
    redone = [info.step for info in report.ranks[0].steps if info.redone_with_clipping]
    kept = [info.step for info in report.ranks[0].steps if not info.rolled_back]
    # gpt-tiny's global norms are ≈ 0.79, 0.83, 0.80: step 0 keeps its speculative step, the others clip.
    assert redone == [1, 2] and kept == [0], report.ranks[0].steps
    for rank in report.ranks:
        assert all(info.speculative for info in rank.steps)
        assert [info.step for info in rank.steps if info.redone_with_clipping] == redone
    model = load_model("gpt-tiny", schedule.problem)
    unclipped = reference_training(model, NUM_MICROBATCHES, TrainingOptions(steps=3, lr=0.1))
    clipped = reference_training(model, NUM_MICROBATCHES, TrainingOptions(steps=3, lr=0.1, max_grad_norm=0.8))
    assert max(float((unclipped.parameters[k] - clipped.parameters[k]).abs().max()) for k in clipped.parameters) > 1e-4
    assert report.reference_loss == pytest.approx(clipped.losses[-1], rel=1e-12)


def test_a_nan_in_one_microbatch_rolls_the_step_back_on_every_rank(runs):
    """Microbatch 2 of step 1 gets a NaN gradient: every rank's speculative step went non-finite, was rolled
    back bit for bit (nothing half-applied), and the parameters after 3 steps equal the reference that
    skipped step 1."""
    _, report = runs["nan-rollback"]
    assert report.rolled_back_steps == [1]
    assert report.reference_skipped_steps == [1]
    for rank in report.ranks:
        step = rank.steps[1]
        assert step.norm is None
        assert step.speculative_step_finite is False  # the speculative step did write NaNs …
        assert step.rolled_back is True
        assert step.max_change_after_rollback == 0.0  # … and the rollback restored every parameter exactly
        assert not step.redone_with_clipping
        assert all(info.norm is not None for info in (rank.steps[0], rank.steps[2]))
    assert report.max_rel_param_error <= 1e-5
    assert all(loss is not None for loss in report.losses)  # the NaN is in the gradient, not the loss


@pytest.mark.parametrize("case", ["2bw-family", "2bw-family-adamw-clipped"])
def test_the_pipedream_2bw_family_runs_in_steady_state_with_the_delayed_update(runs, case):
    """The family's answer is a repeating pattern (ids up to 2m − 1); the runtime runs its K steps as one order
    (unrolled: step t + 1's forwards among step t's backwards, no barrier between steps) with two weight versions per
    stage, and matches the delayed reference — with AdamW and clipping by the global norm too."""
    from pipesched.optimizer.pattern import unroll

    schedule, report = runs[case]
    assert schedule.shape == "pattern"
    assert max(a.microbatch for r in schedule.ranks for a in r.actions if a.microbatch is not None) >= NUM_MICROBATCHES
    assert report.engine == "pipesched"
    assert report.weight_versions == 2
    assert report.max_rel_param_error <= 1e-5
    assert report.max_rel_param_error_vs_synchronous > 1e-3
    unrolled = unroll(schedule.orders(), NUM_MICROBATCHES, 4)
    assert report.executed_order_matches  # every rank ran its whole unrolled order, in order
    for rank in report.ranks:
        last_step = [str(a) for a in unrolled[rank.pp_rank] if a.microbatch // NUM_MICROBATCHES == 3]
        assert [a.action for a in rank.actions] == last_step
        assert [check.step for check in rank.steps] == [0, 1, 2, 3]
        assert all(check.norm is not None for check in rank.steps)
        # 2BW's update, every step: the norm, the check's issue, the copy into the other version, the step, the release
        for parts in rank.update_parts_ms:
            assert {"norm", "issue", "copy", "step", "release"} <= parts.keys() and parts["copy"] > 0
    # the steps overlap: rank 0 runs step 1's first forward before step 0's last backward
    first = [str(a) for a in unrolled[0]]
    assert first.index(f"0F{NUM_MICROBATCHES}") < first.index(f"0W{NUM_MICROBATCHES - 1}")


def test_2bw_matches_the_delayed_update_and_differs_from_synchronous(runs):
    """PipeDream-2BW after K = 4 SGD steps: W(t+1) = W(t) − ν·∇f(W(t−1)) within 1e-5, and visibly away from
    the synchronous W(t+1) = W(t) − ν·∇f(W(t))."""
    _, report = runs["2bw"]
    assert report.weight_versions == 2
    assert report.max_rel_param_error <= 1e-5
    assert report.max_rel_param_error_vs_synchronous > 1e-3
    # Two weight versions on every rank: its static memory holds the parameters twice, plus gradients (SGD: no state).
    from pipesched.runtime.models import load_model

    schedule = runs["2bw"][0]
    model = load_model("gpt-tiny", schedule.problem)
    for rank in report.ranks:
        weights = sum(p.numel() * p.element_size() for p in model.build_stage(rank.pp_rank).parameters())
        assert rank.static_bytes_measured == 3 * weights


def test_cli_rejects_bad_training_options_with_exit_code_2(tmp_path: Path):
    from typer.testing import CliRunner

    from pipesched.api.cli import app

    path = tmp_path / "schedule.json"
    path.write_text(family_schedule("1f1b").model_dump_json())
    for options, says in [
        (["--steps", "0"], "--steps"),
        (["--optimizer", "lamb"], "--optimizer"),
        (["--lr", "nan"], "--lr"),
        (["--lr", "inf"], "--lr"),
        (["--data-parallel", "0"], "--data-parallel"),
        (["--sharding", "zero-7"], "--sharding"),
        (["--weight-update", "3bw"], "--weight-update"),
        (["--inject-nan", "5:0", "--steps", "2"], "--inject-nan"),
        (["--inject-nan", "x"], "--inject-nan"),
    ]:
        result = CliRunner().invoke(app, ["run", str(path), *options])
        assert result.exit_code == 2, (options, result.output)
        assert says in result.output, (options, result.output)


def test_training_options_follow_the_problem():
    from pipesched.runtime.options import training_options

    problem = uniform_problem(NUM_RANKS, NUM_MICROBATCHES).with_changes(
        **{"data_parallel": {"size": 2, "sharding": "none"}, "costs.reduce_grad": 0.5}
    )
    options = training_options(problem)
    assert (options.data_parallel, options.sharding, options.weight_update) == (2, "none", "sync")
    assert training_options(problem, sharding="full", weight_update="2bw").sharding == "full"
    # a problem without flush (its data parallelism is not modelled by the optimizer yet) runs PipeDream-2BW
    no_flush = uniform_problem(NUM_RANKS, NUM_MICROBATCHES).with_changes(
        **{"training": {"flush": False, "weight_versions": 2}, "objective": "step_period"}
    )
    assert training_options(no_flush).weight_update == "2bw"
    plain = training_options(uniform_problem(NUM_RANKS, NUM_MICROBATCHES))
    assert (plain.data_parallel, plain.sharding, plain.weight_update, plain.steps) == (1, "full", "sync", 1)
    validated = uniform_problem(NUM_RANKS, NUM_MICROBATCHES).with_changes(**{"training": {"post_validation": True}})
    assert training_options(validated).clip_norm == 1.0
    # a profile's optimizer (the one its static memory holds the state of) is the run's unless --optimizer says
    profiled = uniform_problem(NUM_RANKS, NUM_MICROBATCHES).with_changes(**{"memory.static_optimizer": "adamw"})
    assert training_options(profiled).optimizer == "adamw"
    assert training_options(profiled, optimizer="sgd").optimizer == "sgd"
    from pipesched.runtime.options import static_optimizer_note

    assert static_optimizer_note(profiled, training_options(profiled)) is None
    assert "this run steps sgd" in (static_optimizer_note(profiled, training_options(profiled, optimizer="sgd")) or "")
    assert "steps no optimizer" in (static_optimizer_note(profiled, None) or "")
    assert static_optimizer_note(uniform_problem(NUM_RANKS, NUM_MICROBATCHES), None) is None  # a problem not profiled
    assert json.dumps(training_options(validated).__dict__)


def test_the_runtime_reads_orders_with_the_optimizers_ir():
    """A rank's program is the schedule's row parsed by the optimizer's IR: PyTorch's communication action names
    beside F/I/W/B, read strictly (no regex of the runtime's own)."""
    from pipesched.optimizer.ir import Action, ActionKind, parse_action
    from pipesched.optimizer.solve import solve_family
    from pipesched.runtime.executor import RankProgram

    problem = uniform_problem(NUM_RANKS, NUM_MICROBATCHES).with_changes(
        **{"data_parallel": {"size": 2, "sharding": "full"}, "costs.unshard": 0.5, "costs.reduce_grad": 0.5}
    )
    schedule = solve_family(problem, "zb-h1")
    program = RankProgram.compile(schedule, 1)
    assert program.order[0] == Action(1, ActionKind.UNSHARD, 0)
    assert program.order[-1].kind == ActionKind.OPTIMIZER_STEP
    assert [str(a) for a in program.order] == [a.action for a in schedule.ranks[1].actions]
    assert program.stages == [1] and program.previous[1, 0] == 0 and program.following[1, 0] is None
    assert parse_action("3REDUCE_GRAD") == Action(3, ActionKind.REDUCE_GRAD, 0)
    for bad in ("0F1x", "0UNSHARD1", "01REDUCE_GRAD", "0SEND_F1", "REDUCE"):
        with pytest.raises(ValueError):
            parse_action(bad)


def test_the_global_norm_is_summed_where_the_gradients_are():
    """The reference of an NCCL run clips on the GPU: its norm must sum on the gradients' device (the CPU
    accumulator it had failed on an H200: "Expected all tensors to be on the same device"). The meta device stands
    in for the GPU here."""
    import torch

    from pipesched.runtime.verify import squared_norm

    on_meta = squared_norm(torch.full((4,), 2.0, device="meta") for _ in range(2))
    assert on_meta.device.type == "meta" and on_meta.dtype == torch.float64
    assert float(squared_norm([torch.full((4,), 2.0), torch.ones(2)])) == 18.0
    assert float(squared_norm([])) == 0.0
    assert squared_norm([torch.ones(2)], "meta").device.type == "meta"
