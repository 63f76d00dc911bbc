"""``/v1/schedules``: solve synchronously, read a stored schedule in a format, view it as HTML."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Response
from fastapi.exceptions import RequestValidationError

from pipesched.api.jobs import SolverDied, SolveTimeout, UnstorableSchedule
from pipesched.api.lanes import LaneClosed, LaneFull, WorkerDied
from pipesched.api.render.worker import Drawing, draw
from pipesched.api.routes._common import (
    Services,
    cache_headers,
    field_error,
    prepare_problem,
    require_token,
    services,
    stored_profiles,
    too_busy,
)
from pipesched.api.schemas import ChromeTrace, ScheduleAnswer, error_responses
from pipesched.api.storage import problem_key
from pipesched.optimizer.derive import ProblemDocument
from pipesched.optimizer.families import FamilyDomainError
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.result import Schedule

router = APIRouter(prefix="/v1/schedules", tags=["schedules"], dependencies=[Depends(require_token)])

FORMAT_MEDIA = {
    "json": "application/json",
    "csv": "text/csv",
    "chrome-trace": "application/json",
    "png": "image/png",
    "svg": "image/svg+xml",
}


def solve_and_store(svc: Services, problem: Problem, *, mode: str = "sync") -> tuple[str, bool]:
    """The stored schedule for ``problem`` (cache hit), or solve it in the pool and store it.

    Returns:
        (the schedule's JSON with its ``id``, hit).

    Raises:
        HTTPException: 429 when the synchronous solves' queue is full; 503 when the solver process died;
            504 when no answer comes within the time limit plus ``max_sync_wait_s``.
        DatabaseUnavailable: the database or the queue cannot be reached (the app answers 503).
        FamilyDomainError: as :func:`pipesched.optimizer.solve.solve`.
    """
    key = problem_key(problem)
    cached = svc.store.schedule_json_by_hash(key)
    svc.metrics.cache_lookups.labels(result="hit" if cached else "miss").inc()
    if cached is not None:
        return cached, True
    try:
        schedule = svc.pool.solve(problem, timeout_s=problem.solver.time_limit_s + svc.settings.max_sync_wait_s)
    except LaneFull as error:
        raise too_busy(error, "submit it as a job with POST /v1/jobs") from None
    except SolverDied as error:
        raise HTTPException(503, f"{error}: retry, or lower the problem's size") from None
    except UnstorableSchedule as error:
        raise field_error(("body",), str(error), "unstorable") from None
    except SolveTimeout as error:
        raise HTTPException(504, f"{error}: retry, or submit it as a job with POST /v1/jobs") from None
    svc.metrics.solve_seconds.labels(method=problem.solver.method, mode=mode).observe(schedule.solve_time_s)
    searched = problem.solver.method == "auto" and schedule.status != "optimal"
    if searched and schedule.problem.solver.time_limit_s < problem.solver.time_limit_s:
        # A search its wait in the queue shortened (api/solving.py) answers this request, but is no answer to the
        # whole limit: stored under the problem it searched, the same problem asked again searches its whole limit
        # (a named family's schedule does not depend on the limit).
        key = problem_key(schedule.problem)
    stored, _created = svc.store.put_schedule(key, schedule)
    return stored.model_dump_json(), False


def with_cache_field(schedule_json: str, hit: bool) -> str:
    """The stored Schedule JSON object with ``"cache"`` appended (the :class:`ScheduleAnswer` shape)."""
    body = schedule_json.rstrip()
    assert body.endswith("}")
    return f'{body[:-1]},"cache":"{"hit" if hit else "miss"}"}}'


@router.post(
    "",
    operation_id="solve_schedule",
    dependencies=[Depends(stored_profiles)],
    summary="Solve a problem within its time limit and answer the schedule",
    response_model=ScheduleAnswer,
    responses=error_responses(401, 413, 422, 429, 503, 504),
)
def solve_schedule(problem: ProblemDocument, response: Response, svc: Services = Depends(services)) -> Response:
    """Solve ``problem`` (clamped to the service's time limit) and answer the schedule with its ``id``.

    The same problem again returns the stored schedule without solving (header
    ``X-Pipesched-Cache: hit``, field ``cache``). An infeasible problem is a 200 answer with
    ``status: infeasible`` and its ``reason``.
    """
    problem = prepare_problem(problem, svc.settings)
    try:
        schedule_json, hit = solve_and_store(svc, problem)
    except FamilyDomainError as error:
        raise field_error(("body", "solver", "method"), f"{error}; choose another method or auto") from None
    return Response(with_cache_field(schedule_json, hit), media_type="application/json", headers=cache_headers(hit))


def _stored(svc: Services, schedule_id: str) -> Schedule:
    schedule = svc.store.schedule(schedule_id)
    if schedule is None:
        raise HTTPException(404, f"no schedule with id {schedule_id!r}: ids come from POST /v1/schedules or a job")
    return schedule


@router.get(
    "/{schedule_id}",
    operation_id="get_schedule",
    summary="A stored schedule as JSON, PyTorch CSV, Chrome trace, PNG or SVG",
    response_model=Schedule | ChromeTrace,
    responses={
        200: {"content": {media: {} for media in ("text/csv", "image/png", "image/svg+xml")}},
        **error_responses(401, 404, 409, 413, 422, 429, 503, 504),
    },
)
def get_schedule(
    schedule_id: str,
    output_format: Literal["json", "csv", "chrome-trace", "png", "svg"] = Query(
        "json", alias="format", description="json, csv (PyTorch compute-only), chrome-trace, png or svg."
    ),
    svc: Services = Depends(services),
) -> Response:
    """The schedule stored under ``schedule_id`` in ``format``: json as stored; the others written in a
    render process (png and svg: 413 over ``PIPESCHED_MAX_RENDER_ACTIONS``; 429 when its queue is full)."""
    media = FORMAT_MEDIA[output_format]
    if output_format == "json":
        stored_json = svc.store.schedule_json(schedule_id)
        if stored_json is None:
            _stored(svc, schedule_id)  # the 404
        return Response(stored_json, media_type=media)
    return drawn(svc, schedule_id, output_format, None)


def drawn(svc: Services, schedule_id: str, kind: str, compare: str | None) -> Response:
    """``kind`` (png, svg, view) of a stored schedule, drawn by :func:`pipesched.api.render.worker.draw` in the
    render lane, waiting at most ``render_timeout_s``.

    Raises:
        HTTPException: 429 (render queue full), 503 (the render process died), 504 (no drawing in time),
            or the drawing's own 404/409/413.
        RequestValidationError: ``compare`` is not a family that admits the problem (422).
    """
    settings = svc.settings
    try:
        ticket = svc.renders.submit(
            draw,
            svc.store.database_url,
            schedule_id,
            kind,
            compare,
            settings.max_render_actions,
            expected_s=settings.render_timeout_s / 4,
        )
    except LaneFull as error:
        raise too_busy(error, "fetch it with ?format=json and draw it locally with `pipesched plot`") from None
    except LaneClosed as error:
        raise HTTPException(503, f"{error}: retry") from None
    try:
        drawing: Drawing = ticket.future.result(timeout=settings.render_timeout_s)
    except TimeoutError:
        waited = svc.renders.cancel(ticket)
        if not waited:
            svc.renders.abort(ticket)  # a runaway drawing would hold the render process for the next ones
        raise HTTPException(
            504,
            f"no drawing within {settings.render_timeout_s:g} s (PIPESCHED_RENDER_TIMEOUT_S): "
            + ("it waited in the render queue and never started" if waited else "the drawing itself took longer")
            + "; fetch it with ?format=json and draw it locally with `pipesched plot`",
        ) from None
    except (WorkerDied, LaneClosed) as error:
        raise HTTPException(503, f"{error}: retry, or fetch it with ?format=json") from None
    if drawing.status == 422:
        raise RequestValidationError(drawing.detail)
    if drawing.status != 200:
        raise HTTPException(drawing.status, drawing.detail)
    return Response(drawing.body, media_type=drawing.media)


@router.get(
    "/{schedule_id}/view",
    operation_id="view_schedule",
    summary="An HTML page of a stored schedule, optionally beside another family's",
    responses={200: {"content": {"text/html": {}}}, **error_responses(401, 404, 409, 413, 422, 429, 503, 504)},
    response_class=Response,
)
def view_schedule(
    schedule_id: str,
    compare: str | None = Query(None, description="A family name (see GET /v1/methods) to draw beside it."),
    svc: Services = Depends(services),
) -> Response:
    """The HTML view; with ``compare`` the same problem solved by that family is drawn beside it (both
    drawn in a render process: 413 over ``PIPESCHED_MAX_RENDER_ACTIONS``, 429 when its queue is full)."""
    return drawn(svc, schedule_id, "view", compare)
