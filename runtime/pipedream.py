"""PipeDream-2BW in steady state: K steps of a no-flush pattern as one run, two weight versions per stage.

PipeDream-2BW (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training", §3.1) never flushes:
step t + 1's forwards run while step t's backwards do, and each stage updates its weights by
W(t+1) = W(t) − ν·∇f(W(t−1)): the gradient of step t is computed on the version before W(t). On a stage, step t's
microbatches use version U(t) = W(t−1) (U(0) = U(1) = W(0)); two versions live at once — U(t) for step t's
microbatches in flight and U(t+1) for step t+1's — and one buffer each holds them (slot t mod 2), as the paper's
"double-buffered weights". When step t's gradient is complete on a rank, the global check (the squared-norm
partial sums, all-reduced over every rank: inf/NaN skips the update, ``max_grad_norm`` clips) is issued without
waiting; the update U(t+2) = U(t+1) − ν·c·g(t) is written into step t's slot as soon as the check has arrived, and
at the latest before step t+2's first forward on the stage needs it. No barrier between steps: the rank runs its
unrolled order (:func:`pipesched.optimizer.pattern.unroll`) once.

Data parallelism is not part of the pattern (the optimizer plans no-flush schedules for the pipeline alone). The
run is verified against the single-process reference of the same rule
(:func:`pipesched.runtime.verify.reference_training`): parameters after K steps (W(K)), the last step's gradient
and every step's loss.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipesched.optimizer.ir import Action, ActionKind
from pipesched.runtime.options import TrainingOptions
from pipesched.runtime.records import StepCheck, timed_part
from pipesched.runtime.verify import clip_coefficient, make_optimizer, squared_norm

__all__ = ["TwoBufferedWeights"]


def _bytes(tensors: list[Any]) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors if t is not None))


class TwoBufferedWeights:
    """One rank's two weight versions per stage and their updates (module docstring).

    ``modules``: stage id → the module holding slot 0; slot 1 is a copy. ``last_backward``: per (stage, step), the
    position of the stage's last W or B of that step in the rank's order; ``num_microbatches``: m (per step);
    ``steps``: K. The executor asks :meth:`module` which version a microbatch computes with and calls
    :meth:`before` / :meth:`after` around every pass.
    """

    def __init__(
        self,
        options: TrainingOptions,
        modules: dict[int, nn.Module],
        *,
        first_ids: set[int],
        num_microbatches: int,
        steps: int,
        device: torch.device,
    ) -> None:
        self.options, self.m, self.steps, self.device = options, num_microbatches, steps, device
        self.slots = {stage: [module, copy.deepcopy(module)] for stage, module in modules.items()}
        self.first_ids = first_ids
        self.optimizers = {
            stage: make_optimizer(options.optimizer, list(module.parameters()), options.lr)
            for stage, module in modules.items()
        }
        self._trained = {stage: 0 for stage in modules}  # the slot the optimizer's state belongs to
        self._remaining = {t: set(modules) for t in range(steps)}
        self._norms: dict[int, tuple[torch.Tensor, Any]] = {}
        self._applied: set[tuple[int, int]] = set()
        self._done: set[int] = set()  # steps applied on every stage
        self.checks: dict[int, StepCheck] = {}
        self.last_gradients: dict[str, torch.Tensor] = {}
        self.static_peak = 0
        #: Per step, the update's own time (the check's partial sum, the copies, ``optimizer.step()``) and its wait for
        #: the check's all-reduce, ms, summed over the rank's stages.
        self.update_ms: dict[int, tuple[float, float]] = {}
        #: Per step, where the update's own time goes (:attr:`~pipesched.runtime.records.StepRecord.update_parts_ms`).
        self.update_parts: dict[int, dict[str, float]] = {}

    def _timed(self, step: int, started: float, waited_s: float = 0.0) -> None:
        own, wait = self.update_ms.get(step, (0.0, 0.0))
        total = time.perf_counter() - started
        self.update_ms[step] = (round(own + (total - waited_s) * 1e3, 6), round(wait + waited_s * 1e3, 6))

    def module(self, stage: int, microbatch: int) -> nn.Module:
        """The version microbatch ``microbatch`` (global id, step ``microbatch // m``) computes with."""
        return self.slots[stage][(microbatch // self.m) % 2]

    def parameters(self) -> list[Any]:
        return [p for slots in self.slots.values() for module in slots for p in module.parameters()]

    def before(self, action: Action) -> None:
        """Before a pass: the first forward of step t needs U(t), written by step t−2's update."""
        step = action.microbatch // self.m
        if action.kind == ActionKind.FORWARD and step >= 2:
            self._apply(action.stage, step - 2, wait=True)
        self._apply_arrived()

    def after(self, action: Action, last_of_step: bool) -> None:
        """After a pass; ``last_of_step``: the stage's last backward of its step, its gradient complete."""
        if not last_of_step:
            return
        step = action.microbatch // self.m
        self._remaining[step].discard(action.stage)
        if not self._remaining[step]:
            self._issue_check(step)

    def _issue_check(self, step: int) -> None:
        """Every stage of this rank has step t's gradient: all-reduce the squared norm's partial sum, not waited."""
        started = time.perf_counter()
        parts = self.update_parts.setdefault(step, {})
        with timed_part(parts, "norm"):
            partial = squared_norm(
                (
                    p.grad
                    for stage, slots in self.slots.items()
                    if stage in self.first_ids
                    for p in slots[step % 2].parameters()
                    if p.grad is not None
                ),
                self.device,
            )
        with timed_part(parts, "issue"):
            self._norms[step] = (partial, dist.all_reduce(partial, async_op=True))
        self._timed(step, started)
        if step == self.steps - 1:
            self.last_gradients = {
                f"{stage}/{name}": p.grad.detach().float().cpu().clone()
                for stage, slots in self.slots.items()
                for name, p in slots[step % 2].named_parameters()
                if p.grad is not None
            }
        self.static_peak = max(self.static_peak, self.static_bytes())

    def _apply_arrived(self) -> None:
        for step, (_, work) in list(self._norms.items()):
            if step not in self._done and work.is_completed():
                for stage in self.slots:
                    self._apply(stage, step, wait=False)
                if all((stage, step) in self._applied for stage in self.slots):
                    self._done.add(step)

    def _apply(self, stage: int, step: int, *, wait: bool) -> None:
        """U(t+2) = U(t+1) − ν·c·g(t) into step t's slot of ``stage`` (skipped for a non-finite norm); U(t+1) first."""
        if step >= 1 and (stage, step - 1) not in self._applied:
            self._apply(stage, step - 1, wait=wait)
            if (stage, step - 1) not in self._applied:
                return
        if (stage, step) in self._applied or step not in self._norms:
            if wait and (stage, step) not in self._applied:
                raise RuntimeError(
                    f"stage {stage} starts step {step + 2} before its step {step} ended: PipeDream-2BW's two weight "
                    "versions need every stage's step t to end before step t + 2 begins (m ≥ p)"
                )
            return
        started = time.perf_counter()
        partial, work = self._norms[step]
        work.wait()
        waited_s = time.perf_counter() - started
        norm = float(partial.sqrt())
        finite = math.isfinite(norm)
        self.checks.setdefault(step, StepCheck(step=step, norm=norm if finite else None, skipped=not finite))
        old, current = self.slots[stage][step % 2], self.slots[stage][(step + 1) % 2]
        coefficient = clip_coefficient(norm, self.options.clip_norm) if finite else 1.0
        parts = self.update_parts.setdefault(step, {})
        # the gradient stays where it is (scaled in place when clipped), U(t+1) copied under it
        with torch.no_grad(), timed_part(parts, "copy"):
            for p, q in zip(old.parameters(), current.parameters(), strict=True):
                p.copy_(q)
                if p.grad is not None and coefficient < 1.0:
                    p.grad.mul_(coefficient)
        if finite:
            with timed_part(parts, "step"):
                self._step(stage, step % 2)
        with timed_part(parts, "release"):
            for p in old.parameters():
                p.grad = None
        self._applied.add((stage, step))
        self._timed(step, started, waited_s)

    def _step(self, stage: int, slot: int) -> None:
        """The optimizer step on ``slot``'s parameters (its state moved from the other slot's)."""
        optimizer = self.optimizers[stage]
        if self._trained[stage] != slot:
            params = list(self.slots[stage][slot].parameters())
            for old, new in zip(optimizer.param_groups[0]["params"], params, strict=True):
                if old in optimizer.state:
                    optimizer.state[new] = optimizer.state.pop(old)
            optimizer.param_groups[0]["params"] = params
            self._trained[stage] = slot
        optimizer.step()

    def finish(self) -> dict[str, nn.Module]:
        """Apply every update still pending (steps K−2 and K−1); the modules holding W(K) (slot (K+1) mod 2)."""
        for step in range(max(0, self.steps - 2), self.steps):
            for stage in self.slots:
                self._apply(stage, step, wait=True)
        return {stage: slots[(self.steps + 1) % 2] for stage, slots in self.slots.items()}

    def static_bytes(self) -> int:
        """Both versions' weights, the gradients held and the optimizer state, bytes."""
        params = self.parameters()
        state = [
            v for o in self.optimizers.values() for s in o.state.values() for v in s.values() if torch.is_tensor(v)
        ]
        return _bytes(params) + _bytes([p.grad for p in params]) + _bytes([v for v in state if torch.is_tensor(v)])
