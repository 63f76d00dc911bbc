"""What the routers share: the app's services, the token check, and preparing a posted problem."""

from __future__ import annotations

import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Depends, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from pipesched.api.jobs import SolverPool
from pipesched.api.lanes import Admission, Lane, LaneFull
from pipesched.api.metrics import Metrics
from pipesched.api.plans import refresh_stored_profiles
from pipesched.api.settings import Settings
from pipesched.api.storage import Store
from pipesched.optimizer.families import FamilyDomainError, UnknownMethodError, check_method
from pipesched.optimizer.problem import Problem

if TYPE_CHECKING:
    from pipesched.api.queue import QueueRunner


@dataclass
class Services:
    """Everything a request handler needs, built once per app (``app.state.services``).

    ``health`` runs ``/healthz``'s database ping on threads of its own, so a liveness probe never waits
    behind solves, checks or drawings for a thread of the server's pool.
    """

    settings: Settings
    store: Store
    pool: SolverPool | QueueRunner
    metrics: Metrics
    renders: Lane
    checks: Lane
    check_admission: Admission
    #: :meth:`Store.profiles_stamp` when this replica last registered the stored profiles.
    profiles_seen: tuple[int, float] | None = None
    health: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(HEALTH_THREADS, thread_name_prefix="pipesched-health")
    )

    def close(self) -> None:
        """Stop the lanes and the solvers (the app's shutdown), then close the database's connections."""
        self.renders.close()
        self.checks.close()
        self.pool.shutdown()
        self.health.shutdown(wait=False, cancel_futures=True)
        self.store.dispose()


#: Threads answering /healthz (a ping each; more probes wait for one, bounded by the probe's timeout).
HEALTH_THREADS = 2


#: The setting that bounds each lane's queue, named in a 429.
QUEUE_SETTINGS = {
    "job": "PIPESCHED_MAX_QUEUED_JOBS",
    "solve": "PIPESCHED_MAX_QUEUED_SOLVES",
    "render": "PIPESCHED_MAX_QUEUED_RENDERS",
    "check": "PIPESCHED_MAX_QUEUED_CHECKS",
}


def too_busy(error: LaneFull, alternative: str = "") -> HTTPException:
    """429 with ``Retry-After`` for a full lane: what is full, its bound's setting, when to retry."""
    return HTTPException(
        status_code=429,
        detail=(
            f"{error} ({QUEUE_SETTINGS.get(error.lane, 'the queue bound')}): retry after {error.retry_after_s} s"
            + (f", or {alternative}" if alternative else "")
        ),
        headers={"Retry-After": str(error.retry_after_s)},
    )


def services(request: Request) -> Services:
    """The app's :class:`Services` (a FastAPI dependency: ``svc: Services = Depends(services)``)."""
    return request.app.state.services


def stored_profiles(request: Request) -> None:
    """Make the profiles stored by any replica selectable here before a request that may name one
    (``cluster.profile``) is read (a FastAPI dependency of the routes that take a model and cluster, and of
    ``GET /v1/profiles``)."""
    svc = services(request)
    svc.profiles_seen = refresh_stored_profiles(svc.store, svc.profiles_seen)


_bearer = HTTPBearer(auto_error=False, description="Needed only when the service is started with an API token.")


def require_token(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
    """401 unless the request carries ``Authorization: Bearer <api_token>`` (when a token is set)."""
    token = services(request).settings.api_token
    if not token:
        return
    if credentials is None or not secrets.compare_digest(credentials.credentials.encode(), token.encode()):
        raise HTTPException(
            status_code=401,
            detail="missing or wrong API token: send the header `Authorization: Bearer <token>`",
            headers={"WWW-Authenticate": "Bearer"},
        )


def field_error(loc: tuple[str | int, ...], msg: str, error_type: str = "value_error") -> RequestValidationError:
    """A 422 naming one field (rendered by the app's validation handler)."""
    return RequestValidationError([{"loc": loc, "msg": msg, "type": error_type}])


def actions_per_microbatch(problem: Problem) -> int:
    """F, I, W per stage and microbatch when the backward is split; F and B otherwise."""
    return 3 if problem.split_backward else 2


def prepare_problem(problem: Problem, settings: Settings, loc_prefix: tuple[str, ...] = ("body",)) -> Problem:
    """Clamp ``solver.time_limit_s`` to ``max_time_limit_s``, bound the size and check a named family's domain.

    Raises:
        RequestValidationError: the problem is larger than ``max_actions`` (naming
            ``pipeline.num_microbatches``), or outside the named family's domain (naming ``solver.method``).
    """
    pipeline = problem.pipeline
    actions = pipeline.num_stages * pipeline.num_microbatches * actions_per_microbatch(problem)
    if actions > settings.max_actions:
        per_microbatch = pipeline.num_stages * actions_per_microbatch(problem)
        raise field_error(
            (*loc_prefix, "pipeline", "num_microbatches"),
            f"the problem has {actions} actions, over this service's limit of {settings.max_actions}: use at "
            f"most {max(1, settings.max_actions // per_microbatch)} microbatches or fewer stages",
            "too_large",
        )
    time_limit_s = min(problem.solver.time_limit_s, settings.max_time_limit_s)
    if time_limit_s != problem.solver.time_limit_s:
        solver = problem.solver.model_copy(update={"time_limit_s": time_limit_s})
        problem = problem.model_copy(update={"solver": solver})
    require_method(problem, (*loc_prefix, "solver", "method"))
    return problem


def require_method(problem: Problem, loc: tuple[str | int, ...]) -> None:
    """Raise a 422 at ``loc`` when ``solver.method`` is not implemented or does not admit ``problem``."""
    try:
        check_method(problem.solver.method, problem)
    except UnknownMethodError as error:
        raise field_error(loc, str(error), "unknown_method") from None
    except FamilyDomainError as error:
        raise field_error(loc, f"{error}; choose another method or auto", "family_domain") from None


def cache_headers(hit: bool) -> dict[str, Any]:
    """The ``X-Pipesched-Cache`` header: ``hit`` when a stored schedule answered, ``miss`` when solved."""
    return {"X-Pipesched-Cache": "hit" if hit else "miss"}
