"""Measure a model's per-stage F, I, W times and activation memory, and write a problem for ``pipesched solve``.

Each model stage runs in this process, on its real input (the previous stage's output), through the
same passes the executor runs: F under the saved-activation meter, I with PyTorch's
``stage_backward_input``, W with ``stage_backward_weight`` (on the first stage, whose input needs no
gradient, I is empty and W does the whole backward, as in the runtime). Times are medians over
``repeats`` microbatches after ``warmup`` untimed ones. Memory per microbatch (contract, Problem):
``activation`` = saved bytes live after F; ``retained_for_weight`` = saved bytes still live after I
(PyTorch's split backward keeps the stage's graph until W, so this is close to ``activation``).
``static`` per rank = bytes of weights + gradients + two Adam moments of the rank's stages.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.problem import Problem
from pipesched.runtime import torch_compat
from pipesched.runtime.executor import SavedActivationMeter
from pipesched.runtime.models import load_model

__all__ = ["SPREAD_WARNING", "PassSpread", "Profile", "measure_model", "profile_model"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: A pass whose interquartile range exceeds this fraction of its median is reported as unsteady.
SPREAD_WARNING = 0.25


@dataclass(frozen=True)
class PassSpread:
    """The timed samples of one pass (F, I or W) of one stage, ms."""

    kind: str
    stage: int
    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def low(self) -> float:
        return min(self.samples)

    @property
    def high(self) -> float:
        return max(self.samples)

    @property
    def iqr(self) -> float:
        """Interquartile range (ms; 0 with fewer than 2 samples)."""
        if len(self.samples) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.samples, n=4, method="inclusive")
        return q3 - q1

    @property
    def relative_iqr(self) -> float:
        """IQR over the median (0 when the median is 0)."""
        return self.iqr / self.median if self.median > 0 else 0.0


@dataclass(frozen=True)
class Profile:
    """What :func:`measure_model` measured: the problem (medians) and every pass's samples."""

    problem: Problem
    spreads: list[PassSpread]

    def unsteady(self, threshold: float = SPREAD_WARNING) -> list[PassSpread]:
        """Passes whose IQR is above ``threshold`` × their median (at least 0.05 ms, below which timer noise
        rules), worst first."""
        noisy = [s for s in self.spreads if s.relative_iqr > threshold and s.iqr > 0.05]
        return sorted(noisy, key=lambda s: s.relative_iqr, reverse=True)


def profile_model(**options: Any) -> Problem:
    """:func:`measure_model`'s problem alone (same arguments)."""
    return measure_model(**options).problem


@dataclass
class _Samples:
    """Per stage: F, I, W times (ms) and the saved bytes after F and after I, one entry per timed microbatch."""

    times: dict[str, list[list[float]]]
    activation: list[list[int]]
    retained: list[list[int]]

    @classmethod
    def empty(cls, num_stages: int) -> _Samples:
        return cls(
            {kind: [[] for _ in range(num_stages)] for kind in "FIW"},
            [[] for _ in range(num_stages)],
            [[] for _ in range(num_stages)],
        )


def _timed(device: torch.device, run: Any) -> tuple[Any, float]:
    """``run()``'s result and its duration in ms (the device synchronised after it)."""
    started = time.perf_counter()
    result = run()
    _sync(device)
    return result, (time.perf_counter() - started) * 1e3


def _measure_stage(
    module: torch.nn.Module, x: torch.Tensor, target: Any, loss_fn: Any, device: torch.device
) -> tuple[torch.Tensor, dict[str, float], int, int]:
    """F, I and W of one stage on one microbatch as the executor runs them: the stage's output (the next stage's
    input), the three times (ms), and the saved bytes live after F and after I."""
    meter = SavedActivationMeter(list(module.parameters()))
    stage_input = x.detach().requires_grad_(x.is_floating_point())
    _sync(device)

    def forward() -> torch.Tensor:
        with meter.hooks():
            out = module(stage_input)
            return out if target is None else loss_fn(out, target.to(device))

    out, forward_ms = _timed(device, forward)
    after_forward = meter.live_bytes
    grad = None if target is not None else torch.randn_like(out)
    param_groups, input_ms = _timed(
        device,
        lambda: torch_compat.backward_input(out, grad, stage_input, module) if stage_input.requires_grad else None,
    )
    after_input = meter.live_bytes

    def weight() -> None:
        if param_groups is None:
            torch.autograd.backward([out], None if grad is None else [grad])
        else:
            torch_compat.backward_weight(param_groups, module)

    _, weight_ms = _timed(device, weight)
    module.zero_grad(set_to_none=True)
    return out.detach(), {"F": forward_ms, "I": input_ms, "W": weight_ms}, after_forward, after_input


def measure_model(
    *,
    num_ranks: int,
    num_microbatches: int,
    stages_per_rank: int = 1,
    placement: str = "loop",
    model: str = "gpt-tiny",
    seed: int = 0,
    repeats: int = 5,
    warmup: int = 2,
    p2p_ms: float = 0.0,
    memory_limit_bytes: float | None = None,
    device: str = "cpu",
) -> Profile:
    """Measure ``model`` split into ``num_ranks · stages_per_rank`` stages; return the problem to solve.

    Returns a :class:`Profile`: its ``problem`` has per-stage ``costs`` (medians, ms) and ``memory`` (bytes),
    ``split_backward`` true, ``memory.limit`` = ``memory_limit_bytes`` (None: no limit), ``costs.p2p`` =
    ``p2p_ms``; its ``spreads`` every pass's timed samples (min, max, interquartile range), since medians on
    a loaded machine move a lot between identical runs.

    With a torch outside :data:`pipesched.runtime.torch_compat.SUPPORTED_TORCH` it warns (``RuntimeWarning``) and
    measures anyway.

    Raises:
        ValueError: unknown model, or a model that cannot be split into that many stages.
    """
    torch_compat.warn_if_unsupported_torch()
    skeleton = load_problem(
        {
            "pipeline": {
                "num_ranks": num_ranks,
                "num_microbatches": num_microbatches,
                "stages_per_rank": stages_per_rank,
                "placement": placement,
            },
            "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1, **_replica_sync(placement)},
            "memory": {"activation": 0},
        }
    )
    target_device = torch.device(device)
    pipeline_model = load_model(model, skeleton, seed=seed)
    num_stages = skeleton.pipeline.num_stages
    modules = [pipeline_model.build_stage(stage).to(target_device) for stage in range(num_stages)]
    samples = _Samples.empty(num_stages)
    for iteration in range(warmup + repeats):
        x, target = pipeline_model.make_microbatch(iteration)
        x = x.to(target_device)
        for stage, module in enumerate(modules):
            last = stage == num_stages - 1
            x, times, after_forward, after_input = _measure_stage(
                module, x, target if last else None, pipeline_model.loss_fn, target_device
            )
            if iteration >= warmup:
                for kind, value in times.items():
                    samples.times[kind][stage].append(value)
                samples.activation[stage].append(after_forward)
                samples.retained[stage].append(after_input)
    data = skeleton.model_dump(mode="json")
    data["costs"] = {kind: [round(statistics.median(t), 6) for t in samples.times[key]] for kind, key in _COSTS.items()}
    data["costs"]["p2p"] = p2p_ms
    data["costs"] |= _replica_sync(placement)
    data["memory"] = {
        "activation": [float(max(a)) for a in samples.activation],
        "retained_for_weight": [
            float(min(max(r), max(a))) for r, a in zip(samples.retained, samples.activation, strict=True)
        ],
        "limit": memory_limit_bytes,
        "static": _static_per_rank(skeleton, modules),
    }
    spreads = [
        PassSpread(kind, stage, tuple(samples.times[kind][stage]))
        for stage in range(num_stages)
        for kind in ("F", "I", "W")
    ]
    return Profile(load_problem(data), spreads)


def _replica_sync(placement: str) -> dict[str, float]:
    """``costs.reduce_grad`` a bidirectional problem needs (its replicas' all-reduce): not measured here, so 0
    (left out of the model) until the profile measures collectives."""
    return {"reduce_grad": 0.0} if placement == "bidirectional" else {}


#: The problem's cost fields and the pass each one is measured from.
_COSTS = {"forward": "F", "backward_input": "I", "backward_weight": "W"}


def _static_per_rank(skeleton: Problem, modules: list[torch.nn.Module]) -> list[float]:
    """Bytes of weights, gradients and two Adam moments of each rank's stages."""
    stage_ranks = skeleton_stage_ranks(skeleton)
    static = [0.0] * skeleton.pipeline.num_ranks
    for stage, module in enumerate(modules):
        parameter_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        static[stage_ranks[stage]] += 4 * parameter_bytes  # weights, gradients, Adam m and v
    return static


def skeleton_stage_ranks(problem: Problem) -> list[int]:
    """Rank of each stage id of ``problem`` (:attr:`pipesched.optimizer.problem.Pipeline.stage_to_rank`)."""
    return problem.pipeline.stage_to_rank
