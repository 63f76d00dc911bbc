"""The ``pipesched`` command line (typer + rich): one typer app, one module per group of commands.

* :mod:`~pipesched.api.cli.schedules`: ``solve``, ``compare``, ``plot``, ``check``
* :mod:`~pipesched.api.cli.plan`: ``plan``
* :mod:`~pipesched.api.cli.calibrate`: ``calibrate``
* :mod:`~pipesched.api.cli.runs`: ``run``, ``profile`` (torch)
* :mod:`~pipesched.api.cli.service`: ``serve``, ``worker``
* :mod:`~pipesched.api.cli.demo`: ``demo``

Bad input exits with code 2 and a message naming the field and the fix.
"""

from __future__ import annotations

import sys

import typer
import typer.rich_utils

from pipesched.api.cli import calibrate, demo, launch, plan, runs, schedules, service
from pipesched.api.cli.common import output_width

__all__ = ["app", "main"]

if typer.rich_utils.MAX_WIDTH is None:  # help piped to a file or `| cat` is not cut at 80 columns
    typer.rich_utils.MAX_WIDTH = output_width(sys.stdout)

app = typer.Typer(
    name="pipesched",
    help="Pipeline-parallel training schedule optimizer: the best schedule your memory allows.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command()(schedules.solve)
app.command()(schedules.compare)
app.command()(demo.demo)
app.command()(runs.run)
app.command()(runs.profile)
app.command(epilog=service.settings_epilog())(service.serve)
app.command()(service.worker)
app.command()(schedules.plot)
app.command()(schedules.check)
app.command(name="plan")(plan.plan_command)
app.command(name="launch")(launch.launch_command)
app.command(name="calibrate")(calibrate.calibrate_command)


def main() -> None:
    """Console-script entry point."""
    app()
