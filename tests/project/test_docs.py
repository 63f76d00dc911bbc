"""The docs stay true: the README's commands exist; every link between the README and docs/ lands on a file."""

from __future__ import annotations

import itertools
import re

from tests.conftest import REPO


def test_readme_opens_with_the_demo_and_test_commands_that_ci_runs() -> None:
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    demo, tests = blocks[0].strip(), blocks[1].strip()
    assert demo.endswith("pipesched demo") and "pip install -e '.[runtime]'" in demo
    assert tests.endswith("python -m pytest -q")
    assert tests in (REPO / ".ci" / "run").read_text()


def test_every_cli_command_in_the_contract_exists() -> None:
    from typer.main import get_command

    from pipesched.api.cli import app

    commands = set(get_command(app).commands)  # type: ignore[attr-defined]
    contract = (REPO / "docs" / "CONTRACT.md").read_text()
    named = set(re.findall(r"`pipesched (\w+)", contract))
    assert named and named <= commands | not_built_yet(), named - commands - not_built_yet()


def not_built_yet() -> set[str]:
    """The commands the README's "Not built yet" list names: the contract's parts still to come."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Not built yet", 1)[1].split("\n## ", 1)[0] if "## Not built yet" in readme else ""
    return set(re.findall(r"`pipesched (\w+)`", section))  # a whole command, not an option of a built one


def test_a_command_in_the_not_built_list_is_not_there_yet() -> None:
    from typer.main import get_command

    from pipesched.api.cli import app

    built = set(get_command(app).commands) & not_built_yet()  # type: ignore[attr-defined]
    assert not built, f"remove {sorted(built)} from the README's Not built yet list: it is built"


def test_every_relative_link_of_the_readme_and_docs_lands_on_a_file() -> None:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    assert len(pages) > 2
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} → {target}")
    assert not broken, broken


def test_every_file_the_readme_tour_reads_is_written_before() -> None:
    # The tour checked `schedule.csv`, which none of its commands wrote: `pipesched check problem.json
    # schedule.csv` answered "cannot read schedule.csv" for a reader who ran it as written.
    readme = (REPO / "README.md").read_text()
    tour = readme.split("## A short tour", 1)[1].split("\n## ", 1)[0]
    written: set[str] = set()
    unread = []
    for block in re.findall(r"```bash\n(.*?)```", tour, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = line.split("#", 1)[0]
            words = command.split()
            if words[:1] == ["pipesched"]:
                options = {"-o", "--output", "--trace", "--model", "--format", "--method", "--placements"}
                inputs = [
                    word
                    for before, word in itertools.pairwise(words)
                    if before not in options and re.fullmatch(r"[\w./-]+\.(json|csv)", word)
                ]
                unread += [f"{line.strip()}: {name}" for name in inputs if name not in written]
            written |= set(re.findall(r"(?:-o|--trace|>)\s*([\w./-]+\.\w+)", command))
    assert written and not unread, unread


#: Checks every bench command quoted in the README and docs/ as its module's argparse reads it, without running it.
_PARSE_ONLY = r"""
import argparse, glob, json, runpy, shlex, sys

class Parsed(Exception):
    pass

def parse_args(self, args=None, namespace=None):
    namespace, extra = argparse.ArgumentParser.parse_known_args(self, args, namespace)
    if extra:
        self.error("unrecognized arguments: " + " ".join(extra))
    raise Parsed

argparse.ArgumentParser.parse_args = parse_args
failed = {}
for command in json.loads(sys.argv[1]):
    words = shlex.split(command)
    argv = [match for word in words[3:] for match in (sorted(glob.glob(word)) or [word])]
    sys.argv = [words[2], *argv]
    try:
        runpy.run_module(words[2], run_name="__main__")
        failed[command] = "the module does not read its arguments with argparse"
    except Parsed:
        pass
    except SystemExit as error:
        failed[command] = f"exit {error.code}"
print(json.dumps(failed))
"""


def test_every_bench_command_the_docs_quote_takes_its_arguments_as_written() -> None:
    """The README's `python -m bench.runtime_bench_table` answered "the following arguments are required: files"
    (exit 2): each quoted command now reads as its module's argparse reads it (placeholders in capitals, such as
    FILES, are left to the reader; a module without options must be quoted without any)."""
    import json
    import subprocess
    import sys

    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    quoted = {
        " ".join(found.split())
        for page in pages
        for found in re.findall(r"`(python3? -m\s+bench\.[^`]+)`", page.read_text())
    }
    commands = sorted(c for c in quoted if not re.search(r"\b[A-Z]{2,}\b", c))
    assert "python -m bench.calibration_bench --held-out-only" in commands
    plain = [c for c in commands if "argparse" not in (REPO / f"{c.split()[2].replace('.', '/')}.py").read_text()]
    assert all(len(c.split()) == 3 for c in plain), plain
    checked = [c for c in commands if c not in plain]
    result = subprocess.run(
        [sys.executable, "-c", _PARSE_ONLY, json.dumps(checked)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.splitlines()[-1]) == {}, result.stderr[-2000:]
