"""One declaration per family (:class:`FamilySpec`) and the domain checks derived from it.

A family module declares ``FAMILIES = [FamilySpec(...)]``: its name, the layouts it admits (placements and
stages per rank), whether it needs split backward, whether its steps end with a flush, what the planner
assumes of it (:class:`PlannerEstimate`) and the PyTorch schedule class it mirrors (:class:`TorchClass`).
Everything else that speaks of a family reads these declarations through the registry of
:mod:`pipesched.optimizer.families`: the method names ``solver.method`` accepts, the planner's space and
estimates, the runtime's mapping to ``torch.distributed.pipelining`` and the tests' domains.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

from pipesched.optimizer.field_errors import FieldError
from pipesched.optimizer.ir import Action, ActionKind, Orders
from pipesched.optimizer.problem import Pipeline, PlacementName, Problem

__all__ = [
    "FamilyDomainError",
    "FamilySpec",
    "PlannerEstimate",
    "TorchClass",
    "UnknownMethodError",
    "applicable_families",
    "backward",
    "check_method",
    "default_family",
    "discover_families",
    "family_names",
    "get_family",
    "method_field_errors",
    "method_names",
    "no_flush_methods",
    "registry",
    "require",
]


class FamilyDomainError(ValueError):
    """The problem lies outside a family's domain; the message says what the family needs."""


class UnknownMethodError(KeyError):
    """A method name that is neither ``auto`` nor a family; the message names the closest ones and every choice."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class TorchClass:
    """The schedule class of ``torch.distributed.pipelining.schedules`` a family mirrors (torch 2.13).

    Attributes:
        name: the name ``get_schedule_class`` takes, e.g. ``"InterleavedZeroBubble"``.
        backward: how the class runs the backward: ``"fused"`` (B), ``"split"`` (I + W) or ``"mixed"``
            (DualPipeV: both forms in one schedule).
    """

    name: str
    backward: Literal["fused", "split", "mixed"] = "fused"


@dataclass(frozen=True)
class PlannerEstimate:
    """What the planner (:mod:`pipesched.optimizer.planner.prune`) assumes of a family before simulating it.

    Attributes:
        in_flight: ``(p, v, m)`` → chunk activations the first rank holds at its peak (p ranks, v stages per
            rank, m microbatches), with its source in the family's module docstring.
        bubble: the bubble as a fraction of 1F1B's ``(p − 1)`` chunk times; orders configurations only.
        seconds_per_thousand_actions: time to generate and simulate the family per 1,000 actions on this
            project's 2-core machine (measured on a 405B configuration, p = 32, m = 128, under load): the
            planner starts no evaluation that cannot end before its deadline.
        last_rank_like_first: the last rank holds as many activations as the first (every forward runs before
            any backward); otherwise it holds at most one microbatch per local stage.
        min_stages_per_rank: the fewest stages per rank the planner tries the family with.
        overlaps_microbatches: it runs one microbatch's forward beside another's backward on a rank, so the
            expert-parallel all-to-alls of one hide behind the other's compute
            (:class:`~pipesched.optimizer.configs.ExpertParallel` ``overlap``).
        by_default: whether the planner tries the family without being asked; otherwise only when
            ``search.method`` names it (a different update rule, as PipeDream-2BW's, or an order another
            family already gives).
        weight_versions: weight copies a rank keeps (2 without a flush: PipeDream-2BW's double buffering).
    """

    in_flight: Callable[[int, int, int], int]
    bubble: float
    seconds_per_thousand_actions: float
    last_rank_like_first: bool = False
    min_stages_per_rank: int = 1
    overlaps_microbatches: bool = False
    by_default: bool = True
    weight_versions: int = 1


#: How each named placement lays stages on ranks, for the domain errors (contract, Terms: placement).
_PLACEMENT_NOTES = {
    "loop": "stage c·num_ranks + r on rank r",
    "v": "rank r holds stages r and 2·num_ranks−1−r",
    "bidirectional": "two V-shaped replicas in opposite directions",
}


@dataclass(frozen=True)
class FamilySpec:
    """One schedule family, declared once in its module.

    Attributes:
        name: the contract's method name, e.g. ``"zb-h1"``.
        description: one line for ``GET /v1/methods``.
        build: per-rank orders for a problem inside the domain (a flushed step, or without a flush the
            repeating per-rank pattern of :mod:`pipesched.optimizer.pattern`).
        listing_order: where the family comes in listings and among ``auto``'s warm starts (ascending: the
            contract's order).
        placements: the named placements it admits.
        stages_per_rank: the stages per rank it admits.
        backward: ``"split"``: it schedules I and W apart and needs ``split_backward`` true; ``"any"``: a
            fused B, or I then W, as ``split_backward`` says.
        flush: whether every step ends with a pipeline flush (``training.flush`` must match).
        domain_note: the rest of the domain in words (microbatch counts, model conditions).
        layout_hint: what to use instead, added to the error outside the layouts.
        backward_hint: what to use instead, added to the error without split backward.
        check_pipeline: further conditions on the pipeline; raises :class:`FamilyDomainError`.
        check_problem: further conditions on the problem (e.g. the model); raises :class:`FamilyDomainError`.
        torch: the PyTorch schedule class it mirrors, if any.
        planner: what the planner assumes of it; ``None``: the planner does not try it.
        default: the schedule people start from (Megatron-LM's and torchtitan's default); the planner runs it
            when a configuration has no pipeline (plain gradient accumulation). Exactly one family is.
        gather_runs: with FSDP's ``reshard_after_forward``, whether the family keeps a stage's weights gathered
            over a run of its passes (breadth-first: once for its forwards, once for its backwards) instead of
            re-gathering them for every pass as FSDP2 does (:mod:`pipesched.optimizer.communication`).
    """

    name: str
    description: str
    build: Callable[[Problem], Orders]
    listing_order: int
    placements: tuple[PlacementName, ...] = ("loop",)
    stages_per_rank: range = range(1, 2)
    backward: Literal["split", "any"] = "any"
    flush: bool = True
    domain_note: str = "any microbatch count"
    layout_hint: str = ""
    backward_hint: str = ""
    check_pipeline: Callable[[Pipeline], None] | None = None
    check_problem: Callable[[Problem], None] | None = None
    torch: TorchClass | None = None
    planner: PlannerEstimate | None = None
    default: bool = False
    gather_runs: bool = False

    @property
    def runs_split_backward(self) -> bool:
        """Whether the frameworks that run this family split its backward into I and W (the planner simulates
        it so: ``split_backward``). False where the PyTorch class it mirrors runs a fused backward:
        ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleGPipe`` and ``ScheduleLoopedBFS`` call
        ``PipelineStage.backward_one_chunk`` with ``full_backward=True`` (input and weight gradients in one
        autograd call) and post the input gradient's send only after it returns
        (``torch/distributed/pipelining/schedules.py`` in every version read, mid-2024 to 2.13; torch 1963fc8 ran
        torchtitan's Llama 3.1 405B benchmarks of December 2024), as Megatron-LM's ``backward_step`` does. Split
        I then W would let the previous stage start its backward one W earlier on every hop: (p − 1)·W shorter for
        1F1B. Families without a PyTorch class keep ``split_backward`` as the problem states it."""
        return self.torch is None or self.torch.backward != "fused"

    @property
    def domain(self) -> str:
        """One line saying which problems it admits (``GET /v1/methods``)."""
        parts = ["placement " + " or ".join(f'"{p}"' for p in self.placements)]
        parts.append(self._stages_text())
        if self.backward == "split":
            parts.append("split_backward true")
        if not self.flush:
            parts.append("training.flush false")
        return ", ".join([*parts, self.domain_note])

    def _stages_text(self) -> str:
        first, last = self.stages_per_rank.start, self.stages_per_rank.stop - 1
        if first == last:
            return f"stages_per_rank {first}"
        return "any stages_per_rank" if first <= 1 else f"stages_per_rank ≥ {first}"

    def admits_layout(self, placement: str | list[int], stages_per_rank: int) -> bool:
        """Whether the family runs on this placement with this many stages per rank."""
        return isinstance(placement, str) and placement in self.placements and stages_per_rank in self.stages_per_rank

    def check_layout(self, pipeline: Pipeline) -> None:
        """The pipeline's placement and stages per rank, then :attr:`check_pipeline`.

        Raises:
            FamilyDomainError: naming the placement and stages per rank it needs.
        """
        if not self.admits_layout(pipeline.placement, pipeline.stages_per_rank):
            needed = " or ".join(f'"{p}"' for p in self.placements)
            notes = "; ".join(_PLACEMENT_NOTES[p] for p in self.placements)
            raise FamilyDomainError(
                f"{self.name} needs placement {needed} with {self._stages_text()} ({notes}), got placement "
                f"{pipeline.placement!r} with stages_per_rank {pipeline.stages_per_rank}"
                + (f": {self.layout_hint}" if self.layout_hint else "")
            )
        if self.check_pipeline is not None:
            self.check_pipeline(pipeline)

    def admits_pipeline(self, pipeline: Pipeline) -> bool:
        """Whether :meth:`check_layout` passes."""
        try:
            self.check_layout(pipeline)
        except FamilyDomainError:
            return False
        return True

    def flush_error(self, flush: bool) -> str | None:
        """Why ``training.flush`` = ``flush`` does not suit the family, or ``None`` when it does."""
        if flush == self.flush:
            return None
        if self.flush:
            return (
                f"{self.name} ends every step with a pipeline flush: set training.flush to true, or use a method "
                f"that runs without one ({', '.join(no_flush_methods())})"
            )
        return (
            f"{self.name} runs without a pipeline flush: it needs training.flush false (training "
            '{"flush": false, "weight_versions": 2}, or leave training out), or use a method with a flush'
        )

    def check_shape(self, problem: Problem) -> None:
        """Everything of the domain but ``training.flush``: layout, backward, the family's own conditions.

        Raises:
            FamilyDomainError: saying what the family needs.
        """
        self.check_layout(problem.pipeline)
        if self.backward == "split" and not problem.split_backward:
            raise FamilyDomainError(
                f"{self.name} needs split_backward true (it schedules I and W separately): set split_backward to "
                "true" + (f" or {self.backward_hint}" if self.backward_hint else "")
            )
        if self.check_problem is not None:
            self.check_problem(problem)

    def check_domain(self, problem: Problem) -> None:
        """``training.flush`` matches the family, then :meth:`check_shape`.

        Raises:
            FamilyDomainError: naming ``training.flush`` or what the family needs.
        """
        from_flush = self.flush_error(problem.training.flush)
        if from_flush is not None:
            raise FamilyDomainError(from_flush)
        self.check_shape(problem)

    def generate(self, problem: Problem) -> Orders:
        """Check the domain, then build the orders.

        Raises:
            FamilyDomainError: outside the family's domain.
        """
        self.check_domain(problem)
        return self.build(problem)

    def applies_to(self, problem: Problem) -> bool:
        """Whether ``problem`` is inside the domain."""
        try:
            self.check_domain(problem)
        except FamilyDomainError:
            return False
        return True


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


# -- the registry ----------------------------------------------------------------------------------


def discover_families(folder: Path, package: str) -> tuple[FamilySpec, ...]:
    """Import every module of ``package`` (in ``folder``) not named ``_…`` and collect its ``FAMILIES``.

    Returns:
        The declarations in listing order.

    Raises:
        ImportError: a family module that fails to import (never skipped).
        RuntimeError: a family module without ``FAMILIES``, or two declarations of one name or listing order.
    """
    specs: list[FamilySpec] = []
    for info in pkgutil.iter_modules([str(folder)]):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        declared = getattr(module, "FAMILIES", None)
        if not declared:
            raise RuntimeError(
                f"{module.__name__} declares no FAMILIES: a family module lists its FamilySpec declarations there "
                "(a helper module's name starts with an underscore)"
            )
        specs.extend(declared)
    for key in ("name", "listing_order"):
        values = [getattr(spec, key) for spec in specs]
        doubled = sorted({value for value in values if values.count(value) > 1}, key=str)
        if doubled:
            raise RuntimeError(f"two family declarations share the {key} {doubled[0]!r}")
    return tuple(sorted(specs, key=lambda spec: spec.listing_order))


@cache
def _declared() -> tuple[FamilySpec, ...]:
    """This package's families (:func:`discover_families`), found once."""
    return discover_families(Path(__file__).parent, __package__ or "pipesched.optimizer.families")


def registry() -> dict[str, FamilySpec]:
    """Every family by name, in listing order (the contract's); a new dict (the caller may change it)."""
    return dict(_by_name())


@cache
def _by_name() -> dict[str, FamilySpec]:
    """Every family by name, built once: what :func:`get_family` reads (the planner's enumeration asks it once per
    configuration, some 100,000 times on 16,384 GPUs). Never handed out."""
    return {spec.name: spec for spec in _declared()}


def family_names() -> tuple[str, ...]:
    """The families' names, in listing order."""
    return tuple(spec.name for spec in _declared())


def method_names() -> tuple[str, ...]:
    """What ``solver.method`` accepts: ``auto`` then every family."""
    return ("auto", *family_names())


def no_flush_methods() -> tuple[str, ...]:
    """Methods that run without a pipeline flush (``training.flush: false``): ``auto`` and the families so declared."""
    return ("auto", *(spec.name for spec in _declared() if not spec.flush))


def default_family() -> FamilySpec:
    """The family declared ``default`` (:attr:`FamilySpec.default`).

    Raises:
        RuntimeError: unless exactly one family is.
    """
    defaults = [spec for spec in _declared() if spec.default]
    if len(defaults) != 1:
        raise RuntimeError(f"exactly one family declares default=True, found {[spec.name for spec in defaults]}")
    return defaults[0]


def get_family(name: str) -> FamilySpec:
    """The family called ``name``.

    Raises:
        UnknownMethodError: with the closest names and every family.
    """
    families = _by_name()
    if name not in families:
        raise UnknownMethodError(_unknown(name, tuple(families)))
    return families[name]


def applicable_families(problem: Problem) -> list[FamilySpec]:
    """Families whose domain admits ``problem``, in listing order."""
    return [family for family in _declared() if family.applies_to(problem)]


def check_method(method: str, problem: Problem | None = None) -> None:
    """``method`` is ``auto`` or a family, and with ``problem`` that family admits it.

    Raises:
        UnknownMethodError: naming the closest method names (difflib) and every choice.
        FamilyDomainError: the family does not admit ``problem`` (what it needs).
    """
    if method == "auto":
        return
    if method not in registry():
        raise UnknownMethodError(_unknown(method, method_names()))
    if problem is not None:
        get_family(method).check_domain(problem)


def method_field_errors(problem: Problem) -> list[FieldError]:
    """``solver.method`` against the registry and ``training.flush`` against the method, as field errors.

    Problem validation knows no family (:mod:`pipesched.optimizer.problem` sits below the families); the
    document loader (:func:`pipesched.optimizer.derive.load_problem`) adds these.
    """
    method = problem.solver.method
    if method == "auto":
        return []
    if method not in registry():
        return [(("solver", "method"), _unknown(method, method_names()), method)]
    message = get_family(method).flush_error(problem.training.flush)
    return [] if message is None else [(("training", "flush"), message, problem.training.flush)]


def _unknown(name: str, choices: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(name, choices, n=3, cutoff=0.5)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return f"{name!r} is not a method: {hint}choose one of {', '.join(choices)}"
