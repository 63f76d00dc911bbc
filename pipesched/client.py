"""A Python client of the pipesched service (httpx): ``Client(url, token=None)``.

    from pipesched.client import Client

    with Client("http://127.0.0.1:8000") as client:
        schedule = client.solve(problem)                      # POST /v1/schedules → ScheduleAnswer
        job_id = client.submit(problem)                       # POST /v1/jobs → the job's id
        job = client.wait(job_id, progress=print)             # polls GET /v1/jobs/{id} → JobStatus (done)
        plans = client.plan(config)                           # POST /v1/plans, polls → PlanStatus (done)
        files = client.launch(plans.id, scheduler="slurm")    # GET /v1/plans/{id}/launch → LaunchFiles
        verdict = client.check(problem, orders)               # POST /v1/schedules/check → CheckAnswer

Answers are the server's own pydantic models. A 429 is retried after its ``Retry-After`` seconds, a 503 or a
connection error after an exponential backoff (0.5 s, 1 s, 2 s, … capped at 10 s), at most ``max_retries``
times each; then :class:`Overloaded` or :class:`Unavailable` is raised. A 422 raises :class:`InvalidRequest`
carrying the service's field paths and sentences. :class:`AsyncClient` is the same over ``httpx.AsyncClient``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from pipesched.api.routes.check import CheckAnswer
from pipesched.api.routes.launch import LaunchFiles
from pipesched.api.routes.plans import PlanStatus
from pipesched.api.schemas import JobCreated, JobStatus, ScheduleAnswer

__all__ = [
    "AsyncClient",
    "Client",
    "InvalidRequest",
    "JobFailed",
    "NotFound",
    "Overloaded",
    "PipeschedError",
    "Unauthorized",
    "Unavailable",
]

Model = TypeVar("Model", bound=BaseModel)
#: Job and plan states after which nothing changes.
FINISHED = ("done", "failed", "cancelled")


class PipeschedError(Exception):
    """An answer the client cannot turn into a result: the status code and the service's detail."""

    def __init__(self, status_code: int, detail: Any, message: str | None = None) -> None:
        self.status_code = status_code
        self.detail = detail
        super().__init__(message or f"{status_code}: {detail}")


class InvalidRequest(PipeschedError):
    """422 (or 400): ``errors`` lists each offending field's path (``loc``) and what to change (``msg``)."""

    @property
    def errors(self) -> list[dict[str, Any]]:
        return self.detail if isinstance(self.detail, list) else [{"loc": [], "msg": str(self.detail)}]


class Unauthorized(PipeschedError):
    """401: the service wants ``Client(url, token=…)``."""


class NotFound(PipeschedError):
    """404: no such job, plan or schedule."""


class Overloaded(PipeschedError):
    """429 still after ``max_retries`` waits of ``Retry-After`` seconds."""


class Unavailable(PipeschedError):
    """503 or no connection still after ``max_retries`` backoffs."""


class JobFailed(PipeschedError):
    """A job or plan search ended failed or cancelled; ``detail`` is its last status."""


_ERRORS: dict[int, type[PipeschedError]] = {
    400: InvalidRequest,
    401: Unauthorized,
    404: NotFound,
    422: InvalidRequest,
    429: Overloaded,
    503: Unavailable,
}


def _message(response: httpx.Response) -> tuple[Any, str]:
    try:
        detail = response.json().get("detail", response.text)
    except ValueError:
        detail = response.text
    if isinstance(detail, list):  # FastAPI's validation errors: path and sentence each
        text = "; ".join(f"{'.'.join(map(str, item.get('loc', [])))}: {item.get('msg')}" for item in detail)
    else:
        text = str(detail)
    return detail, f"{response.status_code} {response.reason_phrase}: {text}"


def raise_for(response: httpx.Response) -> None:
    """Raise the typed error of a non-2xx answer."""
    if response.is_success:
        return
    detail, message = _message(response)
    raise _ERRORS.get(response.status_code, PipeschedError)(response.status_code, detail, message)


@dataclass(frozen=True)
class RetryPolicy:
    """When to try again: 429 after ``Retry-After``, 503 and connection errors after a capped doubling backoff."""

    max_retries: int = 5
    backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    max_retry_after_s: float = 60.0

    def delay(self, response: httpx.Response | None, attempt: int) -> float | None:
        """Seconds to wait before attempt ``attempt + 1``, or None to stop retrying."""
        if attempt >= self.max_retries:
            return None
        if response is not None and response.status_code == 429:
            try:
                return min(self.max_retry_after_s, max(0.0, float(response.headers.get("Retry-After", "1"))))
            except ValueError:
                return 1.0
        if response is None or response.status_code == 503:
            return min(self.max_backoff_s, self.backoff_s * 2**attempt)
        return None


def _body(document: BaseModel | Mapping[str, Any]) -> Any:
    if isinstance(document, BaseModel):
        return document.model_dump(mode="json", exclude_none=True)
    return dict(document)


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


class _Requests:
    """What both clients share: the retry decision, the paths, the bodies, the answer types."""

    def __init__(self, base_url: str, retry: RetryPolicy | None, poll_s: float) -> None:
        self.base_url = base_url
        self.retry = retry or RetryPolicy()
        self.poll_s = poll_s
        #: Retries made, by status code (0: no connection), for callers that watch load.
        self.retries: Counter[int] = Counter()

    def _settle(self, response: httpx.Response | None, failure: Exception | None, attempt: int) -> float | None:
        """None when ``response`` is the answer (its typed error raised if it is one), else seconds to wait."""
        if response is not None and response.status_code not in (429, 503):
            raise_for(response)
            return None
        delay = self.retry.delay(response, attempt)
        if delay is None:
            if response is None:
                raise Unavailable(0, str(failure), f"no connection to {self.base_url}: {failure}")
            raise_for(response)
        self.retries[response.status_code if response is not None else 0] += 1
        return delay

    @staticmethod
    def check_body(problem: BaseModel | Mapping[str, Any], orders: list[list[str]] | str) -> dict[str, Any]:
        return {"problem": _body(problem), "schedule": orders}

    @staticmethod
    def launch_params(plan: int, scheduler: str, target: str, **more: str | None) -> dict[str, Any]:
        params: dict[str, Any] = {"plan": plan, "scheduler": scheduler, "target": target}
        params.update({key: value for key, value in more.items() if value is not None})
        return params

    @staticmethod
    def finished(status: JobStatus | PlanStatus) -> bool:
        if status.status not in FINISHED:
            return False
        if status.status != "done":
            raise JobFailed(200, status.model_dump(mode="json"), f"{status.id} {status.status}: {status.error}")
        return True


class Client(_Requests):
    """A blocking client. ``token`` is the service's ``PIPESCHED_API_TOKEN``; ``timeout_s`` bounds each call."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout_s: float = 120.0,
        retry: RetryPolicy | None = None,
        poll_s: float = 0.5,
    ) -> None:
        super().__init__(url.rstrip("/"), retry, poll_s)
        self.http = httpx.Client(base_url=self.base_url, headers=_headers(token), timeout=timeout_s)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One call with the retry policy; the typed error of its last answer."""
        for attempt in itertools.count():
            response: httpx.Response | None = None
            failure: Exception | None = None
            try:
                response = self.http.request(method, path, **kwargs)
            except httpx.TransportError as error:
                failure = error
            delay = self._settle(response, failure, attempt)
            if delay is None and response is not None:
                return response
            time.sleep(delay or 0.0)
        raise AssertionError("unreachable")

    def _get(self, model: type[Model], method: str, path: str, **kwargs: Any) -> Model:
        return model.model_validate(self.request(method, path, **kwargs).json())

    def solve(self, problem: BaseModel | Mapping[str, Any]) -> ScheduleAnswer:
        """The schedule of ``problem`` (the contract's Problem, as a model or a dict), solved within its limit."""
        return self._get(ScheduleAnswer, "POST", "/v1/schedules", json=_body(problem))

    def submit(self, problem: BaseModel | Mapping[str, Any]) -> str:
        """Queue ``problem`` as a job; its id."""
        return self._get(JobCreated, "POST", "/v1/jobs", json=_body(problem)).id

    def job(self, job_id: str) -> JobStatus:
        """A job's status, progress and, once done, its schedule."""
        return self._get(JobStatus, "GET", f"/v1/jobs/{job_id}")

    def wait(
        self, job_id: str, progress: Callable[[JobStatus], object] | None = None, timeout_s: float | None = None
    ) -> JobStatus:
        """Poll the job until it ends; ``progress`` sees every status. Raises JobFailed, TimeoutError."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            status = self.job(job_id)
            if progress is not None:
                progress(status)
            if self.finished(status):
                return status
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {status.status} after {timeout_s} s")
            time.sleep(self.poll_s)

    def plan(
        self, config: BaseModel | Mapping[str, Any], progress: Callable[[PlanStatus], object] | None = None
    ) -> PlanStatus:
        """Queue a plan search (the contract's plan request) and wait for its ranked plans."""
        plan_id = self._get(JobCreated, "POST", "/v1/plans", json=_body(config)).id
        while True:
            status = self._get(PlanStatus, "GET", f"/v1/plans/{plan_id}")
            if progress is not None:
                progress(status)
            if self.finished(status):
                return status
            time.sleep(self.poll_s)

    def cancel_plan(self, plan_id: str) -> PlanStatus:
        """Cancel a plan search (``DELETE /v1/plans/{id}``): it stops and keeps the plans found until then."""
        return self._get(PlanStatus, "DELETE", f"/v1/plans/{plan_id}")

    def launch(
        self, plan_id: str, plan: int = 1, scheduler: str = "torchrun", target: str = "torchtitan", **more: str | None
    ) -> LaunchFiles:
        """Plan ``plan`` of a finished search as a job scheduler's files (``name``/``image`` in ``more``)."""
        params = self.launch_params(plan, scheduler, target, **more)
        return self._get(LaunchFiles, "GET", f"/v1/plans/{plan_id}/launch", params=params)

    def check(self, problem: BaseModel | Mapping[str, Any], orders: list[list[str]] | str) -> CheckAnswer:
        """Time and check a schedule written elsewhere: action strings per rank, or PyTorch's CSV text."""
        return self._get(CheckAnswer, "POST", "/v1/schedules/check", json=self.check_body(problem, orders))


class AsyncClient(_Requests):
    """:class:`Client` over ``httpx.AsyncClient``: the same methods, awaited."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout_s: float = 120.0,
        retry: RetryPolicy | None = None,
        poll_s: float = 0.5,
    ) -> None:
        super().__init__(url.rstrip("/"), retry, poll_s)
        self.http = httpx.AsyncClient(base_url=self.base_url, headers=_headers(token), timeout=timeout_s)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    async def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One call with the retry policy; the typed error of its last answer."""
        for attempt in itertools.count():
            response: httpx.Response | None = None
            failure: Exception | None = None
            try:
                response = await self.http.request(method, path, **kwargs)
            except httpx.TransportError as error:
                failure = error
            delay = self._settle(response, failure, attempt)
            if delay is None and response is not None:
                return response
            await asyncio.sleep(delay or 0.0)
        raise AssertionError("unreachable")

    async def _get(self, model: type[Model], method: str, path: str, **kwargs: Any) -> Model:
        return model.model_validate((await self.request(method, path, **kwargs)).json())

    async def solve(self, problem: BaseModel | Mapping[str, Any]) -> ScheduleAnswer:
        return await self._get(ScheduleAnswer, "POST", "/v1/schedules", json=_body(problem))

    async def submit(self, problem: BaseModel | Mapping[str, Any]) -> str:
        return (await self._get(JobCreated, "POST", "/v1/jobs", json=_body(problem))).id

    async def job(self, job_id: str) -> JobStatus:
        return await self._get(JobStatus, "GET", f"/v1/jobs/{job_id}")

    async def wait(self, job_id: str, progress: Callable[[JobStatus], object] | None = None) -> JobStatus:
        while True:
            status = await self.job(job_id)
            if progress is not None:
                progress(status)
            if self.finished(status):
                return status
            await asyncio.sleep(self.poll_s)

    async def cancel_plan(self, plan_id: str) -> PlanStatus:
        return await self._get(PlanStatus, "DELETE", f"/v1/plans/{plan_id}")

    async def check(self, problem: BaseModel | Mapping[str, Any], orders: list[list[str]] | str) -> CheckAnswer:
        body = self.check_body(problem, orders)
        return await self._get(CheckAnswer, "POST", "/v1/schedules/check", json=body)
