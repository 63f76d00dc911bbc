"""``pipesched launch PLAN.json [--plan N] [--scheduler S] [--target T] -o DIR``: a plan → files a job scheduler runs.

Bad input (an unreadable plan file, a plan that does not exist, an option a target cannot honour) exits 2 with
the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from pipesched.api.cli.common import err_console, fail
from pipesched.api.launch.bundle import (
    SCHEDULERS,
    TARGETS,
    LaunchBundle,
    LaunchOptions,
    build_bundle,
    pick_plan,
    stored_schedule,
)
from pipesched.api.loading import format_validation_error, wrong_kind
from pipesched.api.routes.plans import PlanStatus
from pipesched.optimizer.planner.request import PlanAnswer, PlanRequest

__all__ = ["launch_command", "load_plan_answer", "write_bundle"]


def _read_json(path: Path, what: str) -> object:
    try:
        return json.loads(path.read_text())
    except OSError as error:
        raise fail(f"cannot read {path}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise fail(f"{path} is not valid JSON ({what}): {error.msg} at line {error.lineno}") from None


def load_plan_answer(path: Path, request_path: Path | None) -> tuple[PlanAnswer, PlanRequest]:
    """The plan answer in ``path`` and the request it answered (its own ``request``, or ``request_path``):
    ``pipesched plan -o``'s file or the service's ``GET /v1/plans/{id}`` answer.

    Raises:
        typer.Exit: code 2 naming the file, the field and the fix.
    """
    data = _read_json(path, "a plan answer, as `pipesched plan -o PLAN.json` writes or GET /v1/plans/{id} answers")
    try:
        answer: PlanAnswer = PlanStatus.model_validate(data)  # the service's answer adds progress and callback
    except ValidationError as error:
        raise fail(
            f"{wrong_kind(path, data, 'plan answer')}{path} is not a plan answer:\n"
            f"{format_validation_error(error, '  ')}"
        ) from None
    request = answer.request
    if request_path is not None:
        try:
            request = PlanRequest.model_validate(_read_json(request_path, "a plan request"))
        except ValidationError as error:
            raise fail(f"{request_path}:\n{format_validation_error(error, '  ')}") from None
    if request is None:
        raise fail(
            f"{path} does not carry the request it answers: give it with --request CONFIG.json, or write the plan "
            "with `pipesched plan CONFIG.json -o PLAN.json`"
        )
    return answer, request


def write_bundle(bundle: LaunchBundle, folder: Path) -> None:
    """Write the bundle's files into ``folder`` (made if missing); shell scripts become executable.

    Raises:
        typer.Exit: code 2 when the folder cannot be written.
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in bundle.files.items():
            target = folder / name
            target.write_text(text)
            if name.endswith((".sh", ".sbatch")):
                target.chmod(0o755)
    except OSError as error:
        raise fail(f"cannot write into {folder}: {error.strerror or error}: give -o a folder you can write") from None


def launch_command(
    plan_path: Annotated[
        Path, typer.Argument(metavar="PLAN.json", help="Plans from `pipesched plan -o` or GET /v1/plans/{id}.")
    ],
    output: Annotated[Path, typer.Option("-o", "--output", help="Folder to write the files into.")],
    number: Annotated[int, typer.Option("--plan", help="Which plan, 1 = the best.")] = 1,
    scheduler: Annotated[str, typer.Option(help=f"One of {', '.join(SCHEDULERS)}.")] = "torchrun",
    target: Annotated[
        str | None,
        typer.Option(
            help=f"Training framework: {' or '.join(TARGETS)}; default: the plan request's training.framework where "
            "pipesched launches it, else torchtitan."
        ),
    ] = None,
    name: Annotated[str | None, typer.Option(help="Job name (default pipesched-plan-N).")] = None,
    image: Annotated[str, typer.Option(help="Container image (Kubernetes).")] = LaunchOptions.image,
    torchtitan_module: Annotated[str | None, typer.Option(help="torchtitan --module of your own.")] = None,
    torchtitan_config: Annotated[str | None, typer.Option(help="torchtitan --config of your own.")] = None,
    request_path: Annotated[
        Path | None, typer.Option("--request", metavar="CONFIG.json", help="The plan request, if PLAN.json lacks it.")
    ] = None,
) -> None:
    """Turn a plan into files a job scheduler runs: schedule.csv, the framework's args, the scheduler's file."""
    answer, request = load_plan_answer(plan_path, request_path)
    options = LaunchOptions(scheduler, target, name, image, torchtitan_module, torchtitan_config)
    try:
        plan = pick_plan(answer, number)
        schedule, notes = stored_schedule(plan_path, number, plan)
        bundle = build_bundle(request, plan, number, schedule, options)
    except ValueError as error:  # LaunchError included
        raise fail(str(error)) from None
    bundle.notes[:0] = notes
    write_bundle(bundle, output)
    for note in bundle.notes:
        err_console.print(f"note: {note}", highlight=False, soft_wrap=True)
    written = ", ".join(bundle.files)
    print(f"wrote {written} into {output}")
    print(f"run: {_how_to_run(options.scheduler, output, bundle.scheduler_file)}")


def _how_to_run(scheduler: str, folder: Path, file: str) -> str:
    return {
        "torchrun": f"on every node, MASTER_ADDR=<first node> {folder / file}",
        "slurm": f"cd {folder} && sbatch {file}",
        "kubernetes": f"kubectl apply -f {folder / file}",
        "skypilot": f"cd {folder} && sky launch {file}",
    }[scheduler]
