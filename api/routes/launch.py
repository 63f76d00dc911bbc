"""``GET /v1/plans/{id}/launch``: a finished plan's files for a job scheduler, as JSON or a zip."""

from __future__ import annotations

import io
import zipfile
from typing import Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Response
from pydantic import BaseModel, Field

from pipesched.api.launch.bundle import LaunchOptions, build_bundle, pick_plan
from pipesched.api.routes._common import Services, field_error, require_token, services
from pipesched.api.schemas import HTTPError, error_responses
from pipesched.api.storage import PlanRow
from pipesched.optimizer.planner.launch import LaunchError
from pipesched.optimizer.planner.request import PlanAnswer, PlanRequest

#: A dotted Python name (a module, or a function in one), as torchtitan's --module and --config take.
_PYTHON_NAME = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"

router = APIRouter(prefix="/v1/plans", tags=["plans"], dependencies=[Depends(require_token)])


class LaunchFiles(BaseModel):
    """A plan's launch files (``pipesched launch``'s), by file name."""

    plan: int = Field(description="Which plan of the answer (1 = best).")
    scheduler_file: str = Field(description="The job scheduler's file among `files`.")
    files: dict[str, str] = Field(description="File name → text: schedule.csv, <target>.args, the scheduler's file.")
    notes: list[str] = Field(default_factory=list, description="What to know before running them.")


def _option_error(error: LaunchError) -> Exception:
    text = str(error)
    for prefix, name in (
        ("scheduler", "scheduler"),
        ("target", "target"),
        ("name", "name"),
        ("model", "torchtitan_module"),
        ("torchtitan", "torchtitan_module"),
    ):
        if text.startswith(prefix):
            return field_error(("query", name), text)
    return field_error(("query", "plan"), text)


def _launchable(row: PlanRow, plan_id: str) -> PlanAnswer:
    """The stored answer whose plans a launch may take: a finished search's, or a cancelled one's once its worker
    stored the plans found until then (as ``pipesched launch`` takes the plans a Ctrl-C kept).

    Raises:
        HTTPException: 409 saying whether to wait (still searching, or stopping) or to ask again (ended without
            a plan).
    """
    answer = PlanAnswer.model_validate_json(row.answer_json) if row.answer_json else None
    if row.status == "done" and answer is not None:
        return answer
    if row.status in ("queued", "running"):
        detail = f"the plan search is {row.status}: poll GET /v1/plans/{plan_id} until its status is done"
    elif row.status == "cancelled" and answer is not None and answer.status in ("queued", "running"):
        detail = (
            f"the plan search was cancelled and is still storing the plans it found: poll GET /v1/plans/{plan_id} "
            "until its plans carry a schedule_id, then ask again"
        )
    elif row.status == "cancelled" and answer is not None and answer.plans:
        return answer
    else:
        why = f" ({row.error})" if row.error else ""
        detail = (
            f"the plan search ended {row.status}{why} with no plan stored to launch: POST the request to /v1/plans "
            "again (a cancelled search keeps only the plans found before DELETE)"
        )
    raise HTTPException(status_code=409, detail=detail)


@router.get(
    "/{plan_id}/launch",
    operation_id="get_plan_launch",
    summary="A finished plan's files for a job scheduler (JSON, or a zip with format=zip)",
    response_model=LaunchFiles,
    responses={
        **error_responses(401, 404, 422),
        409: {
            "description": "The plan search has not finished (poll GET /v1/plans/{id}), or ended without a plan.",
            "model": HTTPError,
        },
        200: {"content": {"application/zip": {}}, "description": "The files, as JSON or a zip."},
    },
)
def get_plan_launch(
    plan_id: str,
    scheduler: Literal["torchrun", "slurm", "kubernetes", "skypilot"] = "torchrun",
    target: Literal["torchtitan", "megatron"] | None = Query(
        None,
        description="The training framework's launch; default: the plan request's training.framework where "
        "pipesched launches it (torchtitan, megatron), else torchtitan.",
    ),
    plan: int = Query(1, ge=1, le=100, description="Which plan, 1 = the best."),
    name: str | None = Query(None, description="Job name (default pipesched-plan-N)."),
    image: str = Query(LaunchOptions.image, max_length=300, description="Container image (Kubernetes)."),
    format: Literal["json", "zip"] = "json",
    torchtitan_module: str | None = Query(
        None,
        max_length=200,
        pattern=_PYTHON_NAME,
        description="torchtitan --module of your own (with torchtitan_config).",
    ),
    torchtitan_config: str | None = Query(
        None,
        max_length=200,
        pattern=_PYTHON_NAME,
        description="torchtitan --config of your own (with torchtitan_module).",
    ),
    svc: Services = Depends(services),
) -> Response | LaunchFiles:
    """The files ``pipesched launch`` writes for plan ``plan`` of a finished search: ``schedule.csv`` (the
    stored schedule), ``torchtitan.args`` or ``megatron.args``, and the scheduler's file."""
    row = svc.store.plan(plan_id)
    if row is None:
        raise HTTPException(status_code=404, detail=f"no plan with id {plan_id!r}: POST /v1/plans first")
    answer = _launchable(row, plan_id)
    request = PlanRequest.model_validate_json(row.request_json)
    options = LaunchOptions(scheduler, target, name, image, torchtitan_module, torchtitan_config)
    try:
        chosen = pick_plan(answer, plan)
        schedule = svc.store.schedule(chosen.schedule_id) if chosen.schedule_id else None
        bundle = build_bundle(request, chosen, plan, schedule, options)
    except LaunchError as error:
        raise _option_error(error) from None
    except ValueError as error:  # the files do not fit a ConfigMap
        raise field_error(("query", "scheduler"), str(error)) from None
    if format == "zip":
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            for file_name, text in bundle.files.items():
                info = zipfile.ZipInfo(file_name)
                info.external_attr = (0o755 if file_name.endswith((".sh", ".sbatch")) else 0o644) << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                archive.writestr(info, text)
        filename = f"pipesched-{plan_id}-plan-{plan}-{scheduler}.zip"
        return Response(
            buffer.getvalue(),
            media_type="application/zip",
            headers={"Content-Disposition": f'attachment; filename="{filename}"'},
        )
    return LaunchFiles(plan=plan, scheduler_file=bundle.scheduler_file, files=bundle.files, notes=bundle.notes)
