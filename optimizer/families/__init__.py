"""Generators for the schedules people use today, one module per family, and their registry.

Each family states its domain (placement, stages per rank, split backward, microbatch counts) and
raises :class:`FamilyDomainError` outside it. ``generate(problem)`` returns per-rank orders that the
simulator accepts (memory limits aside: a family does not look at the limit).
"""

from __future__ import annotations

from pipesched.optimizer.families._base import (
    Family,
    FamilyDomainError,
    UnknownMethodError,
    applicable_families,
    check_method,
    get_family,
    registry,
)

__all__ = [
    "Family",
    "FamilyDomainError",
    "UnknownMethodError",
    "applicable_families",
    "check_method",
    "get_family",
    "registry",
]
