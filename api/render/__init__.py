"""Pictures of a schedule: a Gantt chart per rank with each rank's memory over time.

* :func:`render_png` / :func:`render_svg`: matplotlib (Agg) figure — one row per rank, actions coloured by
  kind (F, I, W, B in the Okabe–Ito colour-blind-safe palette), labelled by microbatch (``s7·12`` where a rank
  holds several stages, whose later stages are also drawn lighter), idle time in grey, real time (ms) on the
  x axis; under it each rank's memory (step plot, from the simulator's ``memory_timeline``) against its limit.
* :func:`render_view_html`: a self-contained HTML page (inline SVG, CSS and JS; nothing fetched) with hover
  tooltips (action, rank, start, end, duration, memory at that time), the memory curves and, optionally, a
  second schedule drawn beneath on the same time axis.
* :func:`plot_to_file`: one of the three by the file's suffix.
* :mod:`~pipesched.api.render.worker`: the service's render process, drawing stored schedules by id.

With data parallelism (contract: communication actions) every rank gets a second row beneath its compute row,
its communication stream: UNSHARD and REDUCE_GRAD bars (RESHARD takes no time); OPTIMIZER_STEP stays on the
compute row.

Memory comes from ``pipesched.optimizer.simulate.simulate(compile_problem(schedule.problem), schedule.orders())``
(memory checks off, so a schedule over its limit is still drawn — with its excess visible).
"""

from __future__ import annotations

from pathlib import Path

from pipesched.api.render.bars import IDLE_COLOR, KIND_COLORS, LIMIT_COLOR
from pipesched.api.render.figure import render_png, render_svg
from pipesched.api.render.page import render_view_html
from pipesched.optimizer.result import Schedule

__all__ = ["IDLE_COLOR", "KIND_COLORS", "LIMIT_COLOR", "plot_to_file", "render_png", "render_svg", "render_view_html"]


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
