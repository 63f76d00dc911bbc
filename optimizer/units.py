"""Human-readable quantities for error messages and summaries."""

from __future__ import annotations

__all__ = ["common_unit", "decimals_against_limit", "format_bytes"]

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(value: float) -> str:
    """``value`` bytes in the largest binary unit it reaches, 4 significant digits.

    Examples: ``format_bytes(3 * 2**30) == "3 GiB"``, ``format_bytes(1536 * 2**20) == "1.5 GiB"``,
    ``format_bytes(8 * 2**20) == "8 MiB"``, ``format_bytes(100) == "100 bytes"``.
    """
    for unit, size in _UNITS:
        if abs(value) >= size:
            return f"{value / size:.4g} {unit}"
    return f"{value:.0f} bytes"


def common_unit(values: list[float] | tuple[float, ...]) -> tuple[str, int]:
    """One binary unit for a column of byte counts: the largest unit the largest value reaches.

    Returns ``(name, size in bytes)``, e.g. ``common_unit([3 * 2**20, 2**30]) == ("GiB", 2**30)``;
    ``("bytes", 1)`` for an empty column or one below 1 KiB. Lets a table print numbers only and name the
    unit once, in its header.
    """
    largest = max((abs(x) for x in values), default=0.0)
    return next(((name, size) for name, size in _UNITS if largest >= size), ("bytes", 1))


def decimals_against_limit(values: list[float], limit: float, unit: float, least: int = 2, most: int = 6) -> int:
    """Decimals to print byte counts ``values`` and ``limit`` with, all in the same ``unit`` (bytes per unit),
    so that every value reads above the limit exactly when it is above it.

    Rounding to a common unit and number of decimals is monotone, so a value at or under the limit never
    reads over it; more decimals (from ``least`` up to ``most``) are added until every value over the limit
    also reads over it. E.g. a peak of 5.9549 MiB against a limit of 5.9551 MiB prints as 5.95 and 5.96 with
    two decimals of separate formats, but with this as 5.955 and 5.955; a peak of 5.9553 needs 4 decimals.
    """
    if limit == float("inf"):
        return least
    for decimals in range(least, most + 1):
        shown_limit = round(limit / unit, decimals)
        if all((value > limit) == (round(value / unit, decimals) > shown_limit) for value in values):
            return decimals
    return most
