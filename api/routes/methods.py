"""``/v1/methods``: the schedule families this build implements, plus auto."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from pipesched.api.routes._common import require_token
from pipesched.api.schemas import MethodInfo, Methods, error_responses
from pipesched.optimizer.families import registry

router = APIRouter(prefix="/v1/methods", tags=["methods"], dependencies=[Depends(require_token)])

AUTO = MethodInfo(
    name="auto",
    domain="every problem",
    description="Search for the best schedule that fits the memory limit within solver.time_limit_s.",
)


@router.get(
    "", operation_id="list_methods", summary="Solver methods", response_model=Methods, responses=error_responses(401)
)
def list_methods() -> Methods:
    """Each family from the registry (name, domain, description), then ``auto``."""
    families = [
        MethodInfo(name=family.name, domain=family.domain, description=family.description)
        for family in registry().values()
    ]
    return Methods(methods=[*families, AUTO])
