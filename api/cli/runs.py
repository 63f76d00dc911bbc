"""``pipesched run`` and ``pipesched profile``: schedules on real ranks (torch.distributed), stages measured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import ValidationError
from rich.table import Table

from pipesched.api.cli.common import (
    check_output_folder,
    console,
    err_console,
    fail,
    require_torch,
    write_output,
)
from pipesched.api.loading import InputError
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.units import format_bytes

if TYPE_CHECKING:
    from pipesched.optimizer.problem import Problem
    from pipesched.optimizer.result import Schedule
    from pipesched.runtime.options import TrainingOptions
    from pipesched.runtime.profile import Profile
    from pipesched.runtime.report import RunReport

# The options of `pipesched run`, one alias each, so that the command reads as the list of its options.
ScheduleArgument = Annotated[Path, typer.Argument(metavar="SCHEDULE.json", help="Schedule from pipesched solve.")]
NprocOption = Annotated[int | None, typer.Option("--nproc-per-node", help="Ranks on this node.")]
BackendOption = Annotated[str, typer.Option("--backend", help="gloo (CPU) or nccl (GPU).")]
ModelOption = Annotated[
    str | None,
    typer.Option(
        "--model",
        help="gpt-tiny, gpt-small, …, problem, module:function (default: the model the problem was profiled on, "
        "costs.profiled_model, else gpt-tiny).",
    ),
]
ReportOption = Annotated[Path | None, typer.Option("-o", "--output", help="Write the run report here.")]
EngineOption = Annotated[
    str,
    typer.Option(
        "--engine",
        help="auto (torch where it can follow the schedule: loop or V placement), torch "
        "(PyTorch's _PipelineScheduleRuntime) or pipesched (own executor, every placement).",
    ),
]
SeedOption = Annotated[int, typer.Option("--seed", help="Seed of weights and batches.")]
TimeoutOption = Annotated[float, typer.Option("--timeout", help="Bound on every wait, s.")]
NnodesOption = Annotated[int, typer.Option("--nnodes", help="Nodes (multi-node runs).")]
NodeRankOption = Annotated[int, typer.Option("--node-rank", help="This node's index.")]
MasterAddrOption = Annotated[str, typer.Option("--master-addr", help="Rendezvous host.")]
MasterPortOption = Annotated[int | None, typer.Option("--master-port", help="Rendezvous port.")]
TraceOption = Annotated[
    Path | None, typer.Option("--trace", help="Write predicted and measured timelines as one Chrome trace.")
]
DataParallelOption = Annotated[
    int | None,
    typer.Option("--data-parallel", help="D replicas of the pipeline (num_ranks × D processes, pp × dp mesh)."),
]
ShardingOption = Annotated[
    str | None,
    typer.Option("--sharding", help="none (gradients all-reduced) or full (FSDP2); default: the problem's, else full."),
]
ReshardOption = Annotated[
    bool | None,
    typer.Option(
        "--reshard-after-forward/--no-reshard-after-forward",
        help="FSDP2: free gathered weights after F (default: the problem's, else no).",
    ),
]
StepsOption = Annotated[int | None, typer.Option("--steps", help="K training steps with a real optimizer.")]
OptimizerOption = Annotated[
    str | None,
    typer.Option(
        "--optimizer", help="sgd or adamw (torch.optim; default: memory.static_optimizer, the profile's, else sgd)."
    ),
]
LrOption = Annotated[float | None, typer.Option("--lr", help="Learning rate (default 0.01).")]
PostValidationOption = Annotated[
    bool | None,
    typer.Option(
        "--post-validation/--no-post-validation",
        help="Speculative optimizer steps rolled back when the global check fails (default: the problem's).",
    ),
]
WeightUpdateOption = Annotated[
    str | None,
    typer.Option("--weight-update", help="sync, or 2bw (PipeDream-2BW: W(t+1) = W(t) − ν·∇f(W(t−1)))."),
]
MaxGradNormOption = Annotated[
    float | None, typer.Option("--max-grad-norm", help="Clip by the global gradient norm (post-validation: 1.0).")
]
InjectNanOption = Annotated[str | None, typer.Option("--inject-nan", hidden=True, help="STEP:MICROBATCH (tests).")]


def prediction_note(problem: Problem, model: str) -> str:
    """Where the run summary's predictions come from when the ranks ran another model than the problem's: the
    problem's model, the model `pipesched profile` measured its costs on (``costs.profiled_model``), or costs as
    written."""
    spec = problem.model
    profiled = problem.costs.profiled_model if problem.costs is not None else None
    if spec is None and profiled is not None:
        measured = (
            f"note: predicted times and memory are {profiled}'s, as pipesched profile --model {profiled} measured"
        )
        if profiled == model:
            return f"{measured} them (costs.profiled_model); the ranks ran {model}, so they compare."
        return (
            f"{measured} them (costs.profiled_model); the ranks ran --model {model}, so they do not compare: run "
            f"--model {profiled}, or profile {model} (pipesched profile --model {model})."
        )
    source = (
        f"the problem's model ({spec.preset or f'{spec.num_layers} layers, hidden {spec.hidden_size}'}, "
        f"sequence {spec.seq_length}, micro-batch {spec.micro_batch_size})"
        if spec is not None
        else "the problem's costs and memory as written (measured on no model pipesched knows: no costs.profiled_model)"
    )
    alternative = " or with --model problem" if spec is not None else ""
    return (
        f"note: predicted times and memory are for {source}; the ranks ran --model {model}. They compare with the "
        f"measured ones only for a problem profiled from {model} (pipesched profile --model {model}){alternative}."
    )


def run(
    schedule_path: ScheduleArgument,
    nproc_per_node: NprocOption = None,
    backend: BackendOption = "gloo",
    model: ModelOption = None,
    output: ReportOption = None,
    engine: EngineOption = "auto",
    seed: SeedOption = 0,
    timeout: TimeoutOption = 300.0,
    nnodes: NnodesOption = 1,
    node_rank: NodeRankOption = 0,
    master_addr: MasterAddrOption = "127.0.0.1",
    master_port: MasterPortOption = None,
    trace: TraceOption = None,
    data_parallel: DataParallelOption = None,
    sharding: ShardingOption = None,
    reshard_after_forward: ReshardOption = None,
    steps: StepsOption = None,
    optimizer: OptimizerOption = None,
    lr: LrOption = None,
    post_validation: PostValidationOption = None,
    weight_update: WeightUpdateOption = None,
    max_grad_norm: MaxGradNormOption = None,
    inject_nan: InjectNanOption = None,
) -> None:
    """Execute a schedule with torch.distributed and verify it against a single-process reference.

    With --steps, --data-parallel, --post-validation or --weight-update (or a problem that asks for data
    parallelism, post-validation or 2BW) the ranks train K steps and the parameters are verified too.
    """
    require_torch("run")
    check_output_folder(output)
    check_output_folder(trace, "--trace")
    from pipesched.api.loading import load_schedule_file
    from pipesched.runtime.launch import RunFailed, ScheduleError, run_schedule

    try:
        schedule = load_schedule_file(schedule_path)
    except InputError as error:
        raise fail(str(error)) from None
    if model is None:  # the model the profile measured, so that the predictions compare
        costs = schedule.problem.costs
        model = (costs.profiled_model if costs is not None else None) or "gpt-tiny"
    given = {
        "data_parallel": data_parallel,
        "sharding": sharding,
        "reshard_after_forward": reshard_after_forward,
        "steps": steps,
        "optimizer": optimizer,
        "lr": lr,
        "post_validation": post_validation,
        "weight_update": weight_update,
        "max_grad_norm": max_grad_norm,
    }
    training = _training_options(schedule.problem, given, inject_nan)
    try:
        report = run_schedule(
            schedule,
            nproc_per_node=nproc_per_node,
            backend=backend,
            model=model,
            seed=seed,
            timeout_s=timeout,
            output=output,
            engine=engine,
            nnodes=nnodes,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=master_port,
            training=training,
        )
    except (ScheduleError, ValueError) as error:
        raise fail(str(error)) from None
    except RunFailed as error:
        raise fail(f"the run failed ({error.reason}): {error}", code=getattr(error, "exit_code", 1)) from None
    if report is None:
        console.print(f"node {node_rank} done; node 0 verifies and reports", highlight=False)
        return
    _print_run(report, schedule, training, output, trace, model)


def _training_options(problem: Problem, given: dict[str, Any], inject_nan: str | None) -> TrainingOptions | None:
    """The training the run does: ``None`` for one verified step, when no option and nothing in the problem asks
    for training steps, data parallelism, post-validation or 2BW. Bad values exit 2."""
    wants_training = (
        any(value is not None for value in given.values())
        or inject_nan is not None
        or (problem.data_parallel is not None and problem.data_parallel.size > 1)
        or problem.training.post_validation
        or not problem.training.flush
    )
    if not wants_training:
        return None
    from pipesched.runtime.training import TrainingError, training_options

    nan_at = None
    if inject_nan is not None:
        try:
            step_text, _, microbatch_text = inject_nan.partition(":")
            nan_at = (int(step_text), int(microbatch_text))
        except ValueError:
            raise fail(f"--inject-nan must be STEP:MICROBATCH (two integers), got {inject_nan!r}") from None
    try:
        return training_options(problem, **given, inject_nan=nan_at)
    except TrainingError as error:
        raise fail(str(error)) from None


def _print_run(
    report: RunReport,
    schedule: Schedule,
    training: TrainingOptions | None,
    output: Path | None,
    trace: Path | None,
    model: str,
) -> None:
    """The verified run's summary (and training's, and whose predictions it shows when ``model`` is not the
    problem's), the files written; exit 1 when it did not verify."""
    from pipesched.runtime.launch import print_run_summary

    print_run_summary(report)
    if model != "problem":
        console.print(prediction_note(schedule.problem, model), highlight=False, soft_wrap=True)
    if training is not None:
        from pipesched.runtime.training import print_training_summary

        print_training_summary(report, console)
    from pipesched.runtime.options import static_optimizer_note

    static_note = static_optimizer_note(schedule.problem, training)
    if static_note is not None:
        console.print(static_note, highlight=False, soft_wrap=True)
    if output is not None:
        console.print(f"wrote {output}", highlight=False)
    if trace is not None:
        from pipesched.optimizer.export import run_report_to_chrome_trace

        write_output(trace, json.dumps(run_report_to_chrome_trace(report.model_dump(), predicted=schedule)), "--trace")
        console.print(f"wrote {trace} (predicted ranks first, then measured)", highlight=False)
    if not report.verified:
        raise typer.Exit(1)


#: The profile's switches that write a measured figure into the problem (measured and printed either way).
_WriteOverlapSlowdown = Annotated[
    bool,
    typer.Option(
        "--overlap-slowdown/--no-overlap-slowdown",
        help="Write the measured slowdown of compute beside a collective (data parallelism) as "
        "costs.overlap_slowdown; measured and printed either way.",
    ),
]
_WriteCommunicationSlowdown = Annotated[
    bool,
    typer.Option(
        "--communication-slowdown/--no-communication-slowdown",
        help="Write the measured slowdown of a collective beside the passes (data parallelism) as "
        "costs.communication_slowdown, the collectives' costs then their time alone; measured and printed "
        "either way.",
    ),
]
_WriteReplicaWait = Annotated[
    bool,
    typer.Option(
        "--replica-wait/--no-replica-wait",
        help="Write each collective's measured wait for its last replica (data parallelism) as "
        "costs.unshard_wait / costs.reduce_grad_wait; measured and printed either way.",
    ),
]


def profile(
    num_ranks: Annotated[int, typer.Option("--num-ranks", help="Pipeline ranks p.")] = 4,
    num_microbatches: Annotated[int, typer.Option("--num-microbatches", help="Microbatches m.")] = 8,
    stages_per_rank: Annotated[int, typer.Option("--stages-per-rank", help="Stages per rank.")] = 1,
    placement: Annotated[str, typer.Option("--placement", help="loop, v or bidirectional.")] = "loop",
    model: Annotated[str, typer.Option("--model", help="gpt-tiny, gpt-small, …, module:function.")] = "gpt-tiny",
    repeats: Annotated[int, typer.Option("--repeats", help="Timed microbatches per stage.")] = 5,
    p2p_ms: Annotated[
        float | None, typer.Option("--p2p-ms", help="p2p latency to record, ms (default: measured and fitted).")
    ] = None,
    data_parallel: Annotated[
        int, typer.Option("--data-parallel", help="D replicas, as the run will have (num_ranks × D processes).")
    ] = 1,
    sharding: Annotated[str, typer.Option("--sharding", help="none or full (FSDP2), as the run will.")] = "none",
    optimizer: Annotated[str, typer.Option("--optimizer", help="sgd or adamw: the static memory it keeps.")] = "sgd",
    weight_update: Annotated[str, typer.Option("--weight-update", help="sync, or 2bw (PipeDream-2BW).")] = "sync",
    post_validation: Annotated[
        bool, typer.Option("--post-validation/--no-post-validation", help="Speculative steps (a rollback copy).")
    ] = False,
    memory_limit: Annotated[float | None, typer.Option("--memory-limit", help="Per-rank limit, bytes.")] = None,
    device: Annotated[str, typer.Option("--device", help="cpu or cuda.")] = "cpu",
    overlap_slowdown: _WriteOverlapSlowdown = False,
    communication_slowdown: _WriteCommunicationSlowdown = False,
    replica_wait: _WriteReplicaWait = False,
    output: Annotated[Path, typer.Option("-o", "--output", help="Write PROBLEM.json here.")] = Path("problem.json"),
) -> None:
    """Measure what a run will see (each stage's F, I, W and activation memory, p2p, collectives, the optimizer step
    and static memory) on the processes a run starts; write a PROBLEM.json for `pipesched solve`."""
    require_torch("profile")
    check_output_folder(output)
    from pipesched.api.loading import format_validation_error
    from pipesched.runtime.launch import RunFailed
    from pipesched.runtime.options import TrainingError, TrainingOptions
    from pipesched.runtime.profile import measure_model

    try:
        training = TrainingOptions(
            data_parallel=data_parallel,
            sharding=sharding,
            optimizer=optimizer,
            weight_update=weight_update,
            post_validation=post_validation,
        )
        measured = measure_model(
            num_ranks=num_ranks,
            num_microbatches=num_microbatches,
            stages_per_rank=stages_per_rank,
            placement=placement,
            model=model,
            repeats=repeats,
            p2p_ms=p2p_ms,
            memory_limit_bytes=memory_limit,
            device=device,
            training=training,
            overlap_slowdown=overlap_slowdown,
            replica_wait=replica_wait,
            communication_slowdown=communication_slowdown,
        )
    except ValidationError as error:
        raise fail(format_validation_error(error)) from None
    except (TrainingError, ValueError) as error:
        raise fail(str(error)) from None
    except RunFailed as error:
        raise fail(f"the profile failed ({error.reason}): {error}", code=1) from None
    write_output(output, measured.problem.model_dump_json(indent=1, exclude_none=True))
    _print_profile(measured, model, repeats)
    console.print(f"wrote {output}", highlight=False)


def _print_profile(measured: Profile, model: str, repeats: int) -> None:
    """Each stage's measured medians with their min–max, then a warning naming the passes that spread too much."""
    from pipesched.runtime.profile import SPREAD_WARNING

    problem = measured.problem
    assert problem.costs is not None and problem.memory is not None
    table = Table(
        title=f"{model}: measured per stage (median ms, and min–max over {repeats} runs)", header_style="bold"
    )
    for column in ("stage", "F ms", "I ms", "W ms", "activation", "retained for W"):
        table.add_column(column, justify="right", no_wrap=column.endswith("ms"))
    spread = {(x.kind, x.stage): x for x in measured.spreads}

    def timed(kind: str, stage: int, median: float) -> str:
        x = spread[(kind, stage)]
        return f"{median:.3f} ({x.low:.3g}–{x.high:.3g})"

    values = [
        problem.stage_values(v)
        for v in (
            problem.costs.forward,
            problem.costs.backward_input,
            problem.costs.backward_weight,
            problem.memory.activation,
            problem.memory.retained_for_weight,
        )
    ]
    for stage, (f, i, w, act, ret) in enumerate(zip(*values, strict=True)):
        table.add_row(
            str(stage),
            timed("F", stage, f),
            timed("I", stage, i),
            timed("W", stage, w),
            format_bytes(act),
            format_bytes(ret),
        )
    console.print(table)
    _print_transfers(measured)
    unsteady = measured.unsteady()
    if unsteady:
        worst = ", ".join(
            f"{x.kind} of stage {x.stage} (interquartile range {100 * x.relative_iqr:.0f}% of its median)"
            for x in unsteady[:3]
        )
        err_console.print(
            f"[bold yellow]warning:[/bold yellow] {len(unsteady)} pass(es) spread by more than "
            f"{100 * SPREAD_WARNING:.0f}% between runs: {worst}. The machine is busy or the passes are too short: "
            "profile on an idle machine, or raise --repeats",
            highlight=False,
            soft_wrap=True,
        )


def _print_transfers(measured: Profile) -> None:
    """The fitted p2p and collectives (latency + bytes / bandwidth), the optimizer step and static memory per rank."""
    problem = measured.problem
    assert problem.costs is not None
    fits = ([("p2p", measured.p2p)] if measured.p2p is not None else []) + sorted(measured.collectives.items())
    for name, fit in fits:
        console.print(
            f"{name}: {fit.latency_ms:.3f} ms + bytes / {format_bytes(fit.bandwidth_bytes_per_s)}/s "
            f"(fitted over {len(fit.samples)} samples)",
            highlight=False,
        )
    calibration = measured.calibration
    if calibration is not None:
        console.print(
            f"calibration run (every rank's forwards, then its backwards): best step {calibration.measured_ms:.3f} ms "
            f"per step against {calibration.predicted_ms:.3f} ms from the pieces alone: "
            f"{calibration.overhead_ms:+.3f} ms per pass, added to every pass above (the passes: the calibration "
            "run's medians; min–max: timed on their own)",
            highlight=False,
        )
        if calibration.overlap is not None:
            overlap = calibration.overlap
            console.print(
                f"compute beside communication: {overlap.passes} passes beside a collective for "
                f"{overlap.overlapped_ms:.1f} ms took {overlap.extra_ms:+.1f} ms against the same passes alone: "
                f"costs.overlap_slowdown {overlap.slowdown:.3f}",
                highlight=False,
            )
        if calibration.communication is not None:
            communication = calibration.communication
            console.print(
                f"communication beside compute: {communication.collectives} collectives beside the passes for "
                f"{communication.overlapped_ms:.1f} ms took {communication.extra_ms:+.1f} ms against the same "
                f"collectives alone: costs.communication_slowdown {communication.slowdown:.3f}",
                highlight=False,
            )
        for name, waits in calibration.replica_waits.items():
            console.print(
                f"wait for the last replica: costs.{name} " + " ".join(f"{w:.1f}" for w in waits) + " ms",
                highlight=False,
            )
    steps = problem.rank_values(problem.costs.optimizer_step, 0.0)
    console.print(
        "optimizer step "
        + ", ".join(f"rank {r}: {t:.3f} ms" for r, t in enumerate(steps))
        + " · static "
        + ", ".join(format_bytes(b) for b in problem.static_memory),
        highlight=False,
    )
