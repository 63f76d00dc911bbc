"""Regression tests for review findings on the service, the CLI's serve command and the optimizer's helpers."""

from __future__ import annotations

import inspect
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from rich.console import Console

from pipesched.api.app import create_app
from pipesched.api.settings import Settings
from pipesched.api.storage import Store, problem_key
from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.partition import PartitionError, partition_layers
from pipesched.optimizer.solve import solve
from pipesched.optimizer.units import format_bytes
from tests.conftest import uniform_problem

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # starlette on its httpx TestClient


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    path = tmp_path_factory.mktemp("review") / "pipesched.api.sqlite3"
    settings = Settings(database_url=f"sqlite:///{path}", solver_workers=1, max_time_limit_s=3.0)
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def test_view_compare_with_a_family_over_the_memory_limit_draws_it_flagged(client: TestClient) -> None:
    # 1F1B holds at most 4 microbatches' activations (400 bytes) on rank 0; GPipe holds all 8 (800).
    problem = uniform_problem(4, 8, p2p=0.1, limit=500.0, method="1f1b", time_limit_s=2.0)
    answer = client.post("/v1/schedules", json=problem.model_dump(mode="json")).json()
    assert answer["status"] == "feasible", answer
    page = client.get(f"/v1/schedules/{answer['id']}/view", params={"compare": "gpipe"})
    assert page.status_code == 200, page.text
    assert "OVER THE LIMIT" in page.text
    assert page.text.count("<svg") >= 2  # both schedules drawn
    # The over-the-limit drawing is not stored as the answer to the gpipe problem.
    gpipe = problem.with_changes(**{"solver.method": "gpipe"}).model_dump(mode="json")
    assert client.post("/v1/schedules", json=gpipe).json()["status"] == "infeasible"


def test_view_compare_outside_the_family_domain_or_auto_is_a_422_naming_compare(client: TestClient) -> None:
    problem = uniform_problem(4, 8, method="1f1b", time_limit_s=2.0, split_backward=False)
    schedule_id = client.post("/v1/schedules", json=problem.model_dump(mode="json")).json()["id"]
    for family in ("zb-h1", "auto", "no-such-family"):
        response = client.get(f"/v1/schedules/{schedule_id}/view", params={"compare": family})
        assert response.status_code == 422, (family, response.text)
        assert response.json()["detail"][0]["loc"] == ["query", "compare"]


def test_partition_cost_is_linear_in_layers_not_in_ranks_times_stages() -> None:
    # 256 ranks × 16 stages each: walking every stage per memory check made this 258,560 stage_memory calls
    # and seconds of work; keeping each rank's held bytes up to date needs two calls per layer placed.
    num_ranks, stages_per_rank, num_layers = 256, 16, 20_000
    num_stages = num_ranks * stages_per_rank
    calls = 0

    def stage_memory(stage: int, count: int) -> float:
        nonlocal calls
        calls += 1
        return 1000.0 * count + (500.0 if stage == 0 else 0.0)

    started = time.perf_counter()
    counts = partition_layers(
        num_layers,
        num_stages,
        stage_time=lambda stage, count: count + (0.5 if stage == num_stages - 1 else 0.0),
        stage_memory=stage_memory,
        stage_ranks=[[stage % num_ranks] for stage in range(num_stages)],
        num_ranks=num_ranks,
        limit=1e12,
    )
    elapsed_s = time.perf_counter() - started
    assert sum(counts) == num_layers and max(counts) - min(counts) == 1
    assert counts[-1] == min(counts)  # the head's stage is slower per layer count, so it gets fewer
    assert calls <= 2 * num_layers + num_stages
    assert elapsed_s < 2.0


def test_partition_memory_shared_by_a_ranks_stages_still_closes_the_full_rank() -> None:
    # 2 ranks × 2 stages (loop: stages 0, 2 on rank 0; 1, 3 on rank 1); rank 0's limit admits 5 layers, rank 1's 6.
    counts = partition_layers(
        11,
        4,
        stage_time=lambda stage, count: float(count),
        stage_memory=lambda stage, count: 10.0 * count + (15.0 if stage == 0 else 0.0),
        stage_ranks=[[0], [1], [0], [1]],
        num_ranks=2,
        limit=65.0,
    )
    assert counts[0] + counts[2] == 5 and counts[1] + counts[3] == 6
    with pytest.raises(PartitionError, match=r"1 of 12 layers do not fit.*already holds"):
        partition_layers(
            12,
            4,
            stage_time=lambda stage, count: float(count),
            stage_memory=lambda stage, count: 10.0 * count + (15.0 if stage == 0 else 0.0),
            stage_ranks=[[0], [1], [0], [1]],
            num_ranks=2,
            limit=65.0,
        )


def _report_with_losses(losses: dict[int, float], reference_loss: float) -> Any:
    """A run report whose measured actions are the schedule's own times (no torch run needed)."""
    pytest.importorskip("torch")
    from pipesched.runtime.records import MeasuredAction, RankResult, StepCheck, StepRecord
    from pipesched.runtime.report import build_report
    from pipesched.runtime.verify import Reference

    schedule = solve(uniform_problem(2, 3, method="1f1b", split_backward=False))
    last = schedule.ranks[-1].rank
    results = [
        RankResult(
            rank=rank.rank,
            pp_rank=rank.rank,
            dp_rank=0,
            device="cpu",
            memory_measure="saved-activations",
            steps=[
                StepRecord(
                    actions=[MeasuredAction(action=a.action, start=a.start, end=a.end) for a in rank.actions],
                    losses=losses if rank.rank == last else {},
                )
            ],
            executed=[a.action for a in rank.actions],
        )
        for rank in schedule.ranks
    ]
    reference = Reference(losses=[reference_loss], steps=[StepCheck(step=0, skipped=False)])
    return build_report(
        schedule, results, reference, None, backend="gloo", device="cpu", engine="test", model_name="none"
    )


def test_run_report_with_a_missing_loss_is_valid_json_and_not_verified() -> None:
    complete = _report_with_losses({0: 1.0, 1: 2.0, 2: 3.0}, reference_loss=2.0)
    assert complete.verified and complete.loss == 2.0 and complete.missing_losses == []
    report = _report_with_losses({0: 1.0, 2: 3.0}, reference_loss=2.0)
    assert report.loss is None and report.loss_rel_error is None
    assert report.missing_losses == [1] and report.verified is False
    assert json.loads(report.model_dump_json())["loss"] is None  # strict JSON: no NaN
    from pipesched.runtime.report import print_report

    console = Console(file=io.StringIO(), width=200)
    print_report(report, console)
    assert "missing for microbatch(es) 1" in console.file.getvalue()


def test_max_job_attempts_counts_the_restarts_a_job_lives_through(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'attempts.sqlite3'}")
    problem = uniform_problem(2, 2, method="1f1b")
    job = store.create_job(problem, problem_key(problem))
    try:
        # max_job_attempts 1 ("restarts a job may live through"): re-queued at the first restart …
        requeued, failed = store.recover_jobs(1)
        assert requeued == [(job.id, 1)] and failed == []
        assert store.start_job(job.id, 1)
        # … and failed at the second.
        requeued, failed = store.recover_jobs(1)
        assert requeued == [] and failed == [job.id]
        assert store.job_status(job.id) == "failed"
    finally:
        store.dispose()


@pytest.mark.parametrize(
    "env,expected",
    [
        ({"PIPESCHED_PORT": "abc"}, "PIPESCHED_PORT: Input should be a valid integer"),
        ({"PIPESCHED_SOLVER_WORKERS": "0"}, "PIPESCHED_SOLVER_WORKERS: Input should be greater than or equal to 1"),
        ({"PIPESCHED_DATABASE_URL": "not a url"}, "PIPESCHED_DATABASE_URL is not a usable database URL"),
        ({"PIPESCHED_DATABASE_URL": "nosuchdb://host/db"}, "PIPESCHED_DATABASE_URL is not a usable database URL"),
        (
            {"PIPESCHED_DATABASE_URL": "sqlite:////nonexistent/dir/pipesched.sqlite3"},
            "PIPESCHED_DATABASE_URL: cannot open the database",
        ),
    ],
)
def test_serve_with_a_bad_setting_exits_2_naming_it(env: dict[str, str], expected: str) -> None:
    from typer.testing import CliRunner

    from pipesched.api.cli import app

    result = CliRunner().invoke(app, ["serve"], env=env)
    assert result.exit_code == 2, (result.output, result.exception)
    assert expected in " ".join(result.stderr.split())
    assert "sqlite:///FILE" in result.stderr or "set a valid value" in result.stderr
    assert "Traceback" not in result.output


def test_serve_port_option_is_validated_like_the_setting() -> None:
    from typer.testing import CliRunner

    from pipesched.api.cli import app

    result = CliRunner().invoke(app, ["serve", "--port", "70000"])
    assert result.exit_code == 2, (result.output, result.exception)
    assert "PIPESCHED_PORT (or --port): Input should be less than or equal to 65535" in " ".join(result.stderr.split())


def test_format_bytes_adapts_its_unit() -> None:
    assert format_bytes(100) == "100 bytes"
    assert format_bytes(8 * 2**20) == "8 MiB"
    assert format_bytes(1536 * 2**20) == "1.5 GiB"
    assert format_bytes(3 * 2**40) == "3 TiB"


def test_weights_too_large_for_a_small_memory_give_the_sizes_not_zero_gib() -> None:
    # A 4-layer model on ranks of 8 MiB: the weights need a few MiB per rank, which read "0.0 GiB" before.
    model = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 1000}
    body = {
        "pipeline": {"num_ranks": 2, "num_microbatches": 4},
        "model": model,
        "cluster": {
            "memory_bytes": 2**20,
            "flops_per_s": 1e12,
            "memory_bandwidth_bytes_per_s": 1e11,
            "memory_headroom_bytes": 0,
        },
    }
    with pytest.raises(ValidationError) as excinfo:
        load_problem(body)
    message = next(str(e["msg"]) for e in excinfo.value.errors() if tuple(e["loc"])[:2] == ("cluster", "memory_bytes"))
    assert "weights, gradients and optimizer state need" in message
    assert "0.0 GiB" not in message and "MiB per rank" in message and "has 1 MiB" in message


def test_the_service_modules_have_no_undocumented_public_functions_and_no_dead_wrappers() -> None:
    import pipesched.api.app
    import pipesched.api.jobs
    import pipesched.api.routes._common
    import pipesched.api.storage

    undocumented = []
    for module in (pipesched.api.app, pipesched.api.jobs, pipesched.api.routes._common, pipesched.api.storage):
        for name, value in vars(module).items():
            if name.startswith("_") or getattr(value, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(value) and not value.__doc__:
                undocumented.append(f"{module.__name__}.{name}")
            if inspect.isclass(value):
                if not value.__doc__:
                    undocumented.append(f"{module.__name__}.{name}")
                undocumented += [
                    f"{module.__name__}.{name}.{method}"
                    for method, member in vars(value).items()
                    if not method.startswith("_") and inspect.isfunction(member) and not member.__doc__
                ]
    assert undocumented == []
    # Removed: an OpenAPI dumper nothing called, and a key function that only renamed problem_key.
    assert not hasattr(pipesched.api.app, "openapi_json") and not hasattr(pipesched.api.routes._common, "solve_key")
