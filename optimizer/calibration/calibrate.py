"""``pipesched calibrate``: refit one accelerator's profile to a user's own runs.

A measurement file (the calibration data's format, :mod:`pipesched.optimizer.cost.calibration.measurements`) holds
runs of one accelerator: a layout and its measured tokens/s per GPU (and peak memory, when known), read from a
torchtitan or Megatron log or from ``pipesched profile --device cuda``. The built-in profile of that accelerator
is the starting point and the prior (:mod:`.fit`):

- with fewer than :data:`FEW_ROWS` rows, one number is fitted: a common scale of its matrix-multiply and
  attention efficiencies (a few runs cannot tell them apart), under a weak prior (the measurement decides);
- with more, the bf16 and fp8 matrix-multiply and the attention efficiencies separately (those the rows
  exercise), each pulled toward the built-in value;
- rows with a peak memory refit ``activation_memory_factor``; with :data:`FEW_ROWS` peaks or more the peak's
  interval (``peak_memory_log_error``) becomes their held-out error, else the built-in one stays;
- with :data:`FEW_ROWS` rows or more the interval becomes their held-out error, else the built-in one stays.

The profile keeps the built-in one's other figures and names its source; ``cluster.profile`` selects it once it
is registered (``--profile FILE`` on the command line, ``POST /v1/profiles`` on the service).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipesched.optimizer.calibration.catalogue import fit_memory_factor, measured_mfu
from pipesched.optimizer.calibration.fit import Parameter, fit, quantile
from pipesched.optimizer.calibration.peaks import held_out_interval, leave_one_out, peak_lines
from pipesched.optimizer.cost.calibration.measurements import Measurement
from pipesched.optimizer.cost.profile import AcceleratorProfile, ProfileCatalogue, active_catalogue, default_profile
from pipesched.optimizer.field_errors import FieldError, raise_field_errors

__all__ = ["FEW_ROWS", "calibrate"]

#: Below this many rows one common scale is fitted, and the built-in interval is kept.
FEW_ROWS = 5
#: The prior's width (log) on the common scale: the user's measurement outweighs the built-in profile.
WEAK_PRIOR = 5.0


def _check(rows: Sequence[Measurement]) -> str:
    errors: list[FieldError] = []
    if not rows:
        errors.append((("rows",), "the measurement file has no rows: give at least one run", None))
    accelerators = sorted({row.accelerator for row in rows})
    if len(accelerators) > 1:
        errors.append(
            (
                ("rows",),
                f"the rows span {', '.join(accelerators)}: a profile is one accelerator's, calibrate each separately",
                accelerators,
            )
        )
    raise_field_errors("Measurements", errors)
    return accelerators[0]


def _parameters(rows: Sequence[Measurement], accelerator: str, start: AcceleratorProfile) -> list[Parameter]:
    on = (accelerator,)
    if len(rows) < FEW_ROWS:
        return [Parameter("scale", on, 1.0, WEAK_PRIOR, 0.2, 5.0)]
    chosen = []
    if any(row.training.precision == "bf16" for row in rows):
        chosen.append(Parameter("gemm_efficiency", on, start.gemm_efficiency, 0.5, 0.1, 1.0))
    if any(row.training.precision == "fp8" for row in rows):
        chosen.append(
            Parameter(
                "fp8_gemm_efficiency",
                on,
                start.fp8_gemm_efficiency,
                0.5,
                0.1,
                1.0,
                lambda row: row.training.precision == "fp8",
            )
        )
    chosen.append(Parameter("attention_efficiency", on, start.attention_efficiency, 0.5, 0.05, 1.0))
    return chosen


def calibrate(rows: Sequence[Measurement], *, name: str | None = None, source: str = "") -> AcceleratorProfile:
    """A profile of the rows' accelerator fitted to them (module docstring).

    Raises:
        pydantic.ValidationError: no rows, or rows of several accelerators (field ``rows``), or an unknown
            accelerator.
        ValueError: a row the planner cannot evaluate.
    """
    accelerator = _check(rows)
    base = active_catalogue()
    start = default_profile(accelerator)
    if base.get(accelerator) is None:
        base = base.model_copy(update={"profiles": {**base.profiles, accelerator: start}})
    result = fit(rows, base, _parameters(rows, accelerator, start), iterations=8, robust=False)
    fitted = result.catalogue.get(accelerator) or start
    interval = start.held_out_log_error
    if len(rows) >= FEW_ROWS:
        interval = (round(quantile(result.loo_log_error, 0.1), 4), round(quantile(result.loo_log_error, 0.9), 4))
    ceiling = dict(start.max_measured_mfu)
    for row in rows:
        precision = row.training.precision
        ceiling[precision] = max(ceiling.get(precision, 0.0), round(measured_mfu(row), 4))
    memory = _memory(rows, ProfileCatalogue(software=base.software, profiles={accelerator: fitted}))
    return fitted.model_copy(
        update={
            "name": name or f"{accelerator}-calibrated",
            "accelerator": accelerator,
            "held_out_log_error": interval,
            "max_measured_mfu": ceiling,
            "fitted_rows": len(rows),
            "source": f"calibrated on {len(rows)} measured rows{f' ({source})' if source else ''}, from the "
            f"built-in {accelerator} profile",
            **memory,
        }
    )


def _memory(rows: Sequence[Measurement], catalogue: ProfileCatalogue) -> dict[str, Any]:
    """The profile's memory fields from the rows with a measured peak (none: nothing changes): the refitted
    ``activation_memory_factor`` and, with :data:`FEW_ROWS` peaks or more, the peak's interval from their
    leave-one-out errors (:mod:`.peaks`)."""
    if not any(row.measured.peak_memory_bytes for row in rows):
        return {}
    lines = peak_lines(rows, catalogue)
    factor, _ = fit_memory_factor(rows, catalogue, lines)
    update: dict[str, Any] = {"activation_memory_factor": factor}
    held_out = leave_one_out(lines)
    if len(held_out) >= FEW_ROWS:
        update["peak_memory_log_error"] = held_out_interval(held_out)
        update["peak_memory_source"] = f"leave one out over {len(held_out)} measured peaks (pipesched calibrate)"
    return update
