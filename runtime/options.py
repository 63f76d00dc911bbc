"""How the ranks train, and whether a run agrees with the schedule it runs (no torch here).

A run's data parallelism is the schedule's: the schedule was solved, and its step time predicted, for its
problem's ``data_parallel`` (size d and sharding; none means d = 1). :func:`check_run_matches_schedule` refuses
options that differ, naming both values, instead of comparing the run with a prediction made for another d.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, get_args

from pipesched.optimizer.problem import Optimizer, Problem

__all__ = [
    "OPTIMIZERS",
    "SHARDINGS",
    "WEIGHT_UPDATES",
    "TrainingError",
    "TrainingOptions",
    "mismatch_with_schedule",
    "runtime_sharding",
    "static_optimizer_note",
    "training_options",
]

OPTIMIZERS: tuple[Optimizer, ...] = get_args(Optimizer)
#: What the runtime shards over the data-parallel group: ``none`` (gradients all-reduced) or ``full``
#: (FSDP2: weights, gradients and optimizer state sharded).
SHARDINGS = ("none", "full")
#: ``sync``: every step's gradient on the current weights; ``2bw``: PipeDream-2BW's delayed update.
WEIGHT_UPDATES = ("sync", "2bw")


class TrainingError(ValueError):
    """A training option is out of range; ``option`` names it (``--steps``, ``--lr``, …)."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option
        self.reason = option


@dataclass(frozen=True)
class TrainingOptions:
    """How the ranks train (:mod:`pipesched.runtime.training`).

    Attributes:
        steps: K ≥ 1 training steps. optimizer: ``sgd`` or ``adamw`` (``torch.optim``, defaults but ``lr``).
        lr: learning rate ν (finite, > 0). data_parallel: D ≥ 1 replicas. sharding: ``none`` or ``full``.
        reshard_after_forward: FSDP2's option (sharding full). post_validation: speculative steps with rollback.
        weight_update: ``sync`` or ``2bw`` (PipeDream-2BW's delayed update). max_grad_norm: clip by the global
        norm (``None``: no clipping; post-validation defaults to 1.0). inject_nan: ``(step, microbatch)``: the
        gradient of that global microbatch (0 … D·m−1) of that step becomes NaN (a test hook).
    """

    steps: int = 1
    optimizer: str = "sgd"
    lr: float = 0.01
    data_parallel: int = 1
    sharding: str = "full"
    reshard_after_forward: bool = False
    post_validation: bool = False
    weight_update: str = "sync"
    max_grad_norm: float | None = None
    inject_nan: tuple[int, int] | None = None

    def check(self, num_microbatches: int | None = None) -> None:
        """Raises :class:`TrainingError` naming the option and the fix."""
        if not isinstance(self.steps, int) or self.steps < 1:
            raise TrainingError("--steps", f"--steps must be an integer ≥ 1, got {self.steps!r}")
        if self.optimizer not in OPTIMIZERS:
            raise TrainingError(
                "--optimizer", f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        if not isinstance(self.lr, int | float) or not math.isfinite(self.lr) or self.lr <= 0:
            raise TrainingError("--lr", f"--lr must be a finite number > 0, got {self.lr!r}")
        if not isinstance(self.data_parallel, int) or self.data_parallel < 1:
            raise TrainingError(
                "--data-parallel", f"--data-parallel must be an integer ≥ 1, got {self.data_parallel!r}"
            )
        if self.sharding not in SHARDINGS:
            raise TrainingError(
                "--sharding",
                f"--sharding must be one of {', '.join(SHARDINGS)} for the runtime (none: gradients all-reduced, "
                f"full: FSDP2), got {self.sharding!r}",
            )
        if self.weight_update not in WEIGHT_UPDATES:
            raise TrainingError("--weight-update", f"--weight-update must be sync or 2bw, got {self.weight_update!r}")
        if self.weight_update == "2bw" and self.post_validation:
            raise TrainingError(
                "--post-validation", "--post-validation needs a flushed schedule; PipeDream-2BW (2bw) has no flush"
            )
        if self.max_grad_norm is not None and (not math.isfinite(self.max_grad_norm) or self.max_grad_norm <= 0):
            raise TrainingError("--max-grad-norm", f"--max-grad-norm must be finite and > 0, got {self.max_grad_norm}")
        self._check_inject_nan(num_microbatches)

    def _check_inject_nan(self, num_microbatches: int | None) -> None:
        if self.inject_nan is None:
            return
        step, microbatch = self.inject_nan
        total = None if num_microbatches is None else num_microbatches * self.data_parallel
        if not 0 <= step < self.steps or microbatch < 0 or (total is not None and microbatch >= total):
            raise TrainingError(
                "--inject-nan",
                f"--inject-nan STEP:MICROBATCH needs 0 ≤ STEP < {self.steps} and 0 ≤ MICROBATCH < "
                f"{total if total is not None else 'D·m'}, got {step}:{microbatch}",
            )

    @property
    def clip_norm(self) -> float | None:
        """The clipping threshold in use: ``max_grad_norm``, or 1.0 under post-validation."""
        if self.max_grad_norm is not None:
            return self.max_grad_norm
        return 1.0 if self.post_validation else None

    @property
    def two_weight_versions(self) -> bool:
        """PipeDream-2BW's rule: step t's gradient is computed on W(t−1) and applied to W(t)."""
        return self.weight_update == "2bw"


def runtime_sharding(problem: Problem) -> tuple[int, str]:
    """``(d, sharding)`` the runtime runs for ``problem``'s ``data_parallel``: d = 1 without one; sharding
    ``none`` stays ``none``, and ZeRO-1/2/3 (``optimizer``, ``gradients``, ``full``) run as FSDP2 (``full``), the
    runtime's one sharded form."""
    dp = problem.data_parallel
    if dp is None:
        return 1, "none"
    return dp.size, "none" if dp.sharding == "none" else "full"


def training_options(problem: Problem, **given: Any) -> TrainingOptions:
    """Options from the command line (``given``, ``None`` = not given) over the problem's own fields:
    ``data_parallel.size``/``sharding``/``reshard_after_forward``, ``training.post_validation``, and
    ``training.flush: false`` with ``weight_versions: 2`` → ``2bw``, ``memory.static_optimizer`` (the optimizer a
    profile measured the static memory of) → ``optimizer``. Sharding defaults to ``full``; a problem whose sharding
    is ``optimizer``/``gradients`` (ZeRO-1/2) runs as ``full`` unless ``--sharding`` says.

    Raises:
        TrainingError: an option out of range (see :meth:`TrainingOptions.check`).
    """
    values = {key: value for key, value in given.items() if value is not None}
    if problem.data_parallel is not None:
        size, sharding = runtime_sharding(problem)
        values.setdefault("data_parallel", size)
        values.setdefault("sharding", sharding)
        values.setdefault("reshard_after_forward", problem.data_parallel.reshard_after_forward)
    training = problem.training
    values.setdefault("post_validation", training.post_validation)
    values.setdefault("weight_update", "2bw" if (not training.flush and training.weight_versions == 2) else "sync")
    if problem.memory is not None and problem.memory.static_optimizer is not None:
        values.setdefault("optimizer", problem.memory.static_optimizer)
    options = TrainingOptions(**values)
    options.check(problem.pipeline.num_microbatches)
    return options


def mismatch_with_schedule(options: TrainingOptions | None, problem: Problem) -> tuple[str, str] | None:
    """``(option, message)`` when ``options`` ask for another data parallelism than the schedule's problem was
    solved for (its predicted step time would be another run's), else ``None``."""
    size, sharding = runtime_sharding(problem)
    run_size = 1 if options is None else options.data_parallel
    if run_size != size:
        return (
            "--data-parallel",
            f"--data-parallel {run_size} differs from the schedule's data_parallel.size {size}: the schedule and its "
            f"predicted step time are for {size} replica(s); run with --data-parallel {size}, or solve the problem "
            f"again with data_parallel.size {run_size}",
        )
    if options is not None and size > 1 and options.sharding != sharding:
        return (
            "--sharding",
            f"--sharding {options.sharding} differs from the schedule's sharding (data_parallel.sharding "
            f"{problem.data_parallel.sharding if problem.data_parallel else 'none'}, run as {sharding}): run with "
            f"--sharding {sharding}, or solve the problem again with the sharding you want",
        )
    return None


def static_optimizer_note(problem: Problem, options: TrainingOptions | None) -> str | None:
    """A sentence for the run summary when the schedule's static memory (``memory.static``, which its predicted
    static and peak memory include) was measured for another optimizer than the run steps
    (``memory.static_optimizer``, written by ``pipesched profile --optimizer``); ``None`` when they agree or the
    problem does not say. ``options`` ``None``: a run of one verified step, which steps no optimizer (its static
    memory is the parameters and gradients, as SGD's, which keeps no state)."""
    memory = problem.memory
    profiled = memory.static_optimizer if memory is not None else None
    ran = options.optimizer if options is not None else None
    if profiled is None or profiled == ran or (ran is None and profiled == "sgd"):
        return None
    said = (
        f"note: the predicted static memory (memory.static) is {profiled}'s, as pipesched profile --optimizer "
        f"{profiled} measured it"
    )
    if ran is None:
        return (
            f"{said}; this run steps no optimizer (one verified step: parameters and gradients only), so the static "
            f"and peak memory predicted are not this run's. Run with --steps K to step {profiled}."
        )
    return (
        f"{said}; this run steps {ran}, whose optimizer state differs, so the static and peak memory predicted are "
        f"not this run's. Profile with --optimizer {ran} for this run's, or run with --optimizer {profiled}."
    )
