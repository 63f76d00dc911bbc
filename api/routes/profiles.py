"""``/v1/profiles``: the accelerator profiles plans can use (``cluster.profile``), and registering a calibrated one.

``POST /v1/profiles`` takes what ``pipesched calibrate`` writes; plans submitted afterwards may name it in
``cluster.profile``. Registered profiles are stored in the service's database: the solver processes that run plans
read them there, and every replica on the same database reads them again before a request that may name one
whenever any was registered or replaced since it last looked (a count and a time, one query).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field, ValidationError

from pipesched.api.routes._common import Services, require_token, services, stored_profiles
from pipesched.api.schemas import error_responses
from pipesched.optimizer.accelerators import accelerator_names, get_accelerator
from pipesched.optimizer.cost.profile import AcceleratorProfile, builtin_catalogue
from pipesched.optimizer.cost.stages import register_profile, registered_profiles
from pipesched.optimizer.field_errors import raise_field_errors

router = APIRouter(prefix="/v1/profiles", tags=["profiles"], dependencies=[Depends(require_token)])


class ProfileInfo(BaseModel):
    """One profile: its name, accelerator, where it comes from, and its 80% interval as factors."""

    name: str
    accelerator: str | None
    source: str
    fitted_rows: int
    interval_factors: tuple[float, float] = Field(description="Multiply a prediction by these for its 80% interval.")
    built_in: bool


class RegisteredProfile(ProfileInfo):
    """A profile just registered, and the one of the same name it replaced, if any."""

    replaced: str | None = Field(
        None,
        description="The source of the profile of the same name this one replaced (plans that name it take this one "
        "from now on); null when the name was new.",
    )


class Profiles(BaseModel):
    """Every profile ``cluster.profile`` may name."""

    profiles: list[ProfileInfo]


def _info(profile: AcceleratorProfile, built_in: bool) -> ProfileInfo:
    import math

    low, high = profile.held_out_log_error
    return ProfileInfo(
        name=profile.name,
        accelerator=profile.accelerator,
        source=profile.source,
        fitted_rows=profile.fitted_rows,
        interval_factors=(round(math.exp(low), 4), round(math.exp(high), 4)),
        built_in=built_in,
    )


@router.get(
    "",
    operation_id="list_profiles",
    dependencies=[Depends(stored_profiles)],
    summary="Accelerator profiles",
    response_model=Profiles,
    responses=error_responses(401),
)
def list_profiles() -> Profiles:
    """The built-in profiles, then those registered with this service."""
    built_in = [_info(profile, True) for profile in builtin_catalogue().profiles.values()]
    return Profiles(profiles=built_in + [_info(profile, False) for profile in registered_profiles()])


@router.post(
    "",
    operation_id="register_profile",
    summary="Register a calibrated profile",
    status_code=201,
    response_model=RegisteredProfile,
    responses=error_responses(401, 422),
)
def post_profile(profile: AcceleratorProfile, svc: Services = Depends(services)) -> RegisteredProfile:
    """Register a profile from ``pipesched calibrate``; ``cluster.profile`` may then name it. One of the same name
    is replaced (a recalibration), and the answer's ``replaced`` says whose it was: ``pipesched calibrate`` names
    every profile of an accelerator alike unless ``--name`` says otherwise.

    Raises:
        422: an accelerator not in the catalogue, or the name of a built-in profile.
    """
    errors = []
    if builtin_catalogue().get(profile.name) is not None:
        errors.append(
            (
                ("body", "name"),
                f"{profile.name!r} is a built-in profile: give yours another name (--name)",
                profile.name,
            )
        )
    if profile.accelerator is None:
        errors.append((("body", "accelerator"), f"name the accelerator: one of {', '.join(accelerator_names())}", None))
    else:
        try:
            get_accelerator(profile.accelerator)
        except KeyError:
            errors.append(
                (
                    ("body", "accelerator"),
                    f"unknown accelerator {profile.accelerator!r}: use one of {', '.join(accelerator_names())}",
                    profile.accelerator,
                )
            )
    try:
        raise_field_errors("AcceleratorProfile", errors)
    except ValidationError as error:
        from fastapi.exceptions import RequestValidationError

        raise RequestValidationError(error.errors()) from None
    previous = svc.store.put_profile(profile.name, profile.model_dump_json())
    register_profile(profile)
    replaced = None
    if previous is not None:
        try:
            replaced = AcceleratorProfile.model_validate_json(previous).source or "a profile stating no source"
        except ValidationError:
            replaced = "a profile stored by an earlier release"
    return RegisteredProfile(**_info(profile, False).model_dump(), replaced=replaced)
