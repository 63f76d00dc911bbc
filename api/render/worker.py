"""Drawing stored schedules (png, svg, the HTML view and its comparison) in a render process.

The web process never parses or draws a schedule for a picture: it sends the schedule's id to
:func:`draw`, which runs in the render lane's worker process (:class:`pipesched.api.lanes.Lane`, a few
processes and a short queue), reads the schedule from the database itself, refuses one with more than
``max_actions`` actions (413, naming ``PIPESCHED_MAX_RENDER_ACTIONS`` and ``format=json``) and draws it
with :mod:`pipesched.api.render`. So parallel drawings of large schedules cost one bounded process, not
the web process's memory, and ``/healthz`` stays fast.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pipesched.api.render import render_png, render_svg, render_view_html
from pipesched.api.storage import Store
from pipesched.optimizer.export import orders_to_torch_csv, schedule_to_chrome_trace
from pipesched.optimizer.families import FamilyDomainError, get_family
from pipesched.optimizer.result import Schedule
from pipesched.optimizer.solve import solve_family

__all__ = ["DRAWING_MEDIA", "DRAWN", "Drawing", "count_actions", "draw"]

DRAWING_MEDIA = {
    "png": "image/png",
    "svg": "image/svg+xml",
    "view": "text/html",
    "csv": "text/csv",
    "chrome-trace": "application/json",
}
#: The kinds that are drawn (matplotlib or the HTML view): capped by ``max_actions``. csv and
#: chrome-trace are written here too, so the web process never parses a large schedule, but not capped.
DRAWN = frozenset({"png", "svg", "view"})

_STORES: dict[str, Store] = {}

#: Each action of a stored schedule's JSON holds this key once (``ActionTiming.action``).
ACTION_KEY = '"action":'


@dataclass(frozen=True)
class Drawing:
    """What :func:`draw` answers: an HTTP status, and the picture (200) or the error's ``detail``."""

    status: int
    body: bytes = b""
    media: str = "application/json"
    detail: Any = None


def count_actions(schedule: Schedule) -> int:
    """Actions over all ranks."""
    return sum(len(rank.actions) for rank in schedule.ranks)


def _compare_error(msg: str, kind: str) -> Drawing:
    return Drawing(422, detail=[{"loc": ["query", "compare"], "msg": msg, "type": kind}])


def draw(database_url: str, schedule_id: str, kind: str, compare: str | None, max_actions: int) -> Drawing:
    """Draw stored schedule ``schedule_id`` as ``kind`` (png, svg or view; csv and chrome-trace are
    written, uncapped), with family ``compare`` beside it (view only), in the calling (render) process.

    Returns:
        200 with the bytes; 404 (no such schedule), 409 (infeasible: nothing to draw), 413 (more than
        ``max_actions`` actions, the compared family's counted as many again), 422 (``compare`` unknown,
        auto, or outside the family's domain) with ``detail``.
    """
    if database_url not in _STORES:
        _STORES[database_url] = Store(database_url)
    text = _STORES[database_url].schedule_json(schedule_id)
    if text is None:
        return Drawing(404, detail=f"no schedule with id {schedule_id!r}: ids come from POST /v1/schedules or a job")
    # Counted in the stored text before parsing it: a schedule over the cap is refused at once.
    actions = text.count(ACTION_KEY) * (2 if compare is not None else 1)
    if kind in DRAWN and actions > max_actions:
        counted = " (the compared family counted as many again)" if compare is not None else ""
        return Drawing(
            413,
            detail=(
                f"schedule {schedule_id} has {actions} actions to draw{counted}, over this service's drawing limit "
                f"of {max_actions} (PIPESCHED_MAX_RENDER_ACTIONS): fetch it with ?format=json (or csv, "
                "chrome-trace) and draw it locally with `pipesched plot`"
            ),
        )
    schedule = Schedule.model_validate_json(text)
    del text
    if schedule.status == "infeasible":
        what = "there is nothing to draw" if kind == "view" else f"it has no actions to write as {kind}"
        return Drawing(409, detail=f"schedule {schedule_id} is infeasible ({schedule.reason}): {what}")
    other: Schedule | None = None
    if compare is not None:
        if compare == "auto":
            return _compare_error("compare names one family (see GET /v1/methods), not auto", "unknown_method")
        try:
            get_family(compare).check_shape(schedule.problem)
            # Drawn as the family builds it, flagged over the limit when it does not fit (not stored: with
            # the memory limit enforced it would be an infeasible answer with nothing to draw).
            other = solve_family(schedule.problem, compare, enforce_memory=False)
        except KeyError as error:
            return _compare_error(str(error.args[0]), "unknown_method")
        except FamilyDomainError as error:
            return _compare_error(f"{error}; choose another family", "family_domain")
    if kind == "csv":
        body = orders_to_torch_csv(schedule.orders()).encode()
    elif kind == "chrome-trace":
        body = json.dumps(schedule_to_chrome_trace(schedule)).encode()
    elif kind == "png":
        body = render_png(schedule)
    elif kind == "svg":
        body = render_svg(schedule).encode()
    else:
        body = render_view_html(schedule, compare=other).encode()
    return Drawing(200, body, DRAWING_MEDIA[kind])
