"""One process of a run: K steps of the schedule with an optimizer, on a pp × dp mesh (contract, Run report).

``pipesched run --steps K --optimizer sgd|adamw --lr ν --data-parallel D`` runs here: ``num_ranks × D``
processes on a two-dimensional ``DeviceMesh`` (``("pp", "dp")``, global rank ``pp_rank · D + dp_rank``),
K training steps with a real ``torch.optim`` optimizer on every rank; the launcher then compares the parameters
after K steps with a single-process reference that follows the same rule
(:func:`pipesched.runtime.verify.reference_training`). Without training options a run is one verified step
without an optimizer, after one untimed warm-up step. A step reads like torchtitan's train step::

    zero the gradients → the pipeline's passes and collectives (one engine) → the remaining gradient reductions
    → the global checks (gradient norm, inf/NaN) → the optimizer step (one update rule)

The update rules (:class:`WeightUpdate` and its two variants):

* **synchronous** (a flushed schedule): gradients of the whole global batch, the global checks, then the step on
  every rank. ``max_grad_norm`` clips by the global norm (``torch.nn.utils.clip_grad_norm_``'s rule, coefficient
  ``max_norm / (norm + 1e-6)`` capped at 1); a non-finite norm skips the step.
* **post-validation** (Zero Bubble, Qi et al. 2023, §4): every rank steps *speculatively* as soon as its own
  gradients are reduced, while the partial sums of the squared norm are all-reduced; the rank's step ends there,
  without waiting for the other ranks. The check is read before the next step starts: when it failed (a non-finite
  norm) the step is rolled back in place (parameters and optimizer state restored from what was kept), when the
  norm needs clipping it is rolled back and redone with the clipped gradients. The parameters equal the
  synchronous ones with clipping (default ``max_norm`` 1.0).
* **PipeDream-2BW** (Narayanan et al. 2020, §3): two weight versions per stage; the gradient of step t is computed
  on W(t−1) and applied to W(t): W(t+1) = W(t) − ν·∇f(W(t−1)) (with SGD; the optimizer's own rule otherwise). A
  no-flush pattern runs its K steps as one, in steady state (:mod:`pipesched.runtime.pipedream`); on a flushed
  schedule the rule runs step after step (:class:`TwoVersionUpdate`).

Data parallelism: replica d of step t takes the global microbatches ``(t·D + d)·m … (t·D + d)·m + m − 1``
(global batch D·m); :mod:`pipesched.runtime.data_parallel` reduces the gradients.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from pipesched.optimizer.export import orders_to_torch_csv
from pipesched.optimizer.ir import ActionKind, compute_only, parse_action
from pipesched.runtime import torch_compat
from pipesched.runtime.data_parallel import DataParallelStages, MirrorGradients, local_tensor
from pipesched.runtime.executor import (
    PipelineExecutor,
    PointToPoint,
    RankProgram,
    SavedActivationMeter,
    StepInputs,
)
from pipesched.runtime.models import PipelineModel, load_model
from pipesched.runtime.options import OPTIMIZERS, SHARDINGS, TrainingError, TrainingOptions, training_options
from pipesched.runtime.pipedream import TwoBufferedWeights
from pipesched.runtime.records import RankJob, RankResult, StepCheck, StepRecord, timed_part
from pipesched.runtime.report import print_training_summary
from pipesched.runtime.streams import CommunicationStream
from pipesched.runtime.verify import clip_coefficient, make_optimizer, nan_hook, squared_norm

__all__ = [
    "OPTIMIZERS",
    "SHARDINGS",
    "RankTrainer",
    "TrainingError",
    "TrainingOptions",
    "WeightUpdate",
    "print_training_summary",
    "train_rank",
    "training_options",
]


def full_tensor(tensor: Any) -> Any:
    """A DTensor gathered (a collective over its mesh: every peer calls it in the same order), or the tensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def tensor_bytes(tensors: list[Any]) -> int:
    """Bytes of the tensors' local data (a DTensor's shard), ``None`` entries skipped."""
    return int(sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors if t is not None))


Saved = tuple[list[Any], dict[Any, dict[str, Any]]]


def _snapshot(params: list[Any], optimizer: torch.optim.Optimizer) -> Saved:
    """What a rollback needs: a copy of every parameter and of the optimizer's per-parameter state."""
    with torch.no_grad():
        saved_params = [p.detach().clone() for p in params]
        saved_state = {
            p: {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in state.items()}
            for p, state in optimizer.state.items()
        }
    return saved_params, saved_state


def _restore(params: list[Any], optimizer: torch.optim.Optimizer, saved: Saved) -> None:
    """Roll back in place: parameters and optimizer state as they were before the speculative step."""
    saved_params, saved_state = saved
    with torch.no_grad():
        for p, copy in zip(params, saved_params, strict=True):
            p.copy_(copy)
    for p in list(optimizer.state):
        if p not in saved_state:
            del optimizer.state[p]
    for p, state in saved_state.items():
        optimizer.state[p] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items()}


def _scale_gradients(params: list[Any], coefficient: float) -> None:
    if coefficient < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coefficient)


class WeightUpdate:
    """The synchronous rule (module docstring): the global norm over every rank, a non-finite norm skips the
    step, clipping, then ``optimizer.step()``. ``params``: this rank's parameters, in its stages' order."""

    def __init__(self, options: TrainingOptions, params: list[Any]) -> None:
        self.options = options
        self.params = params
        self.optimizer = make_optimizer(options.optimizer, self.trained, options.lr)
        self.kept_bytes = 0
        #: The last :meth:`apply`'s own time by part (:attr:`StepRecord.update_parts_ms`), ms.
        self.parts: dict[str, float] = {}

    @property
    def trained(self) -> list[Any]:
        """The tensors the optimizer updates (the parameters; 2BW: W(t), apart from the modules' W(t−1))."""
        return self.params

    def follow(self, current: list[Any]) -> None:
        """FSDP2 may register new sharded parameter objects at its lazy initialisation (first forward): point the
        optimizer (and its state) at the parameters the modules hold."""
        for old, new in zip(self.params, current, strict=True):
            if old in self.optimizer.state:
                self.optimizer.state[new] = self.optimizer.state.pop(old)
        self.optimizer.param_groups[0]["params"] = current
        self.params = current

    #: The last :meth:`apply`'s wait for the global check's all-reduce, ms.
    waited_ms = 0.0

    def apply(self, step: int, partial: torch.Tensor) -> StepCheck:
        """The global check and the step; ``partial``: this rank's share of the squared gradient norm."""
        self.parts = {}
        waiting = time.perf_counter()
        dist.all_reduce(partial)
        self.waited_ms = (time.perf_counter() - waiting) * 1e3
        norm = float(partial.sqrt())
        if not math.isfinite(norm):
            self._skip()
            return StepCheck(step=step, norm=None, skipped=True)
        coefficient = clip_coefficient(norm, self.options.clip_norm)
        with timed_part(self.parts, "step"):
            self._step(coefficient)
        return StepCheck(step=step, norm=norm, clip_coefficient=coefficient)

    def validate(self) -> None:
        """Read a check still in flight (post-validation); the synchronous rule has none."""

    def _skip(self) -> None:
        """A step left out (non-finite norm): the parameters stay."""

    def _step(self, coefficient: float) -> None:
        _scale_gradients(self.params, coefficient)
        self.optimizer.step()

    def static_bytes(self) -> int:
        """Weights, gradients, optimizer state (and what a rollback keeps) this rank holds, bytes."""
        state = [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        grads = [p.grad for p in self.params]
        extra = [] if self.trained is self.params else self.trained
        return tensor_bytes(self.params) + tensor_bytes(grads) + tensor_bytes(extra) + tensor_bytes(state)

    @property
    def final(self) -> list[Any]:
        """The parameters after the last step."""
        return self.trained


class TwoVersionUpdate(WeightUpdate):
    """PipeDream-2BW: the modules compute with W(t−1), the optimizer holds W(t) (module docstring)."""

    def __init__(self, options: TrainingOptions, params: list[Any]) -> None:
        self.masters = [torch.nn.Parameter(p.detach().clone()) for p in params]
        super().__init__(options, params)

    @property
    def trained(self) -> list[Any]:
        return self.masters

    def follow(self, current: list[Any]) -> None:
        self.params = current

    def _skip(self) -> None:
        """W(t+1) = W(t): the modules still move on to W(t), for step t + 1."""
        with torch.no_grad():
            for p, master in zip(self.params, self.masters, strict=True):
                p.copy_(master)

    def _step(self, coefficient: float) -> None:
        _scale_gradients(self.params, coefficient)
        with torch.no_grad():
            for p, master in zip(self.params, self.masters, strict=True):
                master.grad = p.grad  # the same tensor: W(t−1)'s gradient steps W(t)
                p.copy_(master)  # the modules now hold W(t), for step t + 1
        self.optimizer.step()


class PostValidatedUpdate(WeightUpdate):
    """Zero Bubble's post-validation (module docstring): the speculative step is taken at once, beside the global
    check's all-reduce; the check is read (and the step kept, rolled back, or rolled back and redone clipped) by
    :meth:`validate`, before the next step starts or the run ends — not before this step ends."""

    def __init__(self, options: TrainingOptions, params: list[Any]) -> None:
        super().__init__(options, params)
        self._pending: tuple[torch.Tensor, Any, Saved, StepCheck] | None = None

    def apply(self, step: int, partial: torch.Tensor) -> StepCheck:
        self.validate()
        work = dist.all_reduce(partial, async_op=True)
        saved = _snapshot(self.params, self.optimizer)
        self.optimizer.step()
        with torch.no_grad():
            finite_step = all(bool(torch.isfinite(local_tensor(p)).all()) for p in self.params)
        check = StepCheck(step=step, speculative=True, speculative_step_finite=finite_step)
        kept = saved[0] + [v for s in saved[1].values() for v in s.values() if torch.is_tensor(v)]
        self.kept_bytes = max(self.kept_bytes, tensor_bytes(kept))
        self._pending = (partial, work, saved, check)
        return check

    def validate(self) -> None:
        """Read the pending global check: keep the speculative step, roll it back in place (a non-finite norm), or
        roll it back and redo it with the clipped gradients (still held: call before they are zeroed)."""
        if self._pending is None:
            return
        partial, work, saved, check = self._pending
        self._pending = None
        work.wait()
        norm = float(partial.sqrt())
        finite = math.isfinite(norm)
        coefficient = clip_coefficient(norm, self.options.clip_norm) if finite else 1.0
        check.norm = norm if finite else None
        check.rolled_back = not finite or coefficient < 1.0
        if not check.rolled_back:
            return
        _restore(self.params, self.optimizer, saved)
        with torch.no_grad():  # nothing half-applied: every parameter is bit-for-bit what it was before the step
            check.max_change_after_rollback = max(
                (
                    float((local_tensor(p) - local_tensor(q)).abs().max())
                    for p, q in zip(self.params, saved[0], strict=True)
                ),
                default=0.0,
            )
        if finite:
            _scale_gradients(self.params, coefficient)
            self.optimizer.step()
            check.redone_with_clipping = True

    def static_bytes(self) -> int:
        """The live state and, beside it until the check arrives, the copy a rollback needs."""
        return super().static_bytes() + self.kept_bytes


def weight_update(options: TrainingOptions, params: list[Any]) -> WeightUpdate:
    """The update rule ``options`` ask for."""
    if options.two_weight_versions:
        return TwoVersionUpdate(options, params)
    if options.post_validation:
        return PostValidatedUpdate(options, params)
    return WeightUpdate(options, params)


class Engine(Protocol):
    """Runs one step of the rank's part of the schedule (the own executor or PyTorch's runtime)."""

    #: Whether FSDP2's gradient reduction waits for the schedule's REDUCE_GRAD (the own executor runs it).
    defers_reduction: bool
    notes: list[str]

    def run_step(self, inputs: StepInputs, origin: float) -> StepRecord: ...


class TorchEngine:
    """PyTorch's ``_PipelineScheduleRuntime`` fed the schedule's compute-only CSV (it lowers its own
    UNSHARD/RESHARD/REDUCE_GRAD onto FSDP2 and its own sends and receives)."""

    defers_reduction = False

    def __init__(self, trainer: RankTrainer, job: RankJob) -> None:
        schedule = job.schedule
        # Each rank writes its own copy: the ranks of a multi-node run see different folders.
        csv_path = Path(job.workdir) / f"schedule-{job.index}-rank{trainer.global_rank}.csv"
        csv_path.write_text(orders_to_torch_csv(compute_only(schedule.orders())))
        self.trainer = trainer
        self.notes: list[str] = []
        self.loss_fn = trainer.model.loss_fn
        device = trainer.device
        meter = trainer.meter
        self.pipeline = torch_compat.TorchPipeline(
            csv_path,
            trainer.modules,
            num_stages=len(trainer.program.stage_ranks),
            num_microbatches=trainer.program.num_microbatches,
            loss_fn=lambda output, target: self.loss_fn(output, target),
            device=device,
            memory_bytes=(lambda: torch.cuda.memory_allocated(device))
            if device.type == "cuda"
            else (lambda: meter.live_bytes),
            group=trainer.pp_group,
            communication_rows=_rows_with_communication(schedule),
        )
        self.holds_last = any(trainer.program.following[s, 0] is None for s in trainer.program.stages)

    def run_step(self, inputs: StepInputs, origin: float) -> StepRecord:
        self.loss_fn = inputs.loss_fn
        batches = [inputs.microbatch(j) for j in range(self.trainer.program.num_microbatches)]
        with self.trainer.meter.hooks():
            run = self.pipeline.step(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]), origin)
        if self.trainer.data_parallel.sharded:
            self.trainer.data_parallel.reduced.update(self.trainer.modules)  # torch lowered REDUCE_GRAD onto FSDP2
        # With D = 1 torch's REDUCE_GRAD only scales the gradients: no communication to count.
        communication = run.communication if self.trainer.size > 1 else []
        losses = dict(enumerate(run.losses)) if self.holds_last else {}
        return StepRecord(actions=run.actions, communication=communication, losses=losses)


def _rows_with_communication(schedule: Any) -> list[list[str]] | None:
    """The schedule's rows when they hold UNSHARD/RESHARD/REDUCE_GRAD (the torch engine then follows them), else
    ``None`` (torch lowers its own)."""
    rows = [[a.action for a in rank.actions] for rank in schedule.ranks]
    communication = {"UNSHARD", "RESHARD", "REDUCE_GRAD"}
    has = any(a.kind in communication for rank in schedule.ranks for a in rank.actions)
    return rows if has else None


class OwnEngine:
    """pipesched's executor (:class:`pipesched.runtime.executor.PipelineExecutor`): every placement, and the
    schedule's own UNSHARD/RESHARD/REDUCE_GRAD where they stand."""

    defers_reduction = True

    def __init__(self, trainer: RankTrainer, timeout_s: float) -> None:
        size, dp_rank = trainer.size, trainer.dp_rank
        p2p = PointToPoint(
            trainer.pp_rank,
            trainer.device,
            trainer.program.num_microbatches,
            timeout_s,
            lambda peer: peer * size + dp_rank,
        )
        self.executor = PipelineExecutor(
            trainer.program,
            trainer.modules,
            device=trainer.device,
            p2p=p2p,
            meter=trainer.meter,
            communication=trainer.data_parallel,
            timeout_s=timeout_s,
            versions=trainer.versions,
        )

    @property
    def notes(self) -> list[str]:
        return self.executor.notes

    def run_step(self, inputs: StepInputs, origin: float) -> StepRecord:
        return self.executor.run_step(inputs, origin)


class RankTrainer:
    """One process of a run (module docstring): builds its stages on the mesh, then runs the steps."""

    def __init__(self, job: RankJob, global_rank: int, device: torch.device, timeout_s: float) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.options = job.training
        self.size = self.options.data_parallel if self.options else 1
        self.global_rank, self.device = global_rank, device
        self.pp_rank, self.dp_rank = divmod(global_rank, self.size)
        schedule = job.schedule
        self.steady_steps = job.steady_steps
        per_step = schedule.problem.pipeline.num_microbatches // job.steady_steps if job.steady_steps else 0
        self.program = RankProgram.compile(schedule, self.pp_rank, microbatches_per_step=per_step)
        mesh = init_device_mesh(
            device.type, (schedule.problem.pipeline.num_ranks, self.size), mesh_dim_names=("pp", "dp")
        )
        self.pp_group = mesh["pp"].get_group()
        self.model: PipelineModel = load_model(job.model, schedule.problem, seed=job.seed)
        self.modules = self._build_stages(mesh)
        self.timeout_s = timeout_s
        self.stream = CommunicationStream(device)
        mirrors = MirrorGradients(
            self.program.stage_ranks,
            self.program.model_stage,
            size=self.size,
            pp_rank=self.pp_rank,
            dp_rank=self.dp_rank,
        )
        self.data_parallel = DataParallelStages(
            self.modules,
            group=mesh["dp"].get_group(),
            size=self.size,
            sharded=self.options is not None and self.options.sharding == "full" and self.size > 1,
            mirrors=mirrors,
            stream=self.stream,
            scheduled=frozenset(a.stage for a in self.program.order if a.kind == ActionKind.REDUCE_GRAD),
            reshard_after_forward=self.options is not None and self.options.reshard_after_forward,
        )
        self.versions = self._versions()
        self.params = self.versions.parameters() if self.versions else self._parameters()
        self.update = None if self.options is None or self.versions else weight_update(self.options, self.params)
        self.meter = SavedActivationMeter(self.params)
        self.engine: Engine = OwnEngine(self, timeout_s) if job.engine == "pipesched" else TorchEngine(self, job)
        on_gpu = device.type == "cuda"
        self.result = RankResult(
            rank=global_rank,
            pp_rank=self.pp_rank,
            dp_rank=self.dp_rank,
            device=str(device),
            memory_measure="cuda-max-allocated" if on_gpu else "saved-activations",
        )

    def _build_stages(self, mesh: Any) -> dict[int, torch.nn.Module]:
        modules = {s: self.model.build_stage(self.program.model_stage[s]).to(self.device) for s in self.program.stages}
        options = self.options
        if options is not None and options.sharding == "full" and self.size > 1:
            from torch.distributed.fsdp import fully_shard

            for stage, module in modules.items():
                modules[stage] = fully_shard(
                    module, mesh=mesh["dp"], reshard_after_forward=options.reshard_after_forward
                )
        return modules

    def _parameters(self) -> list[Any]:
        return [p for stage in self.program.stages for p in self.modules[stage].parameters()]

    def _versions(self) -> TwoBufferedWeights | None:
        """PipeDream-2BW's two weight versions per stage, for a pattern run in steady state."""
        if not self.steady_steps or self.options is None:
            return None
        model_stage = self.program.model_stage
        first_ids = {s for s in self.program.stages if model_stage.index(model_stage[s]) == s}
        return TwoBufferedWeights(
            self.options,
            self.modules,
            first_ids=first_ids,
            num_microbatches=self.program.per_step,
            steps=self.steady_steps,
            device=self.device,
        )

    def run(self) -> RankResult:
        """The dp group's transport warmed (untimed), the warm-up step (one-step runs only, untimed), then the K steps;
        what this process measured."""
        if self.versions is not None:
            return self._run_steady(self.versions)
        self._warm_transport()
        steps = self.options.steps if self.options else 1
        if self.options is None:
            self.step(0, recorded=False)
            self.meter.restart_peak()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        for step in range(steps):
            self.result.steps.append(self.step(step, recorded=True, last=step == steps - 1))
        self.result.executed = [a.action for a in self.result.last.actions]
        self._finish()
        return self.result

    def _warm_transport(self) -> None:
        """The dp group's connections carried a few full-size messages before the first step (untimed;
        :meth:`~pipesched.runtime.data_parallel.DataParallelStages.warm_transport`), noted with their times."""
        took = self.data_parallel.warm_transport()
        if took:
            self.result.notes.append(
                f"data-parallel transport warmed before the first step (untimed): {len(took)} all-gathers of the "
                f"largest stage's weights, {took[0]:.1f} ms first, {took[-1]:.1f} ms last"
            )

    def _run_steady(self, versions: TwoBufferedWeights) -> RankResult:
        """The K steps of a no-flush pattern as one run, no barrier between steps (:mod:`pipesched.runtime.pipedream`);
        each step's record cut from it: its actions, its losses, and its time (the end of the rank's last action of
        the step after the end of its previous step's)."""
        m = self.program.per_step
        dist.barrier()
        origin = time.perf_counter()
        record = self.engine.run_step(self._inputs(0, steady=True), origin)
        final = versions.finish()
        self.result.executed = [a.action for a in record.actions]
        ended = 0.0
        for step in range(self.steady_steps):
            actions = [a for a in record.actions if parse_action(a.action).microbatch // m == step]
            end = max(a.end for a in actions)
            losses = {g % m: value for g, value in record.losses.items() if g // m == step}
            check = versions.checks.get(step, StepCheck(step=step))
            record_of_step = StepRecord(actions, [], losses, round(end - ended, 6), check)
            record_of_step.update_ms, record_of_step.update_wait_ms = versions.update_ms.get(step, (0.0, 0.0))
            record_of_step.update_parts_ms = versions.update_parts.get(step, {})
            self.result.steps.append(record_of_step)
            ended = end
        self.result.gradients = versions.last_gradients
        self.modules, self.params = final, [p for s in self.program.stages for p in final[s].parameters()]
        self.result.static_memory_bytes = max(versions.static_peak, versions.static_bytes())
        self._finish()
        self.result.notes.append(
            "2bw in steady state: the pattern's K steps as one run, no barrier between steps; step t computes with "
            "W(t−1) while W(t) waits in the other buffer"
        )
        return self.result

    def step(self, step: int, *, recorded: bool, last: bool = False) -> StepRecord:
        """One training step (module docstring): ms from the common start (a barrier) to the optimizer step's end."""
        if self.update is not None:
            self.update.validate()  # the previous step's post-validation, before its gradients go
        for p in self.params:
            p.grad = None
        self.data_parallel.start_step(deferred=self.engine.defers_reduction)
        inputs = self._inputs(step)
        dist.barrier()
        origin = time.perf_counter()
        record = self.engine.run_step(inputs, origin)
        self.data_parallel.reduce_remaining()
        self.stream.wait_all(self.timeout_s)  # the optimizer step waits for every reduction
        record.communication += self.stream.take(origin)
        self._follow_parameters(step, recorded)
        updating = time.perf_counter()
        parts: dict[str, float] = {}
        with timed_part(parts, "norm"):
            partial = self._norm_partial()
        verification_s = 0.0  # the copy of the last step's gradients for the check is no part of the step
        if recorded and last:
            copying = time.perf_counter()
            self.result.gradients = self._gathered(lambda p: p.grad)
            verification_s = time.perf_counter() - copying
        if self.update is not None:
            record.check = self.update.apply(step, partial)
            record.update_wait_ms = round(self.update.waited_ms, 6)
            for name, value in self.update.parts.items():
                parts[name] = round(parts.get(name, 0.0) + value, 6)
        else:
            record.check = StepCheck(step=step)
        ended = time.perf_counter()
        record.update_ms = round((ended - updating - verification_s) * 1e3 - record.update_wait_ms, 6)
        record.update_parts_ms = parts
        record.time_ms = round((ended - origin - verification_s) * 1e3, 6)
        static = (
            self.update.static_bytes() if self.update else tensor_bytes(self.params + [p.grad for p in self.params])
        )
        self.result.static_memory_bytes = max(self.result.static_memory_bytes, static)
        return record

    def _inputs(self, step: int, *, steady: bool = False) -> StepInputs:
        """Replica d's microbatches of step t, and the loss (a NaN hook on the test's poisoned microbatch).
        ``steady``: every step's, by global id ``t·m + j`` (one replica)."""
        m = self.program.per_step
        base = 0 if steady else (step * self.size + self.dp_rank) * m
        model = self.model
        poisoned = None
        nan = self.options.inject_nan if self.options else None
        if nan is not None and (steady or nan[0] == step):
            replica, local = divmod(nan[1], m)
            if replica == self.dp_rank:
                poisoned = model.make_microbatch((nan[0] * self.size + replica) * m + local)[1]

        def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            if poisoned is not None and target.shape == poisoned.shape and torch.equal(target.cpu(), poisoned):
                nan_hook(output)
            return model.loss_fn(output, target)

        return StepInputs(lambda j: model.make_microbatch(base + j), loss_fn)

    def _follow_parameters(self, step: int, recorded: bool) -> None:
        current = self._parameters()
        if all(a is b for a, b in zip(current, self.params, strict=True)):
            return
        if self.update is not None:
            self.update.follow(current)
        self.params = current
        if recorded and step == 0:
            self.result.notes.append("FSDP2 replaced the sharded parameters at lazy initialisation")

    def _norm_partial(self) -> torch.Tensor:
        """This rank's share of the squared global norm: each model stage counted once (its first id), each shard
        once (sharded: every dp rank holds a different shard; replicated: dp rank 0 speaks)."""
        if not (self.data_parallel.sharded or self.dp_rank == 0):
            return torch.zeros((), dtype=torch.float64, device=self.device)
        first_ids = {ms: self.program.model_stage.index(ms) for ms in set(self.program.model_stage)}
        return squared_norm(
            (
                local_tensor(p.grad)
                for stage in self.program.stages
                if first_ids[self.program.model_stage[stage]] == stage
                for p in self.modules[stage].parameters()
                if p.grad is not None
            ),
            self.device,
        )

    def _gathered(self, tensor_of: Any) -> dict[str, Any]:
        """``"{stage}/{name}"`` → the full tensor (fp32, CPU) of every parameter of this rank's stages."""
        gathered = {}
        for stage in self.program.stages:
            for name, p in self.modules[stage].named_parameters():
                value = tensor_of(p)
                if value is not None:
                    gathered[f"{stage}/{name}"] = full_tensor(value).detach().float().cpu().clone()
        return gathered

    def _finish(self) -> None:
        if self.update is not None:
            self.update.validate()
        self.stream.close()
        final = self.update.final if self.update and not self.versions else self.params
        by_parameter = dict(zip(map(id, self.params), final, strict=True))
        self.result.parameters = self._gathered(lambda p: by_parameter[id(p)])
        on_gpu = self.device.type == "cuda"
        self.result.peak_memory_bytes = (
            int(torch.cuda.max_memory_allocated(self.device)) if on_gpu else int(self.meter.peak_bytes)
        )
        self.result.notes[:0] = list(dict.fromkeys(self.engine.notes))
        if self.options is not None and self.options.two_weight_versions and self.versions is None:
            self.result.notes.append(
                "2bw: modules compute with W(t-1), the optimizer holds W(t); steps run one after another"
            )


def train_rank(job: RankJob, global_rank: int, device: torch.device, timeout_s: float) -> RankResult:
    """One process of a run (started by :mod:`pipesched.runtime.launch`); what it measured and holds."""
    return RankTrainer(job, global_rank, device, timeout_s).run()
