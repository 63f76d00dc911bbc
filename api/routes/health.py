"""``/healthz`` and ``/metrics`` (Prometheus text)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, HTTPException, Response
from prometheus_client import CONTENT_TYPE_LATEST

from pipesched.api.routes._common import Services, services
from pipesched.api.schemas import Health, error_responses

router = APIRouter(tags=["health"])

#: The longest /healthz waits for the database, s (503 after).
HEALTH_TIMEOUT_S = 2.0


def _probe(svc: Services) -> int:
    """Ping the database; the jobs in flight (in PostgreSQL mode, counted there)."""
    svc.store.ping()
    return svc.pool.in_flight()


@router.get(
    "/healthz",
    operation_id="health",
    summary="Liveness and database reachability",
    response_model=Health,
    responses=error_responses(503),
)
async def health(svc: Services = Depends(services)) -> Health:
    """200 when the database answers within :data:`HEALTH_TIMEOUT_S`; 503 otherwise.

    Runs on the event loop, its database ping on threads of its own: it never waits for a thread that
    solves, checks or draws.
    """
    loop = asyncio.get_running_loop()
    try:
        in_flight = await asyncio.wait_for(loop.run_in_executor(svc.health, _probe, svc), HEALTH_TIMEOUT_S)
    except TimeoutError:
        raise HTTPException(
            503, f"the database did not answer within {HEALTH_TIMEOUT_S:g} s", headers={"Retry-After": "5"}
        ) from None
    except Exception as error:
        raise HTTPException(
            503, f"the database cannot be reached: {type(error).__name__}", headers={"Retry-After": "5"}
        ) from None
    return Health(status="ok", database="ok", solver_workers=svc.settings.solver_workers, jobs_in_flight=in_flight)


@router.get(
    "/metrics",
    operation_id="metrics",
    summary="Prometheus metrics",
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}},
    response_class=Response,
)
def metrics(svc: Services = Depends(services)) -> Response:
    """Requests by route and status, solve time, cache hits, jobs by status, whether the database answers
    (the job counts keep their last values while it does not)."""
    return Response(svc.metrics.render(), media_type=CONTENT_TYPE_LATEST)
