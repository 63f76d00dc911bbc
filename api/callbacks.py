"""Signed callbacks: when a job or plan search with a ``callback_url`` ends, the service POSTs its JSON there.

The body is the finished job's (or plan's) JSON as ``GET /v1/jobs/{id}`` (``/v1/plans/{id}``) answers it; the
header ``X-Pipesched-Signature: sha256=<hex>`` is the HMAC-SHA256 of the body's bytes keyed with
``PIPESCHED_WEBHOOK_SECRET`` (the GitHub webhook convention; check it with :func:`verify_signature`). A request
is refused with 422 when its ``callback_url`` is not http(s), or when the service has no secret to sign with.

Each callback is a row (``callbacks``) written with its job. A :class:`CallbackSender` thread in every
``pipesched serve`` finds the ended ones, claims each with one conditional update (so that two front ends on
one PostgreSQL database never both send it), and posts it from a small thread pool, never from a solver
process. A failed delivery (no connection, a timeout, a non-2xx answer) is retried after 1, 2, 4, … s (at most
60 s) up to ``callback_max_attempts`` times; attempts, the last error and the state (``pending``, ``sending``,
``delivered``, ``failed``) are recorded and shown in the job's ``callback`` field.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import httpx
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import AnyUrl, BaseModel, ConfigDict, Field, ValidationError, field_validator
from sqlalchemy import or_, select, update

from pipesched.api.settings import Settings
from pipesched.api.storage import CallbackRow, Store

__all__ = [
    "SIGNATURE_HEADER",
    "CallbackSender",
    "CallbackView",
    "callback_url",
    "record_callback",
    "sign",
    "verify_signature",
]

log = logging.getLogger("pipesched.callbacks")

SIGNATURE_HEADER = "X-Pipesched-Signature"
#: A claimed delivery not finished within this many seconds (its sender died) is taken up again.
LEASE_S = 60.0
MAX_BACKOFF_S = 60.0
FINISHED = ("done", "failed", "cancelled")


def sign(body: bytes, secret: str) -> str:
    """The signature header's value: ``sha256=`` and the hex HMAC-SHA256 of ``body`` keyed with ``secret``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify_signature(body: bytes, header: str | None, secret: str) -> bool:
    """Whether ``header`` (the received ``X-Pipesched-Signature``) signs ``body`` with ``secret``
    (a constant-time comparison)."""
    return header is not None and hmac.compare_digest(sign(body, secret), header)


class CallbackView(BaseModel):
    """Where a job's callback stands."""

    url: str
    status: Literal["pending", "sending", "delivered", "failed"] = Field(
        description="pending: waiting for the job to end or for the next attempt; failed: attempts used up."
    )
    attempts: int = Field(description="Deliveries tried so far.")
    last_error: str | None = Field(None, description="Why the last attempt failed.")
    delivered_at: float | None = Field(None, description="Unix time, s.")


class _CallbackField(BaseModel):
    """The ``callback_url`` of a job or plan request body (the rest of the body is the problem or request)."""

    model_config = ConfigDict(extra="ignore")

    callback_url: AnyUrl | None = Field(None, description="http(s) URL POSTed the finished job's JSON, signed.")

    @field_validator("callback_url")
    @classmethod
    def _http_only(cls, url: AnyUrl | None) -> AnyUrl | None:
        if url is not None and url.scheme not in ("http", "https"):
            raise ValueError(f"callback_url must be an http:// or https:// URL, not {url.scheme}://")
        return url


async def callback_url(request: Request) -> str | None:
    """The request body's ``callback_url`` (a FastAPI dependency).

    Raises:
        RequestValidationError: not an http(s) URL, or the service has no ``PIPESCHED_WEBHOOK_SECRET`` to sign
            callbacks with (both at ``body.callback_url``).
    """
    try:
        data = json.loads(await request.body() or b"null")
    except ValueError:
        return None  # the body's own validation reports it
    if not isinstance(data, dict) or data.get("callback_url") is None:
        return None
    try:
        url = str(_CallbackField.model_validate(data).callback_url)
    except ValidationError as error:
        raise RequestValidationError(
            [{**item, "loc": ("body", *item["loc"])} for item in error.errors(include_url=False)]
        ) from None
    if not request.app.state.services.settings.webhook_secret:
        raise RequestValidationError(
            [
                {
                    "loc": ("body", "callback_url"),
                    "msg": "callbacks are signed with PIPESCHED_WEBHOOK_SECRET, which this service is not given: "
                    "set it where the service starts, or leave callback_url out and poll",
                    "type": "callbacks_unsigned",
                }
            ]
        )
    return url


def without_callback_url(data: Any) -> Any:
    """The request document without its ``callback_url`` (a before-validator of the job and plan bodies)."""
    if isinstance(data, dict) and "callback_url" in data:
        return {key: value for key, value in data.items() if key != "callback_url"}
    return data


def record_callback(store: Store, kind: Literal["job", "plan"], target_id: str, url: str | None) -> None:
    """Remember to POST ``target_id``'s JSON to ``url`` once it ends (nothing when ``url`` is None)."""
    if url is None:
        return
    with store.transaction() as session:
        session.add(
            CallbackRow(
                id=uuid.uuid4().hex, kind=kind, target_id=target_id, url=url, status="pending", next_at=0.0, attempts=0
            )
        )


def callback_view(store: Store, kind: str, target_id: str) -> CallbackView | None:
    """The callback of a job or plan, if it has one."""
    with store.transaction() as session:
        row = session.scalar(select(CallbackRow).where(CallbackRow.kind == kind, CallbackRow.target_id == target_id))
        if row is None:
            return None
        return CallbackView(
            url=row.url,
            status=row.status,  # type: ignore[arg-type]
            attempts=row.attempts,
            last_error=row.last_error,
            delivered_at=row.delivered_at,
        )


#: (kind, id) → the target's status and JSON body, or None while it runs or when it is gone.
Render = Callable[[str, str], tuple[str, bytes] | None]


class CallbackSender:
    """The thread that delivers ended jobs' and plans' callbacks (one per ``pipesched serve``).

    Args:
        store: the service's database.
        settings: ``webhook_secret``, ``callback_max_attempts``, ``callback_timeout_s``.
        render: the JSON body of a finished job or plan (None while it runs).
        poll_s: how often the table is looked at, s.
    """

    def __init__(self, store: Store, settings: Settings, render: Render, poll_s: float = 0.25) -> None:
        self.store = store
        self.settings = settings
        self.render = render
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._sends = ThreadPoolExecutor(4, thread_name_prefix="pipesched-callback")
        self._http = httpx.Client(timeout=settings.callback_timeout_s)
        self._thread = threading.Thread(target=self._run, name="pipesched-callbacks", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop looking; deliveries in flight finish (or time out); the rest wait for the next start."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._sends.shutdown(wait=True, cancel_futures=True)
        self._http.close()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                for row_id, kind, target_id in self._due():
                    rendered = self.render(kind, target_id)
                    if rendered is not None and rendered[0] in FINISHED and self._claim(row_id):
                        self._sends.submit(self._deliver, row_id, rendered[1])
            except Exception:  # the database is away: look again at the next tick
                log.exception("callbacks: cannot read the pending deliveries")

    def _due(self) -> list[tuple[str, str, str]]:
        now = time.time()
        with self.store.transaction() as session:
            rows = session.execute(
                select(CallbackRow.id, CallbackRow.kind, CallbackRow.target_id)
                .where(
                    or_(CallbackRow.status == "pending", CallbackRow.status == "sending"),
                    CallbackRow.next_at <= now,
                )
                .limit(50)
            ).all()
        return [(row[0], row[1], row[2]) for row in rows]

    def _claim(self, row_id: str) -> bool:
        """Take the delivery for this process (a conditional update: one claimant wins)."""
        now = time.time()
        with self.store.transaction() as session:
            claimed = session.execute(
                update(CallbackRow)
                .where(CallbackRow.id == row_id, CallbackRow.next_at <= now, CallbackRow.status != "delivered")
                .where(CallbackRow.status != "failed")
                .values(status="sending", next_at=now + LEASE_S)
            )
            return bool(claimed.rowcount)  # type: ignore[attr-defined]

    def _deliver(self, row_id: str, body: bytes) -> None:
        with self.store.transaction() as session:
            row = session.get(CallbackRow, row_id)
            url, attempts = (row.url, row.attempts) if row is not None else ("", 0)
        headers = {"content-type": "application/json", SIGNATURE_HEADER: sign(body, self.settings.webhook_secret or "")}
        error: str | None = None
        try:
            response = self._http.post(url, content=body, headers=headers)
            if not response.is_success:
                error = f"{response.status_code} {response.reason_phrase} from {url}"
        except httpx.HTTPError as failure:
            error = f"{type(failure).__name__}: {failure}"
        attempts += 1
        now = time.time()
        if error is None:
            values: dict[str, Any] = {"status": "delivered", "delivered_at": now, "last_error": None}
        elif attempts >= self.settings.callback_max_attempts:
            values = {"status": "failed", "last_error": error}
            log.warning("callback %s to %s failed %d times: %s", row_id, url, attempts, error)
        else:
            backoff = min(MAX_BACKOFF_S, 2.0 ** (attempts - 1))
            values = {"status": "pending", "next_at": now + backoff, "last_error": error}
        with self.store.transaction() as session:
            session.execute(update(CallbackRow).where(CallbackRow.id == row_id).values(attempts=attempts, **values))
