"""The torch runtime on 4 CPU ranks with gloo: every family's schedule runs, matches the reference
gradients, follows its order; broken schedules and dying ranks fail fast with their reason.

Schedules share launches (process start costs seconds): one launch runs the whole list.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.families import get_family
from pipesched.optimizer.ir import Action, ActionKind
from pipesched.optimizer.result import Schedule, build_schedule
from pipesched.optimizer.solve import solve, solve_family
from tests.conftest import uniform_problem

torch = pytest.importorskip("torch")

NUM_RANKS = 4
NUM_MICROBATCHES = 8


USER_MODEL = "tests.runtime.user_pipeline_model:tiny_stages"


def family_schedule(name: str, **problem_options) -> Schedule:
    """The family's schedule on a 4-rank problem; a family that is not registered fails the test."""
    try:
        family = get_family(name)
    except KeyError:
        pytest.fail(f"family {name!r} is required by the runtime tests but is not registered")
    problem = uniform_problem(NUM_RANKS, NUM_MICROBATCHES, **problem_options)
    return build_schedule(problem, family.generate(problem), method=name, backend="family", check_memory=False)


CASES: list[tuple[str, str, dict]] = [
    ("1f1b", "pipesched", {}),
    ("1f1b", "pipesched", {"split_backward": False}),
    ("interleaved-1f1b", "pipesched", {"stages_per_rank": 2}),
    ("zb-h1", "pipesched", {}),
    ("zb-h2", "pipesched", {}),
    ("zb-v", "pipesched", {"stages_per_rank": 2, "placement": "v"}),
    ("bitpipe", "pipesched", {"stages_per_rank": 2, "placement": "bidirectional", "reduce_grad": 0.0}),
    # PyTorch's own runtime fed the compute-only CSV of `pipesched solve --format csv`.
    ("1f1b", "torch", {}),
    ("zb-h1", "torch", {}),
    ("interleaved-1f1b", "torch", {"stages_per_rank": 2}),  # loop placement, 2 stages per rank
    ("zb-v", "torch", {"stages_per_rank": 2, "placement": "v"}),
    # A user model (`--model module:function` returning one nn.Module per stage) on both engines.
    ("1f1b", "pipesched", {"model": USER_MODEL}),
    ("zb-h1", "torch", {"model": USER_MODEL}),
]

Key = tuple[str, str, bool, str]


def case_key(name: str, engine: str, options: dict) -> Key:
    return name, engine, options.get("split_backward", True), options.get("model", "gpt-tiny")


AUTO_KEY: Key = ("auto", "pipesched", True, "gpt-tiny")
END_STAGES_KEY: Key = ("zb-h1", "auto", True, "problem")


#: A 4-layer model split [0, 2, 2, 0]: the first and last stage hold no transformer layer (embedding / LM head alone).
END_STAGES = {
    "pipeline": {"num_ranks": NUM_RANKS, "num_microbatches": NUM_MICROBATCHES},
    "model": {
        "num_layers": 4,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "seq_length": 16,
        "vocab_size": 64,
        "micro_batch_size": 2,
        "layers_per_stage": [0, 2, 2, 0],
    },
    "cluster": {
        "flops_per_s": 1e10,
        "memory_bytes": 1e9,
        "memory_bandwidth_bytes_per_s": 1e10,
        "memory_headroom_bytes": 0,
    },
}


@pytest.fixture(scope="module")
def family_runs() -> dict[Key, tuple[Schedule, dict]]:
    """Run every case in one launch; returns {(family, engine, split, model): (schedule, report)}."""
    from pipesched.runtime.launch import run_schedules

    schedules, engines, models, keys = [], [], [], []
    for name, engine, options in CASES:
        problem_options = {k: v for k, v in options.items() if k != "model"}
        schedules.append(family_schedule(name, **problem_options))
        engines.append(engine)
        models.append(options.get("model", "gpt-tiny"))
        keys.append(case_key(name, engine, options))
    # auto under a memory limit below 1F1B's peak of 4 activations on rank 0.
    limited = uniform_problem(NUM_RANKS, NUM_MICROBATCHES, limit=350.0).with_changes(
        **{"solver.method": "auto", "solver.time_limit_s": 2.0}
    )
    auto = solve(limited)
    assert auto.status != "infeasible", f"auto found no schedule under the 350 limit: {auto.reason}"
    schedules.append(auto)
    engines.append("pipesched")
    models.append("gpt-tiny")
    keys.append(AUTO_KEY)
    # --model problem with the embedding and the head alone on the end stages (its own test below)
    schedules.append(solve_family(load_problem(END_STAGES), "zb-h1"))
    engines.append("auto")
    models.append("problem")
    keys.append(END_STAGES_KEY)
    with warnings.catch_warnings():
        # The pinned torch (the runtime extra's torch==2.13.0) is supported: no version warning.
        warnings.filterwarnings("error", message=".*untested with the pipesched runtime.*")
        reports = run_schedules(schedules, engine=engines, model=models, timeout_s=120)
    return dict(zip(keys, zip(schedules, reports, strict=True), strict=True))


@pytest.mark.parametrize(
    "key", [case_key(*case) for case in CASES] + [AUTO_KEY], ids=lambda key: "-".join(map(str, key))
)
def test_schedule_runs_and_matches_reference(family_runs, key):
    assert key in family_runs, f"required case {key} did not run"
    name, engine, _, model = key
    schedule, report = family_runs[key]
    assert report.executed_order_matches, report.order_mismatches
    assert report.max_rel_grad_error <= 1e-5
    assert report.missing_gradients == []
    assert abs(report.loss - report.reference_loss) <= 1e-5 * abs(report.reference_loss)
    assert report.verified is True
    assert report.engine == engine
    # The report names the model that ran: the user's module:function, or the GPT preset.
    assert (report.model == model) if ":" in model else report.model.startswith("gpt(")
    # Every action of the schedule was measured, in order, with end ≥ start.
    for rank, expected in zip(report.ranks, schedule.ranks, strict=True):
        assert [a.action for a in rank.actions] == [a.action for a in expected.actions]
        assert all(a.end >= a.start >= 0 for a in rank.actions)
        starts = [a.start for a in rank.actions]
        assert starts == sorted(starts)
        assert rank.peak_memory_bytes > 0
    assert report.measured_makespan_ms > 0
    assert report.predicted_makespan_ms == schedule.makespan
    if name == "auto":
        assert schedule.fits_memory


def test_user_model_gradients_are_the_users_parameters(family_runs):
    """The user-model run compared the gradients of the user's own stage modules (not a GPT's)."""
    from pipesched.runtime.models import load_model
    from pipesched.runtime.verify import reference_training

    schedule, report = family_runs["1f1b", "pipesched", True, USER_MODEL]
    reference = reference_training(load_model(USER_MODEL, schedule.problem), NUM_MICROBATCHES, None)
    reference_loss, gradients = reference.losses[-1], reference.gradients
    # tiny_stages: embedding + Linear, Linear, Linear, Linear + head (weight and bias per Linear).
    assert "0/embedding.weight" in gradients and "3/head.weight" in gradients
    assert len(gradients) == 3 + 2 + 2 + 4
    assert all(float(g.abs().max()) > 0 for g in gradients.values())
    assert report.reference_loss == pytest.approx(reference_loss, rel=1e-12)


def test_peak_memory_follows_the_schedule(family_runs):
    """1F1B holds p − r activations on rank r: measured saved-activation peaks fall from rank 0 to 3,
    while GPipe-like F-first orders would not. Compares measured bytes per rank (CPU, saved-tensor hooks)."""
    _, report = family_runs["1f1b", "pipesched", True, "gpt-tiny"]
    peaks = [rank.peak_memory_bytes for rank in report.ranks]
    # Stage 0 and the last stage differ in size (embedding, head): compare the two middle stages, which
    # hold the same layers: rank 1 keeps 3 microbatches' activations, rank 2 keeps 2.
    assert peaks[1] == pytest.approx(peaks[2] * 3 / 2, rel=0.01)


def test_csv_from_cli_is_what_the_torch_engine_loads(tmp_path: Path):
    """`pipesched solve --format csv` writes exactly the CSV the torch engine feeds `_load_csv`."""
    from typer.testing import CliRunner

    from pipesched.api.cli import app
    from pipesched.optimizer.export import orders_to_torch_csv

    problem = uniform_problem(NUM_RANKS, NUM_MICROBATCHES)
    problem_path = tmp_path / "problem.json"
    problem_path.write_text(problem.model_dump_json())
    out = tmp_path / "schedule.csv"
    result = CliRunner().invoke(
        app, ["solve", str(problem_path), "--method", "1f1b", "--format", "csv", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    schedule = family_schedule("1f1b")
    assert out.read_text() == orders_to_torch_csv(schedule.orders())


def deadlocking_schedule() -> Schedule:
    """1F1B with rank 0 running 0I0/0W0 right after 0F0: rank 0 waits for rank 1's gradient, rank 1
    waits for 0F1: a cycle."""
    schedule = family_schedule("1f1b")
    order = schedule.orders()
    row = order[0]
    backward = [Action(0, ActionKind.BACKWARD_INPUT, 0), Action(0, ActionKind.BACKWARD_WEIGHT, 0)]
    rest = [a for a in row if a not in backward]
    order[0] = [rest[0], *backward, *rest[1:]]
    broken = schedule.model_copy(deep=True)
    for rank, actions in zip(broken.ranks, order, strict=True):
        timings = {a.action: a for a in rank.actions}
        rank.actions = [timings[str(a)] for a in actions]
    return broken


def test_broken_schedules_rejected_before_launch():
    from pipesched.runtime.launch import ScheduleError, run_schedule

    with pytest.raises(ScheduleError) as deadlock:
        run_schedule(deadlocking_schedule())
    assert deadlock.value.reason == "deadlock"
    missing = family_schedule("1f1b")
    missing.ranks[2].actions.pop()
    with pytest.raises(ScheduleError) as error:
        run_schedule(missing)
    assert error.value.reason == "missing_action"


def test_deadlock_at_runtime_ends_with_p2p_timeout():
    """Bypassing the simulator, the runtime itself ends a deadlock within the timeout, naming the wait."""
    import time

    from pipesched.runtime.launch import RunFailed, run_schedules

    started = time.perf_counter()
    with pytest.raises(RunFailed) as error:
        run_schedules([deadlocking_schedule()], validate=False, timeout_s=4, engine="pipesched")
    assert error.value.reason == "p2p_timeout"
    assert "never arrived" in str(error.value)
    assert time.perf_counter() - started < 60


def test_a_timed_out_wait_is_the_cause_before_the_connections_it_closed(tmp_path: Path):
    """The deadlock above on a loaded machine: rank 1's receive timed out first and it left, so rank 0's receive
    ended on a closed connection; the run's reason had been rank 0's ``peer_lost`` (equal rank, file order)."""
    from pipesched.runtime.launch import _failure

    (tmp_path / "rank0.txt").write_text("peer_lost\nDistBackendError: Connection closed by peer [127.0.0.1]:1234")
    (tmp_path / "rank1.txt").write_text("p2p_timeout\nPipelineRuntimeError: rank 1: receiving F0 never arrived")
    (tmp_path / "rank2.txt").write_text("stopped\nSignalException: Process 7 got signal: 15")
    failure = _failure(tmp_path, RuntimeError("agent"))
    assert failure.reason == "p2p_timeout"
    assert str(failure).startswith("rank1: PipelineRuntimeError") and "(2 other rank(s) failed too)" in str(failure)


def test_cli_run_rejects_bad_input_with_exit_code_2(tmp_path: Path):
    from typer.testing import CliRunner

    from pipesched.api.cli import app

    bad = tmp_path / "bad.json"
    bad.write_text('{"status": "optimal"}')
    result = CliRunner().invoke(app, ["run", str(bad)])
    assert result.exit_code == 2
    schedule = family_schedule("1f1b")
    good = tmp_path / "schedule.json"
    good.write_text(schedule.model_dump_json())
    result = CliRunner().invoke(app, ["run", str(good), "--backend", "mpi"])
    assert result.exit_code == 2
    assert "gloo or nccl" in result.output


def test_profile_writes_a_problem_the_solver_takes(tmp_path: Path):
    from pipesched.runtime.profile import profile_model

    problem = profile_model(num_ranks=2, num_microbatches=4, repeats=1, warmup=1)
    assert problem.costs is not None and problem.memory is not None
    forward = problem.stage_values(problem.costs.forward)
    activation = problem.stage_values(problem.memory.activation)
    assert len(forward) == 2 and all(t > 0 for t in forward)
    assert all(a > 0 for a in activation)
    assert all(s > 0 for s in problem.static_memory)
    schedule = solve(problem.with_changes(**{"solver.method": "1f1b"}))
    assert schedule.status == "feasible"


@pytest.mark.parametrize(
    "function,reason,says",
    [
        # os._exit: no Python error, no message from the rank; gloo peers are left waiting on it.
        ("stages_with_rank2_dying", "rank_died", "exit code 17"),
        ("stages_with_rank2_raising", "rank_failed", "RuntimeError: stage 2 fails on purpose"),
    ],
)
@pytest.mark.parametrize("engine", ["torch", "pipesched"])
def test_a_rank_dying_mid_run_fails_the_run_naming_it(function, reason, says, engine):
    """Rank 2's stage ends its process (or raises) on its 3rd forward: the run fails fast naming rank 2 and
    the cause, not the p2p timeouts, lost connections or stops it causes on the other ranks, and never
    waits out the 120 s receive timeout, on either engine."""
    import time

    from pipesched.runtime.launch import RunFailed, run_schedule

    started = time.perf_counter()
    with pytest.raises(RunFailed) as error:
        run_schedule(
            family_schedule("1f1b"), model=f"tests.runtime.user_pipeline_model:{function}", timeout_s=120, engine=engine
        )
    assert time.perf_counter() - started < 60
    assert error.value.reason == reason
    assert str(error.value).startswith("rank2: ")
    assert says in str(error.value)


def test_unsupported_torch_version_warns_before_launch(monkeypatch):
    """`check_torch_version` runs where the runtime starts: another torch than 2.13 warns, then runs."""
    from pipesched.runtime.launch import ScheduleError, run_schedule
    from pipesched.runtime.torch_compat import check_torch_version

    assert check_torch_version("2.13.0+cpu") is None
    assert check_torch_version("2.13.1") is None
    assert "torch 2.12.0 is untested" in (check_torch_version("2.12.0+cu126") or "")
    assert check_torch_version() is None  # the pinned torch of the runtime extra
    monkeypatch.setattr(torch, "__version__", "2.11.0")
    # The warning comes first; the bad backend then stops the run before any process starts.
    with (
        pytest.warns(RuntimeWarning, match=r"torch 2\.11\.0 is untested.*torch==2\.13\.0"),
        pytest.raises(ScheduleError, match="gloo or nccl"),
    ):
        run_schedule(family_schedule("1f1b"), backend="mpi")


def test_cli_profile_writes_a_problem_that_solve_takes(tmp_path: Path):
    """`pipesched profile` of a user model on 2 ranks writes PROBLEM.json; `pipesched solve` schedules it."""
    import json

    from typer.testing import CliRunner

    from pipesched.api.cli import app

    problem_path = tmp_path / "PROBLEM.json"
    profiled = CliRunner().invoke(
        app,
        [
            "profile",
            "--model",
            USER_MODEL,
            "--num-ranks",
            "2",
            "--num-microbatches",
            "2",
            "--repeats",
            "1",
            "--p2p-ms",
            "0.01",
            "-o",
            str(problem_path),
        ],
    )
    assert profiled.exit_code == 0, profiled.output
    problem = json.loads(problem_path.read_text())
    assert problem["pipeline"]["num_ranks"] == 2 and problem["pipeline"]["num_microbatches"] == 2
    assert len(problem["costs"]["forward"]) == 2 and all(t > 0 for t in problem["costs"]["forward"])
    assert problem["costs"]["p2p"] == 0.01
    assert all(a > 0 for a in problem["memory"]["activation"])
    schedule_path = tmp_path / "schedule.json"
    solved = CliRunner().invoke(app, ["solve", str(problem_path), "--time-limit", "5", "-o", str(schedule_path)])
    assert solved.exit_code == 0, solved.output
    schedule = json.loads(schedule_path.read_text())
    assert schedule["status"] in ("optimal", "feasible")
    # 2 microbatches × F, I, W on each rank's one stage, and the rank's measured optimizer step.
    assert [[a["kind"] for a in rank["actions"]].count("OPTIMIZER_STEP") for rank in schedule["ranks"]] == [1, 1]
    assert [len(rank["actions"]) for rank in schedule["ranks"]] == [7, 7]
    assert schedule["makespan"] > 0


def test_embedding_and_head_alone_on_the_end_stages_run_and_verify(family_runs):
    """A partition may leave the first and last stage without transformer layers (embedding / LM head
    alone); `--model problem` builds exactly that split and the run matches the reference (the run is one
    schedule of the shared launch: its engine, gloo and reference are those of a launch of its own)."""
    from pipesched.runtime.models import load_model
    from pipesched.runtime.verify import reference_training

    problem = load_problem(END_STAGES)
    model = load_model("problem", problem)
    assert model.layers_per_stage == [0, 2, 2, 0]
    assert len(model.build_stage(0).blocks) == 0 and len(model.build_stage(3).blocks) == 0
    gradients = reference_training(model, NUM_MICROBATCHES, None).gradients
    assert any(name.startswith("0/token_embedding") for name in gradients)
    assert any(name.startswith("3/lm_head") for name in gradients)
    schedule, report = family_runs[END_STAGES_KEY]
    assert schedule.method == "zb-h1" and len(report.ranks) == NUM_RANKS
    assert report.verified is True
    assert report.max_rel_grad_error <= 1e-5
    assert report.missing_gradients == []


def test_auto_engine_is_torch_wherever_torch_can_follow_the_schedule():
    from pipesched.runtime.launch import ScheduleError, resolve_engine

    assert resolve_engine("auto", family_schedule("zb-h1")) == "torch"
    assert resolve_engine("auto", family_schedule("zb-v", stages_per_rank=2, placement="v")) == "torch"
    bitpipe = family_schedule("bitpipe", stages_per_rank=2, placement="bidirectional", reduce_grad=0.0)
    assert resolve_engine("auto", bitpipe) == "pipesched"
    loop = family_schedule("1f1b")
    explicit = loop.model_copy(update={"problem": loop.problem.with_changes(**{"pipeline.placement": [0, 1, 2, 3]})})
    assert resolve_engine("auto", explicit) == "pipesched"
    assert resolve_engine("pipesched", family_schedule("zb-h1")) == "pipesched"
    with pytest.raises(ScheduleError, match='engine "torch" runs placement "loop" or "v"') as error:
        resolve_engine("torch", bitpipe)
    assert error.value.reason == "placement"
    with pytest.raises(ScheduleError, match="engine must be one of auto, pipesched, torch"):
        resolve_engine("megatron", bitpipe)
