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
    times: dict[str, list[list[float]]] = {kind: [[] for _ in range(num_stages)] for kind in "FIW"}
    activation: list[list[int]] = [[] for _ in range(num_stages)]
    retained: list[list[int]] = [[] for _ in range(num_stages)]
    for iteration in range(warmup + repeats):
        x, target = pipeline_model.make_microbatch(iteration)
        x = x.to(target_device)
        for stage, module in enumerate(modules):
            meter = SavedActivationMeter(list(module.parameters()))
            stage_input = x.detach().requires_grad_(x.is_floating_point())
            _sync(target_device)
            started = time.perf_counter()
            with meter.hooks():
                out = module(stage_input)
                last = stage == num_stages - 1
                if last:
                    out = pipeline_model.loss_fn(out, target.to(target_device))
            _sync(target_device)
            forward_ms = (time.perf_counter() - started) * 1e3
            after_forward = meter.live_bytes
            next_input = out.detach()
            grad = None if last else torch.randn_like(out)
            started = time.perf_counter()
            param_groups: Any = None
            if stage_input.requires_grad:
                param_groups = torch_compat.backward_input(out, grad, stage_input, module)
            _sync(target_device)
            input_ms = (time.perf_counter() - started) * 1e3
            after_input = meter.live_bytes
            started = time.perf_counter()
            if param_groups is None:
                torch.autograd.backward([out], None if grad is None else [grad])
            else:
                torch_compat.backward_weight(param_groups, module)
            _sync(target_device)
            weight_ms = (time.perf_counter() - started) * 1e3
            module.zero_grad(set_to_none=True)
            x = next_input
            if iteration >= warmup:
                times["F"][stage].append(forward_ms)
                times["I"][stage].append(input_ms)
                times["W"][stage].append(weight_ms)
                activation[stage].append(after_forward)
                retained[stage].append(after_input)
    stage_ranks = skeleton_stage_ranks(skeleton)
    static = [0.0] * num_ranks
    for stage, module in enumerate(modules):
        parameter_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        static[stage_ranks[stage]] += 4 * parameter_bytes  # weights, gradients, Adam m and v
    data = skeleton.model_dump(mode="json")
    data["costs"] = {
        "forward": [round(statistics.median(t), 6) for t in times["F"]],
        "backward_input": [round(statistics.median(t), 6) for t in times["I"]],
        "backward_weight": [round(statistics.median(t), 6) for t in times["W"]],
        "p2p": p2p_ms,
        **_replica_sync(placement),
    }
    data["memory"] = {
        "activation": [float(max(a)) for a in activation],
        "retained_for_weight": [float(min(max(r), max(a))) for r, a in zip(retained, activation, strict=True)],
        "limit": memory_limit_bytes,
        "static": static,
    }
    spreads = [
        PassSpread(kind, stage, tuple(times[kind][stage])) for stage in range(num_stages) for kind in ("F", "I", "W")
    ]
    return Profile(load_problem(data), spreads)


def _replica_sync(placement: str) -> dict[str, float]:
    """``costs.reduce_grad`` a bidirectional problem needs (its replicas' all-reduce): not measured here, so 0
    (left out of the model) until the profile measures collectives."""
    return {"reduce_grad": 0.0} if placement == "bidirectional" else {}


def skeleton_stage_ranks(problem: Problem) -> list[int]:
    """Rank of each stage id of ``problem`` (:func:`pipesched.optimizer.instance.stage_to_rank`)."""
    from pipesched.optimizer.instance import stage_to_rank

    return stage_to_rank(problem)
