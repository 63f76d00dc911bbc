"""Measure what a run will see, and write it as a problem for ``pipesched solve`` (the closed loop on this machine).

``pipesched profile`` starts the processes a run of the same shape starts (``num_ranks × D``, one intra-op
thread each, pinned to a core, through the run's own launcher, :func:`pipesched.runtime.launch.launch_jobs`),
and each process measures its own stages, all at once, as the run will run them:

* **passes**: F, I and W of each of its stages on the stage's real input (the previous stages' output), through
  the executor's own calls: F under the saved-activation meter, I with PyTorch's ``stage_backward_input``, W with
  ``stage_backward_weight`` (on the first stage, whose input needs no gradient, I is empty and W does the whole
  backward, as in the runtime). Medians over ``repeats`` microbatches after ``warmup`` untimed ones, every process
  starting each repeat together (a barrier), so that they share the cores as the run's ranks do; a process done
  with its passes keeps its core busy until every process is done (:func:`_busy_until_every_process_is_done`).
  The problem's F, I, W come from the calibration run's passes (below; ``pass_source="calibration"``, the default:
  the medians of 8 microbatches × 15 steps × D replicas stayed put where these swung up to 2.4× with the load) or,
  with ``pass_source="timed"`` or no calibration run, from these.
* **memory** per microbatch (contract, Problem): ``activation`` = saved bytes live after F;
  ``retained_for_weight`` = saved bytes still live after I. ``static`` per rank: what the run's update rule
  allocates (:meth:`pipesched.runtime.training.WeightUpdate.static_bytes` after one real optimizer step:
  parameters, gradients, optimizer state — SGD keeps none, AdamW two moments — the rollback copy of post-validation),
  the extra weight version of PipeDream-2BW left to the optimizer's memory model (``memory.weights``); the optimizer
  it was measured for is ``memory.static_optimizer`` (a run defaults to it, and says so when it steps another).
* **point-to-point**: the executor's own transfers (:class:`pipesched.runtime.executor.PointToPoint`, a header and
  the tensor) between pipeline ranks 0 and 1, ping-pong at several sizes, fitted as latency + bytes / bandwidth
  (:class:`LinearFit`); ``costs.p2p`` of a stage is the fit at the size of the activation it passes on.
* **collectives** (D > 1): each stage's UNSHARD and REDUCE_GRAD as the run runs them (FSDP2's all-gather and
  reduce-scatter, or the all-reduce of the flattened gradients), taken from the calibration run (beside the passes
  of the same order, each from its last dp peer's start): per step the mean of the replicas, the steps a load burst
  slowed left out, the median over the steps kept (``costs.unshard``, ``costs.reduce_grad``;
  :data:`COLLECTIVE_STATISTICS`), with latency + bytes / bandwidth fitted over the stages' sizes for the record; and
  each one's wait for its last replica (the replicas of a pipeline rank enter it at different instants: per step the
  mean over the replicas of the time from its own entry to the last one's, the same steps, the median): reported
  (``Calibration.replica_waits``), and written as ``costs.unshard_wait`` / ``costs.reduce_grad_wait`` (the
  simulator then starts each collective that much later) when asked (``replica_wait=True``, ``pipesched profile
  --replica-wait``): on this machine the calibration run's waits were 2–4× the run's (docs/RUNTIME.md).
* **the optimizer step** of each rank (the global norm's partial sum, its all-reduce and the run's update rule, as a
  run's step ends): ``costs.optimizer_step``.
* **compute beside communication** (D > 1): on the calibration run, every pass that overlapped one of its process's
  collectives against the same passes (stage and kind) with none beside them, per overlapped ms
  (:func:`pipesched.runtime.calibration.fit_overlap_slowdown`): reported, and written as
  ``costs.overlap_slowdown`` (the per-pass overhead then fitted with it) when asked (``overlap_slowdown=True``,
  ``pipesched profile --overlap-slowdown``). One replica (no collectives): none.
* **communication beside compute** (D > 1): on the calibration run, every collective that overlapped its process's
  passes against the same collective alone (its time timed alone above, scaled by what the collectives with no pass
  beside them took in the calibration run over theirs), per overlapped ms
  (:func:`pipesched.runtime.calibration.fit_communication_slowdown`): reported, and written as
  ``costs.communication_slowdown``, with ``costs.unshard`` / ``costs.reduce_grad`` then each collective's time
  alone (its calibration span less the slowdown's share of the part the passes ran beside it), when asked
  (``communication_slowdown=True``, ``pipesched profile --communication-slowdown``). One replica: none.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.instance import compile_for_orders, compile_problem
from pipesched.optimizer.ir import ActionKind, parse_action
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.simulate import simulate
from pipesched.runtime import torch_compat
from pipesched.runtime.calibration import (
    CommunicationSlowdown,
    OverlapSlowdown,
    calibration_orders,
    calibration_problem,
    collective_overlaps,
    fit_communication_slowdown,
    fit_overhead,
    fit_overlap_slowdown,
    with_overhead,
)
from pipesched.runtime.data_parallel import local_tensor, reduce_stage_gradients
from pipesched.runtime.executor import PointToPoint, SavedActivationMeter
from pipesched.runtime.models import load_model
from pipesched.runtime.options import TrainingOptions
from pipesched.runtime.records import MeasuredAction, StepCheck, StepRecord, joined_steps
from pipesched.runtime.verify import squared_norm

__all__ = [
    "SPREAD_WARNING",
    "Calibration",
    "LinearFit",
    "PassSpread",
    "Profile",
    "ProfileSettings",
    "RankProfile",
    "measure_model",
    "profile_model",
    "profile_rank",
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: A pass whose interquartile range exceeds this fraction of its median is reported as unsteady.
SPREAD_WARNING = 0.25

#: Training steps of the calibration run (the first is left out: lazy initialisation). 16: the 15 steps after the
#: first are as many as a run report's medians read in the bench (3 rounds × 5 steps after the first); with 8, a
#: collective's median over 7 steps moved twice as far between profiles as the run's measurement did (docs/RUNTIME.md,
#: "A steady prediction").
CALIBRATION_STEPS = 16

#: How :func:`_calibration_collective_costs` reads the calibration run's collectives (``bench/profile_spread.py``
#: compares them): ``pooled_median``, the median of every sample (steps after the first, both replicas pooled);
#: ``step_median``, per step the mean over the replicas, steps disturbed by load left out (:func:`_steady_steps`),
#: the median over the steps kept; ``step_total``, those medians scaled, per pipeline rank, so that their sum is
#: the median over the steps kept of the rank's per-step sum (what a run report's hidden + exposed is a median of).
COLLECTIVE_STATISTICS = ("pooled_median", "step_median", "step_total")

#: A calibration step slower than this many median absolute deviations above the median step is left out.
OUTLIER_MADS = 3.0
#: Where a profile's F, I, W come from: ``timed``, each pass timed on its own (every process starting each repeat
#: together, :func:`_measure_passes`); ``calibration``, the calibration run's passes (the medians over its steps
#: kept, microbatches and replicas: :func:`_calibration_pass_medians`).
PASS_SOURCES = ("timed", "calibration")
DEFAULT_PASS_SOURCE = "calibration"

#: The statistic a profile uses unless told.
DEFAULT_COLLECTIVE_STATISTIC = "step_median"


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
class LinearFit:
    """A transfer's time as latency + bytes / bandwidth (least squares over ``(bytes, ms)`` samples; with one size
    the latency is 0). ``latency_ms`` ≥ 0; ``bytes_per_ms`` > 0 (``inf`` when time does not grow with size)."""

    latency_ms: float
    bytes_per_ms: float
    samples: tuple[tuple[float, float], ...] = ()

    @classmethod
    def fit(cls, samples: list[tuple[float, float]]) -> LinearFit:
        sizes = [b for b, _ in samples]
        times = [t for _, t in samples]
        if len(set(sizes)) < 2:
            return cls(0.0, max(sizes) / max(statistics.median(times), 1e-9), tuple(samples))
        slope, intercept = statistics.linear_regression(sizes, times)
        if slope <= 0:
            return cls(max(0.0, statistics.median(times)), float("inf"), tuple(samples))
        return cls(max(0.0, intercept), 1.0 / slope, tuple(samples))

    def ms(self, nbytes: float) -> float:
        """The fitted time of ``nbytes``, ms."""
        return self.latency_ms + nbytes / self.bytes_per_ms

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bytes_per_ms * 1e3


@dataclass(frozen=True)
class Profile:
    """What :func:`measure_model` measured: the problem (medians, plus the fitted per-pass overhead), every pass's
    samples, the fitted transfers (``p2p``; ``collectives``: ``"unshard"``/``"reduce_grad"`` over the stages'
    sizes, with D > 1) and the calibration run (:class:`Calibration`)."""

    problem: Problem
    spreads: list[PassSpread]
    p2p: LinearFit | None = None
    collectives: dict[str, LinearFit] = field(default_factory=dict)
    calibration: Calibration | None = None
    #: Per pipeline rank, the optimizer step under PipeDream-2BW's rule (ms): the problem's ``costs.optimizer_step``
    #: plus what the rule adds every step (:mod:`pipesched.runtime.pipedream`): the copy of the weights into the
    #: second version's buffer and the release of the applied version's gradients, each repeat after a sweep of the
    #: cache as the run meets them between passes (``_measure_second_version``); ``None`` where the problem's step
    #: already is 2BW's.
    two_version_optimizer_step: list[float] | None = None

    def unsteady(self, threshold: float = SPREAD_WARNING) -> list[PassSpread]:
        """Passes whose IQR is above ``threshold`` × their median (at least 0.05 ms, below which timer noise
        rules), worst first."""
        noisy = [s for s in self.spreads if s.relative_iqr > threshold and s.iqr > 0.05]
        return sorted(noisy, key=lambda s: s.relative_iqr, reverse=True)


@dataclass(frozen=True)
class ProfileSettings:
    """What every process of a profile measures: the pipeline (``skeleton``: shape, placement, data parallelism),
    the model, the repeats, the run's options (optimizer, sharding, update rule), whether to time p2p."""

    skeleton: Problem
    model: str
    seed: int
    repeats: int
    warmup: int
    options: TrainingOptions
    workdir: str
    measure_p2p: bool = True
    engine: str = "pipesched"
    calibrate: bool = True
    calibration_steps: int = CALIBRATION_STEPS


@dataclass
class RankProfile:
    """One process's measurements: per (kind, stage id) pass times (ms), per stage id saved bytes after F and after
    I, its output's bytes, its weights' bytes (unsharded), UNSHARD and REDUCE_GRAD times, optimizer-step times,
    static bytes, and (pipeline ranks 0 and 1 of replica 0) p2p ``(bytes, one-way ms)`` samples; from the calibration
    run, its step times and its communication records (``calibration_communication``, steps after the first), and
    from those (joined with its dp peers' by :func:`_assemble`) its UNSHARD / REDUCE_GRAD durations per stage id
    (``calibration_collectives``, keyed ``("unshard" | "reduce_grad", stage id)``)."""

    rank: int
    pp_rank: int
    dp_rank: int
    passes: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    activation: dict[int, list[int]] = field(default_factory=dict)
    retained: dict[int, list[int]] = field(default_factory=dict)
    boundary_bytes: dict[int, int] = field(default_factory=dict)
    weight_bytes: dict[int, int] = field(default_factory=dict)
    unshard: dict[int, list[float]] = field(default_factory=dict)
    reduce_grad: dict[int, list[float]] = field(default_factory=dict)
    optimizer_step: list[float] = field(default_factory=list)
    second_version_copy: list[float] = field(default_factory=list)
    static_bytes: int = 0
    p2p: list[tuple[float, float]] = field(default_factory=list)
    calibration_ms: list[float] = field(default_factory=list)
    calibration_communication: list[list[MeasuredAction]] = field(default_factory=list)
    calibration_collectives: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    calibration_passes: list[list[MeasuredAction]] = field(default_factory=list)
    calibration_joined: list[list[MeasuredAction]] = field(default_factory=list)


def _timed(device: torch.device, run: Any) -> tuple[Any, float]:
    """``run()``'s result and its duration in ms (the device synchronised after it)."""
    started = time.perf_counter()
    result = run()
    _sync(device)
    return result, (time.perf_counter() - started) * 1e3


def _measure_stage(
    module: torch.nn.Module, x: torch.Tensor, target: Any, loss_fn: Any, device: torch.device
) -> tuple[dict[str, float], int, int]:
    """F, I and W of one stage on one microbatch as the executor runs them: the three times (ms), and the saved
    bytes live after F and after I. Gradients accumulate into the module."""
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
    return {"F": forward_ms, "I": input_ms, "W": weight_ms}, after_forward, after_input


class _RankSetup:
    """One profiling process: its stages on the pp × dp mesh (FSDP2 with sharding full, gathered and kept gathered,
    as the run holds them between UNSHARD and RESHARD), and plain copies of every model stage to make their inputs."""

    def __init__(self, settings: ProfileSettings, global_rank: int, device: torch.device) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.settings, self.device = settings, device
        problem, options = settings.skeleton, settings.options
        self.size = options.data_parallel
        self.pp_rank, self.dp_rank = divmod(global_rank, self.size)
        inst = compile_problem(problem)
        self.model_stage = inst.model_stage
        self.stages = sorted(s for s, r in enumerate(inst.stage_ranks) if r == self.pp_rank)
        self.mesh = init_device_mesh(device.type, (problem.pipeline.num_ranks, self.size), mesh_dim_names=("pp", "dp"))
        self.model = load_model(settings.model, problem, seed=settings.seed)
        self.plain = [self.model.build_stage(k).to(device) for k in range(self.model.num_model_stages)]
        self.sharded = options.sharding == "full" and self.size > 1
        self.modules = {s: self.model.build_stage(self.model_stage[s]).to(device) for s in self.stages}
        if self.sharded:
            from torch.distributed.fsdp import fully_shard

            for stage, module in self.modules.items():
                self.modules[stage] = fully_shard(module, mesh=self.mesh["dp"], reshard_after_forward=False)
                torch_compat.fsdp_defer_reduction(self.modules[stage])
        self.result = RankProfile(global_rank, self.pp_rank, self.dp_rank)

    def inputs(self, model_stage: int, microbatch: int) -> tuple[torch.Tensor, Any]:
        """The input of ``model_stage`` for ``microbatch`` (the previous stages' output) and, on the last stage, the
        target."""
        x, target = self.model.make_microbatch(microbatch)
        x = x.to(self.device)
        with torch.no_grad():
            for module in self.plain[:model_stage]:
                x = module(x)
        return x, target if model_stage == self.model.num_model_stages - 1 else None

    def params(self) -> list[Any]:
        return [p for stage in self.stages for p in self.modules[stage].parameters()]


def _measure_passes(setup: _RankSetup) -> None:
    """Every stage's F, I, W and saved bytes, each repeat started together on every process (the stages' inputs
    made first, so that no process computes them while the others are timed)."""
    settings, result = setup.settings, setup.result
    iterations = range(settings.warmup + settings.repeats)
    inputs = {s: [setup.inputs(setup.model_stage[s], i) for i in iterations] for s in setup.stages}
    for stage in setup.stages:
        for module in torch_compat.fsdp_modules(setup.modules[stage])[:1]:
            module.unshard()
        plain = setup.plain[setup.model_stage[stage]]
        result.weight_bytes[stage] = sum(p.numel() * p.element_size() for p in plain.parameters())
        x, target = inputs[stage][0]
        with torch.no_grad():
            boundary = x if target is not None else plain(x)  # the activation the stage passes on (or receives)
        result.boundary_bytes[stage] = boundary.numel() * boundary.element_size()
    dist.barrier()
    for iteration in iterations:
        for stage in setup.stages:
            x, target = inputs[stage][iteration]
            times, after_forward, after_input = _measure_stage(
                setup.modules[stage], x, target, setup.model.loss_fn, setup.device
            )
            if iteration < settings.warmup:
                continue
            for kind, value in times.items():
                result.passes.setdefault((kind, stage), []).append(value)
            result.activation.setdefault(stage, []).append(after_forward)
            result.retained.setdefault(stage, []).append(after_input)
        _busy_until_every_process_is_done(setup.device)


#: The filler's square matrix side: one product takes about a millisecond on one core.
_FILLER_SIDE = 256


def _busy_until_every_process_is_done(device: torch.device) -> None:
    """Keep this process's core busy (matrix products) until every process has timed its passes of this repeat
    (a barrier, polled), so that every pass is timed beside a busy process wherever processes share a core.

    A run's ranks share the cores all along (``num_ranks × D`` processes pinned on fewer cores,
    :func:`pipesched.runtime.launch.pinned_core`: the replicas of one pipeline rank on its core, or with one
    replica pipeline ranks r and r + cores), so a pass of the run runs beside another process's pass; without the
    filler, the passes a process times after its core's other process finished its repeat ran alone, up to 2×
    faster than the run sees them (the last stage's W: 22 ms alone, 50 ms in the run, breadth-first pp 2 × dp 2 on
    2 cores, when one replica's pipeline ranks shared a core). On a GPU the passes do not share a core: the barrier
    alone."""
    done = dist.barrier(async_op=True)
    if device.type == "cpu":
        filler = torch.ones(_FILLER_SIDE, _FILLER_SIDE)
        while not done.is_completed():
            torch.mm(filler, filler)
    done.wait()


def _measure_collectives(setup: _RankSetup) -> None:
    """UNSHARD (sharding full) and REDUCE_GRAD of every stage as the run runs them, dp peers started together."""
    settings, result = setup.settings, setup.result
    group = setup.mesh["dp"].get_group()
    for stage in setup.stages:
        module = setup.modules[stage]
        fsdp = torch_compat.fsdp_modules(module)[:1]
        for iteration in range(settings.warmup + settings.repeats):
            for gathered in fsdp:
                gathered.reshard()
                dist.barrier(group=group)
                _, unshard_ms = _timed(setup.device, gathered.unshard)
                if iteration >= settings.warmup:
                    result.unshard.setdefault(stage, []).append(unshard_ms)
            x, target = setup.inputs(setup.model_stage[stage], iteration)
            _measure_stage(module, x, target, setup.model.loss_fn, setup.device)  # gradients to reduce
            dist.barrier(group=group)
            _, reduce_ms = _timed(
                setup.device, lambda module=module: reduce_stage_gradients(module, group, setup.size, setup.sharded)
            )
            for gathered in fsdp:
                torch_compat.fsdp_defer_reduction(gathered)
                gathered.unshard()
            if iteration >= settings.warmup:
                result.reduce_grad.setdefault(stage, []).append(reduce_ms)


def _measure_update(setup: _RankSetup) -> None:
    """The run's optimizer step and the static bytes it leaves (parameters, gradients, optimizer state, the rollback
    copy). The step as a run's step ends: this rank's share of the squared gradient norm (in the step's time on
    every rank: ``RankTrainer.step``, PipeDream-2BW's check), its all-reduce, the update rule."""
    from pipesched.runtime.training import weight_update

    settings, result = setup.settings, setup.result
    for module in setup.modules.values():  # as after the run's RESHARD: the weights' shards only
        for fsdp in torch_compat.fsdp_modules(module)[:1]:
            fsdp.reshard()
    params = setup.params()
    update = weight_update(settings.options, params)
    for iteration in range(settings.warmup + settings.repeats):
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        dist.barrier()

        def step(iteration: int = iteration) -> StepCheck:
            return update.apply(iteration, squared_norm((local_tensor(p.grad) for p in params), setup.device))

        _, step_ms = _timed(setup.device, step)
        if iteration >= settings.warmup:
            result.optimizer_step.append(step_ms)
    # PipeDream-2BW's second version of the weights is the optimizer's to add (memory.weights, weight_versions).
    second_version = 0
    if settings.options.two_weight_versions and not settings.skeleton.training.flush:
        second_version = sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in params)
    result.static_bytes = update.static_bytes() - second_version  # with the gradients, before the copy frees them
    if not settings.options.two_weight_versions:
        _measure_second_version(setup, params)


def _measure_second_version(setup: _RankSetup, params: list[Any]) -> None:
    """What PipeDream-2BW's steady rule adds to the synchronous update every step (``runtime/pipedream.py``,
    ``TwoBufferedWeights._apply``), as its run meets it: U(t+1) copied into the other version's buffer, then the
    applied version's gradients released. The run does it once a step between passes that touched other memory, so
    each repeat here starts after a sweep through twice the last-level cache (:func:`_cache_sweep`): timed back to
    back instead, the same copy of gpt-small's 17 MB stage sped up from 4.1 to 1.8 ms over 8 repeats on this machine,
    while the steady runs' copy took 4.0–4.1 ms a step (``bench/results/runtime_bench_r11_launch1.txt``, the update's
    parts); after a sweep it took 3.4 ms on its own."""
    settings, result = setup.settings, setup.result
    buffers = [local_tensor(p).detach().clone() for p in params]
    sweep = _cache_sweep(setup.device)
    for iteration in range(settings.warmup + settings.repeats):
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if sweep is not None:
            sweep.add_(1.0)
        dist.barrier()

        def copy_version() -> None:
            with torch.no_grad():
                for buffer, p in zip(buffers, params, strict=True):
                    buffer.copy_(local_tensor(p))
            for p in params:
                p.grad = None

        _, copy_ms = _timed(setup.device, copy_version)
        if iteration >= settings.warmup:
            result.second_version_copy.append(copy_ms)


#: The sweep's size when the last-level cache's is unknown, and its most (bytes).
_SWEEP_DEFAULT_BYTES = 64 << 20
_SWEEP_MOST_BYTES = 1 << 30


def _cache_sweep(device: torch.device) -> torch.Tensor | None:
    """A float32 buffer of twice the CPU's last-level cache (``/sys/devices/system/cpu/cpu0/cache/index3/size``;
    64 MiB where unknown, at most 1 GiB): adding to it in place streams the cache's lines out. ``None`` on a GPU."""
    if device.type != "cpu":
        return None
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as size:
            text = size.read().strip()
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[text[-1]] if text[-1].isalpha() else 1
        cache = int(text.rstrip("KMG")) * unit
    except (OSError, ValueError, KeyError, IndexError):
        cache = _SWEEP_DEFAULT_BYTES // 2
    return torch.zeros(min(2 * cache, _SWEEP_MOST_BYTES) // 4)


#: Sizes (float32 elements) of the p2p probes, beside the stages' own activations.
_P2P_PROBES = (256, 16_384)


def _measure_p2p(setup: _RankSetup) -> None:
    """Ping-pong between pipeline ranks 0 and 1 of replica 0 with the executor's transfers: one-way ms per size."""
    settings, result = setup.settings, setup.result
    sizes = sorted({*_P2P_PROBES, *(b // 4 for b in result.boundary_bytes.values()), 4 * max(_P2P_PROBES)})
    dist.barrier()
    if setup.dp_rank == 0 and setup.pp_rank in (0, 1):
        size = setup.size
        p2p = PointToPoint(setup.pp_rank, setup.device, 1, 600.0, lambda peer: peer * size)
        peer = 1 - setup.pp_rank
        for elements in sizes:
            payload = torch.zeros(elements, device=setup.device)
            for iteration in range(settings.warmup + settings.repeats):
                started = time.perf_counter()
                if setup.pp_rank == 0:
                    p2p.send(payload, peer, 0, 0, False)
                    p2p.recv(peer, 0, 0, True, "the p2p probe")
                else:
                    p2p.recv(peer, 0, 0, False, "the p2p probe")
                    p2p.send(payload, peer, 0, 0, True)
                p2p.drain()
                if iteration >= settings.warmup and setup.pp_rank == 0:
                    result.p2p.append((4.0 * elements, (time.perf_counter() - started) * 1e3 / 2))
    dist.barrier()


def profile_rank(settings: ProfileSettings, global_rank: int, device: torch.device, timeout_s: float) -> RankProfile:
    """One process of a profile (started by :func:`measure_model` through the run's launcher)."""
    setup = _RankSetup(settings, global_rank, device)
    _measure_passes(setup)
    if setup.size > 1:
        _measure_collectives(setup)
    _measure_update(setup)
    if settings.measure_p2p and settings.skeleton.pipeline.num_ranks > 1:
        _measure_p2p(setup)
    if settings.calibrate:
        steps = _calibration_run(settings, global_rank, device, timeout_s)
        setup.result.calibration_ms = [step.time_ms for step in steps]
        setup.result.calibration_communication = [step.communication for step in steps[1:]]
        setup.result.calibration_passes = [step.actions for step in steps[1:]]
    return setup.result


def _calibration_run(
    settings: ProfileSettings, global_rank: int, device: torch.device, timeout_s: float
) -> list[StepRecord]:
    """The run's own training steps of the calibration order on these processes
    (:mod:`pipesched.runtime.calibration`): this process's steps."""
    from dataclasses import replace

    from pipesched.optimizer.result import build_schedule
    from pipesched.runtime.launch import resolve_engine
    from pipesched.runtime.records import RankJob
    from pipesched.runtime.training import train_rank

    problem = calibration_problem(settings.skeleton, _data_parallel_section(settings.options))
    schedule = build_schedule(
        problem, calibration_orders(problem), method="calibration", backend="profile", check_memory=False
    )
    options = replace(settings.options, steps=settings.calibration_steps, inject_nan=None)
    engine = resolve_engine(settings.engine, schedule)
    job = RankJob(schedule, settings.model, settings.seed, engine, settings.workdir, 1, options)
    return train_rank(job, global_rank, device, timeout_s).steps


def _join_calibration(results: list[RankProfile]) -> None:
    """Every process's ``calibration_collectives`` from its calibration run's communication, each collective timed
    from the instant its last dp peer entered it (:func:`~pipesched.runtime.records.joined_communication`): the span
    the simulator's ``costs.unshard`` / ``costs.reduce_grad`` stand for and the run report measures. The wait for a
    slower replica before it becomes ``costs.unshard_wait`` / ``costs.reduce_grad_wait``
    (:func:`_calibration_collective_waits`)."""
    for pp_rank in {r.pp_rank for r in results}:
        group = sorted((r for r in results if r.pp_rank == pp_rank), key=lambda r: r.dp_rank)
        joined = joined_steps([r.calibration_communication for r in group])
        for result, steps in zip(group, joined, strict=True):
            result.calibration_collectives = _collective_durations(steps)
            result.calibration_joined = steps


def _collective_durations(steps: list[list[MeasuredAction]]) -> dict[tuple[str, int], list[float]]:
    """Per ``("unshard" | "reduce_grad", stage id)``, how long each such action of ``steps`` (per step, the rank's
    communication records) ran (ms): beside the passes, on the cores the run shares, as the run will see it."""
    durations: dict[tuple[str, int], list[float]] = {}
    for step in steps:
        for measured in step:
            action = parse_action(measured.action)
            name = {ActionKind.UNSHARD: "unshard", ActionKind.REDUCE_GRAD: "reduce_grad"}.get(action.kind)
            if name is not None:
                durations.setdefault((name, action.stage), []).append(measured.end - measured.start)
    return durations


def _data_parallel_section(options: TrainingOptions) -> dict[str, Any] | None:
    """The problem's ``data_parallel`` for the run's options (``None`` with one replica)."""
    if options.data_parallel == 1:
        return None
    return {
        "size": options.data_parallel,
        "sharding": options.sharding,
        "reshard_after_forward": options.reshard_after_forward,
    }


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
    p2p_ms: float | None = None,
    memory_limit_bytes: float | None = None,
    device: str = "cpu",
    training: TrainingOptions | None = None,
    timeout_s: float = 600,
    like: Problem | None = None,
    engine: str = "pipesched",
    calibrate: bool = True,
    overlap_slowdown: bool = False,
    replica_wait: bool = False,
    calibration_steps: int = CALIBRATION_STEPS,
    collective_statistic: str = DEFAULT_COLLECTIVE_STATISTIC,
    pass_source: str = DEFAULT_PASS_SOURCE,
    communication_slowdown: bool = False,
) -> Profile:
    """Measure ``model`` split into ``num_ranks · stages_per_rank`` stages on the processes a run starts; return
    the problem to solve (module docstring).

    ``training``: the run's options (optimizer, ``data_parallel`` D and sharding, update rule; default SGD, D = 1):
    the profile measures what that run allocates and communicates, and the problem gets its ``data_parallel``
    section. ``like``: take the pipeline's shape and the ``model`` section (for ``model="problem"``) from this
    problem (``num_ranks``, ``num_microbatches``, ``stages_per_rank``, ``placement`` are then ignored).
    ``p2p_ms``: record this p2p latency instead of the fitted one. ``calibrate``: end with the calibration run on
    ``engine`` (the engine the runs will use) and add its per-pass overhead to the problem's passes. ``device``:
    ``cpu`` (gloo) or ``cuda`` (NCCL, one GPU per process). Returns a :class:`Profile`: its ``problem``
    (``split_backward`` true, ``memory.limit`` = ``memory_limit_bytes``), every pass's samples, the fitted
    transfers and the calibration. ``overlap_slowdown``: also write the slowdown of compute beside a collective
    that the calibration run measured (D > 1) as ``costs.overlap_slowdown``; measured and reported in
    ``calibration.overlap`` either way. Off by default: on this project's 2-core machine it moved the prediction of
    each collective's hidden time toward the run's but missed the per-rank totals more often (docs/RUNTIME.md).
    ``communication_slowdown``: also write the slowdown of a collective beside the passes that the calibration run
    measured (D > 1) as ``costs.communication_slowdown``, the collectives' costs then their time alone; measured and
    reported in ``calibration.communication`` either way.
    ``replica_wait``: also write each collective's wait for its last replica that the calibration run measured
    (D > 1) as ``costs.unshard_wait`` / ``costs.reduce_grad_wait``; reported in ``calibration.replica_waits`` either
    way. Off by default: here the calibration run's waits were 2–4× the run's (docs/RUNTIME.md).
    ``calibration_steps``: the calibration run's training steps (the first left out; :data:`CALIBRATION_STEPS`).
    ``collective_statistic``: how its collectives become ``costs.unshard`` / ``costs.reduce_grad``
    (:data:`COLLECTIVE_STATISTICS`; default ``step_median``). ``pass_source``: where F, I, W come from
    (:data:`PASS_SOURCES`; default ``calibration``, the calibration run's passes; without a calibration run, timed).

    With a torch outside :data:`pipesched.runtime.torch_compat.SUPPORTED_TORCH` it warns (``RuntimeWarning``) and
    measures anyway.

    Raises:
        ValueError: unknown model, a model that cannot be split into that many stages, options out of range
            (``calibration_steps`` below 2, an unknown ``collective_statistic``, a ``device`` other than cpu or
            cuda, ``repeats`` below 1).
        pipesched.runtime.launch.RunFailed: a profiling process failed (its rank and reason named).
    """
    import tempfile

    from pipesched.runtime.launch import launch_jobs

    torch_compat.warn_if_unsupported_torch()
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"--device must be cpu (gloo) or cuda (NCCL, one GPU per process), got {device!r}")
    if repeats < 1:
        raise ValueError(f"--repeats must be an integer ≥ 1 (timed microbatches per stage), got {repeats}")
    if calibrate and calibration_steps < 2:
        raise ValueError(f"calibration_steps {calibration_steps}: give at least 2 (the first step is left out)")
    _check_statistic(collective_statistic)
    if pass_source not in PASS_SOURCES:
        raise ValueError(f"pass_source {pass_source!r}: use one of {', '.join(PASS_SOURCES)}")
    options = training or TrainingOptions(sharding="none")
    options.check(num_microbatches)
    if like is not None:
        shape = like.pipeline
        num_ranks, num_microbatches = shape.num_ranks, shape.num_microbatches
        stages_per_rank, placement = shape.stages_per_rank, shape.placement  # type: ignore[assignment]
    skeleton = _skeleton(num_ranks, num_microbatches, stages_per_rank, placement, options, like)
    load_model(model, skeleton, seed=seed)  # fail here, not in every process
    with tempfile.TemporaryDirectory(prefix="pipesched-profile-") as workdir:
        settings = ProfileSettings(
            skeleton,
            model,
            seed,
            repeats,
            warmup,
            options,
            workdir,
            p2p_ms is None,
            engine,
            calibrate,
            calibration_steps,
        )
        returned = launch_jobs(
            profile_rank,
            [settings],
            world=num_ranks * options.data_parallel,
            backend="nccl" if device.startswith("cuda") else "gloo",
            timeout_s=timeout_s,
            replicas=options.data_parallel,
        )
    assert returned is not None
    profile = _assemble(
        skeleton,
        returned[0],
        options,
        p2p_ms,
        memory_limit_bytes,
        overlap_slowdown,
        collective_statistic,
        pass_source if calibrate else "timed",
        replica_wait,
        communication_slowdown,
    )
    # whose passes these are, for a run of another model to say so (costs.profiled_model)
    return replace(profile, problem=profile.problem.with_changes(**{"costs.profiled_model": model}))


def _skeleton(
    num_ranks: int,
    num_microbatches: int,
    stages_per_rank: int,
    placement: Any,
    options: TrainingOptions,
    like: Problem | None = None,
) -> Problem:
    data: dict[str, Any] = {
        "pipeline": {
            "num_ranks": num_ranks,
            "num_microbatches": num_microbatches,
            "stages_per_rank": stages_per_rank,
            "placement": placement,
        },
        "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1, **_replica_sync(placement)},
        "memory": {"activation": 0},
    }
    if like is not None and like.model is not None:
        data["model"] = like.model.model_dump(mode="json", exclude_none=True)
    if options.two_weight_versions:
        data["training"] = {"flush": False, "weight_versions": 2}
    elif options.post_validation:
        data["training"] = {"post_validation": True}
    return load_problem(data)


def _replica_sync(placement: str) -> dict[str, float]:
    """``costs.reduce_grad`` a bidirectional problem needs before it is measured (its replicas' all-reduce): 0 in
    the skeleton; :func:`_assemble` replaces it with the fitted p2p cost of the stage's gradient bytes."""
    return {"reduce_grad": 0.0} if placement == "bidirectional" else {}


class _Measured:
    """Every process's measurements, per model stage (stage ids of one model stage and dp replicas pooled)."""

    def __init__(self, skeleton: Problem, results: list[RankProfile]) -> None:
        inst = compile_problem(skeleton)
        self.results = results
        self.num_ranks = skeleton.pipeline.num_ranks
        self.ids = [
            [s for s, ms in enumerate(inst.model_stage) if ms == k] for k in range(skeleton.pipeline.num_stages)
        ]

    def pooled(self, samples_of: Any) -> list[list[float]]:
        """Per model stage, the samples ``samples_of(rank_profile)`` (a stage id → list mapping) holds for its ids."""
        return [[v for r in self.results for s in ids for v in samples_of(r).get(s, [])] for ids in self.ids]

    def first(self, values_of: Any) -> list[float]:
        """Per model stage, the value ``values_of(rank_profile)`` (a stage id → value mapping) gives its first id."""
        merged = {s: v for r in self.results for s, v in values_of(r).items()}
        return [float(merged[ids[0]]) for ids in self.ids]

    def per_rank(self, values_of: Any) -> list[list[float]]:
        """Per pipeline rank, the values of every dp replica's process."""
        return [[v for r in self.results if r.pp_rank == rank for v in values_of(r)] for rank in range(self.num_ranks)]

    def spreads(self) -> list[PassSpread]:
        return [
            PassSpread(kind, k, tuple(samples))
            for kind in ("F", "I", "W")
            for k, samples in enumerate(self.pooled(lambda r, kind=kind: _of_kind(r.passes, kind)))
        ]


def _of_kind(passes: dict[tuple[str, int], list[float]], kind: str) -> dict[int, list[float]]:
    return {stage: values for (of, stage), values in passes.items() if of == kind}


def _assemble(
    skeleton: Problem,
    results: list[RankProfile],
    options: TrainingOptions,
    p2p_ms: float | None,
    limit: float | None,
    write_overlap_slowdown: bool = False,
    collective_statistic: str = DEFAULT_COLLECTIVE_STATISTIC,
    pass_source: str = DEFAULT_PASS_SOURCE,
    write_replica_wait: bool = False,
    write_communication_slowdown: bool = False,
) -> Profile:
    """The problem from every process's measurements (module docstring); ``collective_statistic``: how the
    calibration run's collectives become ``costs.unshard`` / ``costs.reduce_grad`` (:data:`COLLECTIVE_STATISTICS`);
    ``pass_source``: where F, I, W come from (:data:`PASS_SOURCES`); ``write_replica_wait``: write the collectives'
    waits for the last replica (``costs.unshard_wait`` / ``costs.reduce_grad_wait``; measured either way)."""
    _join_calibration(results)
    measured = _Measured(skeleton, results)
    spreads = measured.spreads()
    medians = {(x.kind, x.stage): round(x.median, 6) for x in spreads}
    if pass_source == "calibration":
        medians |= _calibration_pass_medians(measured)
    stages = range(skeleton.pipeline.num_stages)
    samples = [sample for r in results for sample in r.p2p]
    p2p_fit = LinearFit.fit(samples) if samples else None
    boundary = measured.first(lambda r: r.boundary_bytes)
    activation = [float(max(a)) for a in measured.pooled(lambda r: r.activation)]
    retained = [float(max(r)) for r in measured.pooled(lambda r: r.retained)]
    data = skeleton.model_dump(mode="json")
    data["costs"] = {
        "forward": [medians["F", k] for k in stages],
        "backward_input": [medians["I", k] for k in stages],
        "backward_weight": [medians["W", k] for k in stages],
        # One pipeline rank passes nothing between processes: no p2p samples, no p2p cost.
        "p2p": p2p_ms if p2p_ms is not None else [round(p2p_fit.ms(b), 6) for b in boundary] if p2p_fit else 0.0,
        "optimizer_step": [round(statistics.median(t), 6) for t in measured.per_rank(lambda r: r.optimizer_step)],
    }
    weights = measured.first(lambda r: r.weight_bytes)
    data["memory"] = {
        "activation": activation,
        "retained_for_weight": [min(r, a) for r, a in zip(retained, activation, strict=True)],
        "limit": limit,
        "static": [float(max(s)) for s in measured.per_rank(lambda r: [r.static_bytes])],
        "static_optimizer": options.optimizer,  # whose state static holds: a run of another optimizer is told
        "weights": weights,
    }
    communication = _communication_slowdown(measured, collective_statistic) if options.data_parallel > 1 else None
    written = communication if communication is not None and write_communication_slowdown else None
    if written is not None:
        data["costs"]["communication_slowdown"] = written.slowdown
    ratio = written.ratio if written is not None else 0.0
    collectives = _collectives(data, measured, weights, options, collective_statistic, ratio)
    if skeleton.pipeline.placement == "bidirectional" and "reduce_grad" not in data["costs"]:
        # BitPipe's replicas (Wu et al. 2024, Sec. 3.3): an all-reduce of two ranks, each sending its gradient.
        data["costs"]["reduce_grad"] = [round(p2p_fit.ms(w), 6) for w in weights] if p2p_fit else 0.0
    overlap = _overlap_slowdown(results) if options.data_parallel > 1 else None
    if overlap is not None and write_overlap_slowdown:
        data["costs"]["overlap_slowdown"] = overlap.slowdown
    waits = _calibration_collective_waits(measured) if options.data_parallel > 1 else {}
    if write_replica_wait:
        data["costs"] |= waits
    problem = load_problem(data)
    calibration = _calibrate(problem, results, overlap, waits, communication)
    if calibration is not None:
        problem = with_overhead(problem, calibration.overhead_ms)
    copies = measured.per_rank(lambda r: r.second_version_copy)
    two_versions = (
        [round(step + statistics.median(c), 6) for step, c in zip(data["costs"]["optimizer_step"], copies, strict=True)]
        if all(copies)
        else None
    )
    return Profile(problem, spreads, p2p_fit, collectives, calibration, two_versions)


@dataclass(frozen=True)
class Calibration:
    """The calibration run (:mod:`pipesched.runtime.calibration`): its measured step (ms: the best step after the
    first, each step timed on its slowest process — what a run's measured step is compared on; on a shared machine
    the load only ever adds time, so the best step is the one nearest the undisturbed cost), the simulator's step
    of the same order from the measured pieces alone, and the overhead per pass fitted between them (added to
    every pass of the profile's problem)."""

    measured_ms: float
    predicted_ms: float
    overhead_ms: float
    overlap: OverlapSlowdown | None = None
    #: ``"unshard_wait"`` / ``"reduce_grad_wait"`` → per model stage, the collectives' wait for their last replica
    #: on this run, ms (:func:`_calibration_collective_waits`; D > 1), whether the problem carries them or not.
    replica_waits: dict[str, list[float]] = field(default_factory=dict)
    #: The collectives' slowdown beside the passes (D > 1), whether the problem carries it or not.
    communication: CommunicationSlowdown | None = None


def _overlap_slowdown(results: list[RankProfile]) -> OverlapSlowdown | None:
    """The calibration run's passes beside collectives against the same passes alone (every process, steps after
    the first; :func:`~pipesched.runtime.calibration.fit_overlap_slowdown`)."""
    steps = [
        (passes, joined)
        for r in results
        for passes, joined in zip(r.calibration_passes, r.calibration_joined, strict=False)
    ]
    return fit_overlap_slowdown(steps) if steps else None


def _calibrate(
    problem: Problem,
    results: list[RankProfile],
    overlap: OverlapSlowdown | None,
    waits: dict[str, list[float]],
    communication: CommunicationSlowdown | None = None,
) -> Calibration | None:
    if not all(r.calibration_ms for r in results):
        return None
    steps = [max(r.calibration_ms[k] for r in results) for k in range(len(results[0].calibration_ms))]
    measured = min(steps[1:] if len(steps) > 1 else steps)
    orders = calibration_orders(problem)
    predicted = simulate(compile_for_orders(problem, orders), orders, check_memory=False).step_time
    overhead = fit_overhead(problem, orders, measured)
    return Calibration(round(measured, 6), round(predicted, 6), overhead, overlap, waits, communication)


def _collectives(
    data: dict[str, Any],
    measured: _Measured,
    weights: list[float],
    options: TrainingOptions,
    statistic: str,
    ratio: float = 0.0,
) -> dict[str, LinearFit]:
    """With D > 1: the problem's ``data_parallel`` and per-stage ``unshard``/``reduce_grad`` (from the calibration
    run by ``statistic``, each span less ``ratio`` × the time the passes ran beside it; else the medians of the
    collectives timed alone), and each collective fitted over the stages' sizes (their unsharded weight bytes)."""
    if options.data_parallel == 1:
        return {}
    data["data_parallel"] = _data_parallel_section(options)
    calibrated = _calibration_collective_costs(measured, statistic, ratio)
    fits = {}
    for name in ("unshard", "reduce_grad"):
        # as the calibration run saw them (beside the passes, sharing the cores) where it ran them, else alone
        costs = calibrated.get(name)
        if costs is None:
            per_stage = measured.pooled(lambda r, name=name: getattr(r, name))
            if not all(per_stage):
                continue
            costs = [statistics.median(samples) for samples in per_stage]
        data["costs"][name] = [round(m, 6) for m in costs]
        fits[name] = LinearFit.fit(list(zip(weights, costs, strict=True)))
    return fits


def _check_statistic(statistic: str) -> None:
    if statistic not in COLLECTIVE_STATISTICS:
        raise ValueError(f"collective_statistic {statistic!r}: use one of {', '.join(COLLECTIVE_STATISTICS)}")


def _steady_steps(step_ms: list[float]) -> list[int]:
    """The indices of the steps kept: those no slower than the median + :data:`OUTLIER_MADS` × the median absolute
    deviation (scaled to a normal's σ, 1.4826; Leys et al. 2013). On a shared machine load only adds time: a step
    that far above the others ran beside another process's burst, not what the run's median step sees."""
    middle = statistics.median(step_ms)
    spread = 1.4826 * statistics.median(abs(t - middle) for t in step_ms)
    if spread == 0:  # half the steps or more alike: none stands out
        return list(range(len(step_ms)))
    return [k for k, t in enumerate(step_ms) if t <= middle + OUTLIER_MADS * spread]


def _calibration_collective_costs(measured: _Measured, statistic: str, ratio: float = 0.0) -> dict[str, list[float]]:
    """Per ``"unshard"`` / ``"reduce_grad"``, each model stage's cost (ms) from the calibration run by ``statistic``
    (:data:`COLLECTIVE_STATISTICS`), each collective's span less ``ratio`` × the time its process's passes ran
    beside it (0: as the run saw it; the communication slowdown's r: its time alone); empty without a calibration
    run's collectives."""
    _check_statistic(statistic)
    table, holder = _calibration_table(
        measured, lambda r: _collective_steps(r.calibration_joined, r.calibration_passes, ratio)
    )
    keys = sorted(holder)
    if not table or not keys or any(len(keys) != len(row) for row in table):
        return {}
    if statistic == "pooled_median":
        costs = {key: statistics.median(v for row in table for v in row[key]) for key in keys}
    else:
        kept = _steady_replica_means(measured, table, keys)
        costs = {key: statistics.median(row[key] for row in kept) for key in keys}
        if statistic == "step_total":
            for rank in set(holder.values()):
                mine = [key for key in keys if holder[key] == rank]
                total = statistics.median(sum(row[key] for key in mine) for row in kept)
                scale = total / max(sum(costs[key] for key in mine), 1e-9)
                costs |= {key: costs[key] * scale for key in mine}
    return {
        name: [costs[name, k] for k in range(len(measured.ids))]
        for name in ("unshard", "reduce_grad")
        if all((name, k) in costs for k in range(len(measured.ids)))
    }


def _calibration_table(
    measured: _Measured, steps_of: Any
) -> tuple[list[dict[tuple[str, int], list[float]]], dict[tuple[str, int], int]]:
    """Per calibration step (after the first), per ``(name, model stage)``: the values on every process that holds
    it (``steps_of(rank_profile)``: per step, ``(name, stage id)`` → value), and the pipeline rank holding each."""
    results = measured.results
    stage_of = {s: k for k, ids in enumerate(measured.ids) for s in ids}
    steps = min((len(r.calibration_joined) for r in results), default=0)
    table: list[dict[tuple[str, int], list[float]]] = [{} for _ in range(steps)]
    holder: dict[tuple[str, int], int] = {}
    for r in results:
        for k, values in enumerate(steps_of(r)[:steps]):
            for (name, stage), value in values.items():
                table[k].setdefault((name, stage_of[stage]), []).append(value)
                holder[name, stage_of[stage]] = r.pp_rank
    return table, holder


def _steady_replica_means(
    measured: _Measured, table: list[dict[tuple[str, int], list[float]]], keys: list[tuple[str, int]]
) -> list[dict[tuple[str, int], float]]:
    """Per step :func:`_steady_steps` keeps, per key the mean over the processes (the replicas) that hold it."""
    step_ms = [max(r.calibration_ms[k + 1] for r in measured.results) for k in range(len(table))]
    return [{key: statistics.mean(table[k][key]) for key in keys} for k in _steady_steps(step_ms)]


def _calibration_collective_waits(measured: _Measured) -> dict[str, list[float]]:
    """Per ``"unshard_wait"`` / ``"reduce_grad_wait"``, each model stage's wait for its last data-parallel replica
    (ms): per step the mean over the replicas of each one's wait (the collective from its own entry minus from its
    last peer's), the median over the steps :func:`_steady_steps` keeps, as ``costs.unshard`` / ``reduce_grad``
    (``step_median``); empty without a calibration run's collectives."""

    def waits(r: RankProfile) -> list[dict[tuple[str, int], float]]:
        own = _collective_steps(r.calibration_communication)
        joined = _collective_steps(r.calibration_joined)
        return [
            {key: max(0.0, mine[key] - value) for key, value in last.items()}
            for mine, last in zip(own, joined, strict=True)
        ]

    table, holder = _calibration_table(measured, waits)
    keys = sorted(holder)
    if not table or not keys or any(len(keys) != len(row) for row in table):
        return {}
    kept = _steady_replica_means(measured, table, keys)
    medians = {key: statistics.median(row[key] for row in kept) for key in keys}
    return {
        f"{name}_wait": [round(medians[name, k], 6) for k in range(len(measured.ids))]
        for name in ("unshard", "reduce_grad")
        if all((name, k) in medians for k in range(len(measured.ids)))
    }


def _collective_steps(
    steps: list[list[MeasuredAction]], passes: list[list[MeasuredAction]] | None = None, ratio: float = 0.0
) -> list[dict[tuple[str, int], float]]:
    """Per step, per ``("unshard" | "reduce_grad", stage id)``, the summed duration of such actions (ms); with
    ``ratio`` > 0, each less ``ratio`` × the time the step's ``passes`` ran beside it (its time alone)."""
    if ratio == 0 or passes is None:
        return [{key: sum(values) for key, values in _collective_durations([step]).items()} for step in steps]
    found = []
    for step, step_passes in zip(steps, passes, strict=False):
        work: dict[tuple[str, int], float] = {}
        for measured, span, overlap in collective_overlaps(step_passes, step):
            action = parse_action(measured.action)
            key = ("unshard" if action.kind == ActionKind.UNSHARD else "reduce_grad", action.stage)
            work[key] = work.get(key, 0.0) + span - ratio * overlap
        found.append(work)
    return found


def _communication_slowdown(measured: _Measured, statistic: str) -> CommunicationSlowdown | None:
    """The calibration run's collectives beside the passes against the same collectives alone (every process, steps
    after the first; :func:`~pipesched.runtime.calibration.fit_communication_slowdown`), with each stage's costs as
    the run saw them and alone (``seen`` / ``work``, read by ``statistic``)."""
    results = measured.results
    steps = [
        (passes, joined)
        for r in results
        for passes, joined in zip(r.calibration_passes, r.calibration_joined, strict=False)
    ]
    alone = {
        (kind, stage): statistics.median(samples)
        for r in results
        for kind, timed in (("UNSHARD", r.unshard), ("REDUCE_GRAD", r.reduce_grad))
        for stage, samples in timed.items()
        if samples
    }
    found = fit_communication_slowdown(steps, alone) if steps else None
    if found is None:
        return None
    return dataclasses.replace(
        found,
        seen=_calibration_collective_costs(measured, statistic),
        work=_calibration_collective_costs(measured, statistic, found.ratio),
    )


def _calibration_pass_medians(measured: _Measured) -> dict[tuple[str, int], float]:
    """Per (``"F"`` | ``"I"`` | ``"W"``, model stage), the median wall time (ms, from the pass's input at hand to its
    end) of the calibration run's passes over the steps :func:`_steady_steps` keeps, every microbatch and replica;
    empty without a calibration run."""
    results = measured.results
    steps = min((len(r.calibration_passes) for r in results), default=0)
    if not steps:
        return {}
    step_ms = [max(r.calibration_ms[k + 1] for r in results) for k in range(steps)]
    stage_of = {s: k for k, ids in enumerate(measured.ids) for s in ids}
    walls: dict[tuple[str, int], list[float]] = {}
    for r in results:
        for k in _steady_steps(step_ms):
            for action in r.calibration_passes[k]:
                parsed = parse_action(action.action)
                if parsed.kind.value in ("F", "I", "W"):
                    walls.setdefault((parsed.kind.value, stage_of[parsed.stage]), []).append(action.end - action.start)
    return {key: round(statistics.median(values), 6) for key, values in walls.items()}
