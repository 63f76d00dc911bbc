"""A plan request says which framework will run it (``training.framework``, ``pipesched plan --framework``).

The framework sets the kernels where ``training.kernels`` is not said and what the software profile cannot be told
by another field (FSDP's sharded state, prefetch, gradient sync, the loss: ``pipesched.optimizer.frameworks``);
not said, the answer is the one before the field existed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from typer.testing import CliRunner

from pipesched.api.cli import app as cli_app
from pipesched.api.launch.bundle import LaunchOptions, build_bundle, launch_target
from pipesched.optimizer.configs import ModelConfig
from pipesched.optimizer.cost.memory import static_bytes_per_parameter_sharded
from pipesched.optimizer.cost.profile import builtin_catalogue
from pipesched.optimizer.frameworks import FRAMEWORK_SOFTWARE, FRAMEWORKS
from pipesched.optimizer.planner.evaluate import build_problem
from pipesched.optimizer.planner.rank import estimator_for, plan
from pipesched.optimizer.planner.request import PlanRequest
from pipesched.optimizer.planner.space import Configuration

#: Llama 3.1 8B on one node of 8 H100s at torchtitan's Table 1 layout (FSDP 8, two sequences per GPU, selective
#: recomputation; its hosts' 96 GiB H100s), pinned: one configuration, answered in well under a second.
PINNED: dict[str, Any] = {
    "model": {"preset": "llama3.1-8b", "seq_length": 8192},
    "cluster": {"accelerator": "H100-SXM", "num_nodes": 1, "gpus_per_node": 8, "memory_bytes": 96 * 2**30},
    "training": {"global_batch_size": 16},
    "search": {
        "time_limit_s": 20,
        "top": 1,
        "pipeline_parallel": [1],
        "tensor_parallel": [1],
        "sharding": ["full"],
        "micro_batch_size": [2],
        "activation_recomputation": ["selective"],
    },
}


def request(**training: Any) -> PlanRequest:
    return PlanRequest.model_validate({**PINNED, "training": {**PINNED["training"], **training}})


def refusal(body: dict[str, Any]) -> list[tuple[tuple[str | int, ...], str]]:
    with pytest.raises(ValidationError) as caught:
        PlanRequest.model_validate(body)
    return [(tuple(item["loc"]), item["msg"]) for item in caught.value.errors()]


def test_the_frameworks_are_those_the_calibration_rows_name() -> None:
    """Every framework of the table is a ``software.framework`` of the calibration data, and every public framework
    there is in the table (the Llama 3 and DeepSeek-V3 reports ran in-house stacks)."""
    from pipesched.optimizer.cost.calibration.measurements import builtin_measurements

    named = {row.software.framework for row in builtin_measurements()}
    assert set(FRAMEWORKS) <= named
    assert named - set(FRAMEWORKS) == {"meta", "deepseek"}
    software = builtin_catalogue().software
    for fields in FRAMEWORK_SOFTWARE.values():  # each a software-profile field, at a value it takes
        assert set(fields) <= set(type(software).model_fields)
        type(software).model_validate({**software.model_dump(), **fields})


def test_a_name_or_alias_is_read_as_the_framework_and_an_unknown_one_lists_them() -> None:
    assert request(framework="NeMo").training.framework == "megatron"
    assert request(framework="megatron-bridge").training.framework == "megatron"
    assert request(framework="llm-foundry").training.framework == "composer"
    assert request(framework="nemo-automodel").training.framework == "automodel"
    [(loc, message)] = refusal({**PINNED, "training": {"global_batch_size": 16, "framework": "deepspeed"}})
    assert loc == ("training", "framework")
    for name in FRAMEWORKS:
        assert name in message


def test_kernels_the_framework_does_not_run_are_refused_naming_both_fields() -> None:
    [(loc, message)] = refusal(
        {**PINNED, "training": {"global_batch_size": 16, "framework": "megatron", "kernels": "eager"}}
    )
    assert loc == ("training", "kernels")
    assert "training.kernels 'eager'" in message and "training.framework 'megatron'" in message
    assert "fused" in message  # what it runs
    model = {**PINNED["model"], "kernels": "fused"}
    [(loc, message)] = refusal(
        {**PINNED, "model": model, "training": {"global_batch_size": 16, "framework": "torchtitan"}}
    )
    assert loc == ("model", "kernels") and "training.framework 'torchtitan'" in message
    model = {**PINNED["model"], "framework": "automodel"}
    [(loc, message)] = refusal(
        {**PINNED, "model": model, "training": {"global_batch_size": 16, "framework": "composer"}}
    )
    assert loc == ("model", "framework")
    with pytest.raises(ValidationError, match=r"model\.kernels 'compiled' contradicts model\.framework 'megatron'"):
        ModelConfig.model_validate({**PINNED["model"], "framework": "megatron", "kernels": "compiled"})
    # what it runs is accepted; "unknown" is not said
    assert request(framework="torchtitan", kernels="compiled").training.kernels == "compiled"
    assert (
        ModelConfig.model_validate({**PINNED["model"], "framework": "automodel", "kernels": "unknown"}).kernels
        == "fused"
    )


def test_not_said_is_the_answer_without_the_field() -> None:
    """``framework`` null answers what the request without it answers, and the derived problem (the schedule cache's
    key) carries no framework; torchtitan's table is the software profile's defaults, so naming it answers what
    its kernels (eager) alone answer."""
    unsaid = plan(request()).answer
    null = plan(request(framework=None)).answer
    assert unsaid.plans[0].model_dump(exclude={"schedule_id"}) == null.plans[0].model_dump(exclude={"schedule_id"})
    assert unsaid.notes == null.notes and not any("training.framework" in note for note in unsaid.notes)
    estimator = estimator_for(request())
    problem = build_problem(estimator, _pinned_configuration())
    assert "framework" not in json.loads(problem.canonical_json())["model"]
    eager = plan(request(kernels="eager")).answer.plans[0]
    torchtitan = plan(request(framework="torchtitan")).answer.plans[0]
    assert torchtitan.tokens_per_s_per_gpu == eager.tokens_per_s_per_gpu
    assert torchtitan.peak_memory_bytes == eager.peak_memory_bytes
    assert unsaid.plans[0].tokens_per_s_per_gpu != eager.tokens_per_s_per_gpu  # "unknown" is a blend, not eager


def _pinned_configuration(**changes: Any) -> Configuration:
    fields: dict[str, Any] = {
        "pipeline_parallel": 1,
        "tensor_parallel": 1,
        "data_parallel_size": 8,
        "sharding": "full",
        "stages_per_rank": 1,
        "placement": "loop",
        "micro_batch_size": 2,
        "num_microbatches": 1,
        "activation_recomputation": "selective",
        "method": "1f1b",
        "precision": "bf16",
    }
    return Configuration(**{**fields, **changes})


def test_each_framework_is_charged_the_sharded_state_it_keeps() -> None:
    """Fully sharded, Megatron-FSDP keeps 2 + 4 + 4 + 8 = 18 B a parameter (fp32 reduction), NeMo AutoModel's bf16
    model 2 + 2 + 4 = 8 B, torchtitan and Composer the fp32 parameters, 4 + 4 + 8 = 16 B, each over d. Over d = 4
    with a pipeline of 2 (every stack then reduces once a step: the gradient sync aside), a rank's static memory
    differs between the two fused stacks by exactly 10 B over d per parameter of its stage, and the first stage
    (no loss: Composer's fused cross-entropy aside) is the same for the two PyTorch ones."""
    config = _pinned_configuration(pipeline_parallel=2, data_parallel_size=4, micro_batch_size=1, num_microbatches=4)
    body = {**PINNED, "model": {**PINNED["model"], "layers_per_stage": [16, 16]}}  # one split for every framework
    static: dict[str, list[float]] = {}
    weights: list[float] = []
    for name in FRAMEWORKS:
        estimator = estimator_for(
            PlanRequest.model_validate({**body, "training": {**body["training"], "framework": name}})
        )
        state = estimator.full_state("full")
        per_parameter = static_bytes_per_parameter_sharded(estimator.model, "full", 1, full_state=state)
        assert per_parameter == {"torchtitan": 16, "megatron": 18, "automodel": 8, "composer": 16}[name]
        problem = build_problem(estimator, config)
        assert problem.memory is not None and problem.memory.weights is not None
        static[name] = list(problem.memory.static)
        weights = list(problem.memory.weights)  # the stage's gathered bf16 weights: 2 B a parameter
    for rank, gathered in enumerate(weights):
        parameters = gathered / 2
        assert static["megatron"][rank] - static["automodel"][rank] == pytest.approx(10 * parameters / 4, rel=1e-9)
    assert static["torchtitan"][0] == static["composer"][0]
    assert static["torchtitan"][1] > static["composer"][1]  # fp32 log-softmax of the logits against flash-attn's


def test_the_gradients_nemo_automodel_accumulates_are_charged_whole_in_the_reductions_dtype() -> None:
    """Without a pipeline NeMo AutoModel defers FSDP2's reduction to the last microbatch: each rank holds every
    parameter's unsharded gradient, in the reduction's dtype (FSDP2's ``to_accumulated_grad_if_needed``: fp32 under
    AutoModel's ``reduce_dtype`` fp32, bf16 when the reduction is bf16; ``tests/runtime/test_fsdp_static_bytes.py``).
    The step model's ``memory.gradients`` halves with a bf16 reduction, and the search's cheap estimate of a rank's
    static memory counts the same buffer (it counted one layer's: 9.0 GiB against the step model's 35.6)."""
    config = _pinned_configuration(num_microbatches=2, micro_batch_size=1)
    held: dict[str, float] = {}
    for reduce_dtype in ("fp32", "bf16"):
        estimator = estimator_for(request(framework="automodel", gradient_reduce_dtype=reduce_dtype))
        problem = build_problem(estimator, config)
        assert problem.memory is not None and problem.memory.gradients is not None
        held[reduce_dtype] = problem.memory.gradients[0]
        estimate = estimator.estimate(config)
        assert estimate.static_bytes >= held[reduce_dtype] * 7 / 8  # the (d − 1)/d REDUCE_GRAD frees
        # the problem's static also counts its passes' largest transient (the loss's logits): about 1 GiB here
        assert 0 < problem.memory.static[0] - estimate.static_bytes < 0.1 * problem.memory.static[0]
    assert held["bf16"] == pytest.approx(held["fp32"] / 2)


def test_the_notes_say_whose_state_and_kernels_the_plans_assumed() -> None:
    """The framework note says the kernels, the sharded state and the gradient reduction's dtype assumed (it had said
    nothing of the dtype: a Megatron user planning a performance recipe's bf16 reduction had no word of it)."""
    notes = plan(request(framework="automodel")).answer.notes
    assert notes[0].startswith("training.framework automodel (NeMo AutoModel): fused kernels (its own)")
    assert "8 B per parameter" in notes[0] and "fsdp_gradient_sync last_microbatch" in notes[0]
    assert notes[0].endswith("; gradients reduced in fp32 (its default)")
    notes = plan(request(framework="megatron")).answer.notes
    assert (
        "gradients reduced in fp32 (its default: Megatron Bridge's and NeMo's performance recipes reduce in bf16"
        in (notes[0])
        and notes[0].endswith("say training.gradient_reduce_dtype bf16 to plan one)")
    )
    notes = plan(request(framework="megatron", gradient_reduce_dtype="bf16")).answer.notes
    assert notes[0].endswith("; gradients reduced in bf16")
    notes = plan(request(framework="torchtitan", kernels="compiled")).answer.notes
    assert "compiled kernels;" in notes[0] and "16 B per parameter" in notes[0]
    assert not any("training.kernels not said" in note for note in notes)


def test_cli_framework_option_and_a_bad_name_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "request.json"
    path.write_text(json.dumps(PINNED))
    result = CliRunner().invoke(cli_app, ["plan", str(path), "--framework", "composer"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout[result.stdout.index("{") :])
    assert answer["request"]["training"]["framework"] == "composer"
    assert answer["notes"][0].startswith("training.framework composer")
    result = CliRunner().invoke(cli_app, ["plan", str(path), "--framework", "deepspeed"])
    assert result.exit_code == 2
    assert "training.framework" in result.output and "torchtitan" in result.output and "automodel" in result.output


def test_launch_defaults_its_target_to_the_framework_where_one_runs_it() -> None:
    assert launch_target(request(), None) == ("torchtitan", [])
    assert launch_target(request(framework="megatron"), None) == ("megatron", [])
    assert launch_target(request(framework="torchtitan"), None) == ("torchtitan", [])
    target, notes = launch_target(request(framework="automodel"), None)
    assert target == "torchtitan" and "NeMo AutoModel" in notes[0] and "pipesched writes no" in notes[0]
    target, notes = launch_target(request(framework="megatron"), "torchtitan")
    assert target == "torchtitan" and "(given)" in notes[0]
    answer = plan(request(framework="megatron")).answer
    assert answer.request is not None
    bundle = build_bundle(answer.request, answer.plans[0], 1, None, LaunchOptions(scheduler="torchrun"))
    assert "megatron.args" in bundle.files and "torchtitan.args" not in bundle.files


def test_megatron_plans_are_its_own_schedules_and_launch_as_megatron() -> None:
    """Megatron-LM runs its own 1F1B, interleaved over virtual stages in a loop (not a schedule CSV): a plan for it
    is searched among those (``search.method`` unpinned), and its best launches with ``--target megatron``."""
    body = {
        "model": {"preset": "llama3.1-8b"},
        "cluster": {"accelerator": "H100-SXM", "num_nodes": 2, "gpus_per_node": 8},
        "training": {"global_batch_size": 64, "framework": "megatron"},
        "search": {"time_limit_s": 8, "pipeline_parallel": [2], "top": 3},
    }
    answer = plan(PlanRequest.model_validate(body)).answer
    assert answer.plans and {item.method for item in answer.plans} <= {"1f1b", "interleaved-1f1b"}
    assert all(item.placement == "loop" for item in answer.plans)
    assert "it runs the schedules 1f1b, interleaved-1f1b" in answer.notes[0]
    assert answer.request is not None
    bundle = build_bundle(answer.request, answer.plans[0], 1, None, LaunchOptions(scheduler="slurm"))
    assert "megatron.args" in bundle.files
    pinned = {**body, "search": {**body["search"], "method": ["zb-h1"]}}  # a method pinned is the request's choice
    assert {item.method for item in plan(PlanRequest.model_validate(pinned)).answer.plans} == {"zb-h1"}


def test_http_takes_the_framework_and_a_bad_one_is_422_naming_the_field(client: TestClient) -> None:
    body = {**PINNED, "training": {"global_batch_size": 16, "framework": "deepspeed"}}
    answer = client.post("/v1/plans", json=body)
    assert answer.status_code == 422
    [detail] = answer.json()["detail"]
    assert detail["loc"] == ["body", "training", "framework"] and "composer" in detail["msg"]
    body = {**PINNED, "training": {"global_batch_size": 16, "framework": "megatron", "kernels": "compiled"}}
    answer = client.post("/v1/plans", json=body)
    assert answer.status_code == 422 and answer.json()["detail"][0]["loc"] == ["body", "training", "kernels"]
    body = {**PINNED, "training": {"global_batch_size": 16, "framework": "nemo"}}
    created = client.post("/v1/plans", json=body)
    assert created.status_code == 202, created.text
    schema = client.get("/openapi.json").json()["components"]["schemas"]
    [training] = [value for name, value in schema.items() if name.startswith("PlanTraining")]
    assert "nemo" in json.dumps(training["properties"]["framework"])
