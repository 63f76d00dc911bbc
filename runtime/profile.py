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
from typing import Any

import torch

from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.problem import Problem
from pipesched.runtime import torch_compat
from pipesched.runtime.executor import SavedActivationMeter
from pipesched.runtime.models import load_model

__all__ = ["profile_model"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_model(
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
) -> Problem:
    """Measure ``model`` split into ``num_ranks · stages_per_rank`` stages; return the problem to solve.

    Returns a :class:`Problem` with per-stage ``costs`` (ms) and ``memory`` (bytes), ``split_backward``
    true, ``memory.limit`` = ``memory_limit_bytes`` (None: no limit), ``costs.p2p`` = ``p2p_ms``.

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
            "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
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
    }
    data["memory"] = {
        "activation": [float(max(a)) for a in activation],
        "retained_for_weight": [float(min(max(r), max(a))) for r, a in zip(retained, activation, strict=True)],
        "limit": memory_limit_bytes,
        "static": static,
    }
    return load_problem(data)


def skeleton_stage_ranks(problem: Problem) -> list[int]:
    """Rank of each stage id of ``problem`` (:func:`pipesched.optimizer.instance.stage_to_rank`)."""
    from pipesched.optimizer.instance import stage_to_rank

    return stage_to_rank(problem)
