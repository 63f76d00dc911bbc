"""``/v1/plans``: the best parallel configurations for a model on a cluster (a job with progress)."""

from __future__ import annotations

import contextlib

from fastapi import APIRouter, Depends, HTTPException, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field, ValidationError

from pipesched.api.callbacks import CallbackView, callback_url, callback_view, record_callback
from pipesched.api.lanes import LaneFull
from pipesched.api.plans import submit_plan
from pipesched.api.routes._common import Services, require_token, services, stored_profiles, too_busy
from pipesched.api.schemas import JobCreated, PlanDocument, error_responses
from pipesched.api.storage import PlanRow
from pipesched.optimizer.planner.rank import prepare
from pipesched.optimizer.planner.request import PlanAnswer, PlanRequest

router = APIRouter(prefix="/v1/plans", tags=["plans"], dependencies=[Depends(require_token)])


class PlanProgressView(BaseModel):
    """Where a plan search stands."""

    phase: str | None = Field(None, description="search, auto (the schedule search on the best), done.")
    evaluated: int = Field(0, description="Configurations taken up so far.")
    total: int = Field(0, description="Configurations left after the memory filter.")
    best_step_ms: float | None = Field(None, description="Best predicted step so far, ms.")
    elapsed_s: float | None = None


class PlanStatus(PlanAnswer):
    """The contract's plan answer with the search's progress; ``plans`` holds the best so far while running."""

    progress: PlanProgressView = Field(default_factory=PlanProgressView)
    callback: CallbackView | None = Field(None, description="The signed POST of this plan once it ends, if asked.")


@router.post(
    "",
    status_code=202,
    operation_id="create_plan",
    dependencies=[Depends(stored_profiles)],
    summary="Queue a plan search; poll GET /v1/plans/{id}",
    response_model=JobCreated,
    responses=error_responses(401, 413, 422, 429),
)
def create_plan(
    request: PlanDocument,
    response: Response,
    svc: Services = Depends(services),
    callback: str | None = Depends(callback_url),
) -> JobCreated:
    """Check the request (an empty space or one where nothing fits is a 422 naming the field), then queue it.

    With ``"callback_url"`` beside the request's fields, the finished answer is POSTed there, signed.

    ``search.time_limit_s`` is clamped to the service's ``max_time_limit_s``.
    """
    limit = min(request.search.time_limit_s, svc.settings.max_time_limit_s)
    request = request.model_copy(update={"search": request.search.model_copy(update={"time_limit_s": limit})})
    try:
        prepared = prepare(request)
    except ValidationError as error:
        raise RequestValidationError(
            [{"loc": ("body", *item["loc"]), "msg": item["msg"], "type": item["type"]} for item in error.errors()]
        ) from None
    row = svc.store.create_plan(request.model_dump_json(), total=len(prepared.candidates))
    try:
        submit_plan(svc.pool, svc.store, row.id)
    except LaneFull as error:
        svc.store.fail_plan(row.id, f"not started: {error}")
        raise too_busy(error) from None
    record_callback(svc.store, "plan", row.id, callback)
    response.headers["Location"] = f"/v1/plans/{row.id}"
    return JobCreated(id=row.id, status="queued")


@router.get(
    "/{plan_id}",
    operation_id="get_plan",
    summary="A plan search: status, progress, ranked plans",
    response_model=PlanStatus,
    responses=error_responses(401, 404),
)
def get_plan(plan_id: str, svc: Services = Depends(services)) -> PlanStatus:
    """Status, progress, and the ranked plans (the best so far while running); each plan's schedule is at
    ``/v1/schedules/{schedule_id}`` once done."""
    return plan_status(svc, _found(svc.store.plan(plan_id), plan_id))


@router.delete(
    "/{plan_id}",
    operation_id="cancel_plan",
    summary="Cancel a queued or running plan search",
    response_model=PlanStatus,
    responses=error_responses(401, 404),
)
def cancel_plan(plan_id: str, svc: Services = Depends(services)) -> PlanStatus:
    """Cancel the search: a queued one never starts; a running one stops within a poll interval and its answer
    keeps the plans found until then (a note says so), as Ctrl-C does to ``pipesched plan``. A search that already
    ended is answered as it is."""
    return plan_status(svc, _found(svc.store.cancel_plan(plan_id), plan_id))


def _found(row: PlanRow | None, plan_id: str) -> PlanRow:
    """``row``, or a 404 that says where plan ids come from."""
    if row is None:
        raise HTTPException(status_code=404, detail=f"no plan with id {plan_id!r}: POST /v1/plans first")
    return row


def plan_status(svc: Services, row: PlanRow) -> PlanStatus:
    """The API view of a plan search's row; before its answer (queued, running, or failed without one: a restart
    cut it off) the request it was asked is the stored one."""
    answer = PlanAnswer.model_validate_json(row.answer_json) if row.answer_json else PlanAnswer(plans=[])
    if answer.request is None:
        with contextlib.suppress(ValidationError):  # stored by an older release under other rules: shown without it
            answer = answer.model_copy(update={"request": PlanRequest.model_validate_json(row.request_json)})
    return PlanStatus(
        **{
            **answer.model_dump(),
            "id": row.id,
            "status": row.status,
            "error": row.error or answer.error,
        },
        progress=PlanProgressView(
            phase=row.phase,
            evaluated=row.evaluated,
            total=row.total,
            best_step_ms=row.best_step_ms,
            elapsed_s=row.elapsed_s,
        ),
        callback=callback_view(svc.store, "plan", row.id),
    )
