"""What every command shares: the consoles, exit 2 with a message naming the field and the fix, output files."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

import typer
from rich.console import Console

#: Width of output that goes to a file or a pipe (rich's 80 columns cut table cells and help lines).
PIPED_WIDTH = 160


def output_width(stream: TextIO) -> int | None:
    """:data:`PIPED_WIDTH` for a file or a pipe; None (rich measures the terminal, or reads ``$COLUMNS``) else."""
    if stream.isatty() or os.environ.get("COLUMNS", "").isdigit():
        return None
    return PIPED_WIDTH


console = Console(width=output_width(sys.stdout))
err_console = Console(stderr=True, width=output_width(sys.stderr))

FORMATS = ("json", "csv", "chrome-trace")


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``message`` to stderr and return the Exit to raise."""
    err_console.print(f"[bold red]error:[/bold red] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def require_method(method: str) -> None:
    """Exit 2 blaming ``--method`` when it names no method, suggesting the closest names."""
    from pipesched.optimizer.families import UnknownMethodError, check_method

    try:
        check_method(method)
    except UnknownMethodError as error:
        raise fail(f"--method {error}") from None


def require_torch(command: str) -> None:
    """Exit 2 with the install step when torch (the ``runtime`` extra) is missing."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise fail(
            f"`pipesched {command}` needs torch, which this installation lacks: "
            "pip install 'pipesched[runtime]' (or pip install torch==2.13.0)"
        )


def write_output(path: Path | None, text: str, option: str = "-o") -> None:
    """Write ``text`` to ``path`` (stdout when ``None``); an unwritable path exits 2 naming it and ``option``."""
    if path is None:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return
    try:
        path.write_text(text)
    except OSError as error:
        raise fail(
            f"cannot write {path}: {error.strerror or error}: give {option} a path in an existing folder"
        ) from None


def check_output_folder(path: Path | None, option: str = "-o") -> None:
    """Exit 2 before any work when ``path``'s folder does not exist or cannot be written (a run or a profile had
    measured for its whole length, then failed to write what it measured)."""
    if path is None:
        return
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        reason = "no such folder" if not folder.is_dir() else "the folder is not writable"
        raise fail(f"cannot write {path}: {reason}: give {option} a path in an existing folder")


@contextmanager
def stop_on_interrupt(what: str, out: Console | None = None) -> Iterator[threading.Event]:
    """An event set by the first Ctrl-C (SIGINT) inside the block, which a search reads as its stop flag (it then
    answers with the best it found); ``what`` it answers with is said on ``out`` (stderr by default). A second Ctrl-C
    raises :class:`KeyboardInterrupt` as usual. Outside the main thread (no handler can be set) it is never set."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def interrupted(signum: int, frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        (out or err_console).print(
            f"interrupted: the search stops and answers with {what} (Ctrl-C again to quit)", highlight=False
        )

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)
