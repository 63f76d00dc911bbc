"""Time limits are limits: ``solve`` answers within ``solver.time_limit_s`` + 2 s whatever the problem's shape,
every phase stops on the deadline and on the stop flag, and a problem too large to answer in time is refused."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pipesched.optimizer.bounds import lower_bounds
from pipesched.optimizer.families import FamilyDomainError
from pipesched.optimizer.instance import compile_problem
from pipesched.optimizer.problem import PASSES_PER_SECOND
from pipesched.optimizer.progress import Deadline
from pipesched.optimizer.simulate import simulate_indexed
from pipesched.optimizer.solve import solve
from pipesched.optimizer.solvers.heuristic import sequential_orders
from pipesched.runtime.records import run_delay_ms
from tests.conftest import uniform_problem

# Adversarial shapes: many ranks and stages with one microbatch (the bound's worst case before it was
# deadline-aware: 64 × 64 × 1 took 15–120 s at a 1 s limit), many microbatches, V and bidirectional placements,
# all at sizes the validation admits for a limit of 0.5 s (5,000 passes).
SHAPES = [
    # (num_ranks, num_microbatches, stages_per_rank, placement, limit in activations per rank or None)
    (64, 1, 64, "loop", None),
    (1024, 1, 4, "loop", None),
    (1024, 4, 1, "loop", 10.0),
    (16, 300, 1, "loop", 30.0),
    (8, 300, 2, "v", 30.0),
    (8, 300, 2, "bidirectional", 30.0),
    (512, 4, 2, "v", None),
]


def _problem(
    num_ranks: int, num_microbatches: int, stages_per_rank: int, placement: str, limit: float | None, tl: float
):
    return uniform_problem(
        num_ranks,
        num_microbatches,
        stages_per_rank=stages_per_rank,
        placement=placement,
        backward_weight=0.5,
        p2p=0.1,
        reduce_grad=0.3 if placement == "bidirectional" else None,
        limit=None if limit is None else limit * 100.0 * stages_per_rank,
        time_limit_s=tl,
    )


@pytest.fixture(scope="module", autouse=True)
def backends_imported() -> None:
    """A process's first search imports the exact backends (OR-Tools, on first use): one small solve first, so a
    timed window holds the search under test, not that import."""
    solve(_problem(2, 2, 1, "loop", None, tl=0.5))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.sampled_from(SHAPES), time_limit_s=st.sampled_from([0.5, 1.0]))
def test_auto_answers_within_the_limit_plus_two_seconds(shape: tuple, time_limit_s: float) -> None:
    """Wall time less the time this thread was ready to run but waited for a core (Linux's schedstat, where the
    kernel reports it): the suite's other workers start torch processes pinned to the 2 cores, and a 0.3 s answer
    then read 3.45 s on the wall clock. The search's deadline governs the rest."""
    problem = _problem(*shape, tl=time_limit_s)
    waited_before = run_delay_ms()
    started = time.perf_counter()
    schedule = solve(problem)
    wall = time.perf_counter() - started
    waited_after = run_delay_ms()
    waited = 0.0 if waited_before is None or waited_after is None else (waited_after - waited_before) / 1e3
    assert schedule.status in ("optimal", "feasible")
    assert wall - waited <= time_limit_s + 2.0, (
        f"{shape} at {time_limit_s} s answered after {wall:.2f} s ({waited:.2f} s of it waiting for a core)"
    )


def test_the_stop_flag_ends_every_phase_at_once() -> None:
    problem = _problem(64, 1, 64, "loop", None, tl=60.0)
    started = time.perf_counter()
    schedule = solve(problem, should_stop=lambda: True)
    assert time.perf_counter() - started < 10.0  # the unstopped bound alone took 15–120 s here
    assert schedule.status in ("optimal", "feasible")


def test_a_bound_cut_short_is_weaker_but_still_a_bound() -> None:
    problem = uniform_problem(8, 12, stages_per_rank=2, p2p=0.1, limit=600.0, objective="stage_span")
    inst = compile_problem(problem)
    full = lower_bounds(inst)
    cut = lower_bounds(inst, Deadline(time.perf_counter()))  # expired before it starts
    assert cut.stage_span <= full.stage_span and cut.makespan <= full.makespan
    assert cut.stage_span == max(inst.compute)  # each rank's work: the bound that costs nothing
    sequential = simulate_indexed(inst, sequential_orders(inst))
    assert full.makespan <= sequential.objective_value("makespan") + 1e-9
    assert full.stage_span > cut.stage_span  # the windows and the bottleneck rank add to it


def test_a_problem_too_large_for_its_limit_is_refused_naming_the_limit_it_needs() -> None:
    with pytest.raises(ValidationError) as raised:
        uniform_problem(8, 100_000, time_limit_s=1.0)
    error = raised.value.errors()[0]
    assert error["loc"] == ("pipeline", "num_microbatches")
    needed = math.ceil(800_000 / PASSES_PER_SECOND - 2)
    assert "solver.time_limit_s" in error["msg"] and f"at least {needed} s" in error["msg"]
    # With that time limit the same problem is accepted.
    assert uniform_problem(8, 100_000, time_limit_s=needed, method="1f1b").pipeline.num_microbatches == 100_000


FAMILY_SHAPES = [
    (64, 1, 64, "loop", "interleaved-1f1b"),
    (64, 1, 64, "loop", "looped-bfs"),
    (512, 4, 2, "v", "v-half"),
    (512, 4, 2, "v", "zb-v"),
    (512, 4, 2, "v", "dualpipe-v"),
    (16, 64, 2, "bidirectional", "bitpipe"),  # the authors' order: an even p dividing m
    (8, 300, 2, "v", "v-min"),
]


@pytest.mark.parametrize(("num_ranks", "num_microbatches", "stages_per_rank", "placement", "method"), FAMILY_SHAPES)
def test_a_named_family_answers_or_says_it_ran_out_of_time_within_the_limit(
    num_ranks: int, num_microbatches: int, stages_per_rank: int, placement: str, method: str
) -> None:
    # v-half on 512 ranks took 150 s at a 0.5 s limit before the families polled the deadline.
    problem = _problem(num_ranks, num_microbatches, stages_per_rank, placement, 30.0, tl=0.5).with_changes(
        **{"solver.method": method}
    )
    started = time.perf_counter()
    try:
        schedule = solve(problem)
        assert schedule.status in ("feasible", "optimal", "infeasible")
    except FamilyDomainError as error:
        assert "did not finish within solver.time_limit_s 0.5 s" in str(error) and "raise solver.time_limit_s" in str(
            error
        )
    assert time.perf_counter() - started <= 0.5 + 2.0


def test_the_issue_request_answers_over_http_within_the_limit(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from pipesched.api.app import create_app
    from pipesched.api.settings import Settings

    """Wall time less the time the service's threads (this process's and its solver processes') were ready to run
    but waited for a core: under the suite's pinned torch processes a 1 s limit read 3.99 s and once 8.7 s on the
    wall clock, passing alone. A search that ran past its deadline would still show: its own running is not a wait."""
    body = _problem(64, 1, 64, "loop", None, tl=1.0).model_dump(mode="json")
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'limits.sqlite3'}", solver_workers=1)
    with TestClient(create_app(settings)) as client:
        waited_before = _tree_run_delay_ms()
        started = time.perf_counter()
        response = client.post("/v1/schedules", json=body)
        wall = time.perf_counter() - started
        waited = (_tree_run_delay_ms() - waited_before) / 1e3
    assert response.status_code == 200, response.text[:300]
    assert wall - waited <= 1.0 + 2.0, f"answered after {wall:.2f} s, {waited:.2f} s of it waiting for a core"


def _tree_run_delay_ms() -> float:
    """The run delay (Linux schedstat, ms) summed over every thread of this process and of its descendants; 0 where
    the kernel does not report it. Summed over threads that may wait at the same time: an upper bound of the wait
    on any one path."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    tree, frontier = set(), [os.getpid()]
    while frontier:
        pid = frontier.pop()
        tree.add(pid)
        frontier.extend(child for child, parent in parents.items() if parent == pid and child not in tree)
    total = 0.0
    for pid in tree:
        for schedstat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
            try:
                total += int(schedstat.read_text().split()[1]) / 1e6
            except (OSError, IndexError, ValueError):
                continue
    return total


def test_one_search_context_stops_at_its_deadline_its_bound_and_its_flag() -> None:
    from pipesched.optimizer.progress import Progress, SearchContext

    reports: list[Progress] = []
    flag = {"stop": False}
    search: SearchContext[str] = SearchContext.start(
        60.0, 1.0, progress=reports.append, should_stop=lambda: flag["stop"]
    )
    assert not search.should_stop() and 58.0 < search.remaining() <= 59.0
    search.step_s = 100.0  # a step that cannot stop would end past the deadline
    assert search.should_stop()
    search.step_s = 0.0
    assert search.improve("first", 10.0, "a") and not search.improve("worse", 10.0, "b")
    search.raise_bound(12.0, "bounds")  # never above the incumbent: 10 is optimal
    assert search.lower_bound == 10.0 and search.should_stop() and search.best == "first"
    assert [(r.best_objective, r.lower_bound) for r in reports] == [(10.0, 0.0), (10.0, 10.0)]
    open_search: SearchContext[str] = SearchContext.start(60.0, should_stop=lambda: flag["stop"])
    assert not open_search.should_stop()
    flag["stop"] = True
    assert open_search.should_stop() and open_search.as_deadline().expired()
