"""``/healthz`` and ``/metrics`` (Prometheus text)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, Response
from prometheus_client import CONTENT_TYPE_LATEST

from pipesched.api.routes._common import Services, services
from pipesched.api.schemas import Health, error_responses

router = APIRouter(tags=["health"])


@router.get(
    "/healthz",
    operation_id="health",
    summary="Liveness and database reachability",
    response_model=Health,
    responses=error_responses(503),
)
def health(svc: Services = Depends(services)) -> Health:
    """200 when the database answers; 503 otherwise."""
    try:
        svc.store.ping()
    except Exception as error:
        raise HTTPException(503, f"the database cannot be reached: {type(error).__name__}") from None
    return Health(
        status="ok", database="ok", solver_workers=svc.settings.solver_workers, jobs_in_flight=svc.pool.in_flight()
    )


@router.get(
    "/metrics",
    operation_id="metrics",
    summary="Prometheus metrics",
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}},
    response_class=Response,
)
def metrics(svc: Services = Depends(services)) -> Response:
    """Requests by route and status, solve time, cache hits, jobs by status."""
    return Response(svc.metrics.render(), media_type=CONTENT_TYPE_LATEST)
