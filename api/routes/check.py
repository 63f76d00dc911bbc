"""``POST /v1/schedules/check``: time and check a schedule written elsewhere (:mod:`pipesched.optimizer.check`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from pipesched.api.routes._common import Services, field_error, prepare_problem, require_token, services
from pipesched.api.schemas import error_responses
from pipesched.optimizer.check import ScheduleInputError, check_schedule, read_schedule
from pipesched.optimizer.derive import ProblemDocument
from pipesched.optimizer.field_errors import StrictModel

router = APIRouter(prefix="/v1/schedules", tags=["schedules"], dependencies=[Depends(require_token)])


class CheckRequest(StrictModel):
    """A problem and a schedule for it."""

    problem: ProblemDocument
    schedule: list[list[str]] | str = Field(
        description='One list of action strings per rank ([["0F0", "0I0", …], …]), or PyTorch\'s compute-only '
        "CSV text (one row per rank; SEND_*/RECV_* skipped with a note; UNSHARD/RESHARD/REDUCE_GRAD/OPTIMIZER_STEP "
        "read as optimizer/check.py says)."
    )


class CheckViolation(BaseModel):
    """The first violation: the simulator's reason code, a sentence, its details, and the marked grid."""

    reason: str
    message: str
    details: dict[str, Any]
    marks: list[list[int]] = Field(description="[rank, step] cells the violation is about.")
    grid: str = Field(description="Rank × step text grid with the marked cells as >action<.")


class CheckAnswer(BaseModel):
    """``valid`` with objective (ms), bubble rate and peak memory per rank (bytes), or the violation."""

    valid: bool
    objective: str
    notes: list[str]
    objective_value: float | None = None
    makespan: float | None = None
    stage_span: float | None = None
    bubble_rate: float | None = None
    peak_memory: list[float] | None = None
    violation: CheckViolation | None = None
    ranks: list[list[str]]


@router.post(
    "/check",
    operation_id="check_schedule",
    summary="Time and check a schedule written elsewhere (action lists or PyTorch CSV)",
    response_model=CheckAnswer,
    responses=error_responses(401, 413, 422),
)
def check(request: CheckRequest, svc: Services = Depends(services)) -> CheckAnswer:
    """200 with ``valid: true`` and the objective, or ``valid: false`` and the first violation; 422 for a schedule
    that is not one (a cell that is no action) or a problem over the service's size limit."""
    problem = prepare_problem(
        request.problem.with_changes(**{"solver.method": "auto"}), svc.settings, ("body", "problem")
    )
    try:
        orders, notes = read_schedule(request.schedule)
    except ScheduleInputError as error:
        raise field_error(("body", "schedule"), str(error)) from None
    cells = sum(len(row) for row in orders)
    if cells > 3 * svc.settings.max_actions:
        raise field_error(("body", "schedule"), f"the schedule has {cells} actions, over this service's limit")
    return CheckAnswer.model_validate(check_schedule(problem, orders, notes).to_dict())
