"""The ``pipesched`` command line (typer + rich).

Bad input exits with code 2 and a message naming the field and the fix.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from pipesched.api.launch.command import launch_command
from pipesched.api.loading import InputError, load_problem
from pipesched.api.plan_cli import plan_command
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.result import Schedule
from pipesched.optimizer.units import common_unit, decimals_against_limit, format_bytes

app = typer.Typer(
    name="pipesched",
    help="Pipeline-parallel training schedule optimizer: the best schedule your memory allows.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)

FORMATS = ("json", "csv", "chrome-trace")


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``message`` to stderr and return the Exit to raise."""
    err_console.print(f"[bold red]error:[/bold red] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def check_method(method: str) -> None:
    """Exit 2 blaming ``--method`` when it names no method, suggesting the closest names (difflib)."""
    import difflib

    from pipesched.optimizer.problem import METHOD_NAMES

    if method in METHOD_NAMES:
        return
    close = difflib.get_close_matches(method, METHOD_NAMES, n=3, cutoff=0.5)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    raise fail(f"--method {method!r} is not a method: {hint}choose one of {', '.join(METHOD_NAMES)}")


def require_torch(command: str) -> None:
    """Exit 2 with the install step when torch (the ``runtime`` extra) is missing."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise fail(
            f"`pipesched {command}` needs torch, which this installation lacks: "
            "pip install 'pipesched[runtime]' (or pip install torch==2.13.0)"
        )


def render_schedule(schedule: Schedule, *, output_format: str) -> str:
    """The schedule in ``json``, ``csv`` (PyTorch compute-only) or ``chrome-trace``."""
    if output_format == "json":
        return schedule.model_dump_json(indent=1)
    if output_format == "csv":
        from pipesched.optimizer.export import orders_to_torch_csv

        return orders_to_torch_csv(schedule.orders())
    from pipesched.optimizer.export import schedule_to_chrome_trace

    return json.dumps(schedule_to_chrome_trace(schedule))


def print_derived_problem(problem: Problem, out: Console | None = None) -> None:
    """When ``problem`` came from ``model`` and ``cluster``: per-stage layers, F/I/W ms, activation bytes, per-rank
    static and limit (what `pipesched solve` derived; the schedule JSON's ``problem`` holds it for editing)."""
    out = out or console
    if problem.model is None or problem.cluster is None or problem.costs is None or problem.memory is None:
        return
    layers = problem.model.layers_per_stage or []
    forward = problem.stage_values(problem.costs.forward)
    backward_input = problem.stage_values(problem.costs.backward_input)
    backward_weight = problem.stage_values(problem.costs.backward_weight)
    activation = problem.stage_values(problem.memory.activation)
    retained = problem.stage_values(problem.memory.retained_for_weight)
    table = Table(
        show_header=True,
        header_style="bold",
        title=f"derived from model/cluster ({problem.cluster.accelerator or 'explicit accelerator'})",
    )
    for column in ("stage", "layers", "F ms", "I ms", "W ms", "activation", "retained for W"):
        table.add_column(column, justify="right")
    for stage in range(problem.pipeline.num_stages):
        table.add_row(
            str(stage),
            str(layers[stage]) if stage < len(layers) else "—",
            f"{forward[stage]:.3f}",
            f"{backward_input[stage]:.3f}",
            f"{backward_weight[stage]:.3f}",
            format_bytes(activation[stage]),
            format_bytes(retained[stage]),
        )
    if problem.pipeline.num_stages <= 32:
        out.print(table)
    p2p = problem.stage_values(problem.costs.p2p)
    statics = problem.static_memory
    static = ", ".join(format_bytes(x) for x in statics)
    if len(statics) > 8:
        static = f"{format_bytes(min(statics))} … {format_bytes(max(statics))}"
    limits = {format_bytes(x) if x != float("inf") else "none" for x in problem.memory_limits}
    out.print(
        f"layers per stage {layers} · p2p {max(p2p):.3f} ms · static per rank {static} · limit {', '.join(limits)}",
        highlight=False,
        soft_wrap=True,
    )


def print_summary(schedule: Schedule, out: Console | None = None) -> None:
    """A one-screen summary of a schedule (to ``out``, stdout by default)."""
    out = out or console
    problem = schedule.problem
    pipeline = problem.pipeline
    head = (
        f"[bold]{schedule.method}[/bold] ({schedule.backend}) · {pipeline.num_ranks} ranks · "
        f"{pipeline.num_microbatches} microbatches · {pipeline.num_stages} stages · placement "
        f"{pipeline.placement if isinstance(pipeline.placement, str) else 'explicit'}"
    )
    out.print(head, highlight=False)
    print_derived_problem(problem, out)
    if schedule.status == "infeasible":
        out.print(f"[bold red]infeasible[/bold red]: {schedule.reason}", highlight=False)
        if schedule.min_memory_limit:
            limits = ", ".join(format_bytes(x) for x in schedule.min_memory_limit)
            out.print(f"least memory limit per rank that admits a schedule: {limits}", highlight=False)
        return
    table = Table(show_header=True, header_style="bold")
    for column in (
        "status",
        "objective",
        "makespan ms",
        "stage_span ms",
        "step_time ms",
        "bubble rate",
        "lower bound",
        "gap",
    ):
        table.add_column(column, justify="right")
    table.add_row(
        schedule.status,
        schedule.objective,
        f"{schedule.makespan:.3f}",
        f"{schedule.stage_span:.3f}",
        "—" if schedule.step_time is None else f"{schedule.step_time:.3f}",
        f"{schedule.bubble_rate:.4f}",
        "—" if schedule.lower_bound is None else f"{schedule.lower_bound:.3f}",
        "—" if schedule.gap is None else f"{schedule.gap:.4f}",
    )
    out.print(table)
    if schedule.step_period is not None:
        out.print(
            f"step_period {schedule.step_period:.3f} ms per step in steady state (no flush, "
            f"{problem.training.weight_versions} weight versions); the actions are one repeating step, microbatch "
            f"ids ≥ {pipeline.num_microbatches} are the next step's",
            highlight=False,
        )
    elif schedule.step_time is not None and schedule.step_time != schedule.makespan:
        out.print(f"step_time {schedule.step_time:.3f} ms", highlight=False)
    limits = problem.memory_limits
    finite_limits = [limit for limit in limits if limit != float("inf")]
    # One unit and enough decimals that a peak reads over its limit exactly when it is over it.
    unit_name, unit = common_unit(list(schedule.peak_memory) + finite_limits)
    decimals = max(
        [decimals_against_limit([peak], limit, unit) for peak, limit in zip(schedule.peak_memory, limits, strict=True)],
        default=2,
    )
    memory = Table(show_header=True, header_style="bold", title="peak memory per rank")
    memory.add_column("rank", justify="right")
    memory.add_column(f"peak {unit_name}", justify="right")
    memory.add_column(f"limit {unit_name}", justify="right")
    for rank, peak in enumerate(schedule.peak_memory):
        memory.add_row(
            str(rank),
            f"{peak / unit:.{decimals}f}",
            "none" if limits[rank] == float("inf") else f"{limits[rank] / unit:.{decimals}f}",
        )
    if len(schedule.peak_memory) <= 16:
        out.print(memory)
    else:
        out.print(f"max peak memory {format_bytes(max(schedule.peak_memory))}", highlight=False)
    out.print(f"solved in {schedule.solve_time_s:.2f} s", highlight=False)


def solve_with_progress(problem: Problem) -> Schedule:
    """Solve, showing a live progress bar with the incumbent and the bound for ``auto``."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from pipesched.optimizer.solve import Progress as SolveProgress
    from pipesched.optimizer.solve import solve

    if problem.solver.method != "auto" or not err_console.is_terminal:
        if problem.solver.method == "auto":
            err_console.print(f"searching (time limit {problem.solver.time_limit_s:g} s) …", highlight=False)
        return solve(problem)
    limit = problem.solver.time_limit_s
    with Progress(
        TextColumn("[bold]searching[/bold]"),
        BarColumn(),
        TextColumn("{task.fields[state]}"),
        TimeElapsedColumn(),
        console=err_console,
        transient=False,
    ) as bar:
        task = bar.add_task("search", total=limit, state="no schedule yet")

        def on_progress(update: SolveProgress) -> None:
            best = "—" if update.best_objective is None else f"{update.best_objective:.3f}"
            bound = "—" if update.lower_bound is None else f"{update.lower_bound:.3f}"
            bar.update(
                task,
                completed=min(update.elapsed_s, limit),
                state=f"best {best} ms · bound {bound} ms · {update.backend}",
            )

        schedule = solve(problem, progress=on_progress)
        bar.update(task, completed=limit)
    return schedule


@app.command()
def solve(
    problem_path: Annotated[Path, typer.Argument(metavar="PROBLEM.json", help="Problem file (contract).")],
    method: Annotated[str | None, typer.Option("--method", "-m", help="auto or a family name.")] = None,
    time_limit: Annotated[float | None, typer.Option("--time-limit", help="Search time limit, s.")] = None,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write the schedule here.")] = None,
    output_format: Annotated[str, typer.Option("--format", help="json, csv or chrome-trace.")] = "json",
) -> None:
    """Solve a problem and write the schedule; prints a one-screen summary."""
    from pipesched.optimizer.families import FamilyDomainError

    if output_format not in FORMATS:
        raise fail(f"--format must be one of {', '.join(FORMATS)}, got {output_format!r}")
    if method is not None:
        check_method(method)
    try:
        problem = load_problem(problem_path, **{"solver.method": method, "solver.time_limit_s": time_limit})
    except InputError as error:
        raise fail(str(error)) from None
    try:
        schedule = solve_with_progress(problem)
    except FamilyDomainError as error:
        raise fail(f"{error}. Try --method auto, or `pipesched compare` for the families that apply.") from None
    to_stdout = output is None
    # With no -o the schedule goes to stdout (pipe it), so the summary goes to stderr.
    print_summary(schedule, err_console if to_stdout else console)
    if schedule.status == "infeasible":
        if output_format == "json":
            write_output(output, schedule.model_dump_json(indent=1))
        raise typer.Exit(1)
    write_output(output, render_schedule(schedule, output_format=output_format))
    if not to_stdout:
        console.print(f"wrote {output}", highlight=False)


def write_output(path: Path | None, text: str) -> None:
    """Write ``text`` to ``path`` (stdout when ``None``); an unwritable path exits 2 naming it."""
    if path is None:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return
    try:
        path.write_text(text)
    except OSError as error:
        raise fail(f"cannot write {path}: {error.strerror or error}: give -o a path in an existing folder") from None


@app.command()
def compare(
    problem_path: Annotated[Path, typer.Argument(metavar="PROBLEM.json", help="Problem file (contract).")],
    time_limit: Annotated[float | None, typer.Option("--time-limit", help="Time limit for auto, s.")] = None,
    include_auto: Annotated[bool, typer.Option("--auto/--no-auto", help="Also run the auto search.")] = True,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write the table as JSON.")] = None,
    placements: Annotated[
        str | None, typer.Option("--placements", help="Also re-cut the model for these placements: loop,v.")
    ] = None,
    stages_per_rank: Annotated[
        str | None, typer.Option("--stages-per-rank", help="Also re-cut the model for these stages per rank: 1,2.")
    ] = None,
) -> None:
    """Every applicable family (and auto) side by side: objective, bubble rate, peak memory, fits. With
    --placements / --stages-per-rank, the same model re-cut for each such pipeline shape too (from model and
    cluster when the problem has them, else its per-stage costs and activations split by layers)."""
    from pipesched.optimizer.families import applicable_families
    from pipesched.optimizer.solve import solve_family

    try:
        problem = load_problem(problem_path, **{"solver.time_limit_s": time_limit})
    except InputError as error:
        raise fail(str(error)) from None
    from pipesched.optimizer.families import FamilyDomainError

    variants = pipeline_variants(problem, placements, stages_per_rank)
    rows = []
    labels: list[str] = []
    for label, variant, how in variants:
        if how:
            console.print(f"{label}: {how}", highlight=False)
        for family in applicable_families(variant):
            try:
                rows.append(solve_family(variant, family.name, enforce_memory=False))
            except FamilyDomainError:  # e.g. reshard_after_forward with a depth-first family
                continue
            labels.append(label)
        if include_auto:
            started = time.perf_counter()
            auto = solve_with_progress(variant.with_changes(**{"solver.method": "auto"}))
            auto.solve_time_s = round(time.perf_counter() - started, 3)
            rows.append(auto)
            labels.append(label)
    limits = problem.memory_limits
    table = Table(title=f"{problem.pipeline.num_ranks} ranks · {problem.pipeline.num_microbatches} microbatches")
    if len(variants) > 1:
        table.add_column("pipeline")
    per_rank = problem.pipeline.num_ranks <= 16
    finite_limits = [limit for limit in limits if limit != float("inf")]
    unit_name, unit = common_unit([max(x.peak_memory) for x in rows if x.peak_memory] + finite_limits)
    decimals = decimals_against_limit(
        [peak for x in rows for peak in x.peak_memory], min(finite_limits, default=float("inf")), unit
    )
    peak_title = f"peak memory per rank ({unit_name})" if per_rank else "max peak memory"
    step = problem.has_step_actions or problem.objective == "step_time"
    period = problem.objective == "step_period"  # no flush: the steady-state time per step
    columns = (
        "method",
        "makespan ms",
        "stage_span ms",
        *(("step_time ms",) if step else ()),
        *(("step_period ms",) if period else ()),
    )
    for column in (*columns, "bubble rate", peak_title, "fits limit"):
        table.add_column(column, justify="right" if column != "method" else "left")
    table.caption = f"objective {problem.objective}; bubble rate on the objective"
    records = []
    for label, schedule in zip(labels, rows, strict=True):
        shape = [label] if len(variants) > 1 else []
        where = (
            {
                "placement": schedule.problem.pipeline.placement,
                "stages_per_rank": schedule.problem.pipeline.stages_per_rank,
            }
            if len(variants) > 1
            else {}
        )
        if schedule.status == "infeasible":
            table.add_row(*shape, schedule.method, *["—"] * (len(columns) + 1), f"no ({schedule.reason})")
            records.append({**where, "method": schedule.method, "status": "infeasible", "reason": schedule.reason})
            continue
        fits = bool(schedule.fits_memory)
        table.add_row(
            *shape,
            schedule.method,
            f"{schedule.makespan:.3f}",
            f"{schedule.stage_span:.3f}",
            *((f"{schedule.step_time:.3f}",) if step else ()),
            *((f"{schedule.step_period:.3f}",) if period else ()),
            f"{schedule.bubble_rate:.4f}",
            (
                " ".join(f"{x / unit:.{decimals}f}" for x in schedule.peak_memory)
                if per_rank
                else format_bytes(max(schedule.peak_memory))
            ),
            "yes" if fits else "no",
        )
        records.append(
            {
                **where,
                "method": schedule.method,
                "status": schedule.status,
                "objective": schedule.objective_value,
                "makespan": schedule.makespan,
                "stage_span": schedule.stage_span,
                "step_time": schedule.step_time,
                "bubble_rate": schedule.bubble_rate,
                "peak_memory": schedule.peak_memory,
                "fits_limit": fits,
            }
        )
    console.print(table)
    if finite_limits:
        console.print(f"memory limit per rank: {min(finite_limits) / unit:.{decimals}f} {unit_name}", highlight=False)
    if output is not None:
        write_output(output, json.dumps(records, indent=1))


def pipeline_variants(
    problem: Problem, placements: str | None, stages_per_rank: str | None
) -> list[tuple[str, Problem, str]]:
    """``(label, problem, how it was re-cut)`` for the problem's own pipeline shape, then each other shape the
    options name (:func:`pipesched.optimizer.recut.recut_problem`). Bad option values exit 2."""
    from pydantic import ValidationError

    from pipesched.optimizer.recut import recut_problem

    own = problem.pipeline
    label = f"{own.placement if isinstance(own.placement, str) else 'explicit'} ×{own.stages_per_rank}"
    variants = [(label, problem, "")]
    if placements is None and stages_per_rank is None:
        return variants
    wanted_placements = [x.strip() for x in (placements or str(own.placement)).split(",") if x.strip()]
    for name in wanted_placements:
        if name not in ("loop", "v"):
            raise fail(f"--placements: {name!r} is not a placement to re-cut for: use loop and/or v")
    try:
        counts = [int(x) for x in (stages_per_rank or str(own.stages_per_rank)).split(",") if x.strip()]
    except ValueError:
        raise fail(f"--stages-per-rank: expected whole numbers separated by commas, got {stages_per_rank!r}") from None
    if any(not 1 <= count <= 64 for count in counts):
        raise fail("--stages-per-rank: each value must be between 1 and 64")
    seen = {(own.placement, own.stages_per_rank)}
    for name in wanted_placements:
        for count in counts if name == "loop" else [2]:
            if (name, count) in seen:
                continue
            seen.add((name, count))
            try:
                variant, how = recut_problem(problem, name, count)  # type: ignore[arg-type]
            except (ValueError, ValidationError) as error:
                console.print(f"{name} ×{count}: cannot re-cut the model ({error})", highlight=False)
                continue
            variants.append((f"{name} ×{count}", variant, how))
    return variants


@app.command()
def demo(
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Folder for the results.")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="A short plan search (2 s instead of 10 s).")] = False,
    time_limit: Annotated[
        float | None, typer.Option("--time-limit", help="Time limit for the plan search, s (overrides --quick).")
    ] = None,
    run: Annotated[
        bool, typer.Option("--run/--no-run", help="Train the schedule on 4 gloo processes (pp 2 × dp 2, FSDP).")
    ] = True,
) -> None:
    """The main job end to end: plan a layout, schedule it with its communication, train 3 steps on 4 processes
    (pipeline 2 × data-parallel 2, FSDP) and verify them against a single-process reference."""
    import httpx

    from pipesched.api.demo import run_demo

    if run:
        require_torch("demo")
    try:
        run_demo(output, quick=quick, time_limit_s=time_limit, run=run, console=console)
    except httpx.HTTPStatusError as error:
        raise fail(f"the service answered {error.response.status_code}: {error.response.text[:500]}", 1) from None
    except (httpx.HTTPError, RuntimeError, ValueError, OSError) as error:
        raise fail(f"{type(error).__name__}: {error}", code=1) from None


# --- further commands register here (serve, run, profile, plot, demo) ---------------------------


@app.command()
def run(
    schedule_path: Annotated[Path, typer.Argument(metavar="SCHEDULE.json", help="Schedule from pipesched solve.")],
    nproc_per_node: Annotated[int | None, typer.Option("--nproc-per-node", help="Ranks on this node.")] = None,
    backend: Annotated[str, typer.Option("--backend", help="gloo (CPU) or nccl (GPU).")] = "gloo",
    model: Annotated[str, typer.Option("--model", help="gpt-tiny, gpt-small, …, problem, module:function.")] = (
        "gpt-tiny"
    ),
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write the run report here.")] = None,
    engine: Annotated[
        str,
        typer.Option(
            "--engine",
            help="auto (torch where it can follow the schedule: loop or V placement), torch "
            "(PyTorch's _PipelineScheduleRuntime) or pipesched (own executor, every placement).",
        ),
    ] = "auto",
    seed: Annotated[int, typer.Option("--seed", help="Seed of weights and batches.")] = 0,
    timeout: Annotated[float, typer.Option("--timeout", help="Bound on every wait, s.")] = 300.0,
    nnodes: Annotated[int, typer.Option("--nnodes", help="Nodes (multi-node runs).")] = 1,
    node_rank: Annotated[int, typer.Option("--node-rank", help="This node's index.")] = 0,
    master_addr: Annotated[str, typer.Option("--master-addr", help="Rendezvous host.")] = "127.0.0.1",
    master_port: Annotated[int | None, typer.Option("--master-port", help="Rendezvous port.")] = None,
    trace: Annotated[
        Path | None, typer.Option("--trace", help="Write predicted and measured timelines as one Chrome trace.")
    ] = None,
    data_parallel: Annotated[
        int | None,
        typer.Option("--data-parallel", help="D replicas of the pipeline (num_ranks × D processes, pp × dp mesh)."),
    ] = None,
    sharding: Annotated[
        str | None,
        typer.Option(
            "--sharding", help="none (gradients all-reduced) or full (FSDP2); default: the problem's, else full."
        ),
    ] = None,
    reshard_after_forward: Annotated[
        bool | None,
        typer.Option(
            "--reshard-after-forward/--no-reshard-after-forward",
            help="FSDP2: free gathered weights after F (default: the problem's, else no).",
        ),
    ] = None,
    steps: Annotated[int | None, typer.Option("--steps", help="K training steps with a real optimizer.")] = None,
    optimizer: Annotated[str | None, typer.Option("--optimizer", help="sgd or adamw (torch.optim).")] = None,
    lr: Annotated[float | None, typer.Option("--lr", help="Learning rate (default 0.01).")] = None,
    post_validation: Annotated[
        bool | None,
        typer.Option(
            "--post-validation/--no-post-validation",
            help="Speculative optimizer steps rolled back when the global check fails (default: the problem's).",
        ),
    ] = None,
    weight_update: Annotated[
        str | None,
        typer.Option("--weight-update", help="sync, or 2bw (PipeDream-2BW: W(t+1) = W(t) − ν·∇f(W(t−1)))."),
    ] = None,
    max_grad_norm: Annotated[
        float | None, typer.Option("--max-grad-norm", help="Clip by the global gradient norm (post-validation: 1.0).")
    ] = None,
    inject_nan: Annotated[
        str | None, typer.Option("--inject-nan", hidden=True, help="STEP:MICROBATCH (tests).")
    ] = None,
) -> None:
    """Execute a schedule with torch.distributed and verify it against a single-process reference.

    With --steps, --data-parallel, --post-validation or --weight-update (or a problem that asks for data
    parallelism, post-validation or 2BW) the ranks train K steps and the parameters are verified too.
    """
    require_torch("run")
    from pipesched.api.loading import load_schedule
    from pipesched.runtime.launch import RunFailed, ScheduleError, print_run_summary, run_schedule

    try:
        schedule = load_schedule(schedule_path)
    except InputError as error:
        raise fail(str(error)) from None
    training = None
    problem = schedule.problem
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
    wants_training = (
        any(value is not None for value in given.values())
        or inject_nan is not None
        or (problem.data_parallel is not None and problem.data_parallel.size > 1)
        or problem.training.post_validation
        or not problem.training.flush
    )
    if wants_training:
        from pipesched.runtime.training import TrainingError, training_options

        nan_at = None
        if inject_nan is not None:
            try:
                step_text, _, microbatch_text = inject_nan.partition(":")
                nan_at = (int(step_text), int(microbatch_text))
            except ValueError:
                raise fail(f"--inject-nan must be STEP:MICROBATCH (two integers), got {inject_nan!r}") from None
        try:
            training = training_options(problem, **given, inject_nan=nan_at)
        except TrainingError as error:
            raise fail(str(error)) from None
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
    if "verified" not in report:
        console.print(f"node {node_rank} done; node 0 verifies and reports", highlight=False)
        return
    print_run_summary(report)
    if training is not None:
        from pipesched.runtime.training import print_training_summary

        print_training_summary(report, console)
    if output is not None:
        console.print(f"wrote {output}", highlight=False)
    if trace is not None:
        from pipesched.optimizer.export import run_report_to_chrome_trace

        write_output(trace, json.dumps(run_report_to_chrome_trace(report, predicted=schedule)))
        console.print(f"wrote {trace} (predicted ranks first, then measured)", highlight=False)
    if not report["verified"]:
        raise typer.Exit(1)


@app.command()
def profile(
    num_ranks: Annotated[int, typer.Option("--num-ranks", help="Pipeline ranks p.")] = 4,
    num_microbatches: Annotated[int, typer.Option("--num-microbatches", help="Microbatches m.")] = 8,
    stages_per_rank: Annotated[int, typer.Option("--stages-per-rank", help="Stages per rank.")] = 1,
    placement: Annotated[str, typer.Option("--placement", help="loop, v or bidirectional.")] = "loop",
    model: Annotated[str, typer.Option("--model", help="gpt-tiny, gpt-small, …, module:function.")] = "gpt-tiny",
    repeats: Annotated[int, typer.Option("--repeats", help="Timed microbatches per stage.")] = 5,
    p2p_ms: Annotated[float, typer.Option("--p2p-ms", help="p2p latency to record, ms.")] = 0.0,
    memory_limit: Annotated[float | None, typer.Option("--memory-limit", help="Per-rank limit, bytes.")] = None,
    device: Annotated[str, typer.Option("--device", help="cpu or cuda.")] = "cpu",
    output: Annotated[Path, typer.Option("-o", "--output", help="Write PROBLEM.json here.")] = Path("problem.json"),
) -> None:
    """Measure each stage's F, I, W times and activation memory; write a PROBLEM.json for `pipesched solve`."""
    require_torch("profile")
    from pydantic import ValidationError

    from pipesched.api.loading import format_validation_error
    from pipesched.runtime.profile import SPREAD_WARNING, measure_model

    try:
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
        )
    except ValidationError as error:
        raise fail(format_validation_error(error)) from None
    except ValueError as error:
        raise fail(str(error)) from None
    problem = measured.problem
    write_output(output, problem.model_dump_json(indent=1, exclude_none=True))
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
    console.print(f"wrote {output}", highlight=False)


def settings_epilog() -> str:
    """The ``PIPESCHED_*`` environment variables ``pipesched serve`` reads, from the service's settings."""
    from pipesched.api.settings import Settings

    lines = ["Environment variables (each overrides its default; --host/--port override those two):", ""]
    for name, field in Settings.model_fields.items():
        default = "a SQLite file in ~/.local/share/pipesched" if name == "database_url" else repr(field.default)
        lines.append(f"PIPESCHED_{name.upper()}: {field.description} Default: {default}.")
        lines.append("")
    return "\n".join(lines)


def database_description(url: str) -> str:
    """What ``pipesched serve`` says it stores into: the SQLite file's absolute path, or the URL without password."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if database in ("", ":memory:"):
            return "SQLite in memory (nothing kept after exit)"
        return f"SQLite file {Path(database).expanduser().resolve()}"
    return parsed.render_as_string(hide_password=True)


@app.command(epilog=settings_epilog())
def serve(
    host: Annotated[str | None, typer.Option(help="Interface to bind (default: PIPESCHED_HOST or 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (default: PIPESCHED_PORT or 8000).")] = None,
) -> None:
    """Run the HTTP service (settings from PIPESCHED_* environment variables; OpenAPI at /docs)."""
    import uvicorn
    from pydantic import ValidationError
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, OperationalError

    from pipesched.api.app import create_app
    from pipesched.api.settings import Settings, exposure_problem

    updates = {key: value for key, value in (("host", host), ("port", port)) if value is not None}
    try:
        settings = Settings(**updates)  # the options override the environment, validated alike
    except ValidationError as error:
        lines = []
        for item in error.errors():
            name = str(item["loc"][0]) if item["loc"] else "?"
            option = f" (or --{name})" if name in updates else ""
            shown = "" if name == "api_token" else f" (got {item.get('input')!r})"
            described = Settings.model_fields[name].description if name in Settings.model_fields else None
            lines.append(
                f"PIPESCHED_{name.upper()}{option}: {item['msg']}{shown}; set a valid value"
                + (f" ({described})" if described else "")
            )
        raise fail("\n".join(lines)) from None
    exposed = exposure_problem(settings)
    if exposed is not None:
        raise fail(exposed)
    database_fix = "set PIPESCHED_DATABASE_URL to sqlite:///FILE or postgresql+psycopg://USER:PASSWORD@HOST/DATABASE"
    from pipesched.api.queue import QueueSettingsError

    try:
        service = create_app(settings)
    except QueueSettingsError as error:
        raise fail(str(error)) from None
    except ArgumentError as error:
        raise fail(f"PIPESCHED_DATABASE_URL is not a usable database URL ({error}): {database_fix}") from None
    except OperationalError as error:
        where = make_url(settings.database_url).render_as_string(hide_password=True)
        reason = str(error.orig or error).strip().splitlines()[0]
        raise fail(
            f"PIPESCHED_DATABASE_URL: cannot open the database {where} ({reason}): check that it exists and is "
            f"reachable, or {database_fix}"
        ) from None
    err_console.print(
        f"pipesched serve: database {database_description(settings.database_url)} (set PIPESCHED_DATABASE_URL to "
        "change it)",
        highlight=False,
        soft_wrap=True,
    )
    uvicorn.run(
        service,
        host=settings.host,
        port=settings.port,
        log_level="info",
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
    )


@app.command()
def worker(
    processes: Annotated[
        int | None, typer.Option("--processes", help="Solver processes (default: PIPESCHED_SOLVER_WORKERS).", min=1)
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            "--metrics-port", help="Prometheus /metrics port (default: PIPESCHED_WORKER_METRICS_PORT; 0: none)."
        ),
    ] = None,
) -> None:
    """Solve jobs from the PostgreSQL queue (run any number, on any machines, beside `pipesched serve` replicas
    started with PIPESCHED_QUEUE=postgres on the same PIPESCHED_DATABASE_URL)."""
    from pydantic import ValidationError
    from sqlalchemy.engine import make_url

    from pipesched.api.queue import QueueSettingsError, check_queue_settings
    from pipesched.api.settings import Settings

    try:
        settings = Settings()
    except ValidationError as error:
        lines = []
        for item in error.errors():
            name = str(item["loc"][0]) if item["loc"] else "?"
            described = Settings.model_fields[name].description if name in Settings.model_fields else None
            shown = "" if name == "api_token" else f" (got {item.get('input')!r})"
            lines.append(
                f"PIPESCHED_{name.upper()}: {item['msg']}{shown}; set a valid value"
                + (f" ({described})" if described else "")
            )
        raise fail("\n".join(lines)) from None
    try:
        check_queue_settings(settings, role="worker")
    except QueueSettingsError as error:
        raise fail(str(error)) from None
    from pipesched.api.worker import run_worker

    try:
        run_worker(
            settings,
            processes=processes or settings.solver_workers,
            metrics_port=settings.worker_metrics_port if metrics_port is None else metrics_port,
        )
    except Exception as error:
        from pipesched.api.queue import DATABASE_FIX

        if type(error).__name__ not in ("OperationalError", "PoolTimeout", "ArgumentError"):
            raise
        where = make_url(settings.database_url).render_as_string(hide_password=True)
        reason = str(getattr(error, "orig", None) or error).strip().splitlines()[0]
        raise fail(
            f"PIPESCHED_DATABASE_URL: cannot reach the database {where} ({reason}): check that the server runs and "
            f"this machine may connect, or {DATABASE_FIX}"
        ) from None


@app.command()
def plot(
    schedule_path: Annotated[Path, typer.Argument(metavar="SCHEDULE.json", help="Schedule file (pipesched solve).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="FILE.png, FILE.svg or FILE.html.")],
    compare_family: Annotated[
        str | None, typer.Option("--compare", help="Also draw this family (e.g. 1f1b) for the same problem.")
    ] = None,
) -> None:
    """Gantt chart per rank with each rank's memory over time; the suffix of -o picks the format."""
    from pipesched.api.loading import load_schedule
    from pipesched.api.plots import plot_to_file
    from pipesched.optimizer.families import FamilyDomainError
    from pipesched.optimizer.solve import solve_family

    if output.suffix.lower() not in (".png", ".svg", ".html", ".htm"):
        raise fail(f"-o {output}: the file must end in .png, .svg or .html")
    try:
        schedule = load_schedule(schedule_path)
    except InputError as error:
        raise fail(str(error)) from None
    other = None
    if compare_family is not None:
        try:
            other = solve_family(schedule.problem, compare_family, enforce_memory=False)
        except (FamilyDomainError, KeyError, ValueError) as error:
            reason = error.args[0] if isinstance(error, KeyError) and error.args else error
            raise fail(f"--compare {compare_family}: {reason}") from None
    try:
        plot_to_file(schedule, output, compare=other)
    except ValueError as error:  # InvalidSchedule too: orders that do not run on the file's own problem
        raise fail(f"{schedule_path}: {error}") from None
    console.print(f"wrote {output}", highlight=False)


@app.command()
def check(
    problem_path: Annotated[Path, typer.Argument(metavar="PROBLEM.json", help="Problem file (contract).")],
    schedule_path: Annotated[
        Path,
        typer.Argument(
            metavar="SCHEDULE",
            help="PyTorch's compute-only CSV, or JSON: one list of action strings per rank (or a schedule file).",
        ),
    ],
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the answer as JSON (as POST /v1/schedules/check).")
    ] = False,
) -> None:
    """Time and check a schedule written elsewhere: objective, bubble rate and peak memory per rank, or the first
    violation as a rank × step grid. Exit 1 for an invalid schedule, 2 for bad input."""
    from pipesched.optimizer.checking import ScheduleInputError, check_schedule, read_schedule, render_grid

    try:
        problem = load_problem(problem_path)
    except InputError as error:
        raise fail(str(error)) from None
    try:
        text = schedule_path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise fail(f"cannot read {schedule_path}: {getattr(error, 'strerror', None) or error}") from None
    try:
        orders, notes = read_schedule(text)
    except ScheduleInputError as error:
        raise fail(f"{schedule_path}: {error}") from None
    result = check_schedule(problem, orders, notes)
    if as_json:
        write_output(None, json.dumps(result.to_dict(), indent=1))
    else:
        for note in result.notes:
            console.print(f"note: {note}", highlight=False)
        if result.valid:
            assert result.peak_memory is not None
            unit_name, unit = common_unit(result.peak_memory)
            console.print(
                f"valid · {problem.objective} {result.objective_value:.3f} ms · makespan {result.makespan:.3f} ms · "
                f"stage_span {result.stage_span:.3f} ms · bubble rate {result.bubble_rate:.4f}",
                highlight=False,
            )
            console.print(
                f"peak memory per rank ({unit_name}): " + " ".join(f"{x / unit:.2f}" for x in result.peak_memory),
                highlight=False,
            )
        else:
            assert result.violation is not None
            violation = result.violation
            err_console.print(
                f"[bold red]invalid ({violation.reason}):[/bold red] {violation.message}", highlight=False
            )
            if violation.marks:
                err_console.print(render_grid(result.orders, violation.marks), highlight=False, soft_wrap=True)
    if not result.valid:
        raise typer.Exit(1)


app.command(name="plan")(plan_command)
app.command(name="launch")(launch_command)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
