"""Pictures of a schedule: a Gantt chart per rank with each rank's memory over time.

* :func:`render_png` / :func:`render_svg`: matplotlib (Agg) figure — one row per rank, actions coloured by
  kind (F, I, W, B in the Okabe–Ito colour-blind-safe palette), labelled by microbatch (``s7·12`` where a rank
  holds several stages, whose later stages are also drawn lighter), idle time in grey, real time (ms) on the
  x axis; under it each rank's memory (step plot, from the simulator's ``memory_timeline``) against its limit.
* :func:`render_view_html`: a self-contained HTML page (inline SVG, CSS and JS; nothing fetched) with hover
  tooltips (action, rank, start, end, duration, memory at that time), the memory curves and, optionally, a
  second schedule drawn beneath on the same time axis.
* :func:`plot_to_file`: one of the three by the file's suffix.

With data parallelism (contract: communication actions) every rank gets a second row beneath its compute row,
its communication stream: UNSHARD and REDUCE_GRAD bars (RESHARD takes no time); OPTIMIZER_STEP stays on the
compute row.

Memory comes from ``pipesched.optimizer.simulate.simulate(compile_problem(schedule.problem), schedule.orders())``
(memory checks off, so a schedule over its limit is still drawn — with its excess visible).
"""

from __future__ import annotations

import html
import io
import json
import math
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipesched.optimizer.instance import compile_for_orders
from pipesched.optimizer.result import Schedule
from pipesched.optimizer.simulate import simulate

__all__ = ["KIND_COLORS", "plot_to_file", "render_png", "render_svg", "render_view_html"]

# Okabe & Ito (2008) colour-blind-safe palette. I and B never occur in the same schedule.
KIND_COLORS = {
    "F": "#0072B2",
    "I": "#E69F00",
    "W": "#009E73",
    "B": "#D55E00",
    "UNSHARD": "#56B4E9",
    "RESHARD": "#999999",
    "REDUCE_GRAD": "#CC79A7",
    "OPTIMIZER_STEP": "#F0E442",
}
KIND_NAMES = {
    "F": "F forward",
    "I": "I backward (input)",
    "W": "W backward (weight)",
    "B": "B backward (fused)",
    "UNSHARD": "UNSHARD (all-gather weights)",
    "RESHARD": "RESHARD (free gathered weights)",
    "REDUCE_GRAD": "REDUCE_GRAD (reduce gradients)",
    "OPTIMIZER_STEP": "OPTIMIZER_STEP",
}
#: Kinds drawn on a rank's communication row.
COMMUNICATION_KINDS = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
_ALL_KINDS = ("F", "I", "W", "B", "UNSHARD", "RESHARD", "REDUCE_GRAD", "OPTIMIZER_STEP")
_SHORT = {"UNSHARD": "U", "RESHARD": "R", "REDUCE_GRAD": "RG", "OPTIMIZER_STEP": "opt"}
IDLE_COLOR = "#E4E4E4"
LIMIT_COLOR = "#C00000"
_LATER_STAGE_WHITE = 0.45  # a rank's later stages: the kind's colour mixed with this much white


@dataclass
class _Bar:
    action: str
    stage: int | None
    kind: str
    microbatch: int | None
    start: float
    end: float
    chunk: int  # index of the stage among the rank's stages (0 = the rank's lowest stage)
    memory: float  # bytes held on the rank while the action runs (after an F's allocation)


@dataclass
class _RankView:
    rank: int
    stages: list[int]
    bars: list[_Bar]
    timeline: list[tuple[float, float]]  # (ms, bytes) steps, last step at the makespan
    limit: float
    peak: float
    comm_bars: list[_Bar] = field(default_factory=list)  # the communication stream's actions


@dataclass
class _View:
    schedule: Schedule
    ranks: list[_RankView]
    makespan: float
    multi_stage: bool
    kinds: list[str] = field(default_factory=list)

    @property
    def finite_limits(self) -> list[float]:
        return [r.limit for r in self.ranks if math.isfinite(r.limit)]

    @property
    def has_comm(self) -> bool:
        """Whether ranks get a communication row."""
        return any(r.comm_bars for r in self.ranks)

    @property
    def num_rows(self) -> int:
        return len(self.ranks) * (2 if self.has_comm else 1)

    def row_of(self, rank: int) -> int:
        """The compute row of ``rank`` (its communication row is the next one)."""
        return rank * (2 if self.has_comm else 1)


def _prepare(schedule: Schedule) -> _View:
    """Times from the schedule, memory from the simulator.

    Raises:
        ValueError: for an infeasible schedule (nothing to draw).
        InvalidSchedule: when the orders do not run on the schedule's problem.
    """
    if schedule.status == "infeasible" or not schedule.ranks:
        raise ValueError(
            f"schedule{' ' + schedule.id if schedule.id else ''} is infeasible ({schedule.reason}): nothing to draw; "
            "plot a feasible schedule"
        )
    inst = compile_for_orders(schedule.problem, schedule.orders())
    if schedule.step_period is not None:  # no flush: a repeating pattern, not a run of the one-step problem
        from pipesched.optimizer.pattern import pattern_memory_timelines

        memory_timeline, peak_memory = pattern_memory_timelines(schedule), schedule.peak_memory
    else:
        sim = simulate(inst, schedule.orders(), check_memory=False)
        memory_timeline, peak_memory = sim.memory_timeline, sim.peak_memory
    makespan = max((a.end for r in schedule.ranks for a in r.actions), default=0.0)
    stage_to_rank = schedule.stage_to_rank
    ranks = []
    kinds: set[str] = set()
    for rank_schedule in schedule.ranks:
        rank = rank_schedule.rank
        stages = sorted(s for s, r in enumerate(stage_to_rank) if r == rank)
        timeline = list(memory_timeline[rank])
        times = [t for t, _ in timeline]
        bars = []
        comm_bars: list[_Bar] = []
        for a in rank_schedule.actions:
            kinds.add(a.kind)
            at = bisect_right(times, a.start + 1e-9) - 1
            (comm_bars if a.kind in COMMUNICATION_KINDS else bars).append(
                _Bar(
                    action=a.action,
                    stage=a.stage,
                    kind=a.kind,
                    microbatch=a.microbatch,
                    start=a.start,
                    end=a.end,
                    chunk=stages.index(a.stage) if a.stage in stages else 0,
                    memory=timeline[max(at, 0)][1],
                )
            )
        if timeline[-1][0] < makespan:
            timeline.append((makespan, timeline[-1][1]))
        ranks.append(
            _RankView(
                rank=rank,
                stages=stages,
                bars=bars,
                timeline=timeline,
                limit=inst.limit[rank],
                peak=peak_memory[rank],
                comm_bars=comm_bars,
            )
        )
    order: list[str] = [k for k in _ALL_KINDS if k in kinds]
    return _View(
        schedule=schedule,
        ranks=ranks,
        makespan=makespan,
        multi_stage=any(len(r.stages) > 1 for r in ranks),
        kinds=order,
    )


# --- shared helpers ----------------------------------------------------------------------------


def _bytes_unit(value: float) -> tuple[float, str]:
    """(divisor, unit) so that ``value / divisor`` reads well in binary units."""
    for power, unit in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if value >= 1024**power:
            return 1024.0**power, unit
    return 1.0, "B"


def _format_bytes(value: float) -> str:
    if not math.isfinite(value):
        return "none"
    divisor, unit = _bytes_unit(abs(value))
    return f"{value:.0f} B" if unit == "B" else f"{value / divisor:.2f} {unit}"


def _shade(color: str, chunk: int) -> str:
    """The kind's colour for the rank's ``chunk``-th stage: later stages mixed with white."""
    if chunk == 0:
        return color
    mix = min(0.75, _LATER_STAGE_WHITE * chunk)
    rgb = [int(color[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * mix):02X}" for c in rgb)


def _text_color(background: str) -> str:
    """Black or white, whichever reads better on ``background`` (WCAG relative luminance)."""
    channels = []
    for i in (1, 3, 5):
        c = int(background[i : i + 2], 16) / 255
        channels.append(c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4)
    luminance = 0.2126 * channels[0] + 0.7152 * channels[1] + 0.0722 * channels[2]
    return "#000000" if luminance > 0.25 else "#FFFFFF"


def _text_em(text: str) -> float:
    """Approximate width of a bar label in em (DejaVu Sans: digits 0.64, "s" 0.52, "·" 0.32)."""
    return sum(0.32 if ch == "·" else 0.52 if ch == "s" else 0.64 for ch in text)


def _fit_label(
    bar: _Bar, multi_stage: bool, width_px: float, height_px: float, em_px: float
) -> tuple[str, float, bool]:
    """The bar's label, its size (× the label font) and whether it runs vertically, to fit ``width_px`` ×
    ``height_px``; ``("", 0, False)`` if none fits.

    ``s{stage}·{microbatch}`` where a rank holds several stages (or on two lines ``s{stage}`` over the
    microbatch when the bar is narrow but tall), else the microbatch alone, at full size, then at 3/4 size,
    then turned upright (narrow actions such as a W, about half an F, keep their microbatch); nothing when
    even that is too wide.
    """
    if bar.microbatch is None:
        short = _SHORT.get(bar.kind, bar.kind) + ("" if bar.stage is None else str(bar.stage))
        return (short, 1.0, False) if width_px >= _text_em(short) * em_px + 3 else ("", 0.0, False)
    microbatch = str(bar.microbatch)
    if multi_stage:
        full = f"s{bar.stage}·{microbatch}"
        if width_px >= _text_em(full) * em_px + 3:
            return full, 1.0, False
        stage = f"s{bar.stage}"
        scale = 0.85
        if (
            width_px >= max(_text_em(stage), _text_em(microbatch)) * em_px * scale + 2
            and height_px >= 2.3 * em_px * scale
        ):
            return f"{stage}\n{microbatch}", scale, False
    for scale in (1.0, 0.75):
        if width_px >= _text_em(microbatch) * em_px * scale + 3 * scale:
            return microbatch, scale, False
    upright = min(1.0, (width_px - 1) / em_px)  # a line of text is about one em tall
    if upright >= 0.6 and height_px >= _text_em(microbatch) * em_px * upright + 2:
        return microbatch, upright, True
    return "", 0.0, False


def _headline(view: _View) -> tuple[str, str]:
    """Title lines: what the schedule is, and its figures."""
    s = view.schedule
    pipeline = s.problem.pipeline
    placement = pipeline.placement if isinstance(pipeline.placement, str) else "explicit"
    first = (
        f"{s.method} ({s.backend}, {s.status}) · {pipeline.num_ranks} ranks · "
        f"{pipeline.num_microbatches} microbatches · {pipeline.stages_per_rank} stage(s)/rank, placement {placement}"
    )
    peak = max(r.peak for r in view.ranks)
    limits = view.finite_limits
    limit_text = f" of {_format_bytes(min(limits))} limit" if limits else " (no limit)"
    fits = "" if s.fits_memory is None or s.fits_memory else " — OVER THE LIMIT"
    figures = {"makespan": s.makespan, "stage_span": s.stage_span, "step_time": s.step_time}
    times = " · ".join(
        f"{name} {value:.2f} ms" + (" (objective)" if name == s.objective else "")
        for name, value in sorted(figures.items(), key=lambda item: item[0] != s.objective)
        if value is not None
    )
    second = (
        f"{times} · bubble rate {100 * (s.bubble_rate or 0):.1f}% · peak memory {_format_bytes(peak)}{limit_text}{fits}"
    )
    return first, second


# --- matplotlib figure (PNG, SVG) ------------------------------------------------------------------


def _row_height_in(num_ranks: int) -> float:
    if num_ranks <= 8:
        return 0.42
    if num_ranks <= 16:
        return 0.3
    return 0.21


def _figure(schedule: Schedule, compare: Schedule | None, dpi: float) -> Any:
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    views = [_prepare(schedule)] + ([_prepare(compare)] if compare is not None else [])
    x_max = max(v.makespan for v in views) or 1.0
    width_in = 15.0
    heights: list[float] = []
    for v in views:
        heights += [0.9 + _row_height_in(v.num_rows) * v.num_rows, 2.1]
    fig = Figure(figsize=(width_in, sum(heights) + 0.5 * len(views)), dpi=dpi, layout="constrained")
    grid = fig.add_gridspec(len(heights), 1, height_ratios=heights)
    axes_width_px = width_in * dpi * 0.86
    first_gantt = None
    for i, view in enumerate(views):
        gantt = fig.add_subplot(grid[2 * i], sharex=first_gantt)
        first_gantt = first_gantt or gantt
        memory = fig.add_subplot(grid[2 * i + 1], sharex=first_gantt)
        prefix = "" if i == 0 else "compare-"
        _draw_gantt(gantt, view, x_max, axes_width_px, prefix, dpi)
        _draw_memory(memory, view, x_max, prefix)
    _legend(fig, views)
    return fig


def _legend(fig: Any, views: list[_View]) -> None:
    """One legend for the kinds, the later-stage shade and idle time, under the figure."""
    from matplotlib.patches import Patch

    kinds = [k for k in _ALL_KINDS if any(k in v.kinds for v in views)]
    handles = [Patch(facecolor=KIND_COLORS[k], label=KIND_NAMES[k]) for k in kinds]
    if any(v.multi_stage for v in views):
        handles += [
            Patch(
                facecolor=_shade(KIND_COLORS[k], 1),
                label=f"{k}, the rank's later stage (a label s5·3 is stage 5, microbatch 3)",
            )
            for k in kinds[:1]
        ]
    handles.append(Patch(facecolor=IDLE_COLOR, label="idle"))
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncol=len(handles),
        fontsize=8,
        frameon=False,
        handlelength=1.4,
        columnspacing=1.6,
    )


def _draw_gantt(ax: Any, view: _View, x_max: float, axes_width_px: float, prefix: str, dpi: float) -> None:
    num_ranks = len(view.ranks)
    num_rows = view.num_rows
    row_in = _row_height_in(num_rows)
    font = max(4.5, min(8.0, row_in * 72 * 0.42))
    px_per_ms = axes_width_px / x_max
    em_px = font * dpi / 72
    bar_px = row_in * dpi * 0.78
    bar_height = 0.78
    for rank_view in view.ranks:
        row = view.row_of(rank_view.rank)
        y = row - bar_height / 2
        ax.broken_barh([(0.0, view.makespan)], (y, bar_height), facecolors=IDLE_COLOR, linewidth=0)
        if view.has_comm:
            comm = [b for b in rank_view.comm_bars if b.end > b.start]
            comm_colors = [KIND_COLORS[b.kind] for b in comm]
            ax.broken_barh([(0.0, view.makespan)], (y + 1, bar_height), facecolors=IDLE_COLOR, linewidth=0)
            drawn = ax.broken_barh(
                [(b.start, b.end - b.start) for b in comm], (y + 1, bar_height), facecolors=comm_colors, linewidth=0
            )
            drawn.set_gid(f"{prefix}rank-{rank_view.rank}-comm")
            for b, color in zip(comm, comm_colors, strict=True):
                text, size, _ = _fit_label(b, view.multi_stage, (b.end - b.start) * px_per_ms, bar_px, em_px)
                if text:
                    ax.text(
                        (b.start + b.end) / 2,
                        row + 1,
                        text,
                        ha="center",
                        va="center",
                        fontsize=font * size,
                        color=_text_color(color),
                        clip_on=True,
                    )
        colors = [_shade(KIND_COLORS[b.kind], b.chunk) for b in rank_view.bars]
        bars = ax.broken_barh(
            [(b.start, b.end - b.start) for b in rank_view.bars],
            (y, bar_height),
            facecolors=colors,
            edgecolors="white",
            linewidth=0.35 if px_per_ms * min((b.end - b.start for b in rank_view.bars), default=1) > 2.5 else 0.0,
        )
        bars.set_gid(f"{prefix}rank-{rank_view.rank}")
        for b, color in zip(rank_view.bars, colors, strict=True):
            text, size, upright = _fit_label(b, view.multi_stage, (b.end - b.start) * px_per_ms, bar_px, em_px)
            if not text:
                continue
            ax.text(
                (b.start + b.end) / 2,
                row,
                text,
                ha="center",
                va="center",
                linespacing=1.0,
                fontsize=font * size,
                color=_text_color(color),
                rotation=90 if upright else 0,
                clip_on=True,
            )
    ax.set_ylim(num_rows - 0.5, -0.5)
    step = 1 if num_ranks <= 16 else 2
    if view.multi_stage:
        labels = [f"rank {r.rank} (s{', s'.join(map(str, r.stages))})" for r in view.ranks[::step]]
    else:
        labels = [f"rank {r.rank}" for r in view.ranks[::step]]
    ticks = [view.row_of(r.rank) for r in view.ranks[::step]]
    if view.has_comm:
        ticks = [t for row in ticks for t in (row, row + 1)]
        labels = [text for label in labels for text in (label, "  comm")]
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=8 if num_rows <= 16 else 6.5)
    ax.set_xlim(0, x_max * 1.005)
    ax.tick_params(axis="x", labelbottom=False)
    ax.grid(axis="x", color="#BBBBBB", linewidth=0.5, alpha=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    first, second = _headline(view)
    ax.set_title(f"{first}\n{second}", loc="left", fontsize=9.5)


#: Up to this many ranks, each memory curve gets its own colour of a qualitative palette and a legend entry.
QUALITATIVE_RANKS = 20


def _rank_color(rank: int, num_ranks: int) -> str:
    """The memory curve's colour of ``rank`` (hex): one hue per rank from matplotlib's qualitative ``tab10``
    (≤ 10 ranks) or ``tab20`` (≤ 20), else along the ``turbo`` map (then a colour bar says which rank)."""
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    if num_ranks <= 10:
        return to_hex(colormaps["tab10"](rank))
    if num_ranks <= QUALITATIVE_RANKS:
        return to_hex(colormaps["tab20"](rank))
    return to_hex(colormaps["turbo"](0.05 + 0.9 * rank / max(1, num_ranks - 1)))


def _draw_memory(ax: Any, view: _View, x_max: float, prefix: str) -> None:
    from matplotlib import colormaps

    num_ranks = len(view.ranks)
    top = max(max(r.peak for r in view.ranks), max(view.finite_limits, default=0.0)) or 1.0
    divisor, unit = _bytes_unit(top)
    limits = view.finite_limits
    same_limit = bool(limits) and len(limits) == num_ranks and max(limits) - min(limits) <= 1e-9 * max(limits)
    for r in view.ranks:
        color = _rank_color(r.rank, num_ranks)
        xs = [t for t, _ in r.timeline]
        ys = [b / divisor for _, b in r.timeline]
        (line,) = ax.step(xs, ys, where="post", color=color, linewidth=1.3 if num_ranks <= 8 else 0.9)
        line.set_gid(f"{prefix}memory-rank-{r.rank}")
        line.set_label(f"rank {r.rank}")
        if not same_limit and math.isfinite(r.limit):
            ax.axhline(r.limit / divisor, color=color, linestyle=":", linewidth=0.8)
    if same_limit:
        ax.axhline(limits[0] / divisor, color=LIMIT_COLOR, linestyle="--", linewidth=1.6)
        ax.annotate(
            f"limit {_format_bytes(limits[0])}",
            (0, limits[0] / divisor),
            xytext=(3, 2),
            textcoords="offset points",
            fontsize=7.5,
            color=LIMIT_COLOR,
            va="bottom",
        )
    peak_rank = max(view.ranks, key=lambda r: r.peak)
    peak_time = next(t for t, b in peak_rank.timeline if b >= peak_rank.peak)
    ax.plot([peak_time], [peak_rank.peak / divisor], marker="v", color="black", markersize=5)
    ax.annotate(
        f"peak {_format_bytes(peak_rank.peak)} (rank {peak_rank.rank})",
        (peak_time, peak_rank.peak / divisor),
        xytext=(5, 4),
        textcoords="offset points",
        fontsize=7.5,
    )
    ax.set_ylim(0, top / divisor * 1.15)
    ax.set_xlim(0, x_max * 1.005)
    ax.set_ylabel(f"memory ({unit})", fontsize=8)
    ax.set_xlabel("time (ms)", fontsize=8)
    ax.tick_params(labelsize=7.5)
    ax.grid(color="#BBBBBB", linewidth=0.5, alpha=0.6)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    if num_ranks <= QUALITATIVE_RANKS:
        ax.legend(loc="upper right", fontsize=7, ncol=min(num_ranks, 10), frameon=False)
    else:
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import Normalize

        span = max(1, num_ranks - 1)
        mappable = ScalarMappable(norm=Normalize(-0.05 / 0.9 * span, 0.95 / 0.9 * span), cmap=colormaps["turbo"])
        bar = ax.figure.colorbar(mappable, ax=ax, pad=0.005, fraction=0.02, aspect=12)
        bar.set_label("rank", fontsize=7.5)
        bar.ax.set_ylim(0, num_ranks - 1)
        bar.ax.tick_params(labelsize=7)


def render_png(schedule: Schedule, *, compare: Schedule | None = None, dpi: float = 110) -> bytes:
    """A PNG of the Gantt chart and memory curves (1650 px wide at the default ``dpi``).

    Args:
        schedule: a feasible schedule (contract, Schedule).
        compare: another schedule for the same problem, drawn beneath with the same time axis.

    Raises:
        ValueError: ``schedule`` (or ``compare``) is infeasible and has nothing to draw.
    """
    fig = _figure(schedule, compare, dpi)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def render_svg(schedule: Schedule, *, compare: Schedule | None = None) -> str:
    """The same figure as :func:`render_png` as SVG text.

    Each rank's bars form one group ``<g id="rank-{r}">`` (``compare-rank-{r}`` for ``compare``), its memory
    curve ``<g id="memory-rank-{r}">``; text stays text.

    Raises:
        ValueError: ``schedule`` (or ``compare``) is infeasible and has nothing to draw.
    """
    import matplotlib

    fig = _figure(schedule, compare, 100)
    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "pipesched"}):
        fig.savefig(buffer, format="svg", metadata={"Date": None})
    return buffer.getvalue()


# --- HTML view ---------------------------------------------------------------------------------

_SVG_WIDTH = 1360
_LEFT = 118
_RIGHT = 16


def _nice_step(span: float, target: int) -> float:
    raw = span / max(1, target)
    magnitude = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    for factor in (1, 2, 2.5, 5, 10):
        if raw <= factor * magnitude:
            return factor * magnitude
    return 10 * magnitude


def _svg_panel(view: _View, x_max: float, prefix: str) -> str:
    """One schedule: Gantt rows, memory curves and a time axis, as inline SVG."""
    num_ranks = len(view.ranks)
    rows = view.num_rows
    row = 30 if rows <= 4 else 24 if rows <= 8 else 16 if rows <= 16 else 11
    plot_w = _SVG_WIDTH - _LEFT - _RIGHT
    scale = plot_w / x_max

    def x(t: float) -> float:
        return _LEFT + t * scale

    gantt_top = 8
    gantt_h = row * rows
    mem_top = gantt_top + gantt_h + 34
    mem_h = 150
    height = mem_top + mem_h + 34
    font = 10 if row >= 16 else 8
    narrowest = min((b.end - b.start for r in view.ranks for b in r.bars), default=1.0) * scale
    dense = " dense" if narrowest < 4 else ""
    out: list[str] = [
        f'<svg class="panel{dense}" id="{prefix}panel" viewBox="0 0 {_SVG_WIDTH} {height}" '
        f'xmlns="http://www.w3.org/2000/svg" data-left="{_LEFT}" data-scale="{scale:.6f}" '
        f'data-memtop="{mem_top}" data-memh="{mem_h}" data-prefix="{prefix}">'
    ]
    step = _nice_step(x_max, 12)
    ticks = [i * step for i in range(int(x_max / step) + 1)]
    out.append('<g class="grid">')
    for t in ticks:
        out.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{gantt_top}" y2="{mem_top + mem_h}"/>')
    out.append("</g>")
    for r in view.ranks:
        y = gantt_top + view.row_of(r.rank) * row
        stages = f" (s{', s'.join(map(str, r.stages))})" if view.multi_stage else ""
        out.append(
            f'<g class="rank" id="{prefix}rank-{r.rank}">'
            f'<text class="ylab" x="{_LEFT - 6}" y="{y + row / 2 + 4:.1f}" font-size="{11 if row >= 16 else 8}">'
            f"rank {r.rank}{stages}</text>"
            f'<rect class="idle" x="{x(0):.2f}" y="{y + 1}" width="{view.makespan * scale:.2f}" height="{row - 2}"/>'
        )
        for i, b in enumerate(r.bars):
            color = _shade(KIND_COLORS[b.kind], b.chunk)
            w = (b.end - b.start) * scale
            out.append(
                f'<rect class="act" x="{x(b.start):.2f}" y="{y + 1}" width="{max(w, 0.3):.2f}" height="{row - 2}" '
                f'fill="{color}" data-r="{r.rank}" data-i="{i}"/>'
            )
            text, size, upright = _fit_label(b, view.multi_stage, w, row - 2, font)
            center = x(b.start) + w / 2
            attrs = f'class="lab" font-size="{font * size:.1f}" fill="{_text_color(color)}"'
            if "\n" in text:
                upper, lower = text.split("\n")
                line = font * size
                out.append(
                    f'<text {attrs} x="{center:.2f}" y="{y + row / 2 - line * 0.12:.1f}">{upper}'
                    f'<tspan x="{center:.2f}" dy="{line * 0.95:.1f}">{lower}</tspan></text>'
                )
            elif text and upright:
                cy = y + row / 2
                out.append(
                    f'<text {attrs} x="{center + font * size * 0.36:.2f}" y="{cy:.1f}" '
                    f'transform="rotate(-90 {center + font * size * 0.36:.2f} {cy:.1f})">{text}</text>'
                )
            elif text:
                out.append(f'<text {attrs} x="{center:.2f}" y="{y + row / 2 + font * size * 0.36:.1f}">{text}</text>')
        if view.has_comm:
            yc = y + row
            out.append(
                f'<text class="ylab" x="{_LEFT - 6}" y="{yc + row / 2 + 4:.1f}" font-size="{10 if row >= 16 else 7}">'
                f"comm</text>"
                f'<rect class="idle" x="{x(0):.2f}" y="{yc + 1}" width="{view.makespan * scale:.2f}" '
                f'height="{row - 2}"/>'
            )
            for i, b in enumerate(r.comm_bars, start=len(r.bars)):
                color = KIND_COLORS[b.kind]
                w = (b.end - b.start) * scale
                out.append(
                    f'<rect class="act comm" x="{x(b.start):.2f}" y="{yc + 1}" width="{max(w, 0.6):.2f}" '
                    f'height="{row - 2}" fill="{color}" data-r="{r.rank}" data-i="{i}"/>'
                )
                text, size, _ = _fit_label(b, view.multi_stage, w, row - 2, font)
                if text:
                    out.append(
                        f'<text class="lab" font-size="{font * size:.1f}" fill="{_text_color(color)}" '
                        f'x="{x(b.start) + w / 2:.2f}" y="{yc + row / 2 + font * 0.36:.1f}">{text}</text>'
                    )
        out.append("</g>")
    # memory
    top = max(max(r.peak for r in view.ranks), max(view.finite_limits, default=0.0)) or 1.0
    divisor, unit = _bytes_unit(top)
    y_max = top * 1.15

    def y_mem(value: float) -> float:
        return mem_top + mem_h - value / y_max * mem_h

    out.append(
        f'<rect class="memframe" x="{_LEFT}" y="{mem_top}" width="{plot_w}" height="{mem_h}"/>'
        f'<text class="axlab" x="14" y="{mem_top + mem_h / 2}" transform="rotate(-90 14 {mem_top + mem_h / 2})">'
        f"memory ({unit})</text>"
    )
    mstep = _nice_step(y_max / divisor, 4)
    k = 0
    while k * mstep <= y_max / divisor:
        yy = y_mem(k * mstep * divisor)
        out.append(
            f'<line class="hgrid" x1="{_LEFT}" x2="{_LEFT + plot_w}" y1="{yy:.1f}" y2="{yy:.1f}"/>'
            f'<text class="tick" x="{_LEFT - 6}" y="{yy + 4:.1f}" text-anchor="end">{k * mstep:g}</text>'
        )
        k += 1
    for r in view.ranks:
        stroke = _rank_color(r.rank, num_ranks)
        points = []
        previous: float | None = None
        for t, held in r.timeline:
            if previous is not None:
                points.append(f"{x(t):.2f},{y_mem(previous):.2f}")
            points.append(f"{x(t):.2f},{y_mem(held):.2f}")
            previous = held
        out.append(
            f'<polyline class="mem" id="{prefix}memory-rank-{r.rank}" data-r="{r.rank}" '
            f'stroke="{stroke}" points="{" ".join(points)}"><title>rank {r.rank}: peak '
            f"{_format_bytes(r.peak)}, limit {_format_bytes(r.limit)}</title></polyline>"
        )
    # which colour is which rank: swatches for a few ranks, else the two ends of the hue ramp
    shown = view.ranks if num_ranks <= 8 else [view.ranks[0], view.ranks[-1]]
    legend_x = _LEFT + plot_w - 8
    for r in reversed(shown):
        stroke = _rank_color(r.rank, num_ranks)
        label = f"rank {r.rank}" if num_ranks <= 8 or r is view.ranks[0] else f"… rank {r.rank}"
        width = 7 * len(label) + 22
        legend_x -= width
        out.append(
            f'<line x1="{legend_x:.0f}" x2="{legend_x + 16:.0f}" y1="{mem_top + 12}" y2="{mem_top + 12}" '
            f'stroke="{stroke}" stroke-width="3"/>'
            f'<text class="tick" x="{legend_x + 20:.0f}" y="{mem_top + 16}">{label}</text>'
        )
    limits = view.finite_limits
    for value in sorted(set(limits)):
        yy = y_mem(value)
        out.append(
            f'<line class="limit" x1="{_LEFT}" x2="{_LEFT + plot_w}" y1="{yy:.1f}" y2="{yy:.1f}"/>'
            f'<text class="limlab" x="{_LEFT + 4}" y="{yy - 4:.1f}">limit {_format_bytes(value)}</text>'
        )
    # time axis
    axis_y = mem_top + mem_h
    for t in ticks:
        out.append(f'<text class="tick" x="{x(t):.1f}" y="{axis_y + 14}" text-anchor="middle">{t:g}</text>')
    out.append(f'<text class="axlab" x="{_LEFT + plot_w / 2}" y="{axis_y + 30}">time (ms)</text>')
    out.append(
        f'<line class="cursor" x1="0" x2="0" y1="{gantt_top}" y2="{axis_y}" visibility="hidden"/>'
        f'<text class="cursorlab" x="0" y="{mem_top - 6}" visibility="hidden"></text></svg>'
    )
    return "".join(out)


def _view_data(view: _View) -> dict[str, Any]:
    return {
        "ranks": [
            {
                "rank": r.rank,
                "limit": r.limit if math.isfinite(r.limit) else None,
                "bars": [[b.action, b.start, b.end, b.memory] for b in r.bars + r.comm_bars],
                "timeline": [[round(t, 6), b] for t, b in r.timeline],
            }
            for r in view.ranks
        ]
    }


def _summary_html(view: _View, heading: str) -> str:
    first, second = _headline(view)
    return f"<h2>{html.escape(heading)}</h2><p class='sub'>{html.escape(first)}<br><b>{html.escape(second)}</b></p>"


_CSS = """
body{font:14px system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:16px 24px;color:#222;background:#fff}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:18px 0 2px}.sub{margin:0 0 6px;color:#333}
.legend span{display:inline-block;margin-right:16px;font-size:13px}
.legend i{display:inline-block;width:14px;height:14px;vertical-align:-2px;margin-right:5px;border-radius:2px}
svg.panel{width:100%;height:auto;display:block}
.grid line{stroke:#ddd;stroke-width:1}.hgrid{stroke:#eee;stroke-width:1}
.idle{fill:#E4E4E4}.act{stroke:#fff;stroke-width:.4}.dense .act{stroke:none}
.act.focus{stroke:#000;stroke-width:2}.act:hover{stroke:#000;stroke-width:1.5}
.lab{text-anchor:middle;pointer-events:none;font-family:system-ui,sans-serif}
.ylab{text-anchor:end;fill:#333}.tick{font-size:11px;fill:#444}.axlab{font-size:12px;fill:#333;text-anchor:middle}
.memframe{fill:none;stroke:#bbb}.mem{fill:none;stroke-width:1.4}.mem:hover{stroke-width:3}
.limit{stroke:#C00000;stroke-dasharray:6 4;stroke-width:1.3}.limlab{font-size:11px;fill:#C00000}
.cursor{stroke:#000;stroke-width:1;stroke-dasharray:2 2;pointer-events:none}
.cursorlab{font-size:11px;fill:#000;pointer-events:none}
#tip{position:fixed;pointer-events:none;background:rgba(20,20,20,.92);color:#fff;padding:6px 9px;
border-radius:4px;font-size:12px;line-height:1.45;display:none;z-index:9;white-space:nowrap}
"""

_JS = """
(function(){
const DATA=JSON.parse(document.getElementById('pipesched-data').textContent);
const tip=document.getElementById('tip');
function fmtB(v){if(v===null||v===undefined)return 'none';const u=['B','KiB','MiB','GiB','TiB'];let i=0;
 while(Math.abs(v)>=1024&&i<4){v/=1024;i++;}return i?v.toFixed(2)+' '+u[i]:v.toFixed(0)+' B';}
function memAt(tl,t){let lo=0,hi=tl.length-1;
 while(lo<hi){const mid=(lo+hi+1)>>1;if(tl[mid][0]<=t+1e-9)lo=mid;else hi=mid-1;}
 return tl[lo][1];}
function show(e,h){tip.innerHTML=h;tip.style.display='block';
 const w=tip.offsetWidth;tip.style.left=Math.min(e.clientX+14,window.innerWidth-w-8)+'px';
 tip.style.top=(e.clientY+14)+'px';}
function barTip(d,rank,i){const r=d.ranks[rank];const b=r.bars[i];
 return '<b>'+b[0]+'</b> on rank '+r.rank+'<br>start '+b[1].toFixed(3)+' ms · end '+b[2].toFixed(3)+
  ' ms<br>duration '+(b[2]-b[1]).toFixed(3)+' ms<br>memory '+fmtB(b[3])+(r.limit!==null?' of '+fmtB(r.limit):'');}
document.querySelectorAll('svg.panel').forEach(function(svg){
 const key=svg.dataset.prefix?'compare':'main';const d=DATA[key];
 const left=+svg.dataset.left,scale=+svg.dataset.scale,memTop=+svg.dataset.memtop,memH=+svg.dataset.memh;
 const cur=svg.querySelector('.cursor'),lab=svg.querySelector('.cursorlab');
 svg.addEventListener('mousemove',function(e){
  const pt=svg.createSVGPoint();pt.x=e.clientX;pt.y=e.clientY;const p=pt.matrixTransform(svg.getScreenCTM().inverse());
  const t=(p.x-left)/scale;if(t<0){cur.setAttribute('visibility','hidden');lab.setAttribute('visibility','hidden');
   tip.style.display='none';return;}
  cur.setAttribute('x1',p.x);cur.setAttribute('x2',p.x);cur.setAttribute('visibility','visible');
  lab.setAttribute('x',p.x+4);lab.textContent=t.toFixed(2)+' ms';lab.setAttribute('visibility','visible');
  const el=e.target;
  if(el.classList.contains('act')){show(e,barTip(d,+el.dataset.r,+el.dataset.i));
  }else if(p.y>=memTop&&p.y<=memTop+memH){
   let rows=d.ranks.map(function(r){return [r.rank,memAt(r.timeline,t),r.limit];});
   rows.sort(function(a,b){return b[1]-a[1];});const more=rows.length>8?'<br>… '+(rows.length-8)+' more ranks':'';
   show(e,'<b>t = '+t.toFixed(2)+' ms</b><br>'+rows.slice(0,8).map(function(x){return 'rank '+x[0]+': '+fmtB(x[1])+
    (x[2]!==null?' ('+(100*x[1]/x[2]).toFixed(0)+'% of limit)':'');}).join('<br>')+more);
  }else if(el.classList.contains('idle')){show(e,'idle · t = '+t.toFixed(2)+' ms');}
  else{tip.style.display='none';}
 });
 svg.addEventListener('mouseleave',function(){tip.style.display='none';cur.setAttribute('visibility','hidden');
  lab.setAttribute('visibility','hidden');});
});
// A link to one action: view#at=3F12 outlines it and shows its tooltip.
const at=decodeURIComponent(location.hash).match(/^#at=(\\d+[FIWB]\\d+)$/);
if(at){DATA.main.ranks.forEach(function(r,rank){r.bars.forEach(function(b,i){if(b[0]!==at[1])return;
 const el=document.querySelector('#panel rect.act[data-r="'+rank+'"][data-i="'+i+'"]');if(!el)return;
 el.classList.add('focus');el.scrollIntoView({block:'center'});const box=el.getBoundingClientRect();
 show({clientX:box.right,clientY:box.bottom},barTip(DATA.main,rank,i));});});}
document.body.dataset.ready=String(document.querySelectorAll('svg.panel rect.act').length);
})();
"""


def render_view_html(schedule: Schedule, compare: Schedule | None = None) -> str:
    """A self-contained HTML page of ``schedule`` (and ``compare`` beneath it, on the same time axis).

    Inline SVG, CSS and JS only; the page fetches nothing. Hovering an action shows its name, rank, start,
    end, duration (ms) and the rank's memory while it runs (bytes, and of the limit); hovering the memory
    panel shows every rank's memory at that time.

    Raises:
        ValueError: ``schedule`` (or ``compare``) is infeasible and has nothing to draw.
    """
    views = [_prepare(schedule)] + ([_prepare(compare)] if compare is not None else [])
    x_max = max(v.makespan for v in views) or 1.0
    kinds = [k for k in _ALL_KINDS if any(k in v.kinds for v in views)]
    legend = "".join(f'<span><i style="background:{KIND_COLORS[k]}"></i>{KIND_NAMES[k]}</span>' for k in kinds)
    if any(v.multi_stage for v in views):
        legend += (
            f'<span><i style="background:{_shade(KIND_COLORS["F"], 1)}"></i>lighter: the rank\'s later stage '
            "(a label s5·3 is stage 5, microbatch 3)</span>"
        )
    legend += f'<span><i style="background:{IDLE_COLOR}"></i>idle</span>'
    body = [f'<div class="legend">{legend}</div>', _summary_html(views[0], "Schedule"), _svg_panel(views[0], x_max, "")]
    data: dict[str, Any] = {"main": _view_data(views[0])}
    if compare is not None:
        body += [_summary_html(views[1], f"Compared with {compare.method}"), _svg_panel(views[1], x_max, "compare-")]
        data["compare"] = _view_data(views[1])
    title = f"pipesched · {schedule.method} · {schedule.problem.pipeline.num_ranks} ranks"
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<meta name='viewport' content='width=device-width'><title>{html.escape(title)}</title>"
        f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"
        + "".join(body)
        + f'<div id="tip"></div><script type="application/json" id="pipesched-data">{payload}</script>'
        f"<script>{_JS}</script></body></html>"
    )


def plot_to_file(schedule: Schedule, path: Path | str, *, compare: Schedule | None = None) -> Path:
    """Write the picture of ``schedule`` to ``path``; the suffix picks the format (.png, .svg, .html).

    Raises:
        ValueError: an unknown suffix (naming the ones supported), or an infeasible schedule.
    """
    target = Path(path)
    suffix = target.suffix.lower()
    if suffix == ".png":
        target.write_bytes(render_png(schedule, compare=compare))
    elif suffix == ".svg":
        target.write_text(render_svg(schedule, compare=compare), encoding="utf-8")
    elif suffix in (".html", ".htm"):
        target.write_text(render_view_html(schedule, compare), encoding="utf-8")
    else:
        raise ValueError(f"{target.name}: the output file must end in .png, .svg or .html (got {suffix or 'none'!r})")
    return target
