"""The matplotlib figure of a schedule (PNG, SVG): one row per rank (and its communication row), actions
coloured by kind, labelled by microbatch; under it each rank's memory over time against its limit."""

from __future__ import annotations

import io
import math
from typing import Any

from pipesched.api.render.bars import (
    _ALL_KINDS,
    IDLE_COLOR,
    KIND_COLORS,
    KIND_NAMES,
    LIMIT_COLOR,
    QUALITATIVE_RANKS,
    _bytes_unit,
    _fit_label,
    _format_bytes,
    _headline,
    _prepare,
    _rank_color,
    _shade,
    _text_color,
    _View,
)
from pipesched.optimizer.result import Schedule


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
    from matplotlib.backends.backend_agg import FigureCanvasAgg
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
    # as many columns as fit the figure's width (a row wider than the figure is clipped at both sides)
    renderer = FigureCanvasAgg(fig).get_renderer()
    for columns in range(len(handles), 0, -1):
        legend = fig.legend(
            handles=handles,
            loc="outside lower center",
            ncol=columns,
            fontsize=8,
            frameon=False,
            handlelength=1.4,
            columnspacing=1.6,
        )
        if columns == 1 or legend.get_window_extent(renderer).width <= 0.97 * fig.bbox.width:
            return
        legend.remove()


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
