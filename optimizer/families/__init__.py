"""Generators for the schedules people use today, one module per family, and their registry.

Each family module declares ``FAMILIES = [FamilySpec(...)]`` (:class:`FamilySpec`: name, layouts, backward,
flush, planner estimates, the PyTorch class it mirrors); the registry imports every module of this package
whose name does not start with an underscore. Adding a family is its module and its test. A family raises
:class:`FamilyDomainError` outside its domain; ``generate(problem)`` returns per-rank orders that the
simulator accepts (memory limits aside: a family does not look at the limit).
"""

from __future__ import annotations

from pipesched.optimizer.families._base import (
    FamilyDomainError,
    FamilySpec,
    PlannerEstimate,
    TorchClass,
    UnknownMethodError,
    applicable_families,
    check_method,
    default_family,
    discover_families,
    family_names,
    get_family,
    method_field_errors,
    method_names,
    no_flush_methods,
    registry,
)

__all__ = [
    "FamilyDomainError",
    "FamilySpec",
    "PlannerEstimate",
    "TorchClass",
    "UnknownMethodError",
    "applicable_families",
    "check_method",
    "default_family",
    "discover_families",
    "family_names",
    "get_family",
    "method_field_errors",
    "method_names",
    "no_flush_methods",
    "registry",
]
