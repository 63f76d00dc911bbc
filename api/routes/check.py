"""``POST /v1/schedules/check``: time and check a schedule written elsewhere (:mod:`pipesched.optimizer.check`).

The check runs in the check lane (:func:`pipesched.api.checks.run_check`), and a request is admitted before its
body is read (:class:`AdmittedCheck`): at most ``check_workers + max_queued_checks`` checks are read, queued or
run at once, the rest get 429 with ``Retry-After``.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field, field_validator

from pipesched.api.checks import ScheduleInputError, run_check
from pipesched.api.lanes import LaneClosed, LaneFull, WorkerDied
from pipesched.api.routes._common import (
    Services,
    field_error,
    prepare_problem,
    require_token,
    services,
    stored_profiles,
    too_busy,
)
from pipesched.api.schemas import error_responses
from pipesched.optimizer.derive import ProblemDocument
from pipesched.optimizer.field_errors import StrictModel


class AdmittedCheck(APIRoute):
    """A route admitted by ``Services.check_admission`` before FastAPI reads and parses its body (429 when
    every place is taken), holding its place until it answers."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def admitted(request: Request) -> Response:
            svc = services(request)
            try:
                with svc.check_admission.place(svc.settings.check_timeout_s / 4):
                    return await handler(request)
            except LaneFull as error:
                raise too_busy(error, "check it locally with `pipesched check`") from None

        return admitted


router = APIRouter(
    prefix="/v1/schedules", tags=["schedules"], dependencies=[Depends(require_token)], route_class=AdmittedCheck
)


class CheckRequest(StrictModel):
    """A problem and a schedule for it."""

    problem: ProblemDocument
    schedule: list[list[str]] | str = Field(
        description='One list of action strings per rank ([["0F0", "0I0", …], …]), or PyTorch\'s compute-only '
        "CSV text (one row per rank; SEND_*/RECV_* skipped with a note; UNSHARD/RESHARD/REDUCE_GRAD/OPTIMIZER_STEP "
        "read as optimizer/check.py says)."
    )

    @field_validator("schedule", mode="before")
    @classmethod
    def _one_list_per_rank_or_csv(cls, value: Any) -> Any:
        """Another shape gets one sentence on ``schedule`` (it had one line per member of the union, at
        ``schedule.list[list[str]].0``, ``schedule.str``)."""
        if isinstance(value, str) or (
            isinstance(value, list)
            and all(isinstance(rank, list) and all(isinstance(a, str) for a in rank) for rank in value)
        ):
            return value
        if isinstance(value, dict):
            got = "an object: list the ranks in order, rank 0's actions first, not keyed by rank"
        elif isinstance(value, list) and all(isinstance(item, str) for item in value):
            got = "one flat list of strings: put each rank's actions in a list of its own"
        elif isinstance(value, list):
            got = "a list whose items are not each a list of strings"
        else:
            got = "null" if value is None else "a boolean" if isinstance(value, bool) else "a number"
        raise ValueError(
            'give one list of action strings per rank ([["0F0", "0I0", "0W0"], ["1F0", …]]) or PyTorch\'s CSV text, '
            f"not {got}"
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
    dependencies=[Depends(stored_profiles)],
    summary="Time and check a schedule written elsewhere (action lists or PyTorch CSV)",
    response_model=CheckAnswer,
    responses=error_responses(401, 413, 422, 429, 503, 504),
)
def check(request: CheckRequest, svc: Services = Depends(services)) -> CheckAnswer:
    """200 with ``valid: true`` and the objective, or ``valid: false`` and the first violation; 422 for a schedule
    that is not one (a cell that is no action) or a problem over the service's size limit; 429 while
    ``check_workers + max_queued_checks`` checks are under way; 504 after ``check_timeout_s``."""
    problem = prepare_problem(
        request.problem.with_changes(**{"solver.method": "auto"}), svc.settings, ("body", "problem")
    )
    settings = svc.settings
    try:
        ticket = svc.checks.submit(
            run_check, problem, request.schedule, 3 * settings.max_actions, expected_s=settings.check_timeout_s / 4
        )
        result = ticket.future.result(timeout=settings.check_timeout_s)
    except ScheduleInputError as error:
        raise field_error(("body", "schedule"), str(error)) from None
    except TimeoutError:
        waited = svc.checks.cancel(ticket)
        if not waited:
            svc.checks.abort(ticket)
        raise HTTPException(
            504,
            f"no check within {settings.check_timeout_s:g} s (PIPESCHED_CHECK_TIMEOUT_S): check it locally with "
            "`pipesched check`",
        ) from None
    except (WorkerDied, LaneClosed) as error:
        raise HTTPException(503, f"{error}: retry, or check it locally with `pipesched check`") from None
    return CheckAnswer.model_validate(result)
