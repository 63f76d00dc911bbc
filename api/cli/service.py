"""``pipesched serve`` and ``pipesched worker``: the HTTP service and its solver workers."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipesched.api.cli.common import err_console, fail


def settings_epilog() -> str:
    """The ``PIPESCHED_*`` environment variables ``pipesched serve`` reads, from the service's settings."""
    from pipesched.api.settings import Settings

    lines = ["Environment variables (each overrides its default; --host/--port override those two):", ""]
    for name, field in Settings.model_fields.items():
        default = "a SQLite file in ~/.local/share/pipesched" if name == "database_url" else repr(field.default)
        lines.append(f"PIPESCHED_{name.upper()}: {field.description} Default: {default}.")
        lines.append("")
    return "\n".join(lines)


def database_description(url: str) -> str:
    """What ``pipesched serve`` says it stores into: the SQLite file's absolute path, or the URL without password."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if database in ("", ":memory:"):
            return "SQLite in memory (nothing kept after exit)"
        return f"SQLite file {Path(database).expanduser().resolve()}"
    return parsed.render_as_string(hide_password=True)


def serve(
    host: Annotated[str | None, typer.Option(help="Interface to bind (default: PIPESCHED_HOST or 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (default: PIPESCHED_PORT or 8000).")] = None,
) -> None:
    """Run the HTTP service (settings from PIPESCHED_* environment variables; OpenAPI at /docs)."""
    import uvicorn
    from pydantic import ValidationError
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, OperationalError

    from pipesched.api.app import create_app
    from pipesched.api.settings import Settings, exposure_problem

    updates = {key: value for key, value in (("host", host), ("port", port)) if value is not None}
    try:
        settings = Settings(**updates)  # the options override the environment, validated alike
    except ValidationError as error:
        lines = []
        for item in error.errors():
            name = str(item["loc"][0]) if item["loc"] else "?"
            option = f" (or --{name})" if name in updates else ""
            shown = "" if name == "api_token" else f" (got {item.get('input')!r})"
            described = Settings.model_fields[name].description if name in Settings.model_fields else None
            lines.append(
                f"PIPESCHED_{name.upper()}{option}: {item['msg']}{shown}; set a valid value"
                + (f" ({described})" if described else "")
            )
        raise fail("\n".join(lines)) from None
    exposed = exposure_problem(settings)
    if exposed is not None:
        raise fail(exposed)
    database_fix = "set PIPESCHED_DATABASE_URL to sqlite:///FILE or postgresql+psycopg://USER:PASSWORD@HOST/DATABASE"
    from pipesched.api.queue import QueueSettingsError

    try:
        service = create_app(settings)
    except QueueSettingsError as error:
        raise fail(str(error)) from None
    except ArgumentError as error:
        raise fail(f"PIPESCHED_DATABASE_URL is not a usable database URL ({error}): {database_fix}") from None
    except OperationalError as error:
        where = make_url(settings.database_url).render_as_string(hide_password=True)
        reason = str(error.orig or error).strip().splitlines()[0]
        raise fail(
            f"PIPESCHED_DATABASE_URL: cannot open the database {where} ({reason}): check that it exists and is "
            f"reachable, or {database_fix}"
        ) from None
    err_console.print(
        f"pipesched serve: database {database_description(settings.database_url)} (set PIPESCHED_DATABASE_URL to "
        "change it)",
        highlight=False,
        soft_wrap=True,
    )
    uvicorn.run(
        service,
        host=settings.host,
        port=settings.port,
        log_level="info",
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
    )


def worker(
    processes: Annotated[
        int | None, typer.Option("--processes", help="Solver processes (default: PIPESCHED_SOLVER_WORKERS).", min=1)
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            "--metrics-port", help="Prometheus /metrics port (default: PIPESCHED_WORKER_METRICS_PORT; 0: none)."
        ),
    ] = None,
) -> None:
    """Solve jobs from the PostgreSQL queue (run any number, on any machines, beside `pipesched serve` replicas
    started with PIPESCHED_QUEUE=postgres on the same PIPESCHED_DATABASE_URL)."""
    from pydantic import ValidationError
    from sqlalchemy.engine import make_url

    from pipesched.api.queue import QueueSettingsError, check_queue_settings
    from pipesched.api.settings import Settings

    try:
        settings = Settings()
    except ValidationError as error:
        lines = []
        for item in error.errors():
            name = str(item["loc"][0]) if item["loc"] else "?"
            described = Settings.model_fields[name].description if name in Settings.model_fields else None
            shown = "" if name == "api_token" else f" (got {item.get('input')!r})"
            lines.append(
                f"PIPESCHED_{name.upper()}: {item['msg']}{shown}; set a valid value"
                + (f" ({described})" if described else "")
            )
        raise fail("\n".join(lines)) from None
    try:
        check_queue_settings(settings, role="worker")
    except QueueSettingsError as error:
        raise fail(str(error)) from None
    from pipesched.api.worker import run_worker

    try:
        run_worker(
            settings,
            processes=processes or settings.solver_workers,
            metrics_port=settings.worker_metrics_port if metrics_port is None else metrics_port,
        )
    except Exception as error:
        from pipesched.api.queue import DATABASE_FIX

        if type(error).__name__ not in ("OperationalError", "PoolTimeout", "ArgumentError"):
            raise
        where = make_url(settings.database_url).render_as_string(hide_password=True)
        reason = str(getattr(error, "orig", None) or error).strip().splitlines()[0]
        raise fail(
            f"PIPESCHED_DATABASE_URL: cannot reach the database {where} ({reason}): check that the server runs and "
            f"this machine may connect, or {DATABASE_FIX}"
        ) from None
