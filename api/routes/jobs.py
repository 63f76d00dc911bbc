"""``/v1/jobs``: asynchronous solves with progress and cancellation."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends, HTTPException, Response

from pipesched.api.callbacks import callback_url, callback_view, record_callback
from pipesched.api.lanes import LaneClosed, LaneFull
from pipesched.api.routes._common import Services, prepare_problem, require_token, services, stored_profiles, too_busy
from pipesched.api.schemas import JobCreated, JobDocument, JobProgress, JobStatus, error_responses
from pipesched.api.storage import JobRow, problem_key

log = logging.getLogger("pipesched.api")

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[Depends(require_token)])


def job_status(svc: Services, row: JobRow) -> JobStatus:
    """The API view of a job row (the schedule included once done).

    A stored schedule that no longer reads back (written by an older build) is reported as the job's
    ``error`` with status ``failed``, never as a 500.
    """
    status, error = row.status, row.error
    try:
        result = svc.store.schedule(row.schedule_id) if row.schedule_id else None
    except ValueError as unreadable:
        log.error("job %s: stored schedule %s does not read back: %s", row.id, row.schedule_id, unreadable)
        result, status = None, "failed"
        error = (
            f"the stored schedule {row.schedule_id} cannot be read back ({type(unreadable).__name__}); submit it again"
        )
    return JobStatus(
        id=row.id,
        status=status,
        progress=JobProgress(
            best_objective=row.best_objective,
            lower_bound=row.lower_bound,
            elapsed_s=row.elapsed_s,
            message=row.message,
        ),
        schedule_id=row.schedule_id,
        result=result,
        error=error,
        cache="hit" if row.cache_hit else "miss",
        attempt=row.attempt,
        created_at=row.created_at,
        updated_at=row.updated_at,
        callback=callback_view(svc.store, "job", row.id),
    )


@router.post(
    "",
    status_code=202,
    operation_id="create_job",
    dependencies=[Depends(stored_profiles)],
    summary="Queue a solve; poll GET /v1/jobs/{id}",
    response_model=JobCreated,
    responses=error_responses(401, 413, 422, 429, 503),
)
def create_job(
    problem: JobDocument,
    response: Response,
    svc: Services = Depends(services),
    callback: str | None = Depends(callback_url),
) -> JobCreated:
    """Queue ``problem`` for a solver process (at most ``solver_workers`` run at once; the rest wait).

    With ``"callback_url"`` beside the problem's fields, the finished job's JSON is POSTed there, signed
    (``X-Pipesched-Signature``; :mod:`pipesched.api.callbacks`).

    A problem solved before makes a job that is ``done`` at once (``X-Pipesched-Cache: hit``). When
    ``max_queued_jobs`` jobs wait already: 429 with ``Retry-After``, and nothing is stored.
    """
    problem = prepare_problem(problem, svc.settings)
    key = problem_key(problem)
    cached = svc.store.schedule_by_hash(key)
    svc.metrics.cache_lookups.labels(result="hit" if cached else "miss").inc()
    if cached is None:
        try:
            svc.pool.reserve_job()
        except LaneFull as error:
            raise too_busy(error, "solve it synchronously with POST /v1/schedules") from None
        except LaneClosed as error:
            raise HTTPException(503, f"{error}: retry") from None
        try:
            row = svc.store.create_job(problem, key, None)
        except BaseException:
            svc.pool.release_job()
            raise
        try:
            svc.pool.submit_job(row.id, row.attempt, problem.solver.time_limit_s, reserved=True)
        except LaneClosed as error:  # shutting down: the queued row is picked up at the next start
            raise HTTPException(503, f"{error}: job {row.id} runs when the service is back") from None
    else:
        row = svc.store.create_job(problem, key, cached)
    record_callback(svc.store, "job", row.id, callback)
    response.headers["Location"] = f"/v1/jobs/{row.id}"
    response.headers["X-Pipesched-Cache"] = "hit" if cached else "miss"
    return JobCreated(id=row.id, status=row.status)


def _job(svc: Services, job_id: str) -> JobRow:
    row = svc.store.job(job_id)
    if row is None:
        raise HTTPException(404, f"no job with id {job_id!r}: ids come from POST /v1/jobs")
    return row


@router.get(
    "/{job_id}",
    operation_id="get_job",
    summary="A job's status, progress and, once done, its schedule",
    response_model=JobStatus,
    responses=error_responses(401, 404, 422),
)
def get_job(job_id: str, svc: Services = Depends(services)) -> JobStatus:
    """Status (queued/running/done/failed/cancelled), progress (best objective, lower bound, elapsed), result."""
    return job_status(svc, _job(svc, job_id))


@router.delete(
    "/{job_id}",
    operation_id="cancel_job",
    summary="Cancel a queued or running job",
    response_model=JobStatus,
    responses=error_responses(401, 404, 422),
)
def cancel_job(job_id: str, svc: Services = Depends(services)) -> JobStatus:
    """Cancel the job: a queued one never starts, a running one's search is told to stop and nothing is
    stored. A job that already ended is answered as it is."""
    _job(svc, job_id)
    row = svc.store.cancel_job(job_id)
    svc.pool.cancel(job_id)
    assert row is not None
    return job_status(svc, row)
