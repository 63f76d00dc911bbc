"""The plan request's global batch: in sequences (``global_batch_size``) or in tokens (``global_batch_tokens``)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pipesched.optimizer.planner.request import PlanRequest

BASE = {
    "model": {"preset": "llama3.1-8b"},
    "cluster": {"accelerator": "H100-SXM", "num_nodes": 1, "gpus_per_node": 8},
}


def errors(training: dict[str, int]) -> list[tuple[tuple[str | int, ...], str]]:
    with pytest.raises(ValidationError) as caught:
        PlanRequest.model_validate({**BASE, "training": training})
    return [(tuple(item["loc"]), item["msg"]) for item in caught.value.errors()]


def test_global_batch_tokens_become_sequences_of_the_models_length() -> None:
    request = PlanRequest.model_validate({**BASE, "training": {"global_batch_tokens": 2 * 1024 * 1024}})
    assert request.training.global_batch_size == 256  # 2 Mi tokens of 8192-token sequences
    shorter = PlanRequest.model_validate(
        {**BASE, "model": {"preset": "llama3.1-8b", "seq_length": 4096}, "training": {"global_batch_tokens": 2**21}}
    )
    assert shorter.training.global_batch_size == 512
    again = PlanRequest.model_validate_json(request.model_dump_json())  # a stored request reads back
    assert again.training == request.training


def test_tokens_that_are_no_whole_number_of_sequences_name_the_nearest() -> None:
    ((loc, message),) = errors({"global_batch_tokens": 1_000_000})
    assert loc == ("training", "global_batch_tokens")
    assert "999,424 or 1,007,616" in message and "global_batch_size" in message


def test_tokens_beside_a_different_batch_and_no_batch_at_all_are_refused() -> None:
    ((loc, message),) = errors({"global_batch_tokens": 16 * 8192, "global_batch_size": 3})
    assert loc == ("training", "global_batch_tokens") and "16 sequences" in message
    ((loc, message),) = errors({})
    assert loc == ("training", "global_batch_size") and "global_batch_tokens" in message


@pytest.mark.parametrize(
    ("request_fields", "loc"),
    [
        ({"training": {"global_batch_size": True}}, ("training", "global_batch_size")),
        (
            {"training": {"global_batch_size": 8}, "search": {"pipeline_parallel": [True]}},
            ("search", "pipeline_parallel"),
        ),
        (
            {"training": {"global_batch_size": 8}, "model": {"preset": "llama3.1-8b", "seq_length": True}},
            ("model", "seq_length"),
        ),
        (
            {"training": {"global_batch_size": 8}, "cluster": {"accelerator": "H100-SXM", "num_nodes": True}},
            ("cluster", "num_nodes"),
        ),
    ],
)
def test_a_boolean_given_for_a_number_is_refused_naming_the_field(
    request_fields: dict[str, object], loc: tuple[str, ...]
) -> None:
    """``"global_batch_size": true`` had planned a batch of one sequence (pydantic's lax mode reads true as 1)."""
    with pytest.raises(ValidationError) as caught:
        PlanRequest.model_validate({**BASE, **request_fields})
    found = [(tuple(item["loc"]), item["msg"]) for item in caught.value.errors()]
    assert [where for where, _ in found] == [loc], found
    assert "(a boolean)" in found[0][1]


def test_fewer_tokens_than_one_sequence_name_one_sequence_once() -> None:
    # Was "use 8,192 or 8,192 (1 or 1 sequences)".
    ((loc, message),) = errors({"global_batch_tokens": 1000})
    assert loc == ("training", "global_batch_tokens")
    assert "use 8,192 (1 sequence)" in message


def test_an_empty_search_list_is_refused_naming_the_field() -> None:
    # search.pipeline_parallel [] was answered "admits no configuration on 8 GPUs ( is more than the 8 GPUs)".
    with pytest.raises(ValidationError) as caught:
        PlanRequest.model_validate(
            {**BASE, "training": {"global_batch_size": 8}, "search": {"pipeline_parallel": [], "method": []}}
        )
    found = {tuple(item["loc"]): item["msg"] for item in caught.value.errors()}
    assert set(found) == {("search", "pipeline_parallel"), ("search", "method")}
    assert "empty list" in found[("search", "pipeline_parallel")] and "drop it" in found[("search", "method")]
