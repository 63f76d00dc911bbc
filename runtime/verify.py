"""Verify a pipelined run against a single-process, non-pipelined run of the same model and data.

The reference (:func:`reference_training`) runs every model stage in order on the whole global batch and follows
the run's update rule (synchronous, post-validated ≡ synchronous with clipping, PipeDream-2BW's delayed update);
without training options it is one step without an optimizer (gradients and loss only). Checked (contract, Run
report): the loss and every parameter's gradient and value against the reference (fp32 on CPU: max relative
error ≤ 1e-5), each rank's executed order against the schedule. :func:`measured_costs` and
:func:`simulate_with_measured_costs` put the measured passes back into the simulator.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from pipesched.optimizer.instance import compile_problem
from pipesched.optimizer.ir import parse_action
from pipesched.optimizer.result import Schedule
from pipesched.optimizer.simulate import simulate
from pipesched.runtime.models import PipelineModel
from pipesched.runtime.options import TrainingOptions
from pipesched.runtime.records import MeasuredAction, StepCheck

__all__ = [
    "TOLERANCE",
    "Comparison",
    "Reference",
    "clip_coefficient",
    "compare",
    "make_optimizer",
    "measured_costs",
    "nan_hook",
    "reference_training",
    "simulate_with_measured_costs",
    "squared_norm",
]

#: Max relative error of loss, gradients and parameters accepted per device type (fp32).
TOLERANCE = {"cpu": 1e-5, "cuda": 1e-4}


def make_optimizer(name: str, params: list[Any], lr: float) -> torch.optim.Optimizer:
    """``torch.optim.SGD`` or ``AdamW`` over ``params`` with learning rate ``lr`` (their defaults otherwise)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    return torch.optim.AdamW(params, lr=lr)


def squared_norm(tensors: Iterable[torch.Tensor], device: torch.device | str | None = None) -> torch.Tensor:
    """Σ x² over every element of ``tensors``: a float64 scalar on ``device`` (default: the first tensor's device,
    the CPU for none; ``inf`` / ``nan`` carry through; 0 for none). Each tensor's sum goes through
    ``torch.linalg.vector_norm`` in float64, which accumulates in float64 without a float64 copy of the tensor: on
    one CPU thread 4 ms for gpt-small's 4.2 M gradient elements of a stage, against 21 ms for
    ``t.double().pow(2).sum()`` (two float64 temporaries), the same sum to 1e-13."""
    terms = [torch.linalg.vector_norm(tensor, dtype=torch.float64).square() for tensor in tensors]
    where = device if device is not None else terms[0].device if terms else "cpu"
    total = torch.zeros((), dtype=torch.float64, device=where)
    for term in terms:
        total += term.to(where)
    return total


def clip_coefficient(norm: float, clip: float | None) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s factor: ``max_norm / (norm + 1e-6)`` capped at 1 (1 without clipping)."""
    return min(1.0, clip / (norm + 1e-6)) if clip is not None else 1.0


def nan_hook(output: torch.Tensor) -> None:
    """Make the gradient flowing into ``output`` NaN (the loss value itself stays as it is)."""
    if output.requires_grad:
        output.register_hook(lambda grad: torch.full_like(grad, float("nan")))


@dataclass
class Reference:
    """The single-process run: mean loss per step, the last step's gradients, the parameters after the last
    step (``"{model stage}/{parameter}"``) and per step its check (the global norm, and whether it was skipped)."""

    losses: list[float] = field(default_factory=list)
    gradients: dict[str, torch.Tensor] = field(default_factory=dict)
    parameters: dict[str, torch.Tensor] = field(default_factory=dict)
    steps: list[StepCheck] = field(default_factory=list)


def _reference_step(
    modules: list[torch.nn.Module], model: PipelineModel, first: int, total: int, nan_at: int | None, device: str
):
    """Forward and backward of microbatches ``first … first + total − 1`` (mean loss); the losses."""
    losses = []
    for g in range(total):
        x, target = (tensor.to(device) for tensor in model.make_microbatch(first + g))
        for module in modules:
            x = module(x)
        if nan_at == g:
            nan_hook(x)
        loss = model.loss_fn(x, target)
        (loss / total).backward()
        losses.append(float(loss.detach()))
    return losses


def reference_training(
    model: PipelineModel, num_microbatches: int, options: TrainingOptions | None, device: str = "cpu"
) -> Reference:
    """The same K steps in one process, without a pipeline: every model stage in order, the global batch of
    ``D · m`` microbatches per step (mean loss), the same optimizer, clipping, NaN check and update rule
    (synchronous; post-validation ≡ synchronous with clipping; 2BW: W(t+1) = W(t) − ν·∇f(W(t−1))). Without
    ``options``: one step of m microbatches, no optimizer step. ``device``: where it computes (``cuda`` for a
    run on GPUs: a model that takes the GPUs minutes would take the CPU hours); the tensors it returns are on
    the CPU.
    """
    modules = [model.build_stage(stage).to(device) for stage in range(model.num_model_stages)]
    params = [p for module in modules for p in module.parameters()]
    names = [f"{stage}/{name}" for stage, module in enumerate(modules) for name, _ in module.named_parameters()]
    two_versions = options is not None and options.two_weight_versions
    masters = [torch.nn.Parameter(p.detach().clone()) for p in params] if two_versions else []
    optimizer = None if options is None else make_optimizer(options.optimizer, masters or params, options.lr)
    total = num_microbatches * (options.data_parallel if options else 1)
    steps = options.steps if options else 1
    reference = Reference()
    for step in range(steps):
        for p in params:
            p.grad = None
        nan_at = options.inject_nan[1] if options and options.inject_nan and options.inject_nan[0] == step else None
        losses = _reference_step(modules, model, step * total, total, nan_at, device)
        reference.losses.append(sum(losses) / total)
        norm = float(squared_norm(p.grad for p in params if p.grad is not None).sqrt())
        finite = math.isfinite(norm)
        reference.steps.append(StepCheck(step=step, norm=norm if finite else None, skipped=not finite))
        if step == steps - 1:
            reference.gradients = {  # copies: clipping below scales the gradients in place
                n: p.grad.detach().float().cpu().clone()
                for n, p in zip(names, params, strict=True)
                if p.grad is not None
            }
        if optimizer is None or options is None:
            continue
        if not finite:  # the step is left out: W(t+1) = W(t) (2BW: the next step computes with W(t))
            with torch.no_grad():
                for p, master in zip(params, masters, strict=False):
                    p.copy_(master)
            continue
        coefficient = clip_coefficient(norm, options.clip_norm)
        with torch.no_grad():
            for p in params:
                p.grad.mul_(coefficient)
            for p, master in zip(params, masters, strict=False):
                master.grad = p.grad.clone()
                p.copy_(master)
        optimizer.step()
    final = masters or params
    reference.parameters = {n: p.detach().float().cpu().clone() for n, p in zip(names, final, strict=True)}
    return reference


@dataclass(frozen=True)
class Comparison:
    """Measured tensors against the reference: max absolute and relative error, the worst key, and the reference
    keys missing from / measured keys unknown to the reference."""

    max_abs: float = 0.0
    max_rel: float = 0.0
    worst: str | None = None
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()


def compare(measured: dict[str, Any], reference: dict[str, Any], model_stage: list[int]) -> Comparison:
    """Relative error per tensor ``max|x − ref| / max|ref|`` (NaN where both are NaN counts as equal).

    ``measured`` is keyed ``"{stage id}/{name}"``; stage ids map onto model stages by ``model_stage`` (mirrored
    replicas of a bidirectional placement hold the same, summed gradients: the first copy is compared).
    """
    mapped: dict[str, Any] = {}
    for key, value in measured.items():
        stage, name = key.split("/", 1)
        mapped.setdefault(f"{model_stage[int(stage)]}/{name}", value)
    max_abs = max_rel = 0.0
    worst = None
    for key, expected in reference.items():
        if key not in mapped:
            continue
        got = mapped[key]
        both_nan = torch.isnan(got) & torch.isnan(expected)
        difference = torch.where(both_nan, torch.zeros_like(got), (got - expected).abs())
        absolute = float(difference.max()) if difference.numel() else 0.0
        finite = expected[~torch.isnan(expected)]
        scale = float(finite.abs().max()) if finite.numel() else 0.0
        relative = absolute / scale if scale > 0 else absolute
        if math.isnan(relative):
            relative = math.inf
        max_abs = max(max_abs, absolute) if not math.isnan(absolute) else math.inf
        if relative >= max_rel:
            max_rel, worst = relative, key
    return Comparison(
        max_abs,
        max_rel,
        worst,
        tuple(sorted(set(reference) - set(mapped))),
        tuple(sorted(set(mapped) - set(reference))),
    )


def measured_costs(schedule: Schedule, actions: list[list[MeasuredAction]]) -> dict[str, list[float]]:
    """Per-stage median measured duration (ms) of F, I, W and B, indexed by stage id (0.0 where unseen);
    ``actions``: per rank, its measured compute actions."""
    num_ids = len(schedule.stage_to_rank)
    samples: dict[str, list[list[float]]] = {kind: [[] for _ in range(num_ids)] for kind in "FIWB"}
    for row in actions:
        for record in row:
            action = parse_action(record.action)
            samples[action.kind.value][action.stage].append(record.duration_ms)
    return {kind: [statistics.median(s) if s else 0.0 for s in per_stage] for kind, per_stage in samples.items()}


def simulate_with_measured_costs(
    schedule: Schedule, costs: dict[str, list[float]], microbatches: range | None = None
) -> float | None:
    """The simulator's makespan of the schedule's order with the measured per-stage costs (no p2p latency), ms;
    ``None`` when the measured costs do not make a valid problem. ``microbatches`` (global ids; a no-flush pattern
    unrolled over K steps: the last step's): the span of those microbatches' passes instead — the first start to
    the last end of their F, I, W and B — the same span the run's ``measured_makespan_ms`` reads from the last
    step's records."""
    problem = schedule.problem
    inst = compile_problem(problem)
    num_model = problem.pipeline.num_stages

    def per_model_stage(values: list[float]) -> list[float]:
        # Bidirectional ids S…2S−1 run the same model stages: take the larger measured value.
        merged = [0.0] * num_model
        for stage_id, value in enumerate(values):
            model_stage = inst.model_stage[stage_id]
            merged[model_stage] = max(merged[model_stage], value)
        return merged

    if problem.split_backward:
        forward, backward_input, backward_weight = (per_model_stage(costs[k]) for k in "FIW")
    else:
        forward, backward_input = per_model_stage(costs["F"]), per_model_stage(costs["B"])
        backward_weight = [0.0] * num_model
    try:
        measured = problem.with_changes(
            **{
                "costs.forward": forward,
                "costs.backward_input": backward_input,
                "costs.backward_weight": backward_weight,
                "costs.p2p": 0.0,
                "memory.limit": None,
            }
        )
        inst = compile_problem(measured)
        timed = simulate(inst, schedule.orders(), check_memory=False)
    except Exception:
        return None
    if microbatches is None:
        return timed.makespan
    chosen = [k for k, a in enumerate(inst.actions) if a.is_compute and a.microbatch in microbatches]
    return max(timed.end[k] for k in chosen) - min(timed.start[k] for k in chosen) if chosen else None
