"""Training beyond one step, and data parallelism, on the pipelined ranks (contract, Run report).

``pipesched run --steps K --optimizer sgd|adamw --lr ν --data-parallel D`` runs here: ``num_ranks × D``
processes on a two-dimensional ``DeviceMesh`` (``("pp", "dp")``, global rank ``pp_rank · D + dp_rank``),
K training steps with a real ``torch.optim`` optimizer on every rank, then the parameters after K steps
are compared with a single-process reference (:func:`reference_training`) that follows the same rule:

* **synchronous** (a flushed schedule): gradients of the whole global batch, the global checks (gradient
  norm, inf/NaN), then the step on every rank. ``max_grad_norm`` clips by the global norm
  (``torch.nn.utils.clip_grad_norm_``'s rule, coefficient ``max_norm / (norm + 1e-6)`` capped at 1); a
  non-finite norm skips the step.
* **post-validation** (Zero Bubble, Qi et al. 2023, §4): every rank steps *speculatively* as soon as its
  own gradients are reduced, while the partial sums of the squared norm are all-reduced; when the global
  check then fails (a non-finite norm) the step is rolled back in place (parameters and optimizer state
  restored from what was kept), when the norm needs clipping it is rolled back and redone with the
  clipped gradients. The parameters equal the synchronous ones with clipping (default ``max_norm`` 1.0).
* **PipeDream-2BW** (Narayanan et al. 2020, §3): two weight versions per stage; the gradient of step t
  is computed on W(t−1) and applied to W(t): W(t+1) = W(t) − ν·∇f(W(t−1)) (with SGD; the optimizer's own
  rule otherwise). The runtime runs the schedule's pattern once per step with a barrier between steps,
  so it checks the update rule, not the overlap of consecutive steps.

Data parallelism: replica d of step t takes the global microbatches ``(t·D + d)·m … (t·D + d)·m + m − 1``
(global batch D·m). ``sharding: full`` wraps each stage module with FSDP2 ``fully_shard(module,
mesh=mesh["dp"], reshard_after_forward=…)`` (PyTorch's ``_PipelineScheduleRuntime`` lowers
UNSHARD/RESHARD/REDUCE_GRAD for it; the own executor runs them through
:func:`pipesched.runtime.torch_compat.fsdp_reduce_grad`). ``sharding: none`` keeps plain modules and
reduces gradients itself: one ``all_reduce`` (sum, then ÷ D) per stage over the dp group after its
last backward (the schedule's REDUCE_GRAD where it has one, else after the step) — DDP's hooks break
with split backward (pytorch#144530).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pipesched.optimizer.instance import compile_problem
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.result import Schedule

__all__ = [
    "OPTIMIZERS",
    "SHARDINGS",
    "TrainingError",
    "TrainingOptions",
    "build_training_report",
    "print_training_summary",
    "reference_training",
    "train_rank",
    "training_options",
]

OPTIMIZERS = ("sgd", "adamw")
#: What the runtime shards over the data-parallel group: ``none`` (gradients all-reduced) or ``full``
#: (FSDP2: weights, gradients and optimizer state sharded).
SHARDINGS = ("none", "full")
WEIGHT_UPDATES = ("sync", "2bw")
#: Max relative error of the parameters after K steps (fp32 on CPU; cuda looser, as for gradients).
PARAM_TOLERANCE = {"cpu": 1e-5, "cuda": 1e-4}


class TrainingError(ValueError):
    """A training option is out of range; ``option`` names it (``--steps``, ``--lr``, …)."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option
        self.reason = option


@dataclass(frozen=True)
class TrainingOptions:
    """How the ranks train (see the module docstring).

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
        if self.inject_nan is not None:
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


def training_options(problem: Problem, **given: Any) -> TrainingOptions:
    """Options from the command line (``given``, ``None`` = not given) over the problem's own fields:
    ``data_parallel.size``/``sharding``/``reshard_after_forward``, ``training.post_validation``, and
    ``training.flush: false`` with ``weight_versions: 2`` → ``2bw``. Sharding defaults to ``full``; a problem
    whose sharding is ``optimizer``/``gradients`` (ZeRO-1/2) runs as ``full`` unless ``--sharding`` says.

    Raises:
        TrainingError: an option out of range (see :meth:`TrainingOptions.check`).
    """
    values = {key: value for key, value in given.items() if value is not None}
    dp = problem.data_parallel
    if dp is not None:
        values.setdefault("data_parallel", dp.size)
        values.setdefault("sharding", "none" if dp.sharding == "none" else "full")
        values.setdefault("reshard_after_forward", dp.reshard_after_forward)
    training = problem.training
    values.setdefault("post_validation", training.post_validation)
    values.setdefault("weight_update", "2bw" if (not training.flush and training.weight_versions == 2) else "sync")
    options = TrainingOptions(**values)
    options.check(problem.pipeline.num_microbatches)
    return options


# --- the ranks ------------------------------------------------------------------------------------------


def _local(tensor: Any) -> Any:
    """A DTensor's local shard, a plain tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _full(tensor: Any) -> Any:
    """A DTensor gathered (a collective over its mesh: every peer calls it in the same order), or the tensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _make_optimizer(name: str, params: list[Any], lr: float) -> Any:
    import torch

    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    return torch.optim.AdamW(params, lr=lr)


def _snapshot(params: list[Any], optimizer: Any) -> tuple[list[Any], dict[Any, dict[str, Any]]]:
    """What a rollback needs: a copy of every parameter and of the optimizer's per-parameter state."""
    import torch

    with torch.no_grad():
        saved_params = [p.detach().clone() for p in params]
        saved_state = {
            p: {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in state.items()}
            for p, state in optimizer.state.items()
        }
    return saved_params, saved_state


def _restore(params: list[Any], optimizer: Any, saved: tuple[list[Any], dict[Any, dict[str, Any]]]) -> None:
    """Roll back in place: parameters and optimizer state as they were before the speculative step."""
    import torch

    saved_params, saved_state = saved
    with torch.no_grad():
        for p, copy in zip(params, saved_params, strict=True):
            p.copy_(copy)
    for p in list(optimizer.state):
        if p not in saved_state:
            del optimizer.state[p]
    for p, state in saved_state.items():
        optimizer.state[p] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items()}


def _bytes(tensors: list[Any]) -> int:
    return int(sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None))


def _nan_hook(output: Any) -> None:
    """Make the gradient flowing into ``output`` NaN (the loss value itself stays as it is)."""
    import torch

    if output.requires_grad:
        output.register_hook(lambda grad: torch.full_like(grad, float("nan")))


def train_rank(job: dict[str, Any], global_rank: int, device: Any, timeout_s: float) -> dict[str, Any]:
    """One process of a training run (started by :mod:`pipesched.runtime.launch`); returns its records.

    Returns ``{"rank", "pp_rank", "dp_rank", "actions", "executed", "communication", "peak_memory_bytes",
    "static_memory_bytes", "memory_measure", "losses" (per step: microbatch → loss), "step_times_ms",
    "steps" (per step: norm, clipped, rolled back, …), "gradients" (last step, gathered),
    "parameters" (after K steps, gathered), "notes", "device"}``.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pipesched.optimizer.export import orders_to_torch_csv
    from pipesched.runtime import torch_compat
    from pipesched.runtime.executor import Action, SavedActivationMeter, execute_rank, split_action
    from pipesched.runtime.models import load_model

    schedule = Schedule.model_validate_json(job["schedule"])
    options = TrainingOptions(**{**job["training"], "inject_nan": tuple(job["training"]["inject_nan"] or ()) or None})
    D = options.data_parallel
    inst = compile_problem(schedule.problem)
    num_ranks = schedule.problem.pipeline.num_ranks
    pp_rank, dp_rank = divmod(global_rank, D)
    mesh = init_device_mesh(device.type, (num_ranks, D), mesh_dim_names=("pp", "dp"))
    pp_group = mesh["pp"].get_group()
    dp_group = mesh["dp"].get_group()
    model = load_model(job["model"], schedule.problem, seed=job["seed"])
    m = inst.num_microbatches
    my_stages = sorted(s for s, r in enumerate(inst.stage_ranks) if r == pp_rank)
    modules = {s: model.build_stage(inst.model_stage[s]).to(device) for s in my_stages}
    sharded = options.sharding == "full" and D > 1
    if sharded:
        from torch.distributed.fsdp import fully_shard

        for stage, module in modules.items():
            modules[stage] = fully_shard(module, mesh=mesh["dp"], reshard_after_forward=options.reshard_after_forward)
    # Bidirectional placements hold a model stage twice (mirrored replicas): their gradients are summed,
    # as the all-reduce between mirrored ranks does, so both copies take the same steps.
    mirrors: dict[int, Any] = {}
    for model_stage in range(max(inst.model_stage) + 1):
        holders = sorted({inst.stage_ranks[s] for s, ms in enumerate(inst.model_stage) if ms == model_stage})
        ids = [s for s, ms in enumerate(inst.model_stage) if ms == model_stage]
        if len(ids) < 2:
            continue
        for replica in range(D):
            group = dist.new_group([r * D + replica for r in holders]) if len(holders) > 1 else None
            if replica == dp_rank and pp_rank in holders:
                mirrors[model_stage] = (ids, group)

    params = [p for stage in my_stages for p in modules[stage].parameters()]
    two_versions = options.weight_update == "2bw"
    if two_versions:
        # W(t) lives in the masters (the optimizer's parameters); the modules compute with W(t−1).
        masters = [torch.nn.Parameter(p.detach().clone()) for p in params]
        optimizer = _make_optimizer(options.optimizer, masters, options.lr)
    else:
        masters = []
        optimizer = _make_optimizer(options.optimizer, params, options.lr)

    engine = job["engine"]
    meter = SavedActivationMeter(params)
    on_gpu = device.type == "cuda"

    def reduce_gradients(stage: int) -> None:
        """REDUCE_GRAD of one stage over the dp group."""
        module = modules[stage]
        if sharded:
            torch_compat.fsdp_reduce_grad(module)
        elif D > 1:
            for p in module.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=dp_group)
                    p.grad.div_(D)

    def communicate(stage: int, kind: str) -> None:
        fsdp = torch_compat.fsdp_modules(modules[stage])[:1]
        if kind == "REDUCE_GRAD":
            reduce_gradients(stage)
            scheduled_done.add(stage)
        elif kind == "UNSHARD":
            for f in fsdp:
                f.unshard()
        elif kind == "RESHARD":
            for f in fsdp:
                f.reshard()

    torch_pipeline = None
    if engine == "torch":
        csv_path = Path(job["workdir"]) / f"schedule-{job['index']}.csv"
        if global_rank == 0:
            csv_path.write_text(
                orders_to_torch_csv(
                    [
                        [a for a in (split_action(x.action) for x in r.actions) if isinstance(a, Action)]
                        for r in schedule.ranks
                    ]
                )
            )
        dist.barrier()
        holder: dict[str, Callable] = {"loss": model.loss_fn}
        torch_pipeline = torch_compat.TorchPipeline(
            csv_path,
            modules,
            num_stages=inst.num_stages,
            num_microbatches=m,
            loss_fn=lambda output, target: holder["loss"](output, target),
            device=device,
            memory_bytes=(lambda: torch.cuda.memory_allocated(device)) if on_gpu else (lambda: meter.live_bytes),
            group=pp_group,
        )

    last_stage_ids = {chain[-1] for chain in inst.chains}
    holds_last = any(s in last_stage_ids for s in my_stages)
    record: dict[str, Any] = {
        "rank": global_rank,
        "pp_rank": pp_rank,
        "dp_rank": dp_rank,
        "losses": [],
        "step_times_ms": [],
        "steps": [],
        "notes": [],
        "communication": [],
        "device": str(device),
    }
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    static_peak = 0
    scheduled_done: set[int] = set()
    for step in range(options.steps):
        for p in params:
            p.grad = None
        scheduled_done.clear()
        base = (step * D + dp_rank) * m
        poisoned = None
        if options.inject_nan is not None and options.inject_nan[0] == step:
            replica, local = divmod(options.inject_nan[1], m)
            if replica == dp_rank:
                poisoned = model.make_microbatch(base + local)[1]

        def loss_fn(output: Any, target: Any, poisoned: Any = poisoned) -> Any:
            if poisoned is not None and target.shape == poisoned.shape and torch.equal(target.cpu(), poisoned):
                _nan_hook(output)
            return model.loss_fn(output, target)

        def make_microbatch(j: int, base: int = base) -> tuple[Any, Any]:
            return model.make_microbatch(base + j)

        if sharded and engine == "pipesched":
            for module in modules.values():
                torch_compat.fsdp_defer_reduction(module)
        dist.barrier()
        started = time.perf_counter()
        if torch_pipeline is not None:
            holder["loss"] = loss_fn
            batches = [make_microbatch(j) for j in range(m)]
            with meter.hooks():
                run = torch_pipeline.step(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
            # With D = 1 torch's REDUCE_GRAD only scales the gradients: no communication to count.
            actions, communication = run.actions, (run.communication if D > 1 else [])
            losses = dict(enumerate(run.losses)) if holds_last else {}
            if sharded:
                scheduled_done.update(my_stages)  # torch lowered REDUCE_GRAD onto FSDP's post-backward
        else:
            meter.peak_bytes = max(meter.peak_bytes, 0)
            rank_run = execute_rank(
                schedule,
                model,
                rank=pp_rank,
                device=device,
                p2p_timeout_s=timeout_s,
                warmup_steps=0,
                inst=inst,
                modules=modules,
                make_microbatch=make_microbatch,
                loss_fn=loss_fn,
                to_global=lambda peer: peer * D + dp_rank,
                communicate=communicate,
            )
            meter.peak_bytes = max(meter.peak_bytes, rank_run.peak_memory_bytes)
            actions, communication, losses = rank_run.actions, rank_run.communication, rank_run.losses
            if step == 0:
                record["notes"].extend(rank_run.notes)
        origin_shift = (time.perf_counter() - started) * 1e3
        # Stages the schedule gave no REDUCE_GRAD: reduce after the step (timed, as REDUCE_GRAD).
        for stage in my_stages:
            if stage in scheduled_done or (D == 1 and not sharded):
                continue
            began = time.perf_counter()
            reduce_gradients(stage)
            communication.append(
                {
                    "action": f"{stage}REDUCE_GRAD",
                    "start": round((began - started) * 1e3, 6),
                    "end": round((time.perf_counter() - started) * 1e3, 6),
                }
            )
        for ids, group in mirrors.values():
            local = [modules[s] for s in ids if s in modules]
            for named in zip(*(list(mod.parameters()) for mod in local), strict=True):
                total = sum(_local(p.grad) for p in named if p.grad is not None)
                if group is not None:
                    dist.all_reduce(total, group=group)
                for p in named:
                    _local(p.grad).copy_(total)
        # The global checks: squared-norm partial sums, each model stage counted once (its first id), each
        # shard once (sharded: every dp rank holds a different shard; replicated: dp rank 0 speaks).
        # FSDP2 may register new sharded parameter objects at its lazy initialisation (first forward, e.g.
        # with reshard_after_forward): point the optimizer (and its state) at the parameters the modules hold.
        current = [p for stage in my_stages for p in modules[stage].parameters()]
        if any(a is not b for a, b in zip(current, params, strict=True)):
            if not two_versions:
                for old_param, new_param in zip(params, current, strict=True):
                    if old_param in optimizer.state:
                        optimizer.state[new_param] = optimizer.state.pop(old_param)
                optimizer.param_groups[0]["params"] = current
            params = current
            if step == 0:
                record["notes"].append("FSDP2 replaced the sharded parameters at lazy initialisation")
        partial = torch.zeros((), dtype=torch.float64, device=device)
        if sharded or dp_rank == 0:
            for stage in my_stages:
                if min(s for s, ms in enumerate(inst.model_stage) if ms == inst.model_stage[stage]) != stage:
                    continue
                for p in modules[stage].parameters():
                    if p.grad is not None:
                        partial += _local(p.grad).double().pow(2).sum()
        # The reduced gradients of the last step, before clipping (as the reference records them).
        if step == options.steps - 1:
            gradients: dict[str, Any] = {}
            for stage in my_stages:
                for name, p in modules[stage].named_parameters():
                    if p.grad is not None:
                        gradients[f"{stage}/{name}"] = _full(p.grad).detach().float().cpu().clone()
            record["gradients"] = gradients
        clip = options.clip_norm
        info: dict[str, Any] = {"step": step}
        if options.post_validation:
            # Speculative step first, the global check after it (in flight meanwhile).
            pending = dist.all_reduce(partial, async_op=True)
            saved = _snapshot(params, optimizer)
            optimizer.step()
            with torch.no_grad():
                info["speculative_step_finite"] = all(bool(torch.isfinite(_local(p)).all()) for p in params)
            pending.wait()
            norm = float(partial.sqrt())
            finite = math.isfinite(norm)
            coefficient = min(1.0, clip / (norm + 1e-6)) if (clip is not None and finite) else 1.0
            info.update(norm=norm if finite else None, speculative=True)
            if not finite or coefficient < 1.0:
                _restore(params, optimizer, saved)
                info["rolled_back"] = True
                with torch.no_grad():
                    # Nothing half-applied: every parameter is bit-for-bit what it was before the step.
                    info["max_change_after_rollback"] = max(
                        (float((_local(p) - _local(q)).abs().max()) for p, q in zip(params, saved[0], strict=True)),
                        default=0.0,
                    )
                if finite:
                    for p in params:
                        if p.grad is not None:
                            p.grad.mul_(coefficient)
                    optimizer.step()
                    info["redone_with_clipping"] = True
            else:
                info["rolled_back"] = False
            static_peak = max(
                static_peak,
                _bytes(saved[0]) + _bytes([v for s in saved[1].values() for v in s.values() if torch.is_tensor(v)]),
            )
            del saved
        else:
            dist.all_reduce(partial)
            norm = float(partial.sqrt())
            finite = math.isfinite(norm)
            info.update(norm=norm if finite else None)
            if not finite:
                info["skipped"] = True
            else:
                coefficient = min(1.0, clip / (norm + 1e-6)) if clip is not None else 1.0
                info["clip_coefficient"] = coefficient
                if two_versions:
                    with torch.no_grad():
                        for p, master in zip(params, masters, strict=True):
                            master.grad = None if p.grad is None else p.grad.mul(coefficient)
                            p.copy_(master)  # the modules now hold W(t), for step t + 1
                else:
                    if coefficient < 1.0:
                        for p in params:
                            if p.grad is not None:
                                p.grad.mul_(coefficient)
                optimizer.step()
        ended = time.perf_counter()
        record["step_times_ms"].append(round((ended - started) * 1e3, 6))
        record["steps"].append(info)
        record["losses"].append({int(j): float(v) for j, v in losses.items()})
        record["communication"].append(communication)
        if step == options.steps - 1:
            record["actions"] = actions
            record["executed"] = [a["action"] for a in actions]
            record["pipeline_ms"] = round(origin_shift, 6)
        optimizer_state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        static_peak = max(
            static_peak,
            _bytes(params) + _bytes([p.grad for p in params]) + _bytes(masters) + _bytes(optimizer_state),
        )
    final = masters if two_versions else params
    parameters: dict[str, Any] = {}
    position = 0
    for stage in my_stages:
        for name, _ in modules[stage].named_parameters():
            parameters[f"{stage}/{name}"] = _full(final[position]).detach().float().cpu()
            position += 1
    record["parameters"] = parameters
    record["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(device)) if on_gpu else int(meter.peak_bytes)
    record["memory_measure"] = "cuda-max-allocated" if on_gpu else "saved-activations"
    record["static_memory_bytes"] = int(static_peak)
    if options.weight_update == "2bw":
        record["notes"].append(
            "2bw: modules compute with W(t-1), the optimizer holds W(t); steps run one after another"
        )
    return record


# --- the reference ----------------------------------------------------------------------------------------


def reference_training(model: Any, num_microbatches: int, options: TrainingOptions) -> dict[str, Any]:
    """The same K steps in one process, without a pipeline: every model stage in order, the global batch of
    ``D · m`` microbatches per step (mean loss), the same optimizer, clipping, NaN check and update rule
    (synchronous; post-validation ≡ synchronous with clipping; 2BW: W(t+1) = W(t) − ν·∇f(W(t−1))).

    Returns ``{"losses": [mean loss per step], "gradients": last step's, "parameters": after K steps,
    "steps": per step norm and skipped}``, keyed ``"{model stage}/{parameter}"``.
    """
    import torch

    modules = [model.build_stage(stage) for stage in range(model.num_model_stages)]
    params = [p for module in modules for p in module.parameters()]
    names = [f"{stage}/{name}" for stage, module in enumerate(modules) for name, _ in module.named_parameters()]
    two_versions = options.weight_update == "2bw"
    masters = [torch.nn.Parameter(p.detach().clone()) for p in params] if two_versions else []
    optimizer = _make_optimizer(options.optimizer, masters if two_versions else params, options.lr)
    total = options.data_parallel * num_microbatches
    losses, steps = [], []
    gradients: dict[str, Any] = {}
    for step in range(options.steps):
        for p in params:
            p.grad = None
        step_losses = []
        for g in range(total):
            x, target = model.make_microbatch(step * total + g)
            for module in modules:
                x = module(x)
            if options.inject_nan == (step, g):
                _nan_hook(x)
            loss = model.loss_fn(x, target)
            (loss / total).backward()
            step_losses.append(float(loss.detach()))
        losses.append(sum(step_losses) / total)
        norm = float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in params if p.grad is not None)))
        finite = math.isfinite(norm)
        steps.append({"step": step, "norm": norm if finite else None, "skipped": not finite})
        if step == options.steps - 1:
            gradients = {n: p.grad.detach().float().clone() for n, p in zip(names, params, strict=True)}
        if not finite:
            continue
        clip = options.clip_norm
        coefficient = min(1.0, clip / (norm + 1e-6)) if clip is not None else 1.0
        with torch.no_grad():
            for p in params:
                p.grad.mul_(coefficient)
            if two_versions:
                for p, master in zip(params, masters, strict=True):
                    master.grad = p.grad.clone()
                    p.copy_(master)
        optimizer.step()
    final = masters if two_versions else params
    parameters = {n: p.detach().float().clone() for n, p in zip(names, final, strict=True)}
    return {"losses": losses, "gradients": gradients, "parameters": parameters, "steps": steps}


# --- the report ---------------------------------------------------------------------------------------------


def _relative_errors(
    measured: dict[str, Any], reference: dict[str, Any], model_stage: list[int]
) -> tuple[float, float, str | None, list[str]]:
    """Max abs and max relative error (``max|x − ref| / max|ref|`` per tensor; NaN where both are NaN counts
    as equal), the worst key, and the reference keys missing from ``measured`` (stage ids → model stages)."""
    import torch

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
    return max_abs, max_rel, worst, sorted(set(reference) - set(mapped))


def _predicted_step_time(schedule: Schedule) -> tuple[float | None, str]:
    """``schedule.step_time``, else ``step_period``, else the makespan (ms), and which one it was."""
    for field in ("step_time", "step_period"):
        value = getattr(schedule, field, None)
        if value is not None:
            return float(value), field
    return schedule.makespan, "makespan"


def build_training_report(
    schedule: Schedule,
    ranks: list[dict[str, Any]],
    reference: dict[str, Any],
    options: TrainingOptions,
    *,
    backend: str,
    device: str,
    engine: str,
    model_name: str,
    synchronous_reference: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run report of the contract for a training run (``--steps``/``--data-parallel``).

    Verified when, on every rank of every replica, the gathered gradients of the last step and the
    parameters after K steps are within the tolerance of the reference (relative, per tensor), the loss of
    every step too, and every rank ran its schedule's compute actions in order. Communication time per rank:
    measured (the sum of its UNSHARD/RESHARD/REDUCE_GRAD records, mean over steps) beside the prediction (the
    schedule's communication actions of that rank, when it has any). ``synchronous_reference`` (for 2BW):
    the synchronous rule's reference, reported as ``max_rel_param_error_vs_synchronous`` (how far the
    delayed update takes the parameters from it).
    """
    inst = compile_problem(schedule.problem)
    tolerance = PARAM_TOLERANCE["cuda" if device.startswith("cuda") else "cpu"]
    D = options.data_parallel
    m = inst.num_microbatches
    expected_rows = []
    for rank in schedule.ranks:
        expected_rows.append([a.action for a in rank.actions if a.kind in ("F", "I", "W", "B")])
    by_replica: dict[int, list[dict[str, Any]]] = {}
    for rank in ranks:
        by_replica.setdefault(rank["dp_rank"], []).append(rank)
    max_abs_grad = max_rel_grad = max_rel_param = max_abs_param = 0.0
    worst_grad = worst_param = None
    missing: set[str] = set()
    for replica_ranks in by_replica.values():
        gradients: dict[str, Any] = {}
        parameters: dict[str, Any] = {}
        for rank in replica_ranks:
            gradients.update(rank["gradients"])
            parameters.update(rank["parameters"])
        a, r, w, miss = _relative_errors(gradients, reference["gradients"], inst.model_stage)
        if r >= max_rel_grad:
            max_rel_grad, worst_grad = r, w
        max_abs_grad = max(max_abs_grad, a)
        a, r, w, miss2 = _relative_errors(parameters, reference["parameters"], inst.model_stage)
        if r >= max_rel_param:
            max_rel_param, worst_param = r, w
        max_abs_param = max(max_abs_param, a)
        missing |= set(miss) | set(miss2)
    versus_synchronous = None
    if synchronous_reference is not None:
        for replica_ranks in by_replica.values():
            parameters = {k: v for rank in replica_ranks for k, v in rank["parameters"].items()}
            _, r, _, _ = _relative_errors(parameters, synchronous_reference["parameters"], inst.model_stage)
            versus_synchronous = r if versus_synchronous is None else min(versus_synchronous, r)
    step_losses: list[float | None] = []
    for step in range(options.steps):
        seen: dict[int, float] = {}
        for rank in ranks:
            for j, value in rank["losses"][step].items():
                seen[rank["dp_rank"] * m + int(j)] = value
        step_losses.append(sum(seen.values()) / (D * m) if len(seen) == D * m else None)
    loss = step_losses[-1]
    reference_loss = reference["losses"][-1]
    loss_errors = [
        None if got is None else abs(got - want) / max(abs(want), 1e-30)
        for got, want in zip(step_losses, reference["losses"], strict=True)
    ]
    mismatches = [
        {"rank": rank["rank"], "pp_rank": rank["pp_rank"]}
        for rank in ranks
        if rank["executed"] != expected_rows[rank["pp_rank"]]
    ]
    rolled_back = sorted(
        {info["step"] for rank in ranks for info in rank["steps"] if info.get("rolled_back") and info["norm"] is None}
        | {info["step"] for rank in ranks for info in rank["steps"] if info.get("skipped")}
    )
    verified = (
        not mismatches
        and not missing
        and max_rel_grad <= tolerance
        and max_rel_param <= tolerance
        and all(e is not None and e <= tolerance for e in loss_errors)
    )
    predicted_step, predicted_from = _predicted_step_time(schedule)
    per_step = [max(rank["step_times_ms"][k] for rank in ranks) for k in range(options.steps)]
    steady = per_step[1:] if len(per_step) > 1 else per_step
    starts = [a["start"] for rank in ranks for a in rank["actions"]]
    ends = [a["end"] for rank in ranks for a in rank["actions"]]
    report_ranks = []
    for rank in sorted(ranks, key=lambda r: r["rank"]):
        pp = rank["pp_rank"]
        comm_per_step = [sum(c["end"] - c["start"] for c in step) for step in rank["communication"]]
        predicted_comm = [
            a.end - a.start for a in schedule.ranks[pp].actions if a.kind in ("UNSHARD", "RESHARD", "REDUCE_GRAD")
        ]
        static_predicted = schedule.problem.static_memory[pp]
        report_ranks.append(
            {
                "rank": rank["rank"],
                "pp_rank": pp,
                "dp_rank": rank["dp_rank"],
                "peak_memory_bytes": rank["peak_memory_bytes"],
                "static_memory_bytes": rank["static_memory_bytes"],
                "predicted_peak_memory_bytes": schedule.peak_memory[pp] if schedule.peak_memory else None,
                "predicted_peak_activation_bytes": (
                    schedule.peak_memory[pp] - static_predicted if schedule.peak_memory else None
                ),
                "predicted_static_memory_bytes": static_predicted,
                "memory_measure": rank["memory_measure"],
                "measured_communication_ms": round(statistics.mean(comm_per_step), 6) if comm_per_step else 0.0,
                "predicted_communication_ms": round(sum(predicted_comm), 6) if predicted_comm else None,
                "communication": rank["communication"][-1],
                "step_times_ms": rank["step_times_ms"],
                "steps": rank["steps"],
                "actions": rank["actions"],
            }
        )
    return {
        "verified": bool(verified),
        "steps": options.steps,
        "max_abs_grad_error": max_abs_grad,
        "max_rel_grad_error": max_rel_grad,
        "worst_parameter": worst_grad,
        "max_abs_param_error": max_abs_param,
        "max_rel_param_error": max_rel_param,
        "max_rel_param_error_vs_synchronous": versus_synchronous,
        "worst_parameter_after_steps": worst_param,
        "missing_gradients": sorted(missing),
        "tolerance": tolerance,
        "loss": loss,
        "reference_loss": reference_loss,
        "losses": step_losses,
        "reference_losses": reference["losses"],
        "loss_rel_error": loss_errors[-1],
        "rolled_back_steps": rolled_back,
        "reference_skipped_steps": [s["step"] for s in reference["steps"] if s["skipped"]],
        "executed_order_matches": not mismatches,
        "order_mismatches": mismatches,
        "ranks": report_ranks,
        "predicted_makespan_ms": schedule.makespan,
        "measured_makespan_ms": round(max(ends) - min(starts), 6) if starts else 0.0,
        "predicted_step_time_ms": predicted_step,
        "predicted_step_time_from": predicted_from,
        "measured_step_time_ms": round(statistics.median(steady), 6),
        "measured_step_times_ms": per_step,
        "training": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(options).items()}
        | {"clip_norm": options.clip_norm},
        "data_parallel": {"size": D, "sharding": options.sharding if D > 1 else "none", "world_size": len(ranks)},
        "weight_versions": 2 if options.weight_update == "2bw" else 1,
        "method": schedule.method,
        "model": model_name,
        "engine": engine,
        "backend": backend,
        "device": device,
    }


def with_options(options: TrainingOptions, **changes: Any) -> TrainingOptions:
    """``options`` with ``changes`` (a frozen dataclass)."""
    return replace(options, **changes)


def print_training_summary(report: dict[str, Any], console: Any = None) -> None:
    """Lines a person reads after :func:`pipesched.runtime.verify.print_report` for a training run."""
    from rich.console import Console

    console = console or Console()
    dp = report["data_parallel"]
    training = report["training"]
    rule = "2bw (W(t+1) = W(t) − ν·∇f(W(t−1)))" if training["weight_update"] == "2bw" else "synchronous"
    if training["post_validation"]:
        rule = "post-validated (speculative steps, rollback)"
    console.print(
        f"{report['steps']} step(s) · {training['optimizer']} lr {training['lr']:g} · {rule} · clip "
        f"{report['training']['clip_norm']} · data-parallel {dp['size']} ({dp['sharding']}) on {dp['world_size']} "
        f"processes · max parameter error {report['max_rel_param_error']:.3g} rel",
        highlight=False,
    )
    if report.get("max_rel_param_error_vs_synchronous") is not None:
        console.print(
            f"differs from the synchronous rule by {report['max_rel_param_error_vs_synchronous']:.3g} rel",
            highlight=False,
        )
    if report["rolled_back_steps"]:
        console.print(f"rolled back (or skipped): step(s) {report['rolled_back_steps']}", highlight=False)
    console.print(
        f"step time: predicted {report['predicted_step_time_ms']:.3f} ms ({report['predicted_step_time_from']}) · "
        f"measured {report['measured_step_time_ms']:.3f} ms (median, first step excluded when K > 1)",
        highlight=False,
    )
    for rank in report["ranks"][:16]:
        predicted = rank["predicted_communication_ms"]
        console.print(
            f"rank {rank['rank']} (pp {rank['pp_rank']}, dp {rank['dp_rank']}): communication measured "
            f"{rank['measured_communication_ms']:.3f} ms/step"
            + ("" if predicted is None else f", predicted {predicted:.3f} ms")
            + f" · static {rank['static_memory_bytes']} B measured, {rank['predicted_static_memory_bytes']:.0f} B"
            " predicted",
            highlight=False,
        )
