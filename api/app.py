"""The HTTP service (FastAPI): ``create_app(settings)``; run it with ``pipesched serve``.

Routes are in :mod:`pipesched.api.routes`; solving runs in worker processes (:mod:`pipesched.api.jobs`), never on the
event loop; schedules and jobs are stored by :mod:`pipesched.api.storage`.
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
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipesched.api.jobs import JobOutcome
from pipesched.api.lanes import Lane
from pipesched.api.metrics import Metrics, method_label, status_label
from pipesched.api.queue import make_runner
from pipesched.api.routes import check, health, jobs, methods, plans, schedules
from pipesched.api.routes._common import Services
from pipesched.api.settings import Settings
from pipesched.api.storage import Store
from pipesched.optimizer.families import method_names

__all__ = ["create_app"]

log = logging.getLogger("pipesched.api")

#: (path regex, HTTP methods) of each route: the ``Allow`` of a 405.
RouteMethods = Sequence[tuple[re.Pattern[str], frozenset[str]]]


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
    names only the first route's, e.g. GET without DELETE on ``/v1/jobs/{id}``)."""
    path = scope.get("path", "")
    allowed = {method for pattern, methods in routes if pattern.match(path) for method in methods}
    if not allowed:
        return message
    headers = [(key, value) for key, value in message.get("headers", []) if key.lower() != b"allow"]
    headers.append((b"allow", ", ".join(sorted(allowed)).encode()))
    return {**message, "headers": headers}


def _http_error_response(request: Request, error: Exception) -> JSONResponse:
    """HTTP errors as ``{"detail": …}``; a 400 (a body that could not be read) in the shape of a 422,
    ``[{"loc", "msg", "type"}]``, with the reason."""
    assert isinstance(error, StarletteHTTPException)
    headers = getattr(error, "headers", None)
    detail: Any = error.detail
    if error.status_code == 400 and not isinstance(detail, list):
        cause = error.__cause__ or error.__context__
        reason = f"{type(cause).__name__}: {cause}" if cause is not None else str(detail)
        detail = [
            {
                "loc": ["body"],
                "msg": f"the request body could not be read ({reason}); send the problem as a UTF-8 JSON object "
                "with Content-Type: application/json",
                "type": "body_unreadable",
            }
        ]
    return JSONResponse({"detail": detail}, status_code=error.status_code, headers=headers)


def _validation_response(request: Request, error: Exception) -> JSONResponse:
    """422 with ``{"detail": [{"loc", "msg", "type"}]}``; 400 when the body is not JSON at all."""
    assert isinstance(error, RequestValidationError)
    details: list[dict[str, Any]] = []
    status = 422
    for item in error.errors():
        loc = list(item.get("loc", ()))
        msg = str(item.get("msg", "invalid value")).removeprefix("Value error, ")
        kind = str(item.get("type", "value_error"))
        if kind == "json_invalid":
            status = 400
            reason = (item.get("ctx") or {}).get("error", "")
            where = f" at character {loc[1]}" if len(loc) > 1 else ""
            msg = f"the request body is not valid JSON{where}: {reason or msg}; send the problem as a JSON object"
            loc = loc[:1]
        elif kind == "missing" and loc == ["body"]:
            msg = "the request has no body: send the problem as a JSON object (the contract's Problem)"
        details.append({"loc": loc, "msg": msg, "type": kind})
    return JSONResponse({"detail": details}, status_code=status)


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
        app.state.services = Services(settings=settings, store=store, pool=pool, metrics=metrics, renders=renders)
        pool.recover()
        store.fail_unfinished_plans()
        try:
            yield
        finally:
            renders.close()
            pool.shutdown()
            store.dispose()

    app = FastAPI(
        title="pipesched",
        version="0.1.0",
        summary="Pipeline-parallel training schedules: the best schedule your memory allows.",
        lifespan=lifespan,
    )
    app.add_exception_handler(RequestValidationError, _validation_response)
    app.add_exception_handler(StarletteHTTPException, _http_error_response)
    for module in (check, schedules, jobs, methods, plans, health):
        app.include_router(module.router)
    routes = [
        (route.path_regex, frozenset(route.methods))
        for module in (check, schedules, jobs, methods, plans, health)
        for route in module.router.routes
        if isinstance(route, APIRoute)
    ]
    app.add_middleware(GuardAndMeasure, max_body_bytes=settings.max_body_bytes, metrics=metrics, routes=routes)
    app.state.settings = settings
    app.openapi = _openapi_with_methods(app.openapi)  # type: ignore[method-assign]
    return app


def _openapi_with_methods(default: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """The OpenAPI schema with ``solver.method``'s choices from the family registry (the problem model, below
    the families, types it as a string)."""

    def openapi() -> dict[str, Any]:
        schema = default()
        for name, component in schema.get("components", {}).get("schemas", {}).items():
            if name.startswith("SolverOptions") and "method" in component.get("properties", {}):
                component["properties"]["method"]["enum"] = list(method_names())
        return schema

    return openapi
