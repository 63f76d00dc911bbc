"""Human-readable quantities for error messages and summaries."""

from __future__ import annotations

__all__ = ["common_unit", "format_bytes"]

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
