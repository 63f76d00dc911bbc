"""The wheel installs one package, ``pipesched``: its parts live in the repository's top-level folders."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from tests.conftest import REPO

PARTS = {"optimizer": "pipesched.optimizer", "runtime": "pipesched.runtime", "api": "pipesched.api"}


def test_every_folder_of_the_package_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"pipesched"}
    for folder, name in PARTS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(REPO / folder).parts
            found.add(".".join([name, *parts]))
    assert found == listed


def test_a_folder_without_init_would_not_install(tmp_path: Path) -> None:
    # a module folder needs an __init__.py to be found by the listing above
    missing = [
        str(folder.relative_to(REPO))
        for part in PARTS
        for folder in [REPO / part, *(p for p in (REPO / part).rglob("*") if p.is_dir())]
        if folder.name != "__pycache__" and any(folder.glob("*.py")) and not (folder / "__init__.py").exists()
    ]
    assert missing == []


def test_the_wheel_holds_only_the_pipesched_package(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = tmp_path.glob("pipesched-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"pipesched"}
    for module in (
        "pipesched/__init__.py",
        "pipesched/optimizer/solve.py",
        "pipesched/api/cli/__init__.py",
        "pipesched/runtime/launch.py",
        "pipesched/optimizer/families/gpipe.py",
    ):
        assert module in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "pipesched = pipesched.api.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_nothing_top_level_named_optimizer_api_or_runtime_is_importable(tmp_path: Path) -> None:
    code = (
        "import importlib.util, sys\n"
        "found = [n for n in ('optimizer', 'api', 'runtime') if importlib.util.find_spec(n)]\n"
        "import pipesched\n"
        "from pipesched import Problem, Schedule, solve\n"
        "print(found)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
