"""The code keeps its shape (issue 23): each check reads the source tree itself.

(a) a family's name is a string literal in at most 2 source files (its module and one other);
(b) no two rooms import each other (rooms: the subfolders and top modules of optimizer/, api/, runtime/), and the
    three packages import one way: runtime and api may use the optimizer, api may use the runtime, never back;
(c) no function over 150 lines, at most 8 over 80;
(d) at most 4 files directly in tests/;
(e) no source file names the team's shared folder, which a user's clone does not have.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.project.test_import_graph import cycles, room_graph

PACKAGES = ("optimizer", "api", "runtime")
#: Written in two parts, so that this file does not name it itself.
SHARED_FOLDER = "/".join(("..", "shared"))
MAX_FILES_PER_FAMILY_NAME = 2
MAX_FUNCTION_LINES = 150
LONG_FUNCTION_LINES = 80
MAX_LONG_FUNCTIONS = 8
MAX_FILES_DIRECTLY_IN_TESTS = 4


def python_files(folders: Iterable[str], root: Path = REPO) -> list[Path]:
    """Every ``.py`` file under ``root / folder`` for each folder."""
    return sorted(path for folder in folders for path in (root / folder).rglob("*.py"))


@cache
def parsed(path: Path) -> ast.Module:
    """The syntax tree of ``path`` (read once per test session)."""
    return ast.parse(path.read_text(), filename=str(path))


def files_naming(names: Iterable[str], files: Iterable[Path]) -> dict[str, set[Path]]:
    """For each of ``names``, the files in which it is a whole string literal (``"1f1b"``, not ``"1f1b-ish"``)."""
    found: dict[str, set[Path]] = {name: set() for name in names}
    for path in files:
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in found:
                found[node.value].add(path)
    return found


def function_lengths(files: Iterable[Path]) -> dict[str, int]:
    """``path:line name`` → lines from ``def`` to the function's last line, for every function (nested too)."""
    lengths: dict[str, int] = {}
    for path in files:
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
                lengths[f"{where}:{node.lineno} {node.name}"] = node.end_lineno - node.lineno + 1
    return lengths


def files_mentioning(needle: str, folders: Iterable[str], root: Path = REPO) -> list[Path]:
    """Text files under ``root / folder`` that contain ``needle`` (caches and binary files skipped)."""
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            if needle in text:
                found.append(path)
    return found


def family_names() -> list[str]:
    from pipesched.optimizer.families import registry

    return list(registry())


@pytest.fixture(scope="module")
def rooms() -> dict[str, set[str]]:
    return room_graph()


# (a) --------------------------------------------------------------------------------------------------


def test_every_family_is_named_in_its_own_module() -> None:
    named = files_naming(family_names(), python_files(["optimizer/families"]))
    assert len(named) >= 12
    assert all(files for files in named.values()), [name for name, files in named.items() if not files]


def test_each_family_name_is_a_literal_in_at_most_two_source_files() -> None:
    named = files_naming(family_names(), python_files(PACKAGES))
    spread = {
        name: sorted(str(path.relative_to(REPO)) for path in files)
        for name, files in named.items()
        if len(files) > MAX_FILES_PER_FAMILY_NAME
    }
    assert not spread, spread


def test_the_literal_count_sees_whole_literals_only(tmp_path: Path) -> None:
    source = tmp_path / "module.py"
    source.write_text('A = "1f1b"\nB = "1f1b-like"\n"""1f1b in a docstring"""\n')
    assert files_naming(["1f1b", "gpipe"], [source]) == {"1f1b": {source}, "gpipe": set()}


# (b) --------------------------------------------------------------------------------------------------


def test_the_room_graph_sees_the_rooms(rooms: dict[str, set[str]]) -> None:
    assert {"pipesched.api.cli", "pipesched.api.render", "pipesched.optimizer.families"} <= set(rooms)
    assert "pipesched.api.render" in rooms["pipesched.api.cli"]
    assert "pipesched.optimizer.pattern" in rooms["pipesched.api.render"]


def test_no_two_rooms_import_each_other(rooms: dict[str, set[str]]) -> None:
    assert cycles(rooms) == []


def test_the_packages_import_one_way(rooms: dict[str, set[str]]) -> None:
    backwards = {
        (room, target)
        for room, targets in rooms.items()
        for target in targets
        if (room.startswith("pipesched.optimizer") and target.startswith(("pipesched.api", "pipesched.runtime")))
        or (room.startswith("pipesched.runtime") and target.startswith("pipesched.api"))
    }
    assert not backwards, sorted(backwards)


# (c) --------------------------------------------------------------------------------------------------


def test_no_function_over_150_lines() -> None:
    lengths = function_lengths(python_files(PACKAGES))
    too_long = {where: lines for where, lines in lengths.items() if lines > MAX_FUNCTION_LINES}
    assert not too_long, too_long


def test_at_most_8_functions_over_80_lines() -> None:
    lengths = function_lengths(python_files(PACKAGES))
    long = {where: lines for where, lines in lengths.items() if lines > LONG_FUNCTION_LINES}
    assert len(long) <= MAX_LONG_FUNCTIONS, dict(sorted(long.items(), key=lambda item: -item[1]))


def test_function_lengths_count_from_def_to_the_last_line(tmp_path: Path) -> None:
    source = tmp_path / "module.py"
    source.write_text("@decorator\ndef outer(\n    x,\n):\n    def inner():\n        return 1\n\n    return inner\n")
    assert function_lengths([source]) == {f"{source}:2 outer": 7, f"{source}:5 inner": 2}
    assert len(function_lengths(python_files(PACKAGES))) > 500


# (d) --------------------------------------------------------------------------------------------------


def test_at_most_4_files_directly_in_tests() -> None:
    files = sorted(path.name for path in (REPO / "tests").iterdir() if path.is_file())
    assert "conftest.py" in files
    assert len(files) <= MAX_FILES_DIRECTLY_IN_TESTS, files


# (e) --------------------------------------------------------------------------------------------------


def test_no_source_file_names_the_shared_folder() -> None:
    found = files_mentioning(SHARED_FOLDER, [*PACKAGES, "pipesched", "bench", "tests"])
    assert not found, [str(path.relative_to(REPO)) for path in found]


def test_a_mention_of_the_shared_folder_is_caught(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "module.py").write_text(f'"""See {SHARED_FOLDER}/NOTES.md."""\n')
    (tmp_path / "src" / "other.py").write_text('"""See docs/ARCHITECTURE.md."""\n')
    assert files_mentioning(SHARED_FOLDER, ["src"], root=tmp_path) == [tmp_path / "src" / "module.py"]
