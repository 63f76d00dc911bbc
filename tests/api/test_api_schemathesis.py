"""Property-based API tests: schemathesis against the OpenAPI schema a real ``pipesched serve`` serves.

Every operation gets a bounded number of generated requests (valid and invalid); no answer may be a
5xx, carry an undocumented status code or content type, or violate its documented response schema.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.api.test_api_served import ServedApi, problem_body

#: Generated requests per operation (thirteen operations): keeps the module under a minute.
MAX_EXAMPLES = 60


@pytest.fixture(scope="module")
def served_schema(tmp_path_factory: pytest.TempPathFactory) -> Iterator[schemathesis.BaseSchema]:
    directory = tmp_path_factory.mktemp("schemathesis")
    server = ServedApi(
        f"sqlite:///{directory / 'schemathesis.sqlite3'}",
        directory / "server.log",
        PIPESCHED_SOLVER_WORKERS="2",
        PIPESCHED_MAX_TIME_LIMIT_S="1",
        PIPESCHED_MAX_ACTIONS="3000",
    )
    try:
        yield schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    finally:
        server.stop()


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def test_no_server_error_and_no_schema_violation(served_schema: schemathesis.BaseSchema) -> None:
    operations = [result.ok() for result in served_schema.get_all_operations()]
    assert len(operations) == 16
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        )
        def check(case: schemathesis.Case) -> None:
            case.call_and_validate(checks=CHECKS, timeout=60)

        check()


def test_real_answers_conform_to_the_schema(served_schema: schemathesis.BaseSchema) -> None:
    """Generated bodies rarely pass the Problem's cross-field checks: check real answers explicitly."""
    solve_op = served_schema["/v1/schedules"]["POST"]
    job_op = served_schema["/v1/jobs"]["POST"]
    get_op = served_schema["/v1/schedules/{schedule_id}"]["GET"]
    view_op = served_schema["/v1/schedules/{schedule_id}/view"]["GET"]
    job_get_op = served_schema["/v1/jobs/{job_id}"]["GET"]
    job_delete_op = served_schema["/v1/jobs/{job_id}"]["DELETE"]
    bodies = [
        problem_body(8, "1f1b", 1.0),
        problem_body(6, "auto", 1.0),
        {**problem_body(8, "gpipe", 1.0), "memory": {"activation": 100.0, "limit": 300.0}},  # infeasible
        {**problem_body(8, "1f1b", 1.0), "pipeline": {"num_ranks": 4, "num_microbatches": 8, "stages_per_rank": 2}},
    ]
    for body in bodies:
        answer = solve_op.Case(body=body).call_and_validate(checks=CHECKS, timeout=60)
        created = job_op.Case(body=body).call_and_validate(checks=CHECKS, timeout=60)
        if answer.status_code != 200:
            assert answer.status_code == 422 and created.status_code == 422
            continue
        schedule_id = answer.json()["id"]
        for output_format in ("json", "csv", "chrome-trace", "png", "svg"):
            case = get_op.Case(path_parameters={"schedule_id": schedule_id}, query={"format": output_format})
            case.call_and_validate(checks=CHECKS, timeout=60)
        view_op.Case(path_parameters={"schedule_id": schedule_id}, query={"compare": "gpipe"}).call_and_validate(
            checks=CHECKS, timeout=60
        )
        job_id = created.json()["id"]
        job_get_op.Case(path_parameters={"job_id": job_id}).call_and_validate(checks=CHECKS, timeout=60)
        job_delete_op.Case(path_parameters={"job_id": job_id}).call_and_validate(checks=CHECKS, timeout=60)
