"""``pipesched plan CONFIG.json [--top K] [--framework NAME] [-o PLAN.json]``: the best parallel configurations.

Bad input exits 2 naming the field; a search that finds no plan exits 1 with the reason. Ctrl-C stops the search
and answers with the plans found so far (a note says so); a second Ctrl-C quits at once.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pipesched.api.cli.common import stop_on_interrupt
from pipesched.api.loading import format_validation_error, not_json, without_service_fields, wrong_kind
from pipesched.optimizer.cost.profile import load_catalogue
from pipesched.optimizer.cost.stages import register_profile
from pipesched.optimizer.frameworks import FRAMEWORKS
from pipesched.optimizer.planner.rank import PlanOutcome, PlanProgress, prepare, search
from pipesched.optimizer.planner.request import Plan, PlanAnswer, PlanRequest, Rejected
from pipesched.optimizer.units import common_unit, format_bytes

__all__ = ["plan_command", "print_plans", "register_profile_file"]

#: Wide enough for the plans table when the output is not a terminal (a file, a pipe, a test runner).
_WIDTH = 170
console = Console(width=None if sys.stdout.isatty() else _WIDTH)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else _WIDTH)


def _fail(message: str, code: int = 2) -> typer.Exit:
    err_console.print(f"[bold red]error:[/bold red] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def load_plan_request(
    path: Path, top: int | None = None, time_limit: float | None = None, framework: str | None = None
) -> PlanRequest:
    """Read and validate a plan request file (contract, Plan); ``top``, ``time_limit`` and ``framework`` replace
    ``search.top``, ``search.time_limit_s`` and ``training.framework``.

    Raises:
        typer.Exit: code 2 with the field paths and the fix.
    """
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise _fail(f"cannot read {path}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise _fail(not_json(path, error, "a plan request: a JSON object with model, cluster, training")) from None
    if not isinstance(data, dict):
        raise _fail(f"{path}: a plan request is a JSON object with model, cluster, training (see the contract)")
    data = without_service_fields(path, data)
    search = dict(data.get("search") or {})
    if top is not None:
        search["top"] = top
    if time_limit is not None:
        search["time_limit_s"] = time_limit
    data = {**data, "search": search}
    if framework is not None:
        training = data.get("training")
        data["training"] = {**training, "framework": framework} if isinstance(training, dict) else training
    try:
        return PlanRequest.model_validate(data)
    except ValidationError as error:
        raise _fail(f"{path}:\n{format_validation_error(error, '  ')}") from None


def register_profile_file(path: Path) -> None:
    """Register the profiles of a ``pipesched calibrate`` file for this process (``cluster.profile``).

    Raises:
        typer.Exit: code 2 when the file cannot be read or is not a profile.
    """
    try:
        catalogue = load_catalogue(path)
    except OSError as error:
        raise _fail(f"cannot read {path}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise _fail(f"{path} is not valid JSON: {error.msg} at line {error.lineno}") from None
    except ValidationError as error:
        kind = wrong_kind(path, json.loads(path.read_text()), "profile")
        if kind:  # another of pipesched's files: which, and what to do, not one line per field it lacks
            raise _fail(kind.rstrip("\n")) from None
        raise _fail(
            f"{path} is not a profile (pipesched calibrate writes one):\n{format_validation_error(error, '  ')}"
        ) from None
    for item in catalogue.profiles.values():
        register_profile(item)


def _expert_cell(size: int, tensor_parallel: int) -> str:
    """The ep column: the degree, and the expert tensor degree where experts are split with ep > 1."""
    return f"{size} etp {tensor_parallel}" if size > 1 and tensor_parallel > 1 else str(size)


def _data_parallel_cell(size: int, sharding: str, context_parallel: int) -> str:
    """The table's dp cell: d and the sharding, and with context parallelism the d·c GPUs the sharding spans (the
    weights are copied over the c ranks too, so at d 1 the shardings still differ: ``docs/PLANNER.md``)."""
    spans = f" over d·c {size * context_parallel}" if context_parallel > 1 and sharding != "none" else ""
    return f"{size} {sharding}{spans}"


def print_plans(answer: PlanAnswer, out: Console) -> None:
    """The ranked plans as a table, then the search counts."""
    # Padding collapsed between columns (one space beside each rule, not two): the widest cells (``4 gradients over
    # d·c 32``, ``16 etp 2``) then fit the 170 columns of a pipe or file on one line, nothing cut.
    table = Table(title="plans, best first", title_justify="left", collapse_padding=True)
    columns = (
        "#",
        "pp",
        "tp",
        "cp",
        "ep",
        "dp",
        "chunks",
        "mb×m",
        "recompute",
        "prec",
        "method",
        "step ms",
        "tok/s/GPU",
    )
    for column in (*columns, "80% interval", "MFU"):
        table.add_column(
            column, justify="left" if column in ("dp", "chunks", "recompute", "prec", "method") else "right"
        )
    unit, size = common_unit([plan.peak_memory_bytes for plan in answer.plans])
    with_interval = any(plan.peak_memory_bytes_interval for plan in answer.plans)
    table.add_column(f"peak {unit} (80%)" if with_interval else "peak", justify="right")
    table.add_column("bound ms", justify="right")
    for rank, plan in enumerate(answer.plans, 1):
        table.add_row(
            str(rank),
            str(plan.pipeline_parallel),
            str(plan.tensor_parallel),
            str(plan.context_parallel),
            _expert_cell(plan.expert_parallel, plan.expert_tensor_parallel),
            _data_parallel_cell(plan.data_parallel.size, plan.data_parallel.sharding, plan.context_parallel),
            f"{plan.stages_per_rank} {plan.placement}",
            f"{plan.micro_batch_size}×{plan.num_microbatches}",
            plan.activation_recomputation,
            plan.precision,
            plan.method,
            f"{plan.step_time_ms:.1f}",
            f"{plan.tokens_per_s_per_gpu:.0f}",
            f"{plan.tokens_per_s_per_gpu_interval[0]:.0f}–{plan.tokens_per_s_per_gpu_interval[1]:.0f}",
            f"{plan.mfu:.1%}",
            _peak_cell(plan, size) if with_interval else format_bytes(plan.peak_memory_bytes),
            f"{plan.lower_bound_ms:.1f}",
        )
    out.print(table)
    for line in _sources(answer):
        out.print(line, highlight=False)
    if answer.memory_headroom_bytes is not None:
        out.print(
            f"kept free on every GPU: {format_bytes(answer.memory_headroom_bytes)} (cluster.memory_headroom_bytes); "
            f"profile {answer.profile}",
            highlight=False,
        )
    for note in answer.notes:
        out.print(f"[bold yellow]note:[/bold yellow] {note}", highlight=False)
    if answer.parameters is not None and answer.active_parameters is not None:
        active = (
            f", {answer.active_parameters / 1e9:.1f}B active" if answer.active_parameters < answer.parameters else ""
        )
        out.print(f"model: {answer.parameters / 1e9:.1f}B parameters{active}", highlight=False)
    if answer.explain:
        print_explained(answer.explain, out)
    searched = answer.searched
    out.print(
        f"searched: {searched.enumerated} enumerated, {searched.pruned_memory} pruned by memory, "
        f"{searched.pruned_bound} pruned by bound, {searched.solved} simulated, {searched.unexplored} unexplored; "
        f"first plan after {answer.first_answer_s if answer.first_answer_s is not None else '—'} s, "
        f"done in {answer.elapsed_s:.1f} s",
        highlight=False,
    )


def _sources(answer: PlanAnswer) -> list[str]:
    """The lines under the table that say where its figures come from: the best plan's intervals, the peak
    interval's source, what the bound bounds."""
    if not answer.plans:
        return []
    lines = [_best_intervals(answer.plans[0])]
    if answer.peak_memory_interval_source:
        lines.append(f"peak (80% interval): {answer.peak_memory_interval_source}")
    lines.append(
        "bound ms: the model's own bound on the step, the least any schedule of the configuration takes in the same "
        "cost model and profile; not a measured figure"
    )
    return lines


def _peak_cell(plan: Plan, size: int) -> str:
    """The peak column: the predicted peak and its 80% interval in the column's unit (``size`` bytes)."""
    if plan.peak_memory_bytes_interval is None:
        return f"{plan.peak_memory_bytes / size:.1f}"
    low, high = plan.peak_memory_bytes_interval
    return f"{plan.peak_memory_bytes / size:.1f} ({low / size:.1f}–{high / size:.1f})"


def _best_intervals(plan: Plan) -> str:
    """The best plan's step time and MFU with the 80% interval of its tokens/s per GPU carried over (the step is
    the step's tokens over that rate, the MFU proportional to it), so that no printed figure of it stands alone."""
    rate = plan.tokens_per_s_per_gpu
    low, high = plan.tokens_per_s_per_gpu_interval
    step = plan.step_time_ms
    return (
        f"plan 1, 80% interval carried from tok/s/GPU: step {step:.1f} ms ({step * rate / high:.1f}–"
        f"{step * rate / low:.1f}), MFU {plan.mfu:.1%} ({plan.mfu * low / rate:.1%}–{plan.mfu * high / rate:.1%})"
    )


#: The most refused layouts (one line each) the command line prints of ``search.explain``.
EXPLAINED_LINES = 12


def print_explained(explained: list[Rejected], out: Console) -> None:
    """``search.explain`` on the terminal: the first refusal of each parallel layout (pipeline × tensor × context ×
    expert × data parallel and sharding), at most :data:`EXPLAINED_LINES`; the answer's JSON holds them all."""
    first: dict[tuple[object, ...], Rejected] = {}
    for rejected in explained:
        shape = rejected.configuration
        key = tuple(shape.get(name) for name in _LAYOUT_FIELDS)
        first.setdefault(key, rejected)
    out.print(
        f"did not fit (search.explain: {len(explained)} configurations listed in the answer's explain, the first of "
        f"each layout here):",
        highlight=False,
    )
    for rejected in list(first.values())[:EXPLAINED_LINES]:
        shape = rejected.configuration
        layout = " × ".join(f"{short} {shape.get(name, 1)}" for short, name in _LAYOUT_SHORT)
        out.print(
            f"  {layout} {shape.get('sharding', 'none')}, micro-batch {shape.get('micro_batch_size')}, "
            f"recomputation {shape.get('activation_recomputation')}, {shape.get('method')}: {rejected.reason}",
            highlight=False,
            soft_wrap=True,
        )
    if len(first) > EXPLAINED_LINES:
        out.print(f"  … {len(first) - EXPLAINED_LINES} more layouts in the answer's explain", highlight=False)


_LAYOUT_SHORT = (
    ("pp", "pipeline_parallel"),
    ("tp", "tensor_parallel"),
    ("cp", "context_parallel"),
    ("ep", "expert_parallel"),
    ("dp", "data_parallel_size"),
)
_LAYOUT_FIELDS = (*(name for _, name in _LAYOUT_SHORT), "sharding")


def run_with_progress(request: PlanRequest) -> PlanOutcome:
    """Prepare and search with a rich progress bar on stderr (counts and the best step so far). A first Ctrl-C stops
    the search: the outcome holds the plans found until then, and its answer's notes say so.

    Raises:
        pydantic.ValidationError: as :func:`pipesched.optimizer.planner.rank.prepare`.
    """
    prepared = prepare(request)
    searched = prepared.searched
    err_console.print(
        f"{searched.enumerated} configurations, {searched.pruned_memory} over memory, "
        f"{len(prepared.candidates)} to search (time limit {request.search.time_limit_s:g} s)",
        highlight=False,
    )
    with Progress(
        TextColumn("[bold]planning[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[state]}"),
        TimeElapsedColumn(),
        console=err_console,
        transient=False,
        disable=not err_console.is_terminal,
    ) as bar:
        task = bar.add_task("plan", total=max(1, len(prepared.candidates)), state="no plan yet")

        logged = [math.inf]  # the best step already logged, ms

        def on_progress(update: PlanProgress) -> None:
            best = "no plan yet" if update.best_step_ms is None else f"best {update.best_step_ms:.1f} ms"
            bar.update(task, completed=update.evaluated, state=f"{best} · {update.phase}")
            if err_console.is_terminal or update.best_step_ms is None or update.best_step_ms >= logged[0]:
                return
            # Not a terminal (a job scheduler's log, a pipe): no bar, a line for each better plan instead.
            logged[0] = update.best_step_ms
            err_console.print(
                f"planning: best step {update.best_step_ms:.1f} ms after {update.elapsed_s:.1f} s "
                f"({update.evaluated} of {update.total} evaluated, {update.phase})",
                highlight=False,
            )

        with stop_on_interrupt("the plans found so far", err_console) as stop:
            outcome = search(prepared, progress=on_progress, should_stop=stop.is_set)
            if stop.is_set():
                elapsed = time.perf_counter() - prepared.started
                outcome.answer.notes.append(
                    f"stopped by an interrupt (Ctrl-C) after {elapsed:.1f} s of the {request.search.time_limit_s:g} s "
                    "time limit: the plans are the best found until then, not the search's answer"
                )
            return outcome


def plan_command(
    config_path: Annotated[Path, typer.Argument(metavar="CONFIG.json", help="Plan request (contract, Plan).")],
    top: Annotated[int | None, typer.Option("--top", help="Plans to return (search.top).")] = None,
    time_limit: Annotated[float | None, typer.Option("--time-limit", help="search.time_limit_s.")] = None,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write the plans (JSON) here.")] = None,
    profile: Annotated[
        Path | None,
        typer.Option("--profile", help="A profile from `pipesched calibrate`; cluster.profile may then name it."),
    ] = None,
    framework: Annotated[
        str | None,
        typer.Option(
            "--framework",
            help=f"training.framework: the framework that will run the plan ({', '.join(FRAMEWORKS)}).",
        ),
    ] = None,
) -> None:
    """The best parallel configurations (pipeline, tensor, data parallel, schedule) for a model on a cluster."""
    if profile is not None:
        register_profile_file(profile)
    request = load_plan_request(config_path, top, time_limit, framework)
    try:
        outcome = run_with_progress(request)
    except ValidationError as error:
        raise _fail(f"{config_path}:\n{format_validation_error(error, '  ')}") from None
    answer = outcome.answer
    out = err_console if output is None else console
    print_plans(answer, out)
    text = answer.model_dump_json(indent=1)
    if output is None:
        sys.stdout.write(text + "\n")
    else:
        try:
            output.write_text(text)
        except OSError as error:
            raise _fail(
                f"cannot write {output}: {error.strerror or error}: give -o a path in an existing folder"
            ) from None
        from pipesched.api.launch.bundle import write_plan_schedules

        try:  # beside a regular file only (not beside -o /dev/stdout, say)
            written = write_plan_schedules(output, answer.plans, outcome.schedules) if output.is_file() else []
        except OSError as error:
            raise _fail(f"cannot write the plans' schedules beside {output}: {error.strerror or error}") from None
        console.print(
            f"wrote {output}" + (f" and {len(written)} schedule(s) beside it" if written else ""), highlight=False
        )
    if not answer.plans:
        raise _fail(answer.error or "no plan", code=1)
