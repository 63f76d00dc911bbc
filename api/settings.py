"""Service settings (pydantic-settings): environment variables with the prefix ``PIPESCHED_``.

Example: ``PIPESCHED_PORT=9000 PIPESCHED_DATABASE_URL=postgresql+psycopg://u:p@db/pipesched pipesched serve``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["MIN_TOKEN_CHARS", "Settings", "default_database_url", "exposure_problem"]

#: The shortest API token accepted: a guessable token guards nothing.
MIN_TOKEN_CHARS = 16


def default_database_url() -> str:
    """A SQLite file in the per-user data dir (``$XDG_DATA_HOME/pipesched`` or ``~/.local/share/pipesched``).

    Falls back to ``./pipesched.sqlite3`` in the working directory when the data dir cannot be created.
    """
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "pipesched"
    try:
        base.mkdir(parents=True, exist_ok=True)
        path = base / "pipesched.sqlite3"
    except OSError:
        path = Path.cwd() / "pipesched.sqlite3"
    return f"sqlite:///{path}"


class Settings(BaseSettings):
    """How the HTTP service runs. Every field is read from ``PIPESCHED_<NAME>`` (case-insensitive)."""

    model_config = SettingsConfigDict(env_prefix="PIPESCHED_", extra="ignore")

    host: str = Field("127.0.0.1", description="Interface `pipesched serve` binds.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port `pipesched serve` binds.")
    database_url: str = Field(
        default_factory=default_database_url,
        description="SQLAlchemy URL: sqlite:///FILE (default, nothing to set up) or postgresql+psycopg://…",
    )
    max_time_limit_s: float = Field(60.0, gt=0, description="Upper clamp on a request's solver.time_limit_s, s.")
    solver_workers: int = Field(2, ge=1, le=256, description="Solver processes; further solves queue.")
    max_body_bytes: int = Field(1_000_000, ge=1024, description="Largest request body accepted (413 above).")
    max_actions: int = Field(
        200_000,
        ge=1,
        description="Largest problem accepted: num_stages × num_microbatches × actions per microbatch (422 above).",
    )
    api_token: str | None = Field(
        None,
        description=f"When set, /v1 requests need `Authorization: Bearer <token>` (at least {MIN_TOKEN_CHARS} "
        "characters).",
    )
    sync_solver_workers: int = Field(
        1, ge=1, le=256, description="Solver processes for synchronous solves (POST /v1/schedules), apart from jobs."
    )
    max_queued_jobs: int = Field(
        32, ge=0, description="Jobs that may wait for a solver process; more are refused with 429 and Retry-After."
    )
    max_queued_solves: int = Field(
        4, ge=0, description="Synchronous solves that may wait for a solver process; more are refused with 429."
    )
    render_workers: int = Field(1, ge=1, le=64, description="Processes drawing png, svg and view pages.")
    max_queued_renders: int = Field(
        2, ge=0, description="Drawings that may wait for a render process; more are refused with 429."
    )
    max_render_actions: int = Field(
        50_000,
        ge=1,
        description="Largest schedule drawn as png, svg or view (actions, the compared family's included); 413 above.",
    )
    render_timeout_s: float = Field(120.0, gt=0, description="Longest wait for a drawing, s (504 after).")
    check_workers: int = Field(
        1, ge=1, le=64, description="Processes timing and checking posted schedules (POST /v1/schedules/check)."
    )
    max_queued_checks: int = Field(
        2, ge=0, description="Schedule checks that may wait for a check process; more are refused with 429."
    )
    check_timeout_s: float = Field(120.0, gt=0, description="Longest wait for a schedule check, s (504 after).")
    max_sync_wait_s: float = Field(
        60.0,
        gt=0,
        description="How long a synchronous solve (POST /v1/schedules) may wait for a solver process on top of its "
        "time limit, s (504 after).",
    )
    allow_no_token: bool = Field(
        False,
        description="Let `pipesched serve` listen on a non-loopback interface without PIPESCHED_API_TOKEN.",
    )
    shutdown_grace_s: float = Field(
        5.0, ge=0, description="On SIGTERM, how long open requests may finish before the server stops, s."
    )
    max_job_attempts: int = Field(
        3, ge=1, description="Restarts a job may live through before it is marked failed instead of re-queued."
    )
    queue: Literal["local", "postgres"] = Field(
        "local",
        description="Where solves run: local (a process pool inside `pipesched serve`, the default) or postgres "
        "(a procrastinate queue in the PostgreSQL database; `pipesched worker` processes, on any machines, solve).",
    )
    worker_metrics_port: int = Field(
        9464, ge=0, le=65535, description="Port of a `pipesched worker`'s Prometheus /metrics (0: none)."
    )
    worker_metrics_host: str = Field(
        "127.0.0.1",
        description="Interface a `pipesched worker`'s /metrics binds (it has no token: open it to a scraper on "
        "purpose, e.g. 0.0.0.0 behind a firewall).",
    )
    webhook_secret: str | None = Field(
        None,
        description="Key of the callbacks' X-Pipesched-Signature (HMAC-SHA256); without it callback_url is refused.",
    )
    callback_max_attempts: int = Field(
        8, ge=1, le=100, description="Deliveries tried per callback (1, 2, 4 … s apart)."
    )
    callback_timeout_s: float = Field(10.0, gt=0, le=300, description="Longest wait for a callback's receiver, s.")
    worker_stalled_after_s: float = Field(
        10.0,
        ge=2.0,
        le=600.0,
        description="A worker whose heartbeat is older than this, s, is taken for dead and its solve is retried "
        "on another worker (it sends one every third of it).",
    )

    @field_validator("api_token")
    @classmethod
    def _long_enough(cls, token: str | None) -> str | None:
        if not token:  # PIPESCHED_API_TOKEN= (empty): no token
            return None
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(
                f"the API token has {len(token)} characters, fewer than {MIN_TOKEN_CHARS}: use a random secret, "
                "e.g. the output of `python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
            )
        return token


def exposure_problem(settings: Settings) -> str | None:
    """Why ``settings`` must not be served as they are: a non-loopback ``host`` without ``api_token``
    (anyone who reaches the port could use the service), unless ``allow_no_token``; None when fine."""
    if settings.api_token or settings.allow_no_token or _is_loopback(settings.host):
        return None
    return (
        f"refusing to serve on {settings.host} (not a loopback interface) without an API token: set "
        "PIPESCHED_API_TOKEN=<secret> (clients then send `Authorization: Bearer <secret>`), or bind "
        "--host 127.0.0.1, or set PIPESCHED_ALLOW_NO_TOKEN=1 to serve it open on purpose"
    )


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
