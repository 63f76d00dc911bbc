"""Validation helpers shared by every pydantic model of the package (the lowest layer: imports nothing of ours).

Cross-field checks raise one ``pydantic.ValidationError`` whose every entry keeps the path of the field to
fix, so the HTTP service answers 422 with that path and the CLI exits 2 naming it.
"""

from __future__ import annotations

import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

__all__ = ["FieldError", "NumbersModel", "StrictModel", "raise_field_errors"]

#: ``(field path, message, offending input)``.
FieldError = tuple[tuple[str | int, ...], str, Any]


def _bool_is_wrong(annotation: Any) -> bool:
    """Whether a JSON ``true``/``false`` given for ``annotation`` is a wrong type: the field takes numbers (int or
    float, in a union, a list or a dict's values) and not booleans (pydantic's lax mode reads ``true`` as 1)."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _bool_is_wrong(get_args(annotation)[0])
    if origin is Literal:
        return not any(isinstance(value, bool) for value in get_args(annotation))
    if origin in (Union, types.UnionType):
        members = get_args(annotation)
        return bool not in members and any(_bool_is_wrong(member) for member in members)
    return annotation in (int, float)


def _number_items(annotation: Any) -> Any | None:
    """The item annotation of a list, tuple or dict of numbers inside ``annotation``, else None."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _number_items(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        for member in get_args(annotation):
            if (items := _number_items(member)) is not None:
                return items
        return None
    if origin in (list, tuple, set, frozenset, dict):
        args = [arg for arg in get_args(annotation) if arg is not Ellipsis]
        item = args[-1] if args else None
        return item if item is not None and _bool_is_wrong(item) else None
    return None


class NumbersModel(BaseModel):
    """A model whose number fields refuse JSON booleans (``"num_ranks": true`` is not one rank)."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if field is None:
            return value
        if isinstance(value, bool) and _bool_is_wrong(field.annotation):
            raise ValueError(f"expected a number, got {str(value).lower()} (a boolean): give a number")
        item = _number_items(field.annotation) if isinstance(value, list | tuple | dict) else None
        if item is not None:
            entries = value.items() if isinstance(value, dict) else enumerate(value)
            for where, entry in entries:
                if isinstance(entry, bool):
                    raise ValueError(
                        f"entry {where!r}: expected a number, got {str(entry).lower()} (a boolean): give a number"
                    )
        return value


class StrictModel(NumbersModel):
    """A model that rejects unknown fields (a misspelt field is an error, not silently ignored) and booleans given
    for numbers."""

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
