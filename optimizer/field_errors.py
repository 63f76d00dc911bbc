"""Validation helpers shared by every pydantic model of the package (the lowest layer: imports nothing of ours).

Cross-field checks raise one ``pydantic.ValidationError`` whose every entry keeps the path of the field to
fix, so the HTTP service answers 422 with that path and the CLI exits 2 naming it.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails, InitErrorDetails, PydanticCustomError

__all__ = ["FieldError", "NumbersModel", "StrictModel", "raise_field_errors", "without_errors"]

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


#: pydantic's error types of a number out of its field's range (1e30 for a whole number is ``int_parsing_size``,
#: inf and NaN ``finite_number``).
_RANGE_ERRORS = frozenset(
    {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "int_parsing_size", "finite_number"}
)


def _constraints(annotation: Any, info: FieldInfo | None, item: bool) -> tuple[list[Any], bool]:
    """The annotated-types bounds (``Ge``, ``Gt``, ``Le``, ``Lt``) of a field, or of its list's items when
    ``item``, and whether it takes whole numbers only."""
    metadata = list(info.metadata) if info is not None and not item else []
    while get_origin(annotation) in (Union, types.UnionType, list, tuple, set, frozenset, Annotated):
        args = get_args(annotation)
        if get_origin(annotation) is Annotated:
            metadata += [m for extra in args[1:] for m in getattr(extra, "metadata", [extra])]
            annotation = args[0]
            continue
        members = [arg for arg in args if arg is not type(None) and arg is not Ellipsis]
        if not members or (get_origin(annotation) in (list, tuple, set, frozenset) and not item):
            break
        annotation = members[-1] if get_origin(annotation) not in (Union, types.UnionType) else members[0]
    return metadata, annotation is int


def _shown(value: Any) -> str:
    """A bound or an input as a user reads it: 100,000, 1e+30, inf."""
    if not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int) and abs(value) >= 10**15:  # too large a whole number for a float, possibly
        return f"{'-' if value < 0 else ''}{str(abs(value))[0]}e+{len(str(abs(value))) - 1}"
    if math.isfinite(value) and float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value):,}"
    return f"{value:g}"


def range_message(name: str, metadata: list[Any], whole: bool, given: Any, why: str | None = None) -> str | None:
    """``name``'s allowed range in words and what to give, for a number ``given`` outside it (None: no bound)."""
    parts: list[str] = []
    for bound in metadata:
        if isinstance(bound, annotated_types.Ge):
            parts.insert(0, f"greater than or equal to {_shown(bound.ge)}")
        elif isinstance(bound, annotated_types.Gt):
            parts.insert(0, f"greater than {_shown(bound.gt)}")
        elif isinstance(bound, annotated_types.Le):
            parts.append(f"at most {_shown(bound.le)}")
        elif isinstance(bound, annotated_types.Lt):
            parts.append(f"less than {_shown(bound.lt)}")
    if not parts:
        return None
    given_text = _shown(given)
    kind = "a whole number" if whole else "a finite number"
    reason = f" ({why})" if why else ""
    return f"{given_text} is out of range: {name} takes {kind} {' and '.join(parts)}{reason}; give one in that range"


def _with_ranges(model: type[BaseModel], error: ValidationError) -> ValidationError:
    """``error`` with each out-of-range number's message naming its field's range and why (pydantic's own message
    names one side at most, and none at all for 1e30 given for a whole number or for inf and NaN)."""
    why: dict[str, str] = getattr(model, "BOUND_REASONS", {})
    details = []
    for item in error.errors():
        message = item["msg"]
        loc = item["loc"]
        field = model.model_fields.get(str(loc[0])) if loc else None
        if item["type"] in _RANGE_ERRORS and field is not None and (len(loc) == 1 or isinstance(loc[1], int)):
            metadata, whole = _constraints(field.annotation, field, item=len(loc) > 1)
            message = range_message(str(loc[0]), metadata, whole, item["input"], why.get(str(loc[0]))) or message
        details.append(_detail(item, message))
    return ValidationError.from_exception_data(error.title, details)


def _detail(item: ErrorDetails, message: str) -> InitErrorDetails:
    error_type = PydanticCustomError(item["type"], "{message}", {"message": message})
    return InitErrorDetails(type=error_type, loc=item["loc"], input=item["input"])


class NumbersModel(BaseModel):
    """A model whose number fields refuse JSON booleans (``"num_ranks": true`` is not one rank), and whose numbers
    out of range are refused naming the field's whole range, why it ends there (``BOUND_REASONS``), and the fix."""

    #: Why a field's bound is where it is, by field name: said in the message of a number beyond it.
    BOUND_REASONS: ClassVar[dict[str, str]] = {}

    @model_validator(mode="wrap")
    @classmethod
    def _ranges_named(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(data)
        except ValidationError as error:
            if not any(item["type"] in _RANGE_ERRORS for item in error.errors()):
                raise
            raise _with_ranges(cls, error) from None

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


def without_errors(error: ValidationError, drop: Callable[[ErrorDetails], bool]) -> ValidationError | None:
    """``error`` less the entries ``drop`` picks, each kept one with its path, type, message and input; None when
    ``drop`` picks none (raise ``error`` itself then)."""
    items = error.errors()
    kept = [item for item in items if not drop(item)]
    if len(kept) == len(items):
        return None
    return ValidationError.from_exception_data(error.title, [_detail(item, item["msg"]) for item in kept])
