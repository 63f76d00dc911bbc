"""``pipesched solve``, ``compare``, ``plot`` and ``check``: a problem file in, a schedule (or a table, a picture,
a verdict) out."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from pipesched.api.cli.common import (
    FORMATS,
    console,
    err_console,
    fail,
    require_method,
    stop_on_interrupt,
    write_output,
)
from pipesched.api.loading import InputError, load_problem_file
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.result import Schedule
from pipesched.optimizer.units import common_unit, decimals_against_limit, format_bytes


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
    if schedule.shape == "pattern" and schedule.step_period is not None:
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
    """Solve, showing a live progress bar with the incumbent and the bound for ``auto``; a first Ctrl-C stops the
    search, which answers with the best schedule found so far (its status and gap say how far it got)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from pipesched.optimizer.solve import Progress as SolveProgress
    from pipesched.optimizer.solve import solve

    if problem.solver.method != "auto":
        return solve(problem)
    with stop_on_interrupt("the best schedule found so far") as stop:
        if not err_console.is_terminal:
            err_console.print(f"searching (time limit {problem.solver.time_limit_s:g} s) …", highlight=False)
            return solve(problem, should_stop=stop.is_set)
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

            schedule = solve(problem, progress=on_progress, should_stop=stop.is_set)
            bar.update(task, completed=limit)
        return schedule


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
        require_method(method)
    try:
        problem = load_problem_file(problem_path, **{"solver.method": method, "solver.time_limit_s": time_limit})
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
    try:
        problem = load_problem_file(problem_path, **{"solver.time_limit_s": time_limit})
    except InputError as error:
        raise fail(str(error)) from None
    variants = pipeline_variants(problem, placements, stages_per_rank)
    labels, rows = _solve_variants(variants, include_auto)
    records = _print_comparison(problem, len(variants) > 1, labels, rows)
    if output is not None:
        write_output(output, json.dumps(records, indent=1))


def _solve_variants(variants: list[tuple[str, Problem, str]], include_auto: bool) -> tuple[list[str], list[Schedule]]:
    """Each pipeline shape's applicable families (and ``auto``): their labels and schedules, in order."""
    from pipesched.optimizer.families import FamilyDomainError, applicable_families
    from pipesched.optimizer.solve import solve_family

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
    return labels, rows


def _print_comparison(
    problem: Problem, several_shapes: bool, labels: list[str], rows: list[Schedule]
) -> list[dict[str, Any]]:
    """The comparison table (a pipeline column with ``several_shapes``) and the memory limit; returns its rows as
    the records ``-o`` writes."""
    limits = problem.memory_limits
    table = Table(title=f"{problem.pipeline.num_ranks} ranks · {problem.pipeline.num_microbatches} microbatches")
    if several_shapes:
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
        shape = [label] if several_shapes else []
        pipeline = schedule.problem.pipeline
        where = {"placement": pipeline.placement, "stages_per_rank": pipeline.stages_per_rank} if several_shapes else {}
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
        records.append(_comparison_record(schedule, where, fits))
    console.print(table)
    if finite_limits:
        console.print(f"memory limit per rank: {min(finite_limits) / unit:.{decimals}f} {unit_name}", highlight=False)
    return records


def _comparison_record(schedule: Schedule, where: dict[str, Any], fits: bool) -> dict[str, Any]:
    """One feasible row of ``pipesched compare -o``'s JSON."""
    return {
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


def plot(
    schedule_path: Annotated[Path, typer.Argument(metavar="SCHEDULE.json", help="Schedule file (pipesched solve).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="FILE.png, FILE.svg or FILE.html.")],
    compare_family: Annotated[
        str | None, typer.Option("--compare", help="Also draw this family (e.g. 1f1b) for the same problem.")
    ] = None,
) -> None:
    """Gantt chart per rank with each rank's memory over time; the suffix of -o picks the format."""
    from pipesched.api.loading import load_schedule_file
    from pipesched.api.render import plot_to_file
    from pipesched.optimizer.families import FamilyDomainError
    from pipesched.optimizer.solve import solve_family

    if output.suffix.lower() not in (".png", ".svg", ".html", ".htm"):
        raise fail(f"-o {output}: the file must end in .png, .svg or .html")
    try:
        schedule = load_schedule_file(schedule_path)
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
    from pipesched.optimizer.check import ScheduleInputError, check_schedule, read_schedule, render_grid

    try:
        problem = load_problem_file(problem_path)
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
            spans = f"makespan {result.makespan:.3f} ms · stage_span {result.stage_span:.3f} ms"
            if problem.objective not in ("makespan", "stage_span"):  # else the objective is one of the two
                spans = f"{problem.objective} {result.objective_value:.3f} ms · {spans}"
            console.print(
                f"valid · objective {problem.objective} · {spans} · bubble rate {result.bubble_rate:.4f}",
                highlight=False,
            )
            console.print(
                f"peak memory per rank ({unit_name}): " + " ".join(f"{x / unit:.2f}" for x in result.peak_memory),
                highlight=False,
            )
        else:
            assert result.violation is not None
            violation = result.violation
            message = violation.message.removeprefix(f"{violation.reason}: ")  # the reason is said once
            err_console.print(f"[bold red]invalid ({violation.reason}):[/bold red] {message}", highlight=False)
            if violation.marks:
                err_console.print(render_grid(result.orders, violation.marks), highlight=False, soft_wrap=True)
    if not result.valid:
        raise typer.Exit(1)
