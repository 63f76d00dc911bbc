"""Reading problem and schedule files for the command line, with errors a person can act on."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pipesched.optimizer.derive import load_problem as derive_and_validate
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.result import Schedule

__all__ = [
    "InputError",
    "document_kind",
    "format_validation_error",
    "load_problem_file",
    "load_schedule_file",
    "not_json",
    "without_service_fields",
    "wrong_kind",
]


class InputError(Exception):
    """Bad user input; the CLI prints the message and exits with code 2."""


def format_validation_error(error: ValidationError, prefix: str = "") -> str:
    """One line per error: ``field.path: message``."""
    lines = []
    for item in error.errors():
        path = ".".join(str(part) for part in item["loc"]) or "(document)"
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"{prefix}{path}: {message}")
    return "\n".join(lines)


def document_kind(data: Any) -> str | None:
    """Which of the contract's documents ``data`` looks like: ``problem``, ``schedule``, ``plan request``, ``plan
    answer`` or ``measurement file`` (`pipesched calibrate`'s input) (by its top-level fields), else None."""
    if not isinstance(data, dict):
        return None
    if "ranks" in data and "status" in data:
        return "schedule"
    if "plans" in data and "status" in data:
        return "plan answer"
    if "pipeline" in data:
        return "problem"
    if "training" in data and "model" in data and "cluster" in data:
        return "plan request"
    if "rows" in data:
        return "measurement file"
    return None


def wrong_kind(path: Path | str, data: Any, wanted: str, subject: str | None = None) -> str:
    """A line for a file of another kind than ``wanted``, with the command that takes or makes it; "" else.
    ``subject``: what the line calls the document (default ``path``; over HTTP "the body", with ``path`` the file
    name its commands take)."""
    kind = document_kind(data)
    if kind is None or kind == wanted:
        return ""
    command = {
        ("problem", "schedule"): f"make one with `pipesched solve {path} -o schedule.json`",
        ("plan request", "plan answer"): f"make one with `pipesched plan {path} -o plans.json`",
        ("plan request", "problem"): f"plan it with `pipesched plan {path}`",
        ("schedule", "plan answer"): f"run it with `pipesched run {path}`",
        **{
            (kind, "measurement file"): "give runs in the calibration data's format (a list of rows, each a layout "
            "with its measured tokens/s per GPU: optimizer/cost/calibration/README.md)"
            for kind in ("problem", "schedule", "plan request", "plan answer")
        },
        ("measurement file", "profile"): f"make a profile of its runs with `pipesched calibrate {path} -o "
        "profile.json`, then give that",
    }.get(
        (kind, wanted),
        "a profile is what `pipesched calibrate` writes" if wanted == "profile" else f"give the {wanted} file",
    )
    return f"{subject or path} is a {kind}, not a {wanted}: {command}\n"


def not_json(path: Path, error: json.JSONDecodeError, wanted: str) -> str:
    """Why ``path`` did not parse as JSON, and what it should hold: an empty file (``error.doc`` blank) is said to
    be empty, with the ``wanted`` document named (e.g. "a plan request: a JSON object with model, cluster")."""
    if not error.doc.strip():
        return f"{path} is empty: give {wanted}"
    return f"{path} is not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}"


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as error:
        raise InputError(f"cannot read {path}: {error.strerror or error}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise InputError(
            not_json(
                path, error, "a problem: a JSON object with pipeline and costs, or model and cluster (docs/CONTRACT.md)"
            )
        ) from None


def without_service_fields(path: Path, data: Any) -> Any:
    """``data`` without the service's own ``callback_url`` (a job or plan request may carry it over HTTP), with a
    note on stderr: the same file serves ``POST /v1/jobs`` and ``pipesched solve``, ``POST /v1/plans`` and
    ``pipesched plan``, where it had been refused as an extra input."""
    if not isinstance(data, dict) or "callback_url" not in data:
        return data
    sys.stderr.write(
        f"note: {path}'s callback_url is the service's (POST /v1/jobs or /v1/plans POSTs the finished answer there, "
        "signed); the command line answers here and leaves it out\n"
    )
    return {key: value for key, value in data.items() if key != "callback_url"}


def load_problem_file(path: Path, **overrides: Any) -> Problem:
    """Read and validate a problem file; ``overrides`` set dotted fields (``"solver.method"``).

    A schedule file is accepted too: its ``problem`` is used.

    Raises:
        InputError: unreadable file, bad JSON, or a validation error (each field path listed).
    """
    data = without_service_fields(path, _read_json(path))
    if isinstance(data, dict) and "ranks" in data and "problem" in data:
        data = data["problem"]
    if not isinstance(data, dict):
        raise InputError(f"{path}: a problem is a JSON object with pipeline, costs, memory (see the contract)")
    for key, value in overrides.items():
        if value is None:
            continue
        target = data
        parts = key.split(".")
        for part in parts[:-1]:
            if not isinstance(target.get(part), dict):
                target[part] = {}  # absent or null: the override starts the section
            target = target[part]
        target[parts[-1]] = value
    try:
        return derive_and_validate(data)
    except ValidationError as error:
        raise InputError(
            f"{wrong_kind(path, data, 'problem')}{path} is not a valid problem:\n{format_validation_error(error, '  ')}"
        ) from None


def load_schedule_file(path: Path) -> Schedule:
    """Read and validate a schedule file (as written by ``pipesched solve``).

    Raises:
        InputError: unreadable file, bad JSON, a validation error, or a schedule without ranks.
    """
    data = _read_json(path)
    try:
        schedule = Schedule.model_validate(data)
    except ValidationError as error:
        raise InputError(
            f"{wrong_kind(path, data, 'schedule')}{path} is not a valid schedule:\n"
            f"{format_validation_error(error, '  ')}"
        ) from None
    if schedule.status == "infeasible" or not schedule.ranks:
        raise InputError(f"{path} holds no schedule (status {schedule.status}: {schedule.reason})")
    return schedule
