"""The HTTP service (FastAPI): ``create_app(settings)``; run it with ``pipesched serve``.

Routes are in :mod:`pipesched.api.routes`; solving runs in worker processes (:mod:`pipesched.api.jobs`), never on the
event loop; schedules and jobs are stored by :mod:`pipesched.api.storage`.

Errors are JSON everywhere (``{"detail": …}``): a database that cannot be reached is a 503 with ``Retry-After``
(:data:`DATABASE_RETRY_AFTER_S`), anything unforeseen a 500 that names the error, never a bare text page.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipesched.api.callbacks import CallbackSender
from pipesched.api.jobs import JobOutcome
from pipesched.api.lanes import Admission, Lane
from pipesched.api.loading import document_kind, wrong_kind
from pipesched.api.metrics import Metrics, method_label, status_label
from pipesched.api.plans import refresh_stored_profiles
from pipesched.api.queue import make_runner
from pipesched.api.routes import check, health, jobs, launch, methods, plans, profiles, schedules
from pipesched.api.routes._common import Services
from pipesched.api.settings import Settings
from pipesched.api.storage import DatabaseUnavailable, Store, is_unreachable
from pipesched.optimizer.families import method_names
from pipesched.optimizer.solvers.base import backend_names

__all__ = ["DATABASE_RETRY_AFTER_S", "create_app"]

log = logging.getLogger("pipesched.api")

#: ``Retry-After`` of a 503 when the database cannot be reached, s.
DATABASE_RETRY_AFTER_S = 5

#: (path regex, HTTP methods, whether the path has no parameters) of each route: the ``Allow`` of a 405.
RouteMethods = Sequence[tuple[re.Pattern[str], frozenset[str], bool]]


def _too_large_message(limit: int) -> str:
    return f"the request body is larger than this service's limit of {limit} bytes (PIPESCHED_MAX_BODY_BYTES)"


class GuardAndMeasure:
    """ASGI middleware: refuse bodies over ``max_body_bytes`` (413) and count requests by route template.

    A declared Content-Length over the limit is refused before reading; a chunked body is read here
    up to the limit (the server enforces a declared length).
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, metrics: Metrics, routes: RouteMethods = ()) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = {"code": 500}

        async def send_measured(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                if message["status"] == 405:
                    message = _with_full_allow(scope, message, self.routes)
            await send(message)

        try:
            declared = dict(scope["headers"]).get(b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
                response = JSONResponse({"detail": _too_large_message(self.max_body_bytes)}, status_code=413)
                await response(scope, receive, send_measured)
                return
            if declared is None and scope["method"] in ("POST", "PUT", "PATCH"):
                # No Content-Length (chunked): read the body here, bounded, and replay it.
                body = bytearray()
                more = True
                while more:
                    message = await receive()
                    if message["type"] != "http.request":
                        break
                    body += message.get("body", b"")
                    more = message.get("more_body", False)
                    if len(body) > self.max_body_bytes:
                        response = JSONResponse({"detail": _too_large_message(self.max_body_bytes)}, status_code=413)
                        await response(scope, receive, send_measured)
                        return
                replayed = False

                async def receive_buffered() -> Message:
                    nonlocal replayed
                    if not replayed:
                        replayed = True
                        return {"type": "http.request", "body": bytes(body), "more_body": False}
                    return await receive()

                await self.app(scope, receive_buffered, send_measured)
                return
            await self.app(scope, receive, send_measured)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(
                method=method_label(scope["method"]), route=template, status=status_label(status["code"])
            ).inc()
            self.metrics.latency.labels(route=template).observe(time.perf_counter() - started)


def _with_full_allow(scope: Scope, message: Message, routes: RouteMethods) -> Message:
    """A 405's start message with ``Allow`` listing every method of every route on the path (Starlette
    names only the first route's, e.g. GET without DELETE on ``/v1/jobs/{id}``); a route whose path has no
    parameters shadows the parametric ones that also match (``/v1/schedules/check`` allows POST only)."""
    path = scope.get("path", "")
    matching = [(methods, literal) for pattern, methods, literal in routes if pattern.match(path)]
    if any(literal for _methods, literal in matching):  # /v1/schedules/check is not a /v1/schedules/{id}
        matching = [(methods, literal) for methods, literal in matching if literal]
    allowed = {method for methods, _literal in matching for method in methods}
    if not allowed:
        return message
    headers = [(key, value) for key, value in message.get("headers", []) if key.lower() != b"allow"]
    headers.append((b"allow", ", ".join(sorted(allowed)).encode()))
    return {**message, "headers": headers}


def _http_error_response(request: Request, error: Exception) -> JSONResponse:
    """HTTP errors as ``{"detail": …}``; a body that could not be read (Starlette's 400) is a 422, the
    contract's answer to bad input, ``[{"loc": ["body"], "msg", "type"}]`` with the reason."""
    assert isinstance(error, StarletteHTTPException)
    headers = getattr(error, "headers", None)
    detail: Any = error.detail
    status = error.status_code
    if status == 400 and not isinstance(detail, list):
        status = 422
        cause = error.__cause__ or error.__context__
        reason = f"{type(cause).__name__}: {cause}" if cause is not None else str(detail)
        detail = [
            {
                "loc": ["body"],
                "msg": f"the request body could not be read ({reason}); send {_body_of(request)} as a UTF-8 JSON "
                "object with Content-Type: application/json",
                "type": "body_unreadable",
            }
        ]
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def _unreachable_response(request: Request, error: Exception) -> JSONResponse:
    """503 with ``Retry-After`` for a database that cannot be reached (or a 500 for another database error)."""
    if not is_unreachable(error):
        return _unexpected_response(request, error)
    reason = str(getattr(error, "orig", None) or error).strip().splitlines()[0][:200] if str(error) else ""
    log.warning("%s %s: the database cannot be reached: %s: %s", request.method, request.url.path,
                type(error).__name__, reason)  # fmt: skip
    return JSONResponse(
        {
            "detail": f"the database cannot be reached ({type(error).__name__}): retry after "
            f"{DATABASE_RETRY_AFTER_S} s; nothing was changed by this request unless it said so"
        },
        status_code=503,
        headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)},
    )


def _unexpected_response(request: Request, error: Exception) -> JSONResponse:
    """500 as JSON naming the error (the traceback goes to the server's log), never a bare text page."""
    log.error("%s %s failed", request.method, request.url.path, exc_info=error)
    return JSONResponse(
        {"detail": f"the service failed on this request ({type(error).__name__}); see its log, and retry"},
        status_code=500,
    )


def _unreachable_errors() -> list[type[Exception]]:
    """The error types that may mean an unreachable database (SQLAlchemy's and, when installed, psycopg's)."""
    from sqlalchemy.exc import InterfaceError, OperationalError
    from sqlalchemy.exc import TimeoutError as PoolTimeoutError

    types: list[type[Exception]] = [DatabaseUnavailable, OperationalError, InterfaceError, PoolTimeoutError]
    try:
        import psycopg

        types.append(psycopg.OperationalError)
    except ImportError:
        pass
    return types


def _is_json(content_type: str | None) -> bool:
    """True for ``application/json`` and ``application/*+json`` (parameters such as ``charset`` aside)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


#: What each route's body is, for the sentence that says how to send it (the problem where not named).
_BODIES = {
    "/v1/plans": "the plan request",
    "/v1/profiles": "the profile that `pipesched calibrate` wrote",
    "/v1/schedules/check": 'the problem and the schedule ({"problem": …, "schedule": …})',
}


#: The routes whose body is one of pipesched's documents that another is easily mistaken for (by
#: :func:`~pipesched.api.loading.document_kind`): a measurement file sent as the profile gets how to make one, a
#: plan request sent as a job's problem (or a problem as a plan request) the route that takes it.
_DOCUMENTS = {"/v1/profiles": "profile", "/v1/plans": "plan request", "/v1/jobs": "problem", "/v1/schedules": "problem"}

#: Where each of those documents is posted.
_ROUTE_OF = {"plan request": "POST it to /v1/plans", "problem": "POST it to /v1/jobs (or /v1/schedules to wait)"}


def _other_document(body: Any, wanted: str) -> str:
    """A line for a body that is another of pipesched's documents than the route's ``wanted``, naming the route that
    takes it (or, for one no route takes, what to do); "" else."""
    kind = document_kind(body)
    if kind is None or kind == wanted:
        return ""
    if kind in _ROUTE_OF:
        return f"the body is a {kind}, not a {wanted}: {_ROUTE_OF[kind]}"
    if kind == "measurement file" and wanted != "profile":  # a profile of its runs is what plans may name
        return (
            f"the body is a measurement file, not a {wanted}: make a profile of its runs with `pipesched calibrate "
            f"RUNS.json -o profile.json`, POST that to /v1/profiles, and name it in a plan request's cluster.profile"
        )
    return wrong_kind("RUNS.json", body, wanted, subject="the body")


def _body_of(request: Request) -> str:
    """What ``request``'s route takes as its body, in words."""
    return _BODIES.get(request.url.path.rstrip("/"), "the problem")


def _validation_response(request: Request, error: Exception) -> JSONResponse:
    """422 with ``{"detail": [{"loc", "msg", "type"}]}``, also when the body is not JSON at all (``loc``
    ``["body"]``): the contract's one status for bad input."""
    assert isinstance(error, RequestValidationError)
    body = _body_of(request)
    wanted = _DOCUMENTS.get(request.url.path.rstrip("/"))
    other = _other_document(error.body, wanted) if wanted else ""
    if other:  # another of pipesched's documents: which, and what to do, not one line per field it lacks
        detail = {"loc": ["body"], "msg": other.rstrip("\n"), "type": "wrong_document"}
        return JSONResponse({"detail": [detail]}, status_code=422)
    details: list[dict[str, Any]] = []
    for item in error.errors():
        loc = list(item.get("loc", ()))
        msg = str(item.get("msg", "invalid value")).removeprefix("Value error, ")
        kind = str(item.get("type", "value_error"))
        if kind == "json_invalid":
            reason = (item.get("ctx") or {}).get("error", "")
            where = f" at character {loc[1]}" if len(loc) > 1 else ""
            msg = f"the request body is not valid JSON{where}: {reason or msg}; send {body} as a JSON object"
            loc = loc[:1]
        elif kind == "missing" and loc == ["body"]:
            msg = f"the request has no body: send {body} as a JSON object"
        elif loc == ["body"] and not _is_json(request.headers.get("content-type")):
            sent = request.headers.get("content-type") or "no Content-Type"
            msg = (
                f"the body was sent as {sent}, so it was not read as JSON: send {body} as a JSON object with "
                "Content-Type: application/json"
            )
            kind = "content_type"
        details.append({"loc": loc, "msg": msg, "type": kind})
    return JSONResponse({"detail": details}, status_code=422)


def _finished_body(svc: Services, kind: str, target_id: str) -> tuple[str, bytes] | None:
    """A job's or plan's status and JSON as its GET answers it (its callback left out), for the callbacks."""
    if kind == "job":
        job = svc.store.job(target_id)
        view: BaseModel | None = jobs.job_status(svc, job) if job is not None else None
    else:
        plan = svc.store.plan(target_id)
        view = plans.plan_status(svc, plan) if plan is not None else None
    if view is None:
        return None
    return str(getattr(view, "status", "")), view.model_dump_json(exclude={"callback"}).encode()


def create_app(settings: Settings | None = None) -> FastAPI:
    """The service for ``settings`` (default: from ``PIPESCHED_*`` environment variables).

    The database tables are created at construction; the solver pool starts with the app's lifespan,
    which also re-queues (or fails, with the reason) jobs a previous run left queued or running.
    """
    settings = settings or Settings()
    runner = make_runner(settings)  # the in-process pool, or the PostgreSQL queue (PIPESCHED_QUEUE)
    store = Store(settings.database_url)
    metrics = Metrics(store.count_jobs_by_status)

    def job_done(outcome: JobOutcome) -> None:
        metrics.solve_seconds.labels(method=outcome.method, mode="job").observe(outcome.solve_time_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool = runner(store, on_job_done=job_done)
        # A render process is replaced after a few drawings: what a large one left behind is returned.
        renders = Lane("render", settings.render_workers, settings.max_queued_renders, max_tasks_per_child=8)
        # Checks are admitted before their body is read (the route's class), so the lane itself never refuses.
        check_places = settings.check_workers + settings.max_queued_checks
        checks = Lane("check", settings.check_workers, check_places, max_tasks_per_child=8)
        services = Services(
            settings=settings,
            store=store,
            pool=pool,
            metrics=metrics,
            renders=renders,
            checks=checks,
            check_admission=Admission("check", check_places),
        )
        app.state.services = services
        pool.recover()
        store.fail_unfinished_plans()
        services.profiles_seen = refresh_stored_profiles(store, None)
        callbacks = CallbackSender(store, settings, lambda kind, target_id: _finished_body(services, kind, target_id))
        callbacks.start()
        try:
            yield
        finally:
            callbacks.stop()
            services.close()

    app = FastAPI(
        title="pipesched",
        version="0.1.0",
        summary="Pipeline-parallel training schedules: the best schedule your memory allows.",
        lifespan=lifespan,
    )
    app.add_exception_handler(RequestValidationError, _validation_response)
    app.add_exception_handler(StarletteHTTPException, _http_error_response)
    for error_type in _unreachable_errors():
        app.add_exception_handler(error_type, _unreachable_response)
    app.add_exception_handler(Exception, _unexpected_response)
    for module in (check, schedules, jobs, methods, plans, launch, profiles, health):
        app.include_router(module.router)
    routes = [
        (route.path_regex, frozenset(route.methods), "{" not in route.path)
        for module in (check, schedules, jobs, methods, plans, launch, profiles, health)
        for route in module.router.routes
        if isinstance(route, APIRoute)
    ]
    app.add_middleware(GuardAndMeasure, max_body_bytes=settings.max_body_bytes, metrics=metrics, routes=routes)
    app.state.settings = settings
    app.openapi = _openapi_with_methods(app.openapi)  # type: ignore[method-assign]
    return app


def _openapi_with_methods(default: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """The OpenAPI schema with the choices of ``solver.method`` and ``solver.backends`` from the families' and the
    backends' registries (the problem model, below both, types them as strings)."""

    def openapi() -> dict[str, Any]:
        schema = default()
        for name, component in schema.get("components", {}).get("schemas", {}).items():
            properties = component.get("properties", {})
            if name.startswith("SolverOptions") and "method" in properties:
                properties["method"]["enum"] = list(method_names())
                for option in properties["backends"].get("anyOf", []):
                    if option.get("type") == "array":
                        option["items"]["enum"] = list(backend_names())
        return schema

    return openapi
