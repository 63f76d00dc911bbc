"""What both drawings of a schedule show, computed once: per rank its bars (compute and communication
streams) and memory timeline, the colours of kinds and ranks, labels that fit a bar, the headline.

Package-private to :mod:`pipesched.api.render`: :mod:`~pipesched.api.render.figure` (matplotlib) and
:mod:`~pipesched.api.render.page` (the HTML view) draw from :func:`_prepare`'s view.

Memory comes from :func:`pipesched.optimizer.pattern.memory_timelines` (the simulator for a step, memory checks
off, so a schedule over its limit is still drawn — with its excess visible; the steady state for a pattern).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field

from pipesched.optimizer.pattern import memory_timelines
from pipesched.optimizer.result import Schedule

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
    memory_timeline, peak_memory = memory_timelines(schedule)
    limits = schedule.problem.memory_limits
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
                limit=limits[rank],
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
