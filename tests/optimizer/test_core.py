"""Problem validation messages, strict action parsing, and the Schedule JSON round trip."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pipesched.optimizer.ir import Action, ActionKind, parse_action
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.result import Schedule
from pipesched.optimizer.solve import solve_family
from tests.conftest import uniform_problem


def _error_text(**kwargs: object) -> tuple[list[tuple[object, ...]], str]:
    with pytest.raises(ValidationError) as error:
        uniform_problem(**kwargs)  # type: ignore[arg-type]
    return [item["loc"] for item in error.value.errors()], str(error.value)


def test_per_stage_list_of_wrong_length_names_the_field() -> None:
    locs, text = _error_text(num_ranks=4, forward=[1.0, 1.0, 1.0])
    assert ("costs", "forward") in locs
    assert "costs.forward has 3 values but the pipeline has 4 stages" in text


def test_v_placement_needs_two_stages_per_rank() -> None:
    locs, text = _error_text(placement="v", stages_per_rank=1)
    assert any(loc[-1] == "stages_per_rank" for loc in locs)
    assert 'placement "v" needs stages_per_rank 2' in text


def test_negative_cost_is_rejected() -> None:
    locs, text = _error_text(backward_input=-1.0)
    assert any("backward_input" in loc for loc in locs)
    assert "must not be negative" in text


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        ("pipeline", "num_ranks", True),
        ("pipeline", "num_microbatches", False),
        ("costs", "forward", [True, 1.0]),
        ("memory", "limit", True),
        ("solver", "time_limit_s", True),
    ],
)
def test_a_boolean_given_for_a_number_names_the_field(section: str, field: str, value: object) -> None:
    """pydantic's lax mode read ``"num_ranks": true`` as one rank and solved that: a wrong type is an error."""
    document = {
        "pipeline": {"num_ranks": 4, "num_microbatches": 8},
        "costs": {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0, "p2p": 0.1},
        "memory": {"activation": 100, "retained_for_weight": 40, "limit": 400},
        "solver": {"time_limit_s": 5},
    }
    document[section][field] = value  # type: ignore[index]
    with pytest.raises(ValidationError) as error:
        Problem.model_validate(document)
    assert [item["loc"] for item in error.value.errors()] == [(section, field)]
    assert "expected a number, got" in str(error.value) and "(a boolean)" in str(error.value)


@pytest.mark.parametrize(
    ("placement", "words"),
    [
        ("zigzag", "'zigzag' is not a placement"),
        (5, "got 5"),
        ([0, 1, 2, "x"], "entry 3: expected the rank of stage 3"),
    ],
)
def test_a_bad_placement_is_one_error_on_the_field(placement: object, words: str) -> None:
    """It had been one error per union member, at ``pipeline.placement.literal['loop','v','bidirectional']`` and
    ``pipeline.placement.list[int]``."""
    document = {
        "pipeline": {"num_ranks": 4, "num_microbatches": 8, "placement": placement},
        "costs": {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0, "p2p": 0.1},
        "memory": {"activation": 100, "retained_for_weight": 40},
    }
    with pytest.raises(ValidationError) as error:
        Problem.model_validate(document)
    assert [item["loc"] for item in error.value.errors()] == [("pipeline", "placement")]
    assert words in str(error.value)


def test_retained_over_activation_is_rejected() -> None:
    locs, text = _error_text(activation=10.0, retained_for_weight=20.0)
    assert ("memory", "retained_for_weight") in locs
    assert "retained_for_weight must not exceed activation" in text


@pytest.mark.parametrize("text", ["0F1x", "01F1", " 0F1", "0X1", "0F", "F1", "0f1", "0F01", ""])
def test_parse_action_is_strict(text: str) -> None:
    with pytest.raises(ValueError, match="is not an action") as error:
        parse_action(text)
    assert 'one of F, I, W, B (e.g. "3F12")' in str(error.value)  # "B, (e.g." before


def test_parse_action_round_trip() -> None:
    for action in (Action(3, ActionKind.FORWARD, 12), Action(0, ActionKind.BACKWARD_WEIGHT, 0)):
        assert parse_action(str(action)) == action
    assert parse_action("10I7") == Action(10, ActionKind.BACKWARD_INPUT, 7)


@pytest.mark.parametrize("method", ["zb-h2", "dualpipe-v"])
def test_schedule_json_round_trip(method: str) -> None:
    problem = uniform_problem(
        3, 5, stages_per_rank=2 if method == "dualpipe-v" else 1, placement="v" if method == "dualpipe-v" else "loop"
    )
    schedule = solve_family(problem, method)
    again = Schedule.model_validate_json(schedule.model_dump_json())
    assert again == schedule
    assert again.orders() == schedule.orders()
    assert again.problem == problem


def test_auto_without_memory_limit_solves() -> None:
    """No limit means unbounded capacity: the heuristic's warm-up cap must not turn inf into NaN."""
    from pipesched.optimizer.solve import solve
    from tests.conftest import uniform_problem

    schedule = solve(uniform_problem(4, 6, limit=None, time_limit_s=2.0))
    assert schedule.status in ("optimal", "feasible")
    assert schedule.fits_memory


def test_a_problem_too_large_to_plan_names_num_microbatches() -> None:
    import pytest
    from pydantic import ValidationError

    from tests.conftest import uniform_problem

    with pytest.raises(ValidationError) as raised:
        uniform_problem(1024, 100_000, stages_per_rank=2)
    error = raised.value.errors()[0]
    assert error["loc"] == ("pipeline", "num_microbatches") and "fewer microbatches" in error["msg"]


def test_one_placement_rule_for_every_placement() -> None:
    from pipesched.optimizer.problem import Pipeline, stage_to_rank

    def pipeline(placement: object, v: int = 2) -> Pipeline:
        return Pipeline.model_validate(
            {"num_ranks": 3, "num_microbatches": 4, "stages_per_rank": v, "placement": placement}
        )

    assert pipeline("loop").stage_to_rank == [0, 1, 2, 0, 1, 2]
    assert pipeline("v").stage_to_rank == [0, 1, 2, 2, 1, 0]
    bidirectional = pipeline("bidirectional")
    assert bidirectional.stage_to_rank == [0, 1, 2, 2, 1, 0, 2, 1, 0, 0, 1, 2]
    assert bidirectional.stage_holders() == [[0, 2], [1], [0, 2], [0, 2], [1], [0, 2]]
    assert pipeline([2, 1, 0], v=1).stage_holders() == [[2], [1], [0]]
    with pytest.raises(ValueError, match="unknown placement 'w'"):
        stage_to_rank(3, 2, "w")


def test_a_schedule_says_its_shape_and_its_data_parallel_group() -> None:
    from pipesched.optimizer.pattern import memory_timelines

    step = solve_family(uniform_problem(2, 4), "1f1b")
    assert step.shape == "step" and step.data_parallel.size == 1 and step.data_parallel.sharding == "none"
    body = uniform_problem(2, 4).model_dump(mode="json")
    body["training"] = {"flush": False}
    body["objective"] = "step_period"
    pattern = solve_family(Problem.model_validate(body), "pipedream-2bw")
    assert pattern.shape == "pattern" and pattern.step_period is not None
    timelines, peaks = memory_timelines(pattern)
    assert peaks == pattern.peak_memory and max(level for _, level in timelines[0]) == pytest.approx(peaks[0])
    assert memory_timelines(step)[1] == pytest.approx(step.peak_memory)
