"""Request and response bodies of the HTTP service (the request body of a solve is the contract's Problem)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from pipesched.api.callbacks import CallbackView, without_callback_url
from pipesched.optimizer.derive import ProblemDocument
from pipesched.optimizer.planner.request import PlanRequest
from pipesched.optimizer.result import Schedule

__all__ = [
    "ChromeTrace",
    "ErrorDetail",
    "HTTPError",
    "Health",
    "JobCreated",
    "JobDocument",
    "JobProgress",
    "JobStatus",
    "MethodInfo",
    "Methods",
    "PlanDocument",
    "ScheduleAnswer",
    "ValidationErrors",
]

JobState = Literal["queued", "running", "done", "failed", "cancelled"]

#: A job's body: the contract's Problem, and optionally ``callback_url`` (read by the route's dependency).
JobDocument = Annotated[ProblemDocument, BeforeValidator(without_callback_url)]
#: A plan search's body: the contract's plan request, and optionally ``callback_url``.
PlanDocument = Annotated[PlanRequest, BeforeValidator(without_callback_url)]


class ScheduleAnswer(Schedule):
    """The contract's Schedule with its stored ``id`` and whether it came from the store."""

    cache: Literal["hit", "miss"] = Field(
        description="hit: the same problem was solved before and the stored schedule is returned without solving."
    )


class ChromeTrace(BaseModel):
    """A schedule as a Chrome trace (``?format=chrome-trace``; open in chrome://tracing or Perfetto)."""

    model_config = ConfigDict(extra="allow")

    traceEvents: list[dict[str, Any]]


class JobCreated(BaseModel):
    """An accepted job."""

    id: str
    status: JobState


class JobProgress(BaseModel):
    """The search's state: best objective (ms), lower bound (ms), elapsed s, last message."""

    best_objective: float | None = Field(None, description="ms, on the problem's objective")
    lower_bound: float | None = Field(None, description="ms, on the problem's objective")
    elapsed_s: float | None = None
    message: str | None = None


class JobStatus(BaseModel):
    """A job: its state, progress, and the schedule once done."""

    id: str
    status: JobState
    progress: JobProgress
    schedule_id: str | None = Field(None, description="The stored schedule (GET /v1/schedules/{id}) once done.")
    result: Schedule | None = Field(None, description="The schedule, once done.")
    error: str | None = Field(None, description="Why the job failed.")
    cache: Literal["hit", "miss"]
    attempt: int = Field(description="Restarts of the service this job lived through.")
    created_at: float = Field(description="Unix time, s.")
    updated_at: float = Field(description="Unix time, s.")
    callback: CallbackView | None = Field(None, description="The signed POST of this job once it ends, if asked.")


class MethodInfo(BaseModel):
    """One solver method: a schedule family, or auto."""

    name: str
    domain: str = Field(description="Which problems the method admits.")
    description: str


class Methods(BaseModel):
    methods: list[MethodInfo]


class Health(BaseModel):
    status: Literal["ok"]
    database: Literal["ok"]
    solver_workers: int
    jobs_in_flight: int


class ErrorDetail(BaseModel):
    """One problem with the request: the field path, what to do, and the error type."""

    loc: list[str | int]
    msg: str
    type: str


class ValidationErrors(BaseModel):
    """422: every offending field with a sentence to act on (``loc`` ``["body"]`` for a body that is not JSON)."""

    detail: list[ErrorDetail]


class HTTPError(BaseModel):
    """Any other error: one sentence."""

    detail: str


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` for the given error codes."""
    described = {
        401: ("Missing or wrong `Authorization: Bearer <token>` (when the service has a token).", HTTPError),
        404: ("No such id.", HTTPError),
        409: ("The schedule is infeasible: it has no actions to render in this format.", HTTPError),
        413: ("The body, or the schedule to draw, is larger than the service accepts.", HTTPError),
        422: (
            'A field is invalid, or the body is not JSON: its path (`["body"]` for the body) and what to change.',
            ValidationErrors,
        ),
        429: ("The queue for this kind of work is full: retry after `Retry-After` seconds.", HTTPError),
        503: ("The database cannot be reached, or a worker process died.", HTTPError),
        504: ("No answer within the time limit (plus a grace period).", HTTPError),
    }
    return {code: {"description": described[code][0], "model": described[code][1]} for code in codes}
