"""Plan searches off the event loop: one runs in a worker process of the solver pool.

The worker records progress (configurations evaluated, the best step, the best plans so far) in the plan's
row at most every :data:`~pipesched.api.jobs.POLL_INTERVAL_S`, then stores every returned plan's schedule and
the ranked answer in one transaction.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

from pipesched.api.jobs import POLL_INTERVAL_S, SolverPool, _store
from pipesched.api.storage import Store
from pipesched.optimizer.cost.profile import AcceleratorProfile
from pipesched.optimizer.cost.stages import register_profile
from pipesched.optimizer.planner.rank import PlanProgress, prepare, search
from pipesched.optimizer.planner.request import PlanAnswer, PlanRequest

__all__ = ["refresh_stored_profiles", "register_stored_profiles", "run_plan", "submit_plan"]

log = logging.getLogger("pipesched.plans")


def register_stored_profiles(store: Store) -> int:
    """Make every profile registered with the service (``POST /v1/profiles``, stored) selectable in this
    process by ``cluster.profile``: the solver processes that run plans, and a service starting; how many."""
    stored = store.profile_jsons()
    for text in stored:
        register_profile(AcceleratorProfile.model_validate_json(text))
    return len(stored)


def refresh_stored_profiles(store: Store, seen: tuple[int, float] | None) -> tuple[int, float]:
    """Register the stored profiles again when any changed since ``seen`` (:meth:`Store.profiles_stamp`: one
    query of a count and a time), so that a profile another replica on the same database registered, or
    replaced, is selectable here at once; the stamp to pass next time."""
    stamp = store.profiles_stamp()
    if stamp != seen:
        register_stored_profiles(store)
    return stamp


def run_plan(database_url: str, plan_id: str) -> str | None:
    """Run one plan search in a worker process; the stored answer's status (None when the row is gone)."""
    store = _store(database_url)
    row = store.plan(plan_id)
    if row is None:
        return None
    register_stored_profiles(store)  # registered after this process started, in the service's process
    request = PlanRequest.model_validate_json(row.request_json)
    started = time.monotonic()
    last_write = [0.0]

    def progress(update: PlanProgress) -> None:
        now = time.monotonic()
        if update.phase != "done" and now - last_write[0] < POLL_INTERVAL_S and update.evaluated:
            return
        last_write[0] = now
        partial = PlanAnswer(id=plan_id, status="running", plans=update.plans, elapsed_s=round(update.elapsed_s, 3))
        store.record_plan_progress(
            plan_id,
            phase=update.phase,
            evaluated=update.evaluated,
            total=update.total,
            best_step_ms=update.best_step_ms,
            elapsed_s=round(now - started, 3),
            answer_json=partial.model_dump_json(),
        )

    if row.status != "queued":  # cancelled before it started (DELETE /v1/plans/{id})
        return row.status
    last_look = [time.monotonic()]

    def cancelled() -> bool:
        """Whether ``DELETE /v1/plans/{id}`` cancelled the search: the row, read at most every poll interval."""
        now = time.monotonic()
        if now - last_look[0] < POLL_INTERVAL_S:
            return False
        last_look[0] = now
        current = store.plan(plan_id)
        return current is None or current.status == "cancelled"

    outcome = search(prepare(request), progress=progress, should_stop=cancelled)
    answer = outcome.answer
    current = store.plan(plan_id)
    if current is not None and current.status == "cancelled":
        elapsed = time.monotonic() - started
        note = f"cancelled (DELETE /v1/plans/{plan_id}) after {elapsed:.1f} s: these are the plans found until then"
        answer = answer.model_copy(update={"notes": [note, *answer.notes]})
    stored = store.finish_plan(plan_id, answer, outcome.schedules)
    return stored.status


def submit_plan(pool: SolverPool, store: Store, plan_id: str) -> Future:
    """Queue a stored plan search on the pool; a failure marks the row failed with the reason."""
    future: Future = pool.submit_task(run_plan, store.database_url, plan_id)

    def finished(done: Future) -> None:
        if done.cancelled():
            return
        error = done.exception()
        if error is not None:
            log.error("plan %s failed: %s", plan_id, error)
            try:
                store.fail_plan(plan_id, f"the plan search failed: {type(error).__name__}: {error}")
            except Exception:
                log.exception("could not mark plan %s failed", plan_id)

    future.add_done_callback(finished)
    return future
