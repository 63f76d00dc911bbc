"""``pipesched calibrate MEASUREMENTS.json [-o PROFILE.json]``: refit an accelerator profile to your own runs.

The measurement file is the calibration data's format (``optimizer/cost/calibration/README.md``): runs of one
accelerator, each a layout with its measured tokens/s per GPU. Prints every row measured beside predicted before
and after (and its peak memory beside the prediction, where the row gives one), and writes the profile;
``pipesched plan --profile PROFILE.json`` (or ``POST /v1/profiles``) then lets ``cluster.profile`` name it. Bad
input exits 2 naming the field.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from pipesched.api.loading import format_validation_error, not_json, wrong_kind
from pipesched.optimizer.calibration.calibrate import calibrate
from pipesched.optimizer.calibration.fit import predict_each
from pipesched.optimizer.calibration.predict import Prediction
from pipesched.optimizer.cost.calibration.measurements import Measurement, load_measurements
from pipesched.optimizer.cost.profile import ProfileCatalogue, active_catalogue
from pipesched.optimizer.units import format_bytes

__all__ = ["calibrate_command"]

console = Console(width=None if sys.stdout.isatty() else 150)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 150)


#: What a measurement file holds, for a file that is empty.
MEASUREMENTS_WANTED = (
    'the runs you measured as a JSON object {"rows": [...]}, one row per run (its model, accelerator, layout, '
    "training and measured tokens/s per GPU: optimizer/cost/calibration/README.md)"
)


def _fail(message: str) -> typer.Exit:
    err_console.print(f"[bold red]error:[/bold red] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(2)


def _load(path: Path) -> list[Measurement]:
    try:
        return load_measurements(path)
    except OSError as error:
        raise _fail(f"cannot read {path}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise _fail(not_json(path, error, MEASUREMENTS_WANTED)) from None
    except ValidationError as error:
        kind = wrong_kind(path, json.loads(path.read_text()), "measurement file")
        raise _fail(f"{kind}{path}:\n{format_validation_error(error, '  ')}") from None


def _table(rows: list[Measurement], before: list[Prediction], after: list[Prediction]) -> Table:
    """Tokens/s per GPU measured beside predicted (built-in profile, calibrated); where a row's file gives its
    ``measured.peak_memory_bytes``, the peak measured beside both predictions too (the calibration refits the
    activation memory factor to such rows: ``pipesched.optimizer.calibration.calibrate``)."""
    peaks = any(row.measured.peak_memory_bytes is not None for row in rows)
    title = "measured beside predicted, tokens/s per GPU" + (" and peak memory" if peaks else "")
    table = Table(title=title, title_justify="left")
    columns = ("row", "measured", "built-in profile", "error", "calibrated", "error")
    peak_columns = ("peak measured", "built-in profile", "error", "calibrated", "error")
    for column in columns + (peak_columns if peaks else ()):
        table.add_column(column, justify="left" if column == "row" else "right")
    for row, old, new in zip(rows, before, after, strict=True):
        measured = row.measured.tokens_per_s_per_gpu
        old_speed, new_speed = old.tokens_per_s_per_gpu or 0.0, new.tokens_per_s_per_gpu or 0.0
        cells = [
            row.key,
            f"{measured:,.0f}",
            f"{old_speed:,.0f}",
            f"{old_speed / measured - 1:+.1%}",
            f"{new_speed:,.0f}",
            f"{new_speed / measured - 1:+.1%}",
        ]
        peak = row.measured.peak_memory_bytes
        if peaks:
            cells.append(format_bytes(peak) if peak else "")
            for predicted in (old.peak_memory_bytes, new.peak_memory_bytes):
                cells += [format_bytes(predicted), f"{predicted / peak - 1:+.1%}"] if peak and predicted else ["", ""]
        table.add_row(*cells)
    return table


def calibrate_command(
    measurements: Annotated[
        Path,
        typer.Argument(
            metavar="MEASUREMENTS.json",
            help="Runs of one accelerator: {'rows': [...]}, each row as optimizer/cost/calibration/README.md says.",
        ),
    ],
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write the profile (JSON) here.")] = None,
    name: Annotated[str | None, typer.Option("--name", help="The profile's name (cluster.profile).")] = None,
) -> None:
    """Fit an accelerator profile's efficiencies to measured runs; cluster.profile then names it."""
    rows = _load(measurements)
    try:
        profile = calibrate(rows, name=name, source=measurements.name)
        before = predict_each(rows, active_catalogue())
        catalogue = active_catalogue()
        after = predict_each(
            rows,
            ProfileCatalogue(
                software=catalogue.software, profiles={**catalogue.profiles, profile.accelerator or "": profile}
            ),
        )
    except ValidationError as error:
        raise _fail(f"{measurements}:\n{format_validation_error(error, '  ')}") from None
    except ValueError as error:
        raise _fail(f"{measurements}: {error}") from None
    err_console.print(_table(rows, before, after))
    text = profile.model_dump_json(indent=1)
    if output is None:
        sys.stdout.write(text + "\n")
        return
    try:
        output.write_text(text + "\n")
    except OSError as error:
        raise _fail(f"cannot write {output}: {error.strerror or error}: give -o a path in an existing folder") from None
    console.print(f"wrote profile {profile.name!r} to {output}", highlight=False)
