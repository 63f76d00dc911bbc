"""The planner over context and expert parallelism: long sequences choose context parallelism, mixture-of-experts
models state their parameters and shard their experts."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from pipesched.api.app import create_app
from pipesched.api.cli import app as cli_app
from pipesched.api.settings import Settings
from pipesched.optimizer.planner.evaluate import build_problem
from pipesched.optimizer.planner.rank import plan, prepare
from pipesched.optimizer.planner.request import PlanRequest
from pipesched.optimizer.presets import PUBLISHED_PARAMETERS
from pipesched.optimizer.progress import Deadline, active_deadline


def request(model: dict[str, Any], nodes: int, batch: int, time_limit_s: float, **search: Any) -> PlanRequest:
    return PlanRequest.model_validate(
        {
            "model": model,
            "cluster": {"accelerator": "H100-SXM", "num_nodes": nodes, "gpus_per_node": 8},
            "training": {"global_batch_size": batch},
            "search": {"time_limit_s": time_limit_s, "top": 3, **search},
        }
    )


def test_llama3_405b_at_131k_tokens_on_16384_gpus_chooses_context_parallelism_in_time() -> None:
    # Llama 3's long-context stage: 16M tokens per step (128 sequences of 131,072) on 16,384 H100s
    limit = 10.0
    started = time.perf_counter()
    answer = plan(request({"preset": "llama3.1-405b", "seq_length": 131072}, 2048, 128, limit)).answer
    elapsed = time.perf_counter() - started
    assert elapsed <= limit + 2.0
    assert answer.plans, answer.error
    best = answer.plans[0]
    assert best.context_parallel > 1
    gpus = best.pipeline_parallel * best.tensor_parallel * best.context_parallel * best.data_parallel.size
    assert gpus == 16384
    assert best.data_parallel.size * best.micro_batch_size * best.num_microbatches == 128
    assert best.lower_bound_ms <= best.step_time_ms


def test_a_short_limit_stops_the_spaces_enumeration_and_says_so() -> None:
    # DeepSeek-V3 on 16,384 H100s enumerates some 100,000 configurations (0.4 s idle, more on a loaded machine);
    # at 0.5 s the enumeration's share (25%) ends it early, the answer comes within the limit and says what it left
    limit = 0.5
    started = time.perf_counter()
    answer = plan(request({"preset": "deepseek-v3"}, 2048, 16384, limit)).answer
    assert time.perf_counter() - started <= limit + 2.0
    assert 0 < answer.searched.enumerated < 100_000
    assert any("enumeration stopped" in note and "pin dimensions in search" in note for note in answer.notes)
    full = prepare(request({"preset": "deepseek-v3"}, 2048, 16384, 60.0))
    assert full.searched.enumerated > 100_000 and not any("enumeration" in note for note in full.notes)


def test_a_short_limit_that_stops_the_estimates_says_so() -> None:
    """Llama 3.1 8B on 16 H100s at PP 2 enumerates 5,082 configurations at once but estimates them in about 0.6 s
    idle: with a 1 s limit the estimates' share (40%) left 1,754 of them (4,314 in a service's solver process) never
    estimated nor simulated, which only ``searched.unexplored`` said; a note now says it and what to do. Over the
    service (each plan prepared again in its solver process), a 5 s search had left 2,664 so, without a word."""
    body = {
        "model": {"preset": "llama3.1-8b"},
        "cluster": {"accelerator": "H100-SXM", "num_nodes": 2, "gpus_per_node": 8},
        "training": {"global_batch_size": 64},
        "search": {"time_limit_s": 0.3, "pipeline_parallel": [2]},
    }
    short = prepare(PlanRequest.model_validate(body))
    assert short.searched.unexplored > 0  # (the enumeration, at 25%, may be cut too on a loaded machine)
    (note,) = [note for note in short.notes if note.startswith("the estimates stopped at 40% of search.time_limit_s")]
    assert (
        f"{short.searched.unexplored:,} were never estimated or simulated" in note
        and "raise search.time_limit_s" in note
    )
    full = prepare(PlanRequest.model_validate({**body, "search": {**body["search"], "time_limit_s": 60}}))
    assert full.searched.unexplored == 0 and not any("estimates stopped" in note for note in full.notes)


def test_context_parallel_degrees_split_the_sequence_in_balanced_chunks() -> None:
    prepared = prepare(request({"preset": "llama3.1-8b", "seq_length": 65536}, 1, 8, 5.0, tensor_parallel=[1]))
    degrees = {config.context_parallel for config, _ in prepared.candidates}
    assert degrees <= {1, 2, 4, 8, 16} and max(degrees) > 1
    assert all(65536 % (2 * c) == 0 for c in degrees)
    pinned = prepare(request({"preset": "llama3.1-8b", "seq_length": 65536}, 1, 8, 5.0, context_parallel=[4]))
    assert {config.context_parallel for config, _ in pinned.candidates} == {4}


def test_a_mixture_of_experts_plan_states_its_parameters_and_shards_its_experts() -> None:
    answer = plan(
        request({"preset": "mixtral-8x7b"}, 4, 64, 8.0, expert_parallel=[8], pipeline_parallel=[2], tensor_parallel=[1])
    ).answer
    total, active = PUBLISHED_PARAMETERS["mixtral-8x7b"]
    assert answer.parameters == pytest.approx(total, rel=0.03)
    assert answer.active_parameters == pytest.approx(active, rel=0.03)
    assert answer.plans, answer.error
    for candidate in answer.plans:
        assert candidate.expert_parallel == 8 and candidate.pipeline_parallel == 2
        assert candidate.peak_memory_bytes <= 78 * 1024**3
        # MFU counts the active parameters: a 12.9B-active model cannot beat the peak
        assert 0 < candidate.mfu < 1


def test_expert_degrees_divide_the_experts_and_the_stage_gpus() -> None:
    prepared = prepare(request({"preset": "qwen3-30b-a3b"}, 2, 64, 5.0, pipeline_parallel=[1]))
    degrees = {config.expert_parallel for config, _ in prepared.candidates}
    assert max(degrees) > 1
    for config, _ in prepared.candidates:
        assert 128 % config.expert_parallel == 0
        stage_gpus = config.tensor_parallel * config.context_parallel * config.data_parallel_size
        assert stage_gpus % config.expert_parallel == 0
    dense = prepare(request({"preset": "llama3.1-8b"}, 1, 16, 5.0))
    assert {config.expert_parallel for config, _ in dense.candidates} == {1}


def test_a_mixture_of_experts_search_on_16384_gpus_keeps_a_short_time_limit() -> None:
    # DeepSeek-V3 on 16,384 H100s: some 100,000 configurations, more than the limit's estimating share can estimate;
    # the estimates are sampled and the answer comes within the limit. Enumerating the space takes 1.6 s here idle
    # (the first plan at 1.9 s); at 4 s a loaded machine (two busy loops beside four test workers on two cores)
    # spent the whole limit enumerating and answered with no plan: 8 s keeps a plan on a machine 3× slower.
    limit = 8.0
    started = time.perf_counter()
    answer = plan(request({"preset": "deepseek-v3"}, 2048, 16384, limit)).answer
    assert time.perf_counter() - started <= limit + 2.0
    assert answer.searched.enumerated > 50_000
    assert answer.searched.unexplored > 0
    assert answer.plans, answer.error
    assert answer.plans[0].expert_parallel > 1


def test_the_memory_estimate_sees_deepseeks_heaviest_rank() -> None:
    # DeepSeek-V3's three dense first layers make the first pipeline rank light and the next ones heavy: the
    # estimate must count the heaviest rank's weights, state and unsharded gradients, as the derivation does
    prepared = prepare(
        request(
            {"preset": "deepseek-v3"},
            256,
            8192,
            10.0,
            pipeline_parallel=[16],
            tensor_parallel=[8],
            data_parallel_size=[16],
            sharding=["full"],
            stages_per_rank=[2],
            placement=["v"],
            micro_batch_size=[1],
            activation_recomputation=["full"],
            method=["zb-v"],
            expert_parallel=[1],
        )
    )
    config, estimate = prepared.candidates[0]
    # The model-order split, which the estimate describes: its time tie is left unjudged (an expired deadline stops
    # the judging at once). Judged, the split depended on the machine's speed: a full judgement takes 226 s here and
    # the 1 s the derivation allows it reached another split on each machine.
    with active_deadline(Deadline(time.perf_counter())):
        problem = build_problem(prepared.estimator, config)
    assert problem.memory is not None and problem.memory.weights is not None
    holders = problem.pipeline.stage_holders()
    weights = problem.stage_values(problem.memory.weights)
    held = [
        static + sum(weights[stage] for stage, ranks in enumerate(holders) if rank in ranks)
        for rank, static in enumerate(problem.static_memory)
    ]
    heaviest = max(range(len(held)), key=held.__getitem__)
    assert heaviest > 0  # not the first rank
    assert estimate.static_bytes >= 0.9 * held[heaviest]


BAD_DEGREES = [
    ({"preset": "llama3.1-8b"}, {"context_parallel": [0]}, "context_parallel", "greater than or equal to 1"),
    ({"preset": "llama3.1-8b"}, {"context_parallel": [3]}, "context_parallel", "2·3 equal head-tail chunks"),
    ({"preset": "llama3.1-8b"}, {"expert_parallel": [4]}, "expert_parallel", "the model is dense"),
    ({"preset": "mixtral-8x7b"}, {"expert_parallel": [3]}, "expert_parallel", "does not divide model.num_experts 8"),
]


def _body(model: dict[str, Any], search: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": model,
        "cluster": {"accelerator": "H100-SXM", "num_nodes": 1, "gpus_per_node": 8},
        "training": {"global_batch_size": 16},
        "search": {"time_limit_s": 2, **search},
    }


def test_bad_context_and_expert_degrees_are_422_and_exit_2_naming_the_field(tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'pipesched.sqlite3'}", solver_workers=1)
    with TestClient(create_app(settings)) as client:
        for model, search, field, message in BAD_DEGREES:
            answer = client.post("/v1/plans", json=_body(model, search))
            assert answer.status_code == 422, answer.text
            detail = answer.json()["detail"][0]
            assert detail["loc"][1:3] == ["search", field] and message in detail["msg"]
            config = tmp_path / "plan.json"
            config.write_text(json.dumps(_body(model, search)))
            result = CliRunner().invoke(cli_app, ["plan", str(config)])
            assert result.exit_code == 2 and f"search.{field}" in result.output, result.output
