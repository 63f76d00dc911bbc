"""Pictures and traces of a schedule: PNG, SVG, the HTML view, Chrome traces, and ``pipesched plot``."""

from __future__ import annotations

import io
import json
import re
import xml.etree.ElementTree as ET
from bisect import bisect_right
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from typer.testing import CliRunner

from pipesched.api import render
from pipesched.api.cli import app
from pipesched.api.render import bars, figure
from pipesched.optimizer.export import run_report_to_chrome_trace, schedule_to_chrome_trace
from pipesched.optimizer.instance import compile_problem
from pipesched.optimizer.ir import Action, ActionKind, Orders
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.result import Schedule, build_schedule, infeasible_schedule
from pipesched.optimizer.simulate import simulate
from pipesched.optimizer.solve import solve_family
from tests.conftest import paper_problem, paper_settings, uniform_problem

SVG_NS = "{http://www.w3.org/2000/svg}"


def _v_orders(problem: Problem) -> Orders:
    """A valid V-placement order: each rank runs its first stage's forwards, then its second's, then backwards."""
    p, m = problem.pipeline.num_ranks, problem.pipeline.num_microbatches
    orders: Orders = []
    for rank in range(p):
        first, second = rank, 2 * p - 1 - rank
        row = [Action(first, ActionKind.FORWARD, j) for j in range(m)]
        row += [Action(second, ActionKind.FORWARD, j) for j in range(m)]
        for stage in (second, first):
            for j in range(m):
                row += [Action(stage, ActionKind.BACKWARD_INPUT, j), Action(stage, ActionKind.BACKWARD_WEIGHT, j)]
        orders.append(row)
    return orders


@pytest.fixture(scope="module")
def one_f_one_b() -> Schedule:
    return solve_family(uniform_problem(4, 8, p2p=0.05, limit=450.0), "1f1b")


@pytest.fixture(scope="module")
def zb_h1() -> Schedule:
    return solve_family(paper_problem(paper_settings()[0], **{"pipeline.num_microbatches": 24}), "zb-h1")


@pytest.fixture(scope="module")
def v_schedule() -> Schedule:
    problem = uniform_problem(4, 6, stages_per_rank=2, placement="v", backward_weight=0.7, p2p=0.05)
    return build_schedule(problem, _v_orders(problem), method="v-test", backend="family", check_memory=False)


def _pixels(png: bytes) -> np.ndarray:
    image = matplotlib.image.imread(io.BytesIO(png), format="png")
    return np.round(image[:, :, :3] * 255).astype(int)


def _has_color(pixels: np.ndarray, hex_color: str, tolerance: int = 6) -> int:
    rgb = np.array([int(hex_color[i : i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(pixels - rgb).max(axis=2) <= tolerance).sum())


def test_png_decodes_with_the_expected_size_and_kind_colours(one_f_one_b: Schedule) -> None:
    png = render.render_png(one_f_one_b, dpi=100)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = _pixels(png)
    height, width = pixels.shape[:2]
    assert width == 1500  # 15 in at 100 dpi
    assert 400 <= height <= 800
    for kind in ("F", "I", "W"):
        assert _has_color(pixels, render.KIND_COLORS[kind]) > 500, f"no {kind} bars in the picture"
    assert _has_color(pixels, render.KIND_COLORS["B"]) == 0  # split backward: no fused B
    assert _has_color(pixels, render.IDLE_COLOR) > 1000  # warm-up and cool-down bubbles are drawn
    assert _has_color(pixels, render.LIMIT_COLOR, tolerance=30) > 100  # the 450 B limit line

    with_compare = _pixels(
        render.render_png(
            one_f_one_b, compare=solve_family(one_f_one_b.problem, "gpipe", enforce_memory=False), dpi=100
        )
    )
    assert with_compare.shape[1] == width
    assert with_compare.shape[0] > 1.8 * height  # a second chart beneath


def test_png_of_a_fused_backward_schedule_uses_the_b_colour() -> None:
    schedule = solve_family(uniform_problem(4, 8, split_backward=False, backward_input=2.0), "1f1b")
    pixels = _pixels(render.render_png(schedule, dpi=60))
    assert _has_color(pixels, render.KIND_COLORS["B"]) > 200
    assert _has_color(pixels, render.KIND_COLORS["I"]) == 0


def _svg_rank_groups(svg: str, prefix: str = "") -> dict[int, ET.Element]:
    root = ET.fromstring(svg)
    pattern = re.compile(rf"{prefix}rank-(\d+)")
    return {
        int(match.group(1)): g
        for g in root.iter(f"{SVG_NS}g")
        if (match := pattern.fullmatch(g.get("id", ""))) is not None
    }


def test_svg_parses_with_one_group_per_rank_holding_its_actions(zb_h1: Schedule) -> None:
    svg = render.render_svg(zb_h1, compare=solve_family(zb_h1.problem, "1f1b", enforce_memory=False))
    groups = _svg_rank_groups(svg)
    assert sorted(groups) == list(range(8))
    for rank in zb_h1.ranks:
        assert len(groups[rank.rank].findall(f"{SVG_NS}path")) == len(rank.actions)
    assert sorted(_svg_rank_groups(svg, "compare-")) == list(range(8))
    root = ET.fromstring(svg)
    memory = [g for g in root.iter(f"{SVG_NS}g") if re.fullmatch(r"memory-rank-\d+", g.get("id", ""))]
    assert len(memory) == 8
    texts = " ".join(t.text or "" for t in root.iter(f"{SVG_NS}text"))
    assert "zb-h1" in texts and "bubble rate" in texts and "time (ms)" in texts


def test_svg_names_both_stages_of_a_v_placement_rank(v_schedule: Schedule) -> None:
    svg = render.render_svg(v_schedule)
    root = ET.fromstring(svg)
    texts = [t.text or "" for t in root.iter(f"{SVG_NS}text")]
    assert "rank 0 (s0, s7)" in texts and "rank 3 (s3, s4)" in texts
    assert any(re.fullmatch(r"s[0-7]·\d", text) for text in texts), "no stage·microbatch labels"


def test_labels_thin_out_when_actions_are_too_narrow() -> None:
    schedule = solve_family(uniform_problem(16, 128, p2p=0.0), "1f1b")
    root = ET.fromstring(render.render_svg(schedule))
    labels = [t for t in root.iter(f"{SVG_NS}text") if re.fullmatch(r"\d+", (t.text or "").strip())]
    actions = sum(len(r.actions) for r in schedule.ranks)
    assert len(labels) < actions / 4


def test_html_view_is_self_contained_with_the_schedules_times_and_memory(v_schedule: Schedule) -> None:
    page = render.render_view_html(v_schedule, compare=v_schedule)
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"""(src|href)\s*=|@import|url\(|https?://(?!www\.w3\.org/2000/svg)""", page)
    assert page.count('class="rank"') == 2 * 4
    assert page.count('class="act"') == 2 * sum(len(r.actions) for r in v_schedule.ranks)
    data = json.loads(re.search(r'id="pipesched-data">(.*?)</script>', page, re.S).group(1))  # type: ignore[union-attr]
    sim = simulate(compile_problem(v_schedule.problem), v_schedule.orders(), check_memory=False)
    for rank in v_schedule.ranks:
        bars = data["main"]["ranks"][rank.rank]["bars"]
        assert [b[0] for b in bars] == [a.action for a in rank.actions]
        assert [(b[1], b[2]) for b in bars] == [(a.start, a.end) for a in rank.actions]
        timeline = sim.memory_timeline[rank.rank]
        times = [t for t, _ in timeline]
        for bar in bars:
            assert bar[3] == timeline[bisect_right(times, bar[1] + 1e-9) - 1][1]
        assert max(b for _, b in data["main"]["ranks"][rank.rank]["timeline"]) == sim.peak_memory[rank.rank]


def test_infeasible_schedules_have_nothing_to_draw() -> None:
    problem = uniform_problem(4, 8, limit=50.0)
    schedule = infeasible_schedule(problem, method="1f1b", backend="family", reason="over the limit")
    for draw in (render.render_png, render.render_svg, render.render_view_html):
        with pytest.raises(ValueError, match="infeasible"):
            draw(schedule)  # type: ignore[operator]
    with pytest.raises(ValueError, match="infeasible"):
        schedule_to_chrome_trace(schedule)


def test_plot_to_file_rejects_unknown_suffixes(tmp_path: Path, one_f_one_b: Schedule) -> None:
    with pytest.raises(ValueError, match=r"\.png, \.svg or \.html"):
        render.plot_to_file(one_f_one_b, tmp_path / "gantt.pdf")


def _events(trace: dict, phase: str, pid: int | None = None) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == phase and (pid is None or e["pid"] == pid)]


def test_chrome_trace_has_one_process_per_rank_with_the_schedules_times(v_schedule: Schedule) -> None:
    trace = json.loads(json.dumps(schedule_to_chrome_trace(v_schedule)))
    names = {e["pid"]: e["args"]["name"] for e in _events(trace, "M") if e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(4)}
    sim = simulate(compile_problem(v_schedule.problem), v_schedule.orders(), check_memory=False)
    for rank in v_schedule.ranks:
        events = _events(trace, "X", rank.rank)
        assert len(events) == len(rank.actions)
        for event, action in zip(events, rank.actions, strict=True):
            assert event["name"] == f"{action.kind}{action.microbatch} (stage {action.stage})"
            assert event["cat"] == action.kind
            assert event["ts"] == pytest.approx(action.start * 1000, abs=1e-3)
            assert event["dur"] == pytest.approx((action.end - action.start) * 1000, abs=1e-3)
        counters = _events(trace, "C", rank.rank)
        assert [c["args"]["bytes"] for c in counters] == [b for _, b in sim.memory_timeline[rank.rank]]
        assert max(c["args"]["bytes"] for c in counters) == v_schedule.peak_memory[rank.rank]


def test_run_report_trace_matches_the_schedule_layout(one_f_one_b: Schedule) -> None:
    origin_ms = 5000.0
    report = {
        "verified": True,
        "measured_makespan_ms": 31.0,
        "ranks": [
            {
                "rank": r.rank,
                "peak_memory_bytes": 1234,
                "actions": [
                    {"action": a.action, "start": origin_ms + a.start * 1.1, "end": origin_ms + a.end * 1.1}
                    # The executor's live bytes after each action; rank 3 has none (as from the torch engine).
                    | ({"memory_bytes": 1000 * r.rank + k} if r.rank < 3 else {})
                    for k, a in enumerate(r.actions)
                ],
            }
            for r in one_f_one_b.ranks
        ],
    }
    trace = json.loads(json.dumps(run_report_to_chrome_trace(report, pid_offset=4)))
    names = {e["pid"]: e["args"]["name"] for e in _events(trace, "M") if e["name"] == "process_name"}
    assert names == {4 + r: f"rank {r} (measured)" for r in range(4)}
    predicted = schedule_to_chrome_trace(one_f_one_b)
    for r in one_f_one_b.ranks:
        measured = _events(trace, "X", 4 + r.rank)
        assert [e["name"] for e in measured] == [e["name"] for e in _events(predicted, "X", r.rank)]
        for event, action in zip(measured, r.actions, strict=True):
            assert event["ts"] == pytest.approx(action.start * 1.1 * 1000, abs=1e-3)
        # One memory sample per action, at its end, with the bytes recorded after it.
        memory = [e for e in _events(trace, "C", 4 + r.rank) if e["name"] == "memory"]
        if r.rank < 3:
            assert [e["args"]["bytes"] for e in memory] == [1000 * r.rank + k for k in range(len(r.actions))]
            assert [e["ts"] for e in memory] == pytest.approx([a.end * 1.1 * 1000 for a in r.actions], abs=1e-3)
        else:
            assert memory == []
        peak = [e for e in _events(trace, "C", 4 + r.rank) if e["name"] == "peak memory"]
        assert [e["args"]["bytes"] for e in peak] == [1234]
    assert trace["otherData"]["measured_makespan_ms"] == 31.0
    # Predicted and measured in one file: each process says which it is (the predicted ranks had been named "rank r",
    # beside "rank r (measured)"); the schedule's own trace keeps "rank r".
    both = run_report_to_chrome_trace(report, predicted=one_f_one_b)
    names = {e["pid"]: e["args"]["name"] for e in _events(both, "M") if e["name"] == "process_name"}
    assert names == {
        **{r: f"rank {r} (predicted)" for r in range(4)},
        **{4 + r: f"rank {r} (measured)" for r in range(4)},
    }
    assert len(_events(both, "X")) == 2 * len(_events(predicted, "X"))
    # With data-parallel replicas the measured process names the pipeline rank it matches among the predicted ones
    replicas = {
        "ranks": [
            {"rank": g, "pp_rank": g % 2, "dp_rank": g // 2, "actions": [{"action": "0F0", "start": g, "end": g + 1}]}
            for g in range(4)
        ]
    }
    replicated = _events(run_report_to_chrome_trace(replicas), "M")
    names = {e["pid"]: e["args"]["name"] for e in replicated if e["name"] == "process_name"}
    assert names[3] == "rank 3 (measured: pipeline rank 1, replica 1)"
    with pytest.raises(ValueError, match=r"ranks\[0\]\.actions\[1\]\.end"):
        run_report_to_chrome_trace(
            {"ranks": [{"rank": 0, "actions": [report["ranks"][0]["actions"][0], {"start": 1}]}]}
        )
    with pytest.raises(ValueError, match=r"ranks\[0\]\.actions\[0\]\.action"):
        run_report_to_chrome_trace({"ranks": [{"rank": 0, "actions": [{"action": "F0", "start": 0, "end": 1}]}]})


def test_pipesched_plot_writes_each_format(tmp_path: Path, zb_h1: Schedule) -> None:
    source = tmp_path / "schedule.json"
    source.write_text(zb_h1.model_dump_json())
    runner = CliRunner()
    for suffix in ("png", "svg", "html"):
        target = tmp_path / f"gantt.{suffix}"
        result = runner.invoke(app, ["plot", str(source), "-o", str(target), "--compare", "1f1b"])
        assert result.exit_code == 0, result.output
        assert target.stat().st_size > 10_000
    assert _pixels((tmp_path / "gantt.png").read_bytes()).shape[1] == 1650
    assert sorted(_svg_rank_groups((tmp_path / "gantt.svg").read_text(), "compare-")) == list(range(8))
    assert "Compared with 1f1b" in (tmp_path / "gantt.html").read_text()

    bad = runner.invoke(app, ["plot", str(source), "-o", str(tmp_path / "gantt.pdf")])
    assert bad.exit_code == 2 and ".png, .svg or .html" in bad.output
    wrong_family = runner.invoke(app, ["plot", str(source), "-o", str(tmp_path / "x.png"), "--compare", "zb-v"])
    assert wrong_family.exit_code == 2 and "placement" in wrong_family.output

    data = json.loads(source.read_text())
    rank0 = data["ranks"][0]["actions"]
    backward = next(i for i, a in enumerate(rank0) if a["kind"] == "I")
    rank0.insert(0, rank0.pop(backward))  # 0I0 before 0F0: the orders can no longer run
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(data))
    broken = runner.invoke(app, ["plot", str(tampered), "-o", str(tmp_path / "x.png")])
    assert broken.exit_code == 2 and "deadlock" in broken.output


def test_pipesched_solve_writes_a_chrome_trace(tmp_path: Path) -> None:
    problem = tmp_path / "problem.json"
    problem.write_text(uniform_problem(4, 8).model_dump_json())
    target = tmp_path / "trace.json"
    result = CliRunner().invoke(
        app, ["solve", str(problem), "--method", "1f1b", "--format", "chrome-trace", "-o", str(target)]
    )
    assert result.exit_code == 0, result.output
    trace = json.loads(target.read_text())
    assert len(_events(trace, "X")) == 4 * 8 * 3
    assert {e["pid"] for e in _events(trace, "X")} == {0, 1, 2, 3}


def test_w_actions_carry_their_microbatch_label(zb_h1: Schedule) -> None:
    # W runs about half as long as F (9.3 against 18.5 ms): too narrow for a level label, so it stands upright.
    fig = figure._figure(zb_h1, None, 110)
    labelled = {(round(t.get_position()[0], 6), round(t.get_position()[1])): t for t in fig.axes[0].texts}
    view = bars._prepare(zb_h1)
    weights = [(r.rank, b) for r in view.ranks for b in r.bars if b.kind == "W"]
    found = [labelled.get((round((b.start + b.end) / 2, 6), rank)) for rank, b in weights]
    assert all(t is not None and t.get_text() == str(b.microbatch) for t, (_, b) in zip(found, weights, strict=True))
    # The HTML view's own SVG labels every action too, the narrowest upright.
    page = render.render_view_html(zb_h1)
    assert page.count('<text class="lab"') == 3 * len(weights)
    assert re.search(r'<text class="lab"[^>]*transform="rotate\(-90[^>]*>\d+</text>', page)


def test_memory_curves_have_one_hue_per_rank(zb_h1: Schedule) -> None:
    from matplotlib.colors import to_hex

    fig = figure._figure(zb_h1, None, 110)
    colors = [to_hex(line.get_color()) for line in fig.axes[1].lines if str(line.get_label()).startswith("rank")]
    assert len(colors) == 8 and len(set(colors)) == 8
    from matplotlib import colormaps

    assert colors == [to_hex(colormaps["tab10"](r)) for r in range(8)]  # qualitative, not a one-hue ramp
    html = render.render_view_html(zb_h1)
    assert all(color in html for color in colors)


def test_the_v_legend_explains_the_labels_without_a_format_string(v_schedule: Schedule) -> None:
    fig = figure._figure(v_schedule, None, 110)
    texts = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert any("s5·3 is stage 5, microbatch 3" in text for text in texts), texts
    assert not any("{" in text for text in texts)
    assert "{stage}" not in render.render_view_html(v_schedule)
