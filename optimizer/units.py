"""Human-readable quantities for error messages and summaries."""

from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(value: float) -> str:
    """``value`` bytes in the largest binary unit it reaches, 4 significant digits.

    Examples: ``format_bytes(3 * 2**30) == "3 GiB"``, ``format_bytes(1536 * 2**20) == "1.5 GiB"``,
    ``format_bytes(8 * 2**20) == "8 MiB"``, ``format_bytes(100) == "100 bytes"``.
    """
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.4g} {unit}"
    return f"{value:.0f} bytes"
