"""Validation helpers shared by every pydantic model of the package (the lowest layer: imports nothing of ours).

Cross-field checks raise one ``pydantic.ValidationError`` whose every entry keeps the path of the field to
fix, so the HTTP service answers 422 with that path and the CLI exits 2 naming it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

__all__ = ["FieldError", "StrictModel", "raise_field_errors"]

#: ``(field path, message, offending input)``.
FieldError = tuple[tuple[str | int, ...], str, Any]


class StrictModel(BaseModel):
    """A model that rejects unknown fields (a misspelt field is an error, not silently ignored)."""

    model_config = ConfigDict(extra="forbid", frozen=False)


def raise_field_errors(title: str, errors: list[FieldError]) -> None:
    """Raise one pydantic ``ValidationError`` carrying every ``(field path, message, input)``; nothing if empty.

    Raises:
        pydantic.ValidationError: titled ``title``, one entry per error.
    """
    if not errors:
        return
    details = [
        InitErrorDetails(
            type=PydanticCustomError("value_error", "{message}", {"message": message}),
            loc=loc,
            input=value,
        )
        for loc, message, value in errors
    ]
    raise ValidationError.from_exception_data(title, details)
