"""Start one process per rank with torch's elastic launcher and run, verify and report schedules.

Ranks are started as ``torch.distributed.run`` (torchrun) starts them, through its API
``torch.distributed.launcher.api.elastic_launch``: ``nproc_per_node`` workers per node, a static
rendezvous at ``master_addr:master_port``, ``nnodes``/``node_rank`` passed through for multi-node runs
(start the same command on every node with its ``node_rank``). No restarts: a rank that dies ends the
run, the agent stops the others, and the reason comes back as :class:`RunFailed`. Every wait is
bounded: point-to-point receives by ``timeout_s`` (a p2p that never arrives raises with the action and
the peer), collectives by the process group's timeout.

Several schedules can run in one launch (:func:`run_schedules`), which saves the seconds each
process start costs.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipesched.optimizer.instance import compile_for_orders
from pipesched.optimizer.result import Schedule, build_schedule
from pipesched.optimizer.simulate import InvalidSchedule, simulate
from pipesched.runtime.options import TrainingError, TrainingOptions, mismatch_with_schedule
from pipesched.runtime.records import RankJob, RankResult

if TYPE_CHECKING:
    from pipesched.runtime.report import RunReport

__all__ = [
    "NodeConfig",
    "PlannedRun",
    "RunFailed",
    "ScheduleError",
    "check_run",
    "keep_freed_memory",
    "launch_jobs",
    "malloc_setting",
    "pinned_core",
    "plan_runs",
    "print_run_summary",
    "run_schedule",
    "run_schedules",
]

ENGINES = ("auto", "pipesched", "torch")
"""``torch``: PyTorch's ``_PipelineScheduleRuntime`` fed the schedule's compute-only CSV (loop and V
placement); ``pipesched``: the own executor (:mod:`pipesched.runtime.executor`, every placement); ``auto``: torch
wherever it can follow the schedule, else pipesched."""


def resolve_engine(engine: str, schedule: Schedule, *, steady: bool = False) -> str:
    """The engine that runs ``schedule``: ``auto`` becomes ``torch`` for loop and V placement (PyTorch's
    runtime knows one chain of stages, placed by its CSV) and ``pipesched`` otherwise (bidirectional
    replicas, explicit placement lists, and ``steady`` runs of a no-flush pattern: two weight versions).

    Raises:
        ScheduleError: an unknown engine, or ``torch`` asked for a placement or a steady run it cannot run.
    """
    if engine not in ENGINES:
        raise ScheduleError("engine", f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if steady and engine == "torch":
        raise ScheduleError(
            "engine",
            'engine "torch" runs flushed steps; a no-flush pattern trained with PipeDream-2BW runs in steady state '
            'on engine "pipesched" (or auto)',
        )
    placement = schedule.problem.pipeline.placement
    torch_can = placement in ("loop", "v") and not steady
    if engine == "auto":
        return "torch" if torch_can else "pipesched"
    if engine == "torch" and not torch_can:
        raise ScheduleError(
            "placement", f'engine "torch" runs placement "loop" or "v", not {placement!r}; use engine "pipesched"'
        )
    return engine


class ScheduleError(ValueError):
    """The schedule cannot be run as given (rejected by the simulator, or unsupported); ``reason`` says why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class RunFailed(RuntimeError):
    """A rank failed or a wait timed out; ``reason`` says why: ``rank_died`` (a process ended without a Python
    error), ``rank_failed`` (a Python error on a rank), ``p2p_timeout``, ``peer_lost`` (a peer's process went
    away), ``interrupted`` (the launcher got SIGTERM/SIGINT from outside), ``schedule``, …; the message names the
    rank (``"rank2: …"``). ``exit_code``: what the CLI exits with (1, or 128 + signal when interrupted)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.exit_code = 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


#: How a transport error reads on a rank whose peer process ended (gloo over TCP).
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe")


def pinned_core(local_rank: int, nproc: int, replicas: int, cores: int) -> int:
    """The core (index among ``cores``) local process ``local_rank`` of ``nproc`` is pinned to (processes numbered
    ``pp · replicas + dp``, as on the run's pp × dp mesh).

    With a core for every process, its own core. With fewer cores than processes, the replicas of one pipeline rank
    share its core (pipeline rank modulo the cores) wherever there are at least as many pipeline ranks as cores: a
    core then holds one pipeline rank's processes, which run the same passes at once and so share it evenly, and
    a pipeline rank's bubble leaves its core idle, as the simulator's one timeline per rank has it (with one
    replica: rank modulo the cores). Else (fewer pipeline ranks than cores) process modulo the cores."""
    pipeline_ranks = max(1, nproc // max(1, replicas))
    if nproc > cores and replicas > 1 and pipeline_ranks >= cores:
        return (local_rank // replicas) % cores
    return local_rank % cores


#: How the rank processes' C heap (glibc ``malloc``, which PyTorch's CPU tensors use) treats freed memory
#: (``PIPESCHED_MALLOC``): ``keep`` (default) sets ``mallopt(3)``'s ``M_MMAP_THRESHOLD`` (1 GiB: tensors below it come
#: from the heap, not from a fresh ``mmap`` each), ``M_TRIM_THRESHOLD`` (2 GiB: the heap's freed top is not handed back
#: to the kernel) and ``M_TOP_PAD`` (64 MiB: the heap grows in large steps) at the process's start, so a pass reuses
#: the pages an earlier pass freed; ``glibc`` leaves glibc's defaults (a dynamic mmap threshold that starts at
#: 128 KiB and follows the largest freed mmapped block, trimming above twice it). With the defaults a gpt-small
#: stage's forward + backward (CPU, one thread) took 1,000–4,000 minor page faults (fresh pages zeroed by the kernel),
#: a number that follows the process's allocation history, and a rank 12,000–85,000 in a 4-step run; kept, 14–6,600
#: after a launch's first run, and over 16 interleaved runs (1F1B and PipeDream-2BW) the passes' medians were 7–16 %
#: faster and their spread between runs narrower in 3 of 4 launches (bench/results/two_bw_passes.md). ``one-arena``
#: is ``keep`` with ``M_ARENA_MAX`` 1: every thread allocates from the main heap, which the settings above keep.
#: Under ``keep`` glibc gives each further thread an arena of 64 MiB heaps and unmaps a heap once its last block is
#: freed, whatever ``M_TRIM_THRESHOLD`` says; the communication stream's thread allocates a stage's reduce-scatter
#: input there (10.5 MB for gpt-small's last stage), and in a breadth-first pp 2 × dp 2 run it faulted on all 2,570
#: pages of it in 2–4 of the 6 replica-steps of steps 2–4 and seldom later (2–3 of 24), each such REDUCE_GRAD 10–30
#: ms longer beside the passes; with one arena none of 88 faulted. Not the default: issue 25's bar 3, 7 launches
#: each way alternating, met 0 of 7 with it and 3 of 7 without (R24, bench/results/issue25_bars.md, section 8).
MALLOC_SETTINGS = ("keep", "glibc", "one-arena")
#: ``mallopt`` parameters (glibc's ``malloc.h``) and the values ``keep`` sets.
_KEEP_FREED_MEMORY = {
    "M_TRIM_THRESHOLD": (-1, 2**31 - 1),
    "M_TOP_PAD": (-2, 64 << 20),
    "M_MMAP_THRESHOLD": (-3, 1 << 30),
}
#: The ``mallopt`` parameter ``one-arena`` adds to ``keep``'s (one malloc arena for every thread).
_ONE_ARENA = {"M_ARENA_MAX": (-8, 1)}


#: What the rank processes' Python garbage collector does between jobs (``PIPESCHED_GC``): ``freeze`` (default)
#: collects once and moves every object alive before each job (torch's, the launcher's: some 10⁵–10⁶ objects) to
#: the permanent generation (``gc.freeze``), so that a full collection inside the job walks only the job's own
#: objects; ``python`` leaves CPython's collector as it is. Under ``python`` a full collection took 110 ms in a
#: gpt-small rank and fell, by allocation counts, inside a pass at the same place of the same job of every launch
#: (1F1B's rank-1 step-2 I pass at 158–197 ms against 30 ms; bench/results/pass_drift.md).
GC_SETTINGS = ("freeze", "python")


def gc_setting() -> str:
    """``PIPESCHED_GC`` (:data:`GC_SETTINGS`), default ``freeze``.

    Raises:
        ScheduleError: another value (the variable and its choices named).
    """
    return _environment_choice("PIPESCHED_GC", GC_SETTINGS)


def malloc_setting() -> str:
    """``PIPESCHED_MALLOC`` (:data:`MALLOC_SETTINGS`), default ``keep``.

    Raises:
        ScheduleError: another value (the variable and its choices named).
    """
    return _environment_choice("PIPESCHED_MALLOC", MALLOC_SETTINGS)


def _environment_choice(name: str, choices: tuple[str, ...]) -> str:
    """The environment variable ``name``, lower-cased, one of ``choices`` (unset or blank: the first).

    Raises:
        ScheduleError: another value (the variable and its choices named).
    """
    value = os.environ.get(name, choices[0]).strip().lower() or choices[0]
    if value not in choices:
        raise ScheduleError(
            name, f"{name}={value!r}: use one of {', '.join(choices)} (or leave it unset: {choices[0]})"
        )
    return value


def keep_freed_memory(one_arena: bool = False) -> dict[str, bool]:
    """Set this process's heap to keep what it frees (:data:`MALLOC_SETTINGS`' ``keep``; ``one_arena``: and one
    arena for every thread, ``one-arena``): each ``mallopt`` parameter's name → whether glibc accepted it; empty
    where the C library has no ``mallopt`` (not glibc)."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return {}
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    settings = _KEEP_FREED_MEMORY | (_ONE_ARENA if one_arena else {})
    return {name: mallopt(param, value) == 1 for name, (param, value) in settings.items()}


def _pin_to_core(local_rank: int, nproc: int, replicas: int) -> None:
    """Pin this process to one core (:func:`pinned_core`), so that ranks do not trade cores mid-pass: a profile and
    a run then see the same placement (``os.sched_setaffinity``; no-op where absent)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[pinned_core(local_rank, nproc, replicas, len(cores))]})


def _worker(
    entry: Callable[[Any, int, Any, float], Any],
    jobs: list[Any],
    backend: str,
    timeout_s: float,
    error_dir: str,
    pin: bool = True,
    replicas: int = 1,
    malloc: str = "keep",
    collector: str = "freeze",
) -> list[list[Any]] | None:
    """One process (started by the elastic agent, which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*): every job
    in turn (``entry(job, global_rank, device, timeout_s)``: a run's :func:`~pipesched.runtime.training.train_rank`,
    a profile's rank); process 0 gathers every process's result of each job. One intra-op thread per process,
    pinned to a core (``pin``; ``replicas``: the data-parallel size, :func:`pinned_core`), its heap keeping what it
    frees unless ``malloc`` (``PIPESCHED_MALLOC`` as the launcher read it) says ``glibc``, with one arena for every
    thread where it says ``one-arena`` (:data:`MALLOC_SETTINGS`),
    its collector's objects frozen before each job unless ``collector`` says ``python`` (:data:`GC_SETTINGS`)."""
    import gc

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        torch.set_num_threads(1)
        if malloc in ("keep", "one-arena"):
            keep_freed_memory(one_arena=malloc == "one-arena")
        if pin and backend == "gloo":
            _pin_to_core(local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), replicas)
        if backend == "nccl":
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
            exact_float32()
        else:
            device = torch.device("cpu")
        dist.init_process_group(
            backend, timeout=timedelta(seconds=timeout_s), device_id=device if backend == "nccl" else None
        )
        results = []
        for job in jobs:
            if collector == "freeze":
                gc.collect()
                gc.freeze()
            result = entry(job, rank, device, timeout_s)
            gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
            dist.gather_object(result, gathered, dst=0)
            results.append(gathered)
        dist.barrier()
        dist.destroy_process_group()
        return results if rank == 0 else None
    except BaseException as error:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        # A rank the agent stops (SIGTERM) after another rank failed, or whose peer went away under it, is
        # collateral, not a cause.
        if isinstance(error, SignalException | KeyboardInterrupt):
            reason = "stopped"
        elif any(sign in str(error).lower() for sign in _PEER_LOST):
            reason = "peer_lost"
        else:
            reason = getattr(error, "reason", "rank_failed")
        # The root cause: PyTorch's runtime wraps a stage's error ("[Stage 2] failed to run forward").
        root: BaseException = error
        while root.__cause__ is not None:
            root = root.__cause__
        first_line = str(root).strip().splitlines()[0] if str(root).strip() else type(root).__name__
        Path(error_dir, f"rank{rank}.txt").write_text(f"{reason}\n{type(root).__name__}: {first_line}")
        if reason == "peer_lost":
            # A lost connection is collateral: the peer that went away (``rank_died``: no Python error, no file,
            # only its exit code, which the agent reports for the first failed process it sees) must be seen
            # first. The agent polls every 0.1 s: both exits within one poll would let the lower rank win.
            time.sleep(PEER_LOST_GRACE_S)
        raise


def steady_steps(schedule: Schedule, options: TrainingOptions | None) -> int:
    """Flush or no flush, decided here once: K when ``schedule.shape`` is ``"pattern"`` (no flush), the pipeline
    has no replicas and the run trains K steps with PipeDream-2BW's rule — the pattern's K steps then run as one, in
    steady state, no barrier between them (:mod:`pipesched.runtime.pipedream`) — else 0: flushed steps one after
    another, a barrier between them (a pattern without the 2BW rule, or with data parallelism, runs its first step
    unrolled, K times)."""
    if schedule.shape == "step" or schedule.status == "infeasible" or options is None:
        return 0
    if schedule.problem.data_parallel_size > 1:
        return 0  # the steady executor holds no replicas' reductions: flushed steps, each one reduced
    return options.steps if options.two_weight_versions else 0


def executable_step(schedule: Schedule, steps: int = 1) -> Schedule:
    """The order the ranks run for ``schedule``: itself (a flushed step), or, for a schedule without a flush (a
    repeating pattern whose ids run to 2m − 1), its first ``steps`` steps unrolled with their warm-up and drain
    (:func:`pipesched.optimizer.pattern.unroll`; global microbatch ``t·m + j``), re-timed as one flushed run of
    ``steps · m`` microbatches.
    """
    if schedule.shape == "step" or schedule.status == "infeasible":
        return schedule
    from pipesched.optimizer.communication import with_communication
    from pipesched.optimizer.instance import compile_problem
    from pipesched.optimizer.ir import compute_only
    from pipesched.optimizer.pattern import unroll

    problem = schedule.problem
    m = problem.pipeline.num_microbatches
    step = problem.with_changes(
        **{
            "training.flush": True,
            "training.weight_versions": 1,
            "objective": "makespan",
            "solver.method": "auto",
            "pipeline.num_microbatches": steps * m,
            "costs.optimizer_step": None,  # a pattern's updates are inside its steps, not OPTIMIZER_STEP actions
        }
    )
    # The pattern's passes; a data-parallel one's reductions and optimizer step placed again for the one step
    # (steady runs are of the pipeline alone: :func:`steady_steps`).
    orders = unroll(compute_only(schedule.orders()), m, steps)
    orders = with_communication(compile_problem(step), orders)
    return build_schedule(step, orders, method=schedule.method, backend=schedule.backend, check_memory=False)


def _validate(schedule: Schedule) -> None:
    if schedule.status == "infeasible" or not schedule.ranks:
        raise ScheduleError("no_schedule", f"the schedule holds no ranks (status {schedule.status}: {schedule.reason})")
    inst = compile_for_orders(schedule.problem, schedule.orders())
    try:
        simulate(inst, schedule.orders(), check_memory=False)
    except InvalidSchedule as error:
        raise ScheduleError(error.reason, f"the simulator rejects the schedule ({error.reason}): {error}") from None
    except ValueError as error:
        raise ScheduleError("malformed", str(error)) from None


def _failure(error_dir: Path, error: BaseException) -> RunFailed:
    """The run's root cause: a rank that died without a Python error (``rank_died``: killed, ``os._exit``,
    out of memory), else a rank's own error, before what it causes on its peers (``p2p_timeout``, then a lost
    connection: ``peer_lost``), before the ranks the agent stopped afterwards (``stopped``). A wait that timed
    out goes before a lost connection: a rank leaves after its timeout, and its peers still waiting on it lose
    their connection (which rank's timeout fires first depends on the machine's load; in a deadlock the rank
    that names the wait is the cause either way)."""
    messages = []
    for path in sorted(error_dir.glob("rank*.txt")):
        reason, _, message = path.read_text().partition("\n")
        messages.append((reason, path.stem, message))
    reported = {who for _, who, _ in messages}
    for rank, failure in sorted(getattr(error, "failures", {}).items()):
        if f"rank{rank}" in reported:
            continue
        code = failure.exitcode
        how = f"exit code {code}"
        if code < 0:
            try:
                how = f"signal {signal.Signals(-code).name}"
            except ValueError:
                how = f"signal {-code}"
        messages.append(
            (
                "rank_died",
                f"rank{rank}",
                f"the process died ({how}) without a Python error: killed, os._exit, a crash, or out of memory",
            )
        )
    if not messages:
        return RunFailed("rank_failed", f"a rank failed without a message: {str(error).strip()[:500]}")
    order = {"rank_died": 0, "p2p_timeout": 2, "peer_lost": 3, "stopped": 4}
    messages.sort(key=lambda item: order.get(item[0], 1))
    reason, who, message = messages[0]
    others = "" if len(messages) == 1 else f" ({len(messages) - 1} other rank(s) failed too)"
    return RunFailed(reason, f"{who}: {message}{others}")


def _interrupted(signum: int) -> RunFailed:
    """The launcher itself got ``signum`` (SIGTERM, SIGINT: Ctrl-C, a job scheduler's stop): every rank was
    stopped with it, none failed. ``RunFailed.exit_code`` is the shell's 128 + signal number."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    failure = RunFailed(
        "interrupted",
        f"the run was stopped from outside ({name} to the launcher); every rank was stopped with it and none failed: "
        "run it again to completion",
    )
    failure.exit_code = 128 + int(signum)
    return failure


@dataclass(frozen=True)
class PlannedRun:
    """One schedule of a launch, as it will run: the order the ranks execute (``schedule``), the schedule whose
    prediction the run is compared with (``prediction``: the pattern of a steady run), its model, engine, training
    and ``steady_steps`` (:func:`steady_steps`)."""

    schedule: Schedule
    prediction: Schedule
    model: str
    engine: str
    training: TrainingOptions | None
    steady_steps: int = 0


def _per_schedule(value: Any, count: int) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else [value] * count


def check_run(schedule: Schedule, options: TrainingOptions | None) -> None:
    """Refuse options the schedule cannot run with: another data parallelism than the one the schedule was solved
    (and its step time predicted) for, or FSDP2's known loss of weight gradients.

    Raises:
        ScheduleError: ``data_parallel`` or ``sharding`` (both values named), ``reshard_after_forward``, or the
            option out of range (:class:`~pipesched.runtime.options.TrainingError`'s option as the reason).
    """
    if options is not None:
        try:
            options.check(schedule.problem.pipeline.num_microbatches)
        except TrainingError as error:
            raise ScheduleError(error.option, str(error)) from None
    mismatch = mismatch_with_schedule(options, schedule.problem)
    if mismatch is not None:
        raise ScheduleError(mismatch[0].removeprefix("--").replace("-", "_"), mismatch[1])
    if (
        options is not None
        and options.sharding == "full"
        and options.data_parallel > 1
        and options.reshard_after_forward
        and schedule.problem.split_backward
    ):
        # Measured with torch 2.13: FSDP2's post-backward fires at I (the input gradient) and W's weight gradients
        # of every stage whose input needs a gradient are lost (both engines).
        raise ScheduleError(
            "reshard_after_forward",
            "--reshard-after-forward with split backward (I/W) loses weight gradients under FSDP2 (torch 2.13); run "
            "with --no-reshard-after-forward (torchtitan's choice under pipelining) or a schedule with fused "
            "backward (split_backward false)",
        )


def plan_runs(
    schedules: list[Schedule], *, model: Any, engine: Any, training: Any, seed: int, validate: bool
) -> list[PlannedRun]:
    """Check every schedule of a launch before any process starts; what each runs.

    Raises:
        ScheduleError: see :func:`check_run`, :func:`resolve_engine`; schedules of one launch with different rank
            counts or data parallelism; a model this machine cannot hold or build.
    """
    from pipesched.runtime.memory_check import check_run_memory
    from pipesched.runtime.models import load_model

    count = len(schedules)
    runs = []
    for schedule, name, asked, options in zip(
        schedules,
        _per_schedule(model, count),
        _per_schedule(engine, count),
        _per_schedule(training, count),
        strict=True,
    ):
        check_run(schedule, options)
        steady = steady_steps(schedule, options)
        engine_name = resolve_engine(asked, schedule, steady=steady > 0)
        step = executable_step(schedule, steady or 1)
        if validate:
            _validate(step)
        pipeline_model = load_model(name, step.problem, seed=seed)  # fail here, not in every rank
        if pipeline_model.config is not None:  # refuse a model this machine cannot hold before building it
            check_run_memory(step, pipeline_model.config, name)
        # a steady run is compared with its pattern's step_period, steps one after another with the step they run
        runs.append(PlannedRun(step, schedule if steady else step, name, engine_name, options, steady))
    if len({run.schedule.problem.pipeline.num_ranks for run in runs}) > 1:
        raise ScheduleError("num_ranks", "schedules launched together must have the same number of ranks")
    if len({run.training.data_parallel if run.training else 1 for run in runs}) > 1:
        raise ScheduleError("data_parallel", "schedules launched together must have the same --data-parallel size")
    return runs


def exact_float32() -> None:
    """float32 matrix multiplies and convolutions without TF32 on the GPU, as the ranks and their reference
    compute (the check's tolerance is float32's)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _check_gpus(backend: str, nproc: int) -> None:
    """NCCL takes one GPU per process (it refuses two ranks on one GPU: "Duplicate GPU detected")."""
    if backend != "nccl":
        return
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise ScheduleError(
            "backend", "--backend nccl needs CUDA GPUs; use gloo: run --backend gloo, profile --device cpu"
        )
    if nproc > gpus:
        raise ScheduleError(
            "backend",
            f"NCCL takes one GPU per process: {nproc} processes on this node but {gpus} GPU(s) visible; run fewer "
            "pipeline ranks × data-parallel replicas per node (one GPU: --num-ranks 1, --data-parallel 1), more "
            "nodes, or gloo on the CPU",
        )


#: How long a rank that lost its connection to a peer waits before it exits (:func:`_worker`).
PEER_LOST_GRACE_S = 1.0
#: How the launcher starts its processes (``PIPESCHED_START_METHOD``): ``forkserver`` (default), each forked from
#: one server process that imported torch and this runtime once (a 2-rank profile with its calibration run
#: 9.6 -> 3.8 s on a 2-core machine), or ``spawn``, each a fresh interpreter importing torch (about 2 s of CPU per
#: process there). The closed loop's error (measured step against the profile's prediction) showed no bias between
#: them: 13 runs each, alternating, on a 2-core machine and a quiet 16-core one (bench/results/device/h200/
#: start_methods.txt), median +1% with the fork server (-30 … +54%) and +5.5% with spawn (-16 … +37%).
START_METHODS = ("forkserver", "spawn")
_FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "pipesched.runtime.launch",
    "pipesched.runtime.training",
    "pipesched.runtime.profile",
]


def start_method() -> str:
    """The launcher's start method: ``PIPESCHED_START_METHOD`` (:data:`START_METHODS`), default ``forkserver``.

    Raises:
        ScheduleError: another value (the variable and its choices named).
    """
    method = _environment_choice("PIPESCHED_START_METHOD", START_METHODS)
    if method == "forkserver":
        import multiprocessing

        # What the server imports before its first fork (a no-op once it runs).
        multiprocessing.get_context("forkserver").set_forkserver_preload(_FORKSERVER_PRELOAD)
    return method


def launch_jobs(
    entry: Callable[[Any, int, Any, float], Any],
    jobs: list[Any],
    *,
    world: int,
    nproc_per_node: int | None = None,
    backend: str = "gloo",
    timeout_s: float = 300,
    nodes: NodeConfig | None = None,
    pin: bool = True,
    replicas: int = 1,
) -> list[list[Any]] | None:
    """Start ``world`` processes with the elastic launcher and run ``entry(job, global_rank, device, timeout_s)`` (a
    module-level function) for every job (each with a ``workdir`` every process sees); node 0 gets, per job, every
    process's result. ``pin``: each process on one core (gloo; :func:`pinned_core`, ``replicas`` the data-parallel
    size D of the processes numbered ``pp · D + dp``). Each process's heap keeps what it frees
    (``PIPESCHED_MALLOC``, :data:`MALLOC_SETTINGS`); its Python objects are frozen before each job
    (``PIPESCHED_GC``, :data:`GC_SETTINGS`).

    Raises:
        ScheduleError: the process count does not divide into the nodes; ``PIPESCHED_MALLOC``,
            ``PIPESCHED_START_METHOD`` or ``PIPESCHED_GC`` not one of its choices.
        RunFailed: a process failed or was stopped (its reason and rank named).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    nodes = nodes or NodeConfig()
    nproc = nproc_per_node if nproc_per_node is not None else max(1, world // nodes.nnodes)
    if nproc * nodes.nnodes != world:
        raise ScheduleError(
            "nproc_per_node",
            f"the schedule's ranks × data-parallel size = {world} processes but nnodes {nodes.nnodes} × "
            f"nproc_per_node {nproc} = {nproc * nodes.nnodes}: set --nproc-per-node {world // max(nodes.nnodes, 1)}",
        )
    _check_gpus(backend, nproc)
    method = start_method()
    malloc = malloc_setting()
    collector = gc_setting()
    error_dir = Path(jobs[0].workdir, "errors")
    error_dir.mkdir()
    config = LaunchConfig(
        min_nodes=nodes.nnodes,
        max_nodes=nodes.nnodes,
        nproc_per_node=nproc,
        # Every node's agent keys the rendezvous store by the run id: the same on every node of one run.
        run_id=f"pipesched-{nodes.master_addr}-{nodes.master_port}"
        if nodes.nnodes > 1
        else f"pipesched-{uuid.uuid4().hex[:8]}",
        rdzv_backend="static",
        rdzv_endpoint=f"{nodes.master_addr}:{nodes.master_port or _free_port()}",
        rdzv_configs={"rank": nodes.node_rank, "timeout": int(timeout_s)},
        max_restarts=0,
        monitor_interval=0.1,
        start_method=method,
    )
    try:
        returned = elastic_launch(config, _worker)(
            entry, jobs, backend, timeout_s, str(error_dir), pin, replicas, malloc, collector
        )
    except SignalException as error:
        raise _interrupted(error.sigval) from None
    except KeyboardInterrupt:
        raise _interrupted(signal.SIGINT) from None
    except (ChildFailedError, Exception) as error:
        raise _failure(error_dir, error) from None
    return returned.get(0) if nodes.node_rank == 0 else None


def check_launch_options(nodes: NodeConfig, timeout_s: float) -> None:
    """Refuse node and wait options no launch can use, before any process starts (``--nnodes 0`` had divided by
    zero, ``--node-rank`` past the last node waited for a rendezvous that never forms, a timeout ≤ 0 failed in
    the processes' first connection).

    Raises:
        ScheduleError: the option named, with what it takes.
    """
    if nodes.nnodes < 1:
        raise ScheduleError("nnodes", f"--nnodes must be an integer ≥ 1, got {nodes.nnodes}")
    if not 0 <= nodes.node_rank < nodes.nnodes:
        raise ScheduleError(
            "node_rank",
            f"--node-rank must be 0 … {nodes.nnodes - 1} (one per node of --nnodes {nodes.nnodes}), "
            f"got {nodes.node_rank}",
        )
    if nodes.nnodes > 1 and nodes.master_port is None:
        raise ScheduleError(
            "master_port",
            f"--nnodes {nodes.nnodes} needs --master-port (the same free port on --master-addr "
            f"{nodes.master_addr} for every node): each node would otherwise pick a port of its own",
        )
    if nodes.master_port is not None and not 1 <= nodes.master_port <= 65535:
        raise ScheduleError("master_port", f"--master-port must be a TCP port 1 … 65535, got {nodes.master_port}")
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ScheduleError("timeout", f"--timeout must be a finite number of seconds > 0, got {timeout_s}")


@dataclass(frozen=True)
class NodeConfig:
    """Where this launcher sits among the nodes of a multi-node run (torchrun's ``--nnodes``, ``--node-rank``,
    ``--master-addr``, ``--master-port``; ``None``: a free port here)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None


def _reference(
    run: PlannedRun, training: TrainingOptions | None, seed: int, references: dict[str, Any], backend: str = "gloo"
) -> tuple[Any, str]:
    """The single-process reference of ``run``'s model and problem under ``training`` (and the model's name),
    computed once per launch for equal inputs (``references``: a launch running a schedule in several rounds, or
    two families on one problem, checks them against one reference); on the first GPU for NCCL runs, in float32
    without TF32 as the ranks compute."""
    from pipesched.runtime.models import load_model
    from pipesched.runtime.verify import reference_training

    problem = run.prediction.problem  # a steady run: m per step, not the K·m of its unrolled order
    key = f"{run.model}|{seed}|{training!r}|{problem.model_dump_json()}"
    if key not in references:
        # A fresh model each time: a user model's build_stage may hand out the same (now trained) modules.
        pipeline_model = load_model(run.model, problem, seed=seed)
        device = "cpu"
        if backend == "nccl":
            exact_float32()
            device = "cuda:0"
        references[key] = (
            reference_training(pipeline_model, problem.pipeline.num_microbatches, training, device),
            pipeline_model.name,
        )
    return references[key]


def _report(
    run: PlannedRun, results: list[RankResult], *, backend: str, seed: int, references: dict[str, Any]
) -> RunReport:
    """Verify one schedule's results against the single-process reference."""
    import torch

    from pipesched.runtime.report import build_report

    reference, name = _reference(run, run.training, seed, references, backend)
    synchronous = None
    if run.training is not None and run.training.two_weight_versions:
        synchronous, _ = _reference(run, replace(run.training, weight_update="sync"), seed, references, backend)
    return build_report(
        run.schedule,
        results,
        reference,
        run.training,
        prediction=run.prediction,
        backend=backend,
        device=results[0].device if backend == "gloo" else f"cuda ({torch.cuda.get_device_name(0)})",
        engine=run.engine,
        model_name=name,
        synchronous_reference=synchronous,
    )


def run_schedules(
    schedules: list[Schedule],
    *,
    nproc_per_node: int | None = None,
    backend: str = "gloo",
    model: str | list[str] = "gpt-tiny",
    seed: int = 0,
    timeout_s: float = 300,
    engine: str | list[str] = "auto",
    validate: bool = True,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    training: TrainingOptions | list[TrainingOptions | None] | None = None,
) -> list[RunReport | None]:
    """Run several schedules (same number of ranks) one after another in one launch; one report each.

    ``training``: :class:`~pipesched.runtime.options.TrainingOptions` (or one per schedule, ``None`` for one
    verified step without an optimizer) runs K steps with an optimizer and/or data parallelism (``num_ranks × D``
    processes on a pp × dp mesh; D must be the schedule's ``data_parallel.size``, every job of one launch the same).

    ``model`` and ``engine`` may be one value or one per schedule. ``engine``: one of :data:`ENGINES`
    (default ``"auto"``: PyTorch's ``_PipelineScheduleRuntime`` for loop and V placement, the own
    executor for the others; see :func:`resolve_engine`). ``validate``: reject a schedule the simulator rejects
    before starting any process (``False`` lets the runtime meet it, for testing the timeouts).
    On a node other than ``node_rank`` 0 the reports are ``None``: node 0 verifies.
    With a torch outside :data:`pipesched.runtime.torch_compat.SUPPORTED_TORCH` it warns (``RuntimeWarning``) and runs.

    Raises:
        ScheduleError: bad input (rejected schedule, unknown engine/backend, rank count or data-parallel mismatch).
        RunFailed: a rank failed or a wait timed out; the message names the rank and the reason.
    """
    if not schedules:
        return []
    from pipesched.runtime.torch_compat import warn_if_unsupported_torch

    warn_if_unsupported_torch()
    if backend not in ("gloo", "nccl"):
        raise ScheduleError("backend", f"--backend must be gloo or nccl, got {backend!r}")
    check_launch_options(NodeConfig(nnodes, node_rank, master_addr, master_port), timeout_s)
    runs = plan_runs(schedules, model=model, engine=engine, training=training, seed=seed, validate=validate)
    options = runs[0].training
    world = runs[0].schedule.problem.pipeline.num_ranks * (options.data_parallel if options else 1)
    with tempfile.TemporaryDirectory(prefix="pipesched-run-") as workdir:
        jobs = [
            RankJob(run.schedule, run.model, seed, run.engine, workdir, index, run.training, run.steady_steps)
            for index, run in enumerate(runs)
        ]
        from pipesched.runtime.training import train_rank

        per_job = launch_jobs(
            train_rank,
            jobs,
            world=world,
            nproc_per_node=nproc_per_node,
            backend=backend,
            timeout_s=timeout_s,
            nodes=NodeConfig(nnodes, node_rank, master_addr, master_port),
            replicas=options.data_parallel if options else 1,
        )
    if per_job is None:
        return [None for _ in runs]
    references: dict[str, Any] = {}
    return [
        _report(run, results, backend=backend, seed=seed, references=references)
        for run, results in zip(runs, per_job, strict=True)
    ]


def run_schedule(
    schedule: Schedule,
    *,
    nproc_per_node: int | None = None,
    backend: str = "gloo",
    model: str = "gpt-tiny",
    seed: int = 0,
    timeout_s: float = 300,
    output: Path | None = None,
    engine: str = "auto",
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    training: TrainingOptions | None = None,
) -> RunReport | None:
    """Execute ``schedule`` on ``num_ranks`` (× D) processes with ``torch.distributed`` and verify it.

    Returns the run report of the contract (``verified``, ``max_abs_grad_error``, ``max_rel_grad_error``,
    ``loss``, ``reference_loss``, ``executed_order_matches``, ``ranks`` with per-action start/end in ms
    and ``peak_memory_bytes``, ``predicted_makespan_ms``, ``measured_makespan_ms``, ``backend``,
    ``device``) plus diagnostics; written as JSON to ``output`` when given. With ``training`` (a
    :class:`pipesched.runtime.training.TrainingOptions`): K steps, data parallelism, and the training fields
    (``steps``, ``max_rel_param_error``, ``predicted_step_time_ms``, ``measured_step_time_ms``, …).

    Raises:
        ScheduleError: the schedule, model or options cannot run (``reason`` says which).
        RunFailed: a rank failed or a receive timed out after ``timeout_s`` (``reason``, rank named).
    """
    report = run_schedules(
        [schedule],
        nproc_per_node=nproc_per_node,
        backend=backend,
        model=model,
        seed=seed,
        timeout_s=timeout_s,
        engine=engine,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        training=training,
    )[0]
    if output is not None and report is not None:
        Path(output).write_text(report.model_dump_json(indent=1))
    return report


def print_run_summary(report: RunReport) -> None:
    """Print a one-screen rich summary of a run report (see :func:`pipesched.runtime.report.print_report`)."""
    from pipesched.runtime.report import print_report

    print_report(report)
