"""Schedule families: known formulas, domains, property tests, and the simulator's rejections."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pipesched.optimizer.communication import with_communication
from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.families import FamilyDomainError, FamilySpec, discover_families, get_family, registry
from pipesched.optimizer.instance import compile_problem
from pipesched.optimizer.ir import Action, ActionKind
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.simulate import InvalidSchedule, SimulationResult, simulate
from tests.conftest import REPO, uniform_problem


def _run(problem: Problem, name: str) -> SimulationResult:
    """The family's orders with the step's communication (a bidirectional placement's replica sync) placed."""
    inst = compile_problem(problem)
    return simulate(inst, with_communication(inst, get_family(name).generate(problem)))


# -- known formulas (uniform costs, zero p2p) ---------------------------------------------------


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (5, 11), (8, 16)])
def test_one_f_one_b_bubble_formula(p: int, m: int) -> None:
    problem = uniform_problem(p, m, forward=2.0, backward_input=3.0, backward_weight=1.5, split_backward=False)
    sim = _run(problem, "1f1b")
    assert sim.makespan == pytest.approx(m * 6.5 + (p - 1) * 6.5)


@pytest.mark.parametrize(("p", "m"), [(4, 8), (6, 12)])
def test_zero_bubble_formulas(p: int, m: int) -> None:
    costs = {"forward": 2.0, "backward_input": 2.5, "backward_weight": 1.5}
    h1 = _run(uniform_problem(p, m, **costs, objective="stage_span"), "zb-h1")
    assert h1.stage_span == pytest.approx(m * 6.0 + (p - 1) * (2.0 + 2.5 - 1.5))
    assert h1.peak_memory[0] == pytest.approx(p * 100.0)
    assert max(h1.peak_memory) == h1.peak_memory[0]
    h2 = _run(uniform_problem(p, m, **costs, objective="stage_span"), "zb-h2")
    assert h2.peak_memory[0] == pytest.approx((2 * p - 1) * 100.0)
    assert h2.stage_span < h1.stage_span


def test_interleaved_bubble_shrinks_with_stages_per_rank() -> None:
    p, m = 4, 8
    rates = []
    for v in (1, 2, 4):
        # The same model cut into v chunks per rank: each stage costs 1/v.
        problem = uniform_problem(
            p, m, stages_per_rank=v, forward=1 / v, backward_input=1 / v, backward_weight=1 / v, split_backward=False
        )
        sim = _run(problem, "1f1b" if v == 1 else "interleaved-1f1b")
        rates.append(sim.bubble_rate("makespan"))
        assert sim.makespan - sim.ideal == pytest.approx((p - 1) * 3.0 / v)
    assert rates[0] > rates[1] > rates[2]


def test_v_half_and_v_min_memory() -> None:
    p, m = 12, 24
    one = _run(uniform_problem(p, m, activation=200.0, retained_for_weight=80.0), "1f1b")
    halves = {"forward": 0.5, "backward_input": 0.5, "backward_weight": 0.5}
    v_problem = uniform_problem(p, m, stages_per_rank=2, placement="v", **halves)
    zb_v = _run(v_problem, "zb-v")
    half = _run(v_problem, "v-half")
    vmin = _run(v_problem, "v-min")
    baseline = max(one.peak_memory)
    assert max(zb_v.peak_memory) <= baseline
    assert 0.4 * baseline <= max(half.peak_memory) <= (0.5 + 1 / p) * baseline + 1e-6
    assert 0.25 * baseline <= max(vmin.peak_memory) <= (1 / 3 + 1 / p) * baseline + 1e-6
    assert zb_v.bubble_rate("makespan") < one.bubble_rate("makespan")


def test_dualpipe_v_peak_about_p_plus_one_microbatches() -> None:
    p = 4
    sim = _run(uniform_problem(p, 16, stages_per_rank=2, placement="v"), "dualpipe-v")
    # One microbatch holds 2 × 100 bytes on a rank (its two stages).
    assert p * 200.0 <= max(sim.peak_memory) <= (p + 1) * 200.0


# -- domains and property tests -----------------------------------------------------------------


def _domain(family: FamilySpec) -> tuple[str, tuple[int, ...], bool]:
    """(placement, the first three admitted stages_per_rank, needs split backward), from the declaration."""
    return family.placements[0], tuple(family.stages_per_rank[:3]), family.backward == "split"


# pipedream-2bw (no flush, a repeating pattern) is tested in tests/optimizer/test_training.py.
_DOMAINS = {name: _domain(family) for name, family in registry().items() if family.flush}


def test_every_contract_family_is_registered() -> None:
    contract = (REPO / "docs" / "CONTRACT.md").read_text()
    line = next(line for line in contract.splitlines() if line.startswith("- `solver.method`"))
    named = line.split("a named family:")[1].split(".")[0]
    assert set(registry()) == {name.strip(" `") for name in named.split(",")}


@pytest.mark.parametrize("name", sorted(_DOMAINS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_generated_schedules_pass_the_simulator(name: str, data: st.DataObject) -> None:
    forward = data.draw(st.floats(0.5, 3.0), label="forward")
    p2p = data.draw(st.sampled_from([0.0, 0.3]), label="p2p")
    problem = _draw_problem(data, name, min_ranks=1, max_microbatches=13, forward=forward, p2p=p2p)
    sim = _run(problem, name)
    assert sim.makespan >= sim.ideal - 1e-9
    kinds = {action.kind for row in get_family(name).generate(problem) for action in row}
    assert (ActionKind.BACKWARD in kinds) == (not problem.split_backward)


def _draw_problem(data: st.DataObject, name: str, *, min_ranks: int, max_microbatches: int, **costs: float) -> Problem:
    """A uniform problem inside family ``name``'s domain: 1–5 ranks, 1–``max_microbatches`` microbatches."""
    placement, stages, needs_split = _DOMAINS[name]
    p = data.draw(st.integers(min_ranks, 5), label="num_ranks")
    m = data.draw(st.integers(1, max_microbatches), label="num_microbatches")
    if name == "bitpipe":  # the authors' order: an even p, m a multiple of it (their fork's own check)
        p = 2 * max(1, p // 2)
        m = p * max(1, m // p)
    v = data.draw(st.sampled_from(stages), label="stages_per_rank")
    split = True if needs_split else data.draw(st.booleans(), label="split_backward")
    sync = {"reduce_grad": 0.4} if placement == "bidirectional" else {}
    return uniform_problem(p, m, stages_per_rank=v, placement=placement, split_backward=split, **sync, **costs)


_OUTSIDE = [
    ("1f1b", {"stages_per_rank": 2, "placement": "v"}, 'placement "loop"'),
    ("interleaved-1f1b", {"stages_per_rank": 1}, "stages_per_rank ≥ 2"),
    ("zb-h1", {"split_backward": False}, "split_backward true"),
    ("zb-h2", {"stages_per_rank": 2}, "stages_per_rank 1"),
    ("zb-v", {"stages_per_rank": 2, "placement": "v", "split_backward": False}, "split_backward true"),
    ("zb-v", {"stages_per_rank": 2}, 'placement "v" with stages_per_rank 2'),
    ("v-half", {"stages_per_rank": 2, "placement": "bidirectional", "reduce_grad": 0.4}, 'placement "v"'),
    (
        "bitpipe",
        {"stages_per_rank": 2, "placement": "bidirectional", "reduce_grad": 0.4, "num_microbatches": 6},
        "num_microbatches a multiple of num_ranks",
    ),
    ("v-min", {}, 'placement "v"'),
    ("bitpipe", {"stages_per_rank": 2, "placement": "v"}, '"bidirectional"'),
    ("dualpipe-v", {"stages_per_rank": 2}, 'placement "v"'),
    ("looped-bfs", {"stages_per_rank": 2, "placement": "v"}, 'placement "loop"'),
]


@pytest.mark.parametrize(("name", "changes", "needle"), _OUTSIDE)
def test_outside_the_domain_is_a_clear_error(name: str, changes: dict, needle: str) -> None:  # type: ignore[type-arg]
    problem = uniform_problem(**{"num_ranks": 4, "num_microbatches": 8, **changes})
    with pytest.raises(FamilyDomainError, match=name) as error:
        get_family(name).generate(problem)
    assert needle in str(error.value)


# -- corrupted schedules ------------------------------------------------------------------------


def _h1() -> tuple[Problem, list[list[Action]]]:
    problem = uniform_problem(4, 8)
    return problem, get_family("zb-h1").generate(problem)


def test_dropped_action_is_missing() -> None:
    problem, orders = _h1()
    dropped = orders[2].pop(5)
    with pytest.raises(InvalidSchedule) as error:
        simulate(compile_problem(problem), orders)
    assert error.value.reason == "missing_action"
    assert error.value.details["action"] == str(dropped) and error.value.details["rank"] == 2


def test_duplicated_action_is_rejected() -> None:
    problem, orders = _h1()
    orders[1].append(orders[1][0])
    with pytest.raises(InvalidSchedule) as error:
        simulate(compile_problem(problem), orders)
    assert error.value.reason == "duplicate_action"


def test_weight_before_its_input_gradient_deadlocks() -> None:
    problem, orders = _h1()
    row = orders[3]
    i_pos = row.index(Action(3, ActionKind.BACKWARD_INPUT, 0))
    w_pos = row.index(Action(3, ActionKind.BACKWARD_WEIGHT, 0))
    row.insert(i_pos, row.pop(w_pos))
    with pytest.raises(InvalidSchedule, match="rank 3 cannot run 3W0 before 3I0") as error:
        simulate(compile_problem(problem), orders)
    assert error.value.reason == "deadlock"
    assert {"rank": 3, "action": "3W0", "waits_for": "3I0", "on_rank": 3} in error.value.details["waits"]


def test_backward_before_its_forward_deadlocks() -> None:
    problem = uniform_problem(3, 4, split_backward=False)
    orders = get_family("1f1b").generate(problem)
    row = orders[0]
    f_pos = row.index(Action(0, ActionKind.FORWARD, 0))
    b_pos = row.index(Action(0, ActionKind.BACKWARD, 0))
    row[f_pos], row[b_pos] = row[b_pos], row[f_pos]
    with pytest.raises(InvalidSchedule, match="rank 0 cannot run 0B0") as error:
        simulate(compile_problem(problem), orders)
    assert error.value.reason == "deadlock"
    assert any(wait["rank"] == 0 for wait in error.value.details["waits"])


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
def test_memory_limit_one_byte_below_peak(name: str) -> None:
    problem = uniform_problem(4, 8)
    orders = get_family(name).generate(problem)
    peak = max(simulate(compile_problem(problem), orders).peak_memory)
    assert simulate(compile_problem(problem.with_changes(**{"memory.limit": peak})), orders).fits
    with pytest.raises(InvalidSchedule) as error:
        simulate(compile_problem(problem.with_changes(**{"memory.limit": peak - 1})), orders)
    assert error.value.reason == "memory_limit"
    assert error.value.details["rank"] == 0
    assert error.value.details["bytes"] == pytest.approx(peak)
    assert f"rank 0 holds {peak:.0f} bytes" in str(error.value)


@pytest.mark.parametrize("name", sorted(_DOMAINS))
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_corrupted_family_schedules_are_rejected_with_their_reason(name: str, data: st.DataObject) -> None:
    problem = _draw_problem(data, name, min_ranks=2, max_microbatches=9, p2p=0.25)
    inst = compile_problem(problem)
    orders = with_communication(inst, get_family(name).generate(problem))
    rank = data.draw(st.sampled_from([r for r, row in enumerate(orders) if row]), label="rank")

    # A dropped action.
    position = data.draw(st.integers(0, len(orders[rank]) - 1), label="position")
    dropped = [list(row) for row in orders]
    action = dropped[rank].pop(position)
    with pytest.raises(InvalidSchedule) as error:
        simulate(inst, dropped)
    assert error.value.reason == "missing_action"
    assert error.value.details["action"] == str(action)

    # A duplicated action.
    duplicated = [list(row) for row in orders]
    duplicated[rank].insert(position, duplicated[rank][position])
    with pytest.raises(InvalidSchedule) as error:
        simulate(inst, duplicated)
    assert error.value.reason == "duplicate_action"

    # A swapped dependency: a backward moved before its own forward on the same rank.
    row = orders[rank]
    backwards = [a for a in row if a.kind in (ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD)]
    backward = data.draw(st.sampled_from(backwards), label="backward")
    swapped = [list(r) for r in orders]
    swapped[rank].remove(backward)
    swapped[rank].insert(swapped[rank].index(Action(backward.stage, ActionKind.FORWARD, backward.microbatch)), backward)
    with pytest.raises(InvalidSchedule) as error:
        simulate(inst, swapped)
    assert error.value.reason == "deadlock"
    assert any(wait["rank"] == rank for wait in error.value.details["waits"])

    # A memory limit one byte below the peak.
    peaks = simulate(inst, orders).peak_memory
    tight = compile_problem(problem.with_changes(**{"memory.limit": max(peaks) - 1}))
    with pytest.raises(InvalidSchedule) as error:
        simulate(tight, orders)
    assert error.value.reason == "memory_limit"
    assert peaks[error.value.details["rank"]] == max(peaks)


def test_capped_greedy_stops_when_asked() -> None:
    from pipesched.optimizer.families._greedy import SearchStopped, capped_greedy_orders

    inst = compile_problem(uniform_problem(4, 8, stages_per_rank=2, placement="bidirectional", reduce_grad=0.4))
    calls = []

    def stop_after_ten() -> bool:
        calls.append(1)
        return len(calls) > 10

    with pytest.raises(SearchStopped):
        capped_greedy_orders(inst, [1e9] * 4, should_stop=stop_after_ten)
    assert len(calls) == 11  # polled once per placed action, and it stopped at the first True


# -- the registry ---------------------------------------------------------------------------------


def _package(tmp_path: Path, name: str, modules: dict[str, str]) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    for module, text in modules.items():
        (folder / f"{module}.py").write_text(text)
    return folder


_SPEC = (
    "from pipesched.optimizer.families import FamilySpec\n"
    "FAMILIES = [FamilySpec(name={name!r}, description='', build=lambda problem: [], listing_order={order})]\n"
)


def test_a_family_module_that_fails_to_import_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    good = _package(tmp_path, "fams_good", {"b": _SPEC.format(name="b", order=2), "a": _SPEC.format(name="a", order=1)})
    assert [spec.name for spec in discover_families(good, "fams_good")] == ["a", "b"]
    broken = _package(tmp_path, "fams_broken", {"a": _SPEC.format(name="a", order=1), "b": "import no_such_module\n"})
    with pytest.raises(ImportError, match="no_such_module"):
        discover_families(broken, "fams_broken")
    bare = _package(tmp_path, "fams_bare", {"helper": "X = 1\n", "_private": "Y = 2\n"})
    with pytest.raises(RuntimeError, match=r"fams_bare\.helper declares no FAMILIES"):
        discover_families(bare, "fams_bare")
    twice = _package(
        tmp_path, "fams_twice", {"a": _SPEC.format(name="a", order=1), "b": _SPEC.format(name="a", order=2)}
    )
    with pytest.raises(RuntimeError, match="share the name 'a'"):
        discover_families(twice, "fams_twice")


def test_the_loader_checks_the_method_against_the_registry() -> None:
    body = uniform_problem(4, 8).model_dump(mode="json")
    body["solver"]["method"] = "zb-h3"
    with pytest.raises(ValidationError) as error:
        load_problem(body)
    entry = error.value.errors()[0]
    assert entry["loc"] == ("solver", "method") and "did you mean zb-h2" in entry["msg"]
    body["solver"]["method"] = "pipedream-2bw"
    del body["training"]
    assert load_problem(body).training.flush is False  # a family without a flush sets its training


@pytest.mark.parametrize("split_backward", [False, True])
def test_lga_is_breadth_first_at_one_layer_per_stage(split_backward: bool) -> None:
    """LGA (Lamy-Poirier 2021, Sec. 3) runs every microbatch through a layer before the next, forward up and
    backward down, with layer l on rank l mod p: looped-bfs's order when a stage is one layer. The family is
    kept for its domain (one stage per layer of the model) and documented as this same order."""
    problem = uniform_problem(4, 6, stages_per_rank=4, split_backward=split_backward)
    assert get_family("lga").generate(problem) == get_family("looped-bfs").generate(problem)
    assert get_family("lga").gather_runs and get_family("looped-bfs").gather_runs
    layered = {
        "pipeline": {"num_ranks": 4, "num_microbatches": 6, "stages_per_rank": 2},
        "model": {
            "num_layers": 16,
            "hidden_size": 256,
            "num_attention_heads": 4,
            "seq_length": 128,
            "vocab_size": 1000,
        },
        "cluster": {"accelerator": "A100-80GB"},
    }
    with pytest.raises(FamilyDomainError, match="set stages_per_rank to 4"):
        get_family("lga").generate(load_problem(layered))
    get_family("looped-bfs").generate(load_problem(layered))  # breadth-first admits several layers per stage
