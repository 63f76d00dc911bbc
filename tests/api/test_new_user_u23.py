"""A new user's afternoon, fourth round (U23): plans of every preset on 8 to 16,384 GPUs, their launch files read by
torchtitan 0.3.0's own parser, bad input on the command line and over HTTP (a real ``pipesched serve`` on loopback
with SQLite), and a cancelled search's plans. Each test failed before its fix (``bench/results/new_user_audit.md``)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from pipesched.optimizer.planner.launch import LaunchError, LaunchSpec, megatron_args, torchtitan_launch
from pipesched.optimizer.planner.request import PlanRequest
from pipesched.optimizer.planner.space import Configuration
from tests.api.test_api_served import ServedApi
from tests.api.test_newcomer import pipesched

BASE: dict[str, Any] = {
    "model": {"preset": "llama3.1-8b"},
    "cluster": {"accelerator": "H100-SXM", "num_nodes": 1, "gpus_per_node": 8},
    "training": {"global_batch_size": 16},
    "search": {"time_limit_s": 3},
}


def with_search(model: dict[str, Any] | None = None, nodes: int = 1, **search: Any) -> dict[str, Any]:
    """The base request with ``search`` fields (and another model or node count)."""
    return {
        **BASE,
        "model": model or BASE["model"],
        "cluster": {**BASE["cluster"], "num_nodes": nodes},
        "search": {**BASE["search"], **search},
    }


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedApi]:
    """A real `pipesched serve` on a loopback port with its own SQLite file."""
    directory = tmp_path_factory.mktemp("u23-served")
    server = ServedApi(f"sqlite:///{directory / 'served.sqlite3'}", directory / "server.log")
    yield server
    server.stop()


COUNT_LISTS = [
    "pipeline_parallel",
    "tensor_parallel",
    "data_parallel_size",
    "micro_batch_size",
    "num_microbatches",
    "stages_per_rank",
]


@pytest.mark.parametrize("name", COUNT_LISTS)
def test_a_search_list_of_zero_is_a_422_naming_its_item_not_a_500(served: ServedApi, name: str) -> None:
    """search.pipeline_parallel [0] had ended in a ZeroDivisionError (HTTP 500, a traceback and exit 1 on the
    command line); micro_batch_size [-1] had been taken and blamed on the global batch ("products: -8, -4")."""
    for value in (0, -1):
        answer = served.client.post("/v1/plans", json=with_search(**{name: [value]}))
        assert answer.status_code == 422, answer.text
        (error,) = answer.json()["detail"]
        assert error["loc"] == ["body", "search", name, 0] and "greater than or equal to 1" in error["msg"]
    assert served.client.get("/healthz").status_code == 200


def test_the_best_plans_step_and_mfu_print_with_their_interval(tmp_path: Path) -> None:
    """tok/s/GPU printed with its 80% interval, the step time and MFU beside it without one."""
    (tmp_path / "plan.json").write_text(json.dumps(with_search(top=1, time_limit_s=2)))
    result = pipesched("plan", "plan.json", "-o", "plans.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    best = json.loads((tmp_path / "plans.json").read_text())["plans"][0]
    rate, (low, high) = best["tokens_per_s_per_gpu"], best["tokens_per_s_per_gpu_interval"]
    step = best["step_time_ms"]
    line = next(line for line in result.stdout.splitlines() if line.startswith("plan 1, 80% interval"))
    assert f"step {step:.1f} ms ({step * rate / high:.1f}–{step * rate / low:.1f})" in line
    assert f"MFU {best['mfu']:.1%} ({best['mfu'] * low / rate:.1%}–{best['mfu'] * high / rate:.1%})" in line


def test_a_zero_pipeline_degree_on_the_command_line_exits_2_naming_it(tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_text(json.dumps(with_search(pipeline_parallel=[0])))
    result = pipesched("plan", "plan.json", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "search.pipeline_parallel.0" in result.stderr and "Traceback" not in result.stderr


MOE = {"preset": "mixtral-8x7b"}


@pytest.mark.parametrize(
    ("request_body", "said"),
    [
        (with_search(expert_tensor_parallel=[2]), "the model is dense"),
        (with_search(MOE, nodes=4, expert_parallel=[1], expert_tensor_parallel=[2]), "search.expert_parallel pins 1"),
        (with_search(MOE, nodes=4, expert_tensor_parallel=[3]), "does not divide the experts' FFN width 14,336"),
    ],
    ids=["dense", "ep-1", "not-dividing"],
)
def test_an_expert_tensor_pin_the_search_would_drop_is_refused(request_body: dict[str, Any], said: str) -> None:
    """e_t [2] on Llama 3.1 8B had planned as if not said (e_t is 1 for a dense model), e_t [2] with
    expert_parallel [1] too (e_t is t there); e_t [3] on Mixtral (FFN 14,336) had been refused as "admits no
    configuration … given the other pins" on the expert-parallel degree."""
    with pytest.raises(ValidationError) as caught:
        PlanRequest.model_validate(request_body)
    errors = {tuple(item["loc"]): item["msg"] for item in caught.value.errors()}
    assert list(errors) == [("search", "expert_tensor_parallel")]
    assert said in errors[("search", "expert_tensor_parallel")]


def test_the_expert_tensor_refusal_is_a_422_over_http(served: ServedApi) -> None:
    answer = served.client.post("/v1/plans", json=with_search(expert_tensor_parallel=[2]))
    assert answer.status_code == 422 and answer.json()["detail"][0]["loc"] == [
        "body",
        "search",
        "expert_tensor_parallel",
    ]


def layout(**changes: Any) -> Configuration:
    values: dict[str, Any] = {
        "pipeline_parallel": 1,
        "tensor_parallel": 2,
        "data_parallel_size": 4,
        "sharding": "gradients",
        "stages_per_rank": 1,
        "placement": "loop",
        "micro_batch_size": 2,
        "num_microbatches": 8,
        "activation_recomputation": "full",
        "method": "1f1b",
    }
    return Configuration(**{**values, **changes})


def launch_spec(preset: str, nodes: int, batch: int, config: Configuration, kernels: str | None = None) -> LaunchSpec:
    model = {"preset": preset} | ({"kernels": kernels} if kernels else {})
    request = PlanRequest.model_validate({**BASE, "model": model, "training": {"global_batch_size": batch}})
    return LaunchSpec(model=request.model, num_nodes=nodes, gpus_per_node=8, global_batch_size=batch, layout=config)


def parse_with_torchtitan(args: list[str], folder: Path | None = None) -> Any:
    """torchtitan 0.3.0's ConfigManager on ``args`` (``folder`` on sys.path for a config module written there);
    its error box (stderr) in the failure message."""
    manager = pytest.importorskip("torchtitan.config.manager")
    if folder is not None:
        sys.path.insert(0, str(folder))
        sys.modules.pop("pipesched_torchtitan", None)
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return manager.ConfigManager().parse_args(args)
    except SystemExit:
        pytest.fail(f"torchtitan refused {args}:\n{errors.getvalue()}")
    finally:
        if folder is not None:
            sys.path.remove(str(folder))
            sys.modules.pop("pipesched_torchtitan", None)


def test_torchtitan_takes_an_expert_parallel_plan_without_a_pipeline() -> None:
    """Qwen3-30B-A3B, TP 2 × EP 8 × FSDP 4 on 8 GPUs, the best plan on 8 H100s: torchtitan 0.3.0 refused its argv
    (CUDA graphs with the all-to-all token dispatcher, which syncs with the host) until the launch disabled them,
    as it already did under pipeline parallelism."""
    spec = launch_spec("qwen3-30b-a3b", 1, 64, layout(expert_parallel=8, num_microbatches=1))
    config = parse_with_torchtitan(torchtitan_launch(spec).args)
    assert config.parallelism.expert_parallel_degree == 8 and config.training.disable_cuda_graphs


def test_megatron_args_of_a_mixture_of_experts_plan_build_its_experts() -> None:
    """Megatron's args had carried --expert-model-parallel-size but no --num-experts: Megatron-LM would have built a
    dense model (Qwen3-30B-A3B with a 6,144-wide FFN in every layer, DeepSeek-V3 with multi-head attention)."""
    qwen = megatron_args(launch_spec("qwen3-30b-a3b", 1, 64, layout(expert_parallel=8, num_microbatches=1)))
    pairs = dict(zip(qwen, [*qwen[1:], ""], strict=True))
    assert (pairs["--num-experts"], pairs["--moe-router-topk"], pairs["--moe-ffn-hidden-size"]) == ("128", "8", "768")
    assert pairs["--kv-channels"] == "128" and pairs["--moe-token-dispatcher-type"] == "alltoall"
    assert "--moe-layer-freq" not in pairs and "--moe-shared-expert-intermediate-size" not in pairs
    deepseek = megatron_args(launch_spec("deepseek-v3", 16, 512, layout(expert_parallel=8, data_parallel_size=64)))
    pairs = dict(zip(deepseek, [*deepseek[1:], ""], strict=True))
    assert "--multi-latent-attention" in pairs and (pairs["--q-lora-rank"], pairs["--kv-lora-rank"]) == ("1536", "512")
    assert (pairs["--qk-head-dim"], pairs["--qk-pos-emb-head-dim"], pairs["--v-head-dim"]) == ("128", "64", "128")
    assert pairs["--moe-layer-freq"] == "([0]*3+[1]*58)" and pairs["--moe-shared-expert-intermediate-size"] == "2048"
    assert "--num-experts" not in megatron_args(launch_spec("llama3.1-8b", 1, 16, layout()))


def test_a_torchtitan_launch_refuses_experts_spread_over_ddp_replicas() -> None:
    """Qwen3-30B-A3B, EP 8 over 8 DDP replicas (sharding none, TP 1): torchtitan's expert mesh is
    dp_shard · cp · tp / ep = 1/8 GPU; the launch had written the args (the job would fail building its mesh)."""
    spec = launch_spec("qwen3-30b-a3b", 1, 64, layout(expert_parallel=8, tensor_parallel=1, sharding="none"))
    with pytest.raises(LaunchError, match="does not divide torchtitan's FSDP"):
        torchtitan_launch(spec)
    assert "--expert-model-parallel-size" in megatron_args(spec)  # Megatron's EP spans the data-parallel ranks


def test_a_torchtitan_launch_of_split_experts_says_torchtitan_runs_them_whole(tmp_path: Path) -> None:
    """Qwen3-30B-A3B on 64 H100s pinned to EP 8 × e_t 2: torchtitan 0.3 has no expert tensor parallelism, and the
    launch had written its args without a word that the job runs e_t 1."""
    body = with_search(
        {"preset": "qwen3-30b-a3b"},
        nodes=8,
        top=1,
        expert_parallel=[8],
        expert_tensor_parallel=[2],
        pipeline_parallel=[1],
    )
    (tmp_path / "plan.json").write_text(json.dumps({**body, "training": {"global_batch_size": 64}}))
    planned = pipesched("plan", "plan.json", "-o", "plans.json", cwd=tmp_path)
    assert planned.returncode == 0, planned.stderr
    assert json.loads((tmp_path / "plans.json").read_text())["plans"][0]["expert_tensor_parallel"] == 2
    launched = pipesched("launch", "plans.json", "-o", "job", cwd=tmp_path)
    assert launched.returncode == 0, launched.stderr
    said = " ".join((launched.stdout + launched.stderr).split())
    assert "splits each routed expert over 2 GPUs" in said and "(e_t 1)" in said


def layout_405b() -> Configuration:
    """Llama 3.1 405B on 1,024 GPUs: PP 16 × TP 8 × CP 2, FSDP 4, no recomputation."""
    return layout(
        pipeline_parallel=16,
        tensor_parallel=8,
        context_parallel=2,
        sharding="full",
        micro_batch_size=1,
        num_microbatches=32,
        activation_recomputation="none",
    )


@pytest.fixture(scope="module")
def llama_405b_eager(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A bf16 Llama 3.1 405B plan said to run eager (PP 16 × TP 8 × CP 2, FSDP 4 on 1,024 GPUs) launched for
    torchtitan: its argv and the folder holding the config module written beside it."""
    folder = tmp_path_factory.mktemp("u23-405b")
    config = layout_405b()
    launched = torchtitan_launch(launch_spec("llama3.1-405b", 128, 128, config, kernels="eager"))
    assert launched.config_source is not None  # torchtitan's llama3_405b trains in Float8: a bf16 wrapper
    (folder / "pipesched_torchtitan.py").write_text(launched.config_source)
    return folder, launched.args


def test_a_bf16_405b_plan_builds_its_torchtitan_config_without_float8(llama_405b_eager: tuple[Path, list[str]]) -> None:
    """The bf16 wrapper had called llama3_405b(), which builds its Float8 converter: torchao is needed (ImportError
    without it) for a plan that never runs FP8."""
    folder, args = llama_405b_eager
    config = parse_with_torchtitan(args, folder)
    assert config.model_spec.flavor == "405B" and "Float8" not in repr(config.model_spec.model)
    assert (config.parallelism.pipeline_parallel_degree, config.parallelism.context_parallel_degree) == (16, 2)
    registry = importlib.import_module("torchtitan.models.llama3.config_registry")
    assert registry.model_registry is importlib.import_module("torchtitan.models.llama3").model_registry  # put back


def test_a_405b_plan_predicted_eager_runs_eager(llama_405b_eager: tuple[Path, list[str]]) -> None:
    """llama3_405b compiles the model with async TP; a plan predicted eager had been handed off compiled."""
    folder, args = llama_405b_eager
    config = parse_with_torchtitan(args, folder)
    assert not config.compile.enable and not config.compile.enable_async_tensor_parallel


def test_a_compiled_405b_plan_runs_async_tp_only_when_its_prediction_did(tmp_path: Path) -> None:
    """llama3_405b turns AsyncTP on with compilation; a compiled plan timed without the overlap launches without
    it, one timed with it (training.async_tensor_parallel) keeps it."""
    config = layout_405b()
    compiled = launch_spec("llama3.1-405b", 128, 128, config, kernels="compiled")
    for overlap in (False, True):
        launched = torchtitan_launch(dataclasses.replace(compiled, async_tensor_parallel=overlap))
        folder = tmp_path / str(overlap)
        folder.mkdir()
        if launched.config_source is not None:
            (folder / "pipesched_torchtitan.py").write_text(launched.config_source)
        parsed = parse_with_torchtitan(launched.args, folder)
        assert parsed.compile.enable and parsed.compile.enable_async_tensor_parallel is overlap


def test_an_empty_calibration_file_says_it_is_empty_and_what_it_holds(tmp_path: Path) -> None:
    (tmp_path / "runs.json").write_text("")
    result = pipesched("calibrate", "runs.json", cwd=tmp_path)
    assert result.returncode == 2
    assert "runs.json is empty" in result.stderr and '{"rows": [...]}' in result.stderr
    assert "Expecting value" not in result.stderr


#: Llama 3.1 70B on 64 H100s, 60 s: its first plans come within a second or two, the search goes on.
LONG_SEARCH = {
    "model": {"preset": "llama3.1-70b"},
    "cluster": {"accelerator": "H100-SXM", "num_nodes": 8, "gpus_per_node": 8},
    "training": {"global_batch_size": 128},
    "search": {"time_limit_s": 60},
}


def wait_for(served: ServedApi, plan_id: str, ready: Any, timeout_s: float = 90.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = served.client.get(f"/v1/plans/{plan_id}").json()
        if ready(status):
            return status
        time.sleep(0.3)
    pytest.fail(f"plan {plan_id} never got there: {status['status']}, {len(status['plans'])} plans")


def test_a_cancelled_search_launches_the_plans_it_kept(served: ServedApi) -> None:
    """DELETE keeps the plans found until then, as Ctrl-C does, and `pipesched launch` takes a Ctrl-C's plans;
    over HTTP the launch had answered 409 "poll GET /v1/plans/{id} until its status is done", which never comes."""
    plan_id = served.client.post("/v1/plans", json=LONG_SEARCH).json()["id"]
    wait_for(served, plan_id, lambda status: status["status"] == "running" and status["plans"])
    assert served.client.delete(f"/v1/plans/{plan_id}").json()["status"] == "cancelled"
    stored = wait_for(served, plan_id, lambda status: status["progress"]["phase"] == "done")
    assert stored["status"] == "cancelled" and stored["plans"] and stored["plans"][0]["schedule_id"]
    launched = served.client.get(f"/v1/plans/{plan_id}/launch", params={"scheduler": "slurm"})
    assert launched.status_code == 200, launched.text
    assert {"torchtitan.args", "job.sbatch"} <= set(launched.json()["files"])


def test_a_search_cancelled_before_any_plan_says_there_is_nothing_to_wait_for(served: ServedApi) -> None:
    plan_id = served.client.post("/v1/plans", json=LONG_SEARCH).json()["id"]
    served.client.delete(f"/v1/plans/{plan_id}")
    wait_for(served, plan_id, lambda status: status["status"] == "cancelled")
    answer = served.client.get(f"/v1/plans/{plan_id}/launch")
    assert answer.status_code == 409
    detail = answer.json()["detail"]
    assert "until its status is done" not in detail
    assert "ended cancelled" in detail or "still storing" in detail
