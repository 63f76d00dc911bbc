"""Family protocol and registry."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from dataclasses import dataclass

from pipesched.optimizer.ir import Action, ActionKind, Orders
from pipesched.optimizer.problem import FAMILY_NAMES, METHOD_NAMES, Problem

__all__ = [
    "Family",
    "FamilyDomainError",
    "UnknownMethodError",
    "applicable_families",
    "backward",
    "check_method",
    "get_family",
    "registry",
]


class FamilyDomainError(ValueError):
    """The problem lies outside a family's domain; the message says what the family needs."""


class UnknownMethodError(KeyError):
    """A method name that is neither ``auto`` nor a family; the message names the closest ones and every choice."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class Family:
    """One schedule family.

    Attributes:
        name: the contract's method name, e.g. ``"zb-h1"``.
        description: one line for ``GET /v1/methods``.
        domain: one line saying which problems it admits.
        check: raises :class:`FamilyDomainError` when ``problem`` is outside the domain.
        build: per-rank orders for a problem inside the domain.
        flush: whether every step ends with a pipeline flush (``training.flush`` must match). A family
            without one (PipeDream-2BW) builds the repeating per-rank pattern of
            :mod:`pipesched.optimizer.pattern` instead of one step.
        gather_runs: with FSDP's ``reshard_after_forward``, whether the family keeps a stage's weights gathered
            over a run of its passes (breadth-first: once for its forwards, once for its backwards) instead of
            re-gathering them for every pass as FSDP2 does (:mod:`pipesched.optimizer.communication`).
    """

    name: str
    description: str
    domain: str
    check: Callable[[Problem], None]
    build: Callable[[Problem], Orders]
    flush: bool = True
    gather_runs: bool = False

    def generate(self, problem: Problem) -> Orders:
        """Check the domain, then build the orders.

        Raises:
            FamilyDomainError: outside the family's domain.
        """
        self.check_domain(problem)
        return self.build(problem)

    def check_domain(self, problem: Problem) -> None:
        """``training.flush`` matches the family, then the family's own check.

        Raises:
            FamilyDomainError: naming ``training.flush`` or what the family needs.
        """
        if problem.training.flush != self.flush:
            if self.flush:
                raise FamilyDomainError(
                    f"{self.name} ends every step with a pipeline flush: it needs training.flush true "
                    "(use pipedream-2bw or auto for a schedule without flushes)"
                )
            raise FamilyDomainError(f"{self.name} runs without a flush: it needs training.flush false")
        self.check(problem)

    def applies_to(self, problem: Problem) -> bool:
        """Whether ``problem`` is inside the domain."""
        try:
            self.check_domain(problem)
        except FamilyDomainError:
            return False
        return True


_MODULES = {
    "gpipe": "gpipe",
    "1f1b": "one_f_one_b",
    "interleaved-1f1b": "interleaved",
    "interleaved-zb": "interleaved_zb",
    "looped-bfs": "looped_bfs",
    "zb-h1": "zero_bubble",
    "zb-h2": "zero_bubble",
    "zb-v": "zb_v",
    "v-half": "v_shape",
    "v-min": "v_shape",
    "bitpipe": "bitpipe",
    "dualpipe-v": "dualpipe_v",
    "lga": "lga",
    "pipedream-2bw": "pipedream_2bw",
}


def registry() -> dict[str, Family]:
    """Every implemented family by name, in the contract's order."""
    families: dict[str, Family] = {}
    for name in FAMILY_NAMES:
        module_name = _MODULES[name]
        try:
            module = importlib.import_module(f"pipesched.optimizer.families.{module_name}")
        except ModuleNotFoundError as error:
            if error.name == f"pipesched.optimizer.families.{module_name}":
                continue
            raise
        for family in module.FAMILIES:
            if family.name == name:
                families[name] = family
    return families


def get_family(name: str) -> Family:
    """The family called ``name``.

    Raises:
        KeyError: with the known names.
    """
    families = registry()
    if name not in families:
        raise UnknownMethodError(_unknown(name, tuple(families)))
    return families[name]


def check_method(method: str, problem: Problem | None = None) -> None:
    """``method`` is ``auto`` or a family, and with ``problem`` that family admits it.

    Raises:
        UnknownMethodError: naming the closest method names (difflib) and every choice.
        FamilyDomainError: the family does not admit ``problem`` (what it needs).
    """
    if method == "auto":
        return
    if method not in METHOD_NAMES:
        raise UnknownMethodError(_unknown(method, METHOD_NAMES))
    family = get_family(method)
    if problem is not None:
        family.check_domain(problem)


def _unknown(name: str, choices: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(name, choices, n=3, cutoff=0.5)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return f"{name!r} is not a method: {hint}choose one of {', '.join(choices)}"


def applicable_families(problem: Problem) -> list[Family]:
    """Families whose domain admits ``problem``."""
    return [family for family in registry().values() if family.applies_to(problem)]


def backward(problem: Problem, stage: int, microbatch: int) -> list[Action]:
    """A fused backward as the problem runs it: ``[B]``, or ``[I, W]`` back to back when split."""
    if problem.split_backward:
        return [
            Action(stage, ActionKind.BACKWARD_INPUT, microbatch),
            Action(stage, ActionKind.BACKWARD_WEIGHT, microbatch),
        ]
    return [Action(stage, ActionKind.BACKWARD, microbatch)]


def require(condition: bool, family: str, message: str) -> None:
    """Raise :class:`FamilyDomainError` ``"{family} needs …"`` unless ``condition``."""
    if not condition:
        raise FamilyDomainError(f"{family} {message}")


def require_loop_single_stage(problem: Problem, family: str) -> None:
    """The domain of the one-stage-per-rank families (GPipe, 1F1B, ZB-H1/H2)."""
    pipeline = problem.pipeline
    require(
        pipeline.placement == "loop" and pipeline.stages_per_rank == 1,
        family,
        'needs placement "loop" with stages_per_rank 1 (one stage per rank), got placement '
        f"{pipeline.placement!r} with stages_per_rank {pipeline.stages_per_rank}",
    )
