"""Code habits hold from the first commit: ruff (lint and format) and mypy on optimizer/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_ruff_lint() -> None:
    result = run("ruff", "check", "pipesched", "optimizer", "runtime", "api", "tests", "bench")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format() -> None:
    result = run("ruff", "format", "--check", "pipesched", "optimizer", "runtime", "api", "tests", "bench")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_optimizer(tmp_path: Path) -> None:
    # The folders install as pipesched.*, which mypy cannot map from the repository's layout: it reads
    # them through a tree of links named as installed.
    tree = tmp_path / "pipesched"
    tree.mkdir()
    (tree / "__init__.py").symlink_to(REPO / "pipesched" / "__init__.py")
    for part in ("optimizer", "runtime", "api"):
        (tree / part).symlink_to(REPO / part)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"), "-p", "pipesched.optimizer"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_optimizer_never_imports_torch() -> None:
    code = (
        "import sys, pipesched, pipesched.optimizer.solve, pipesched.optimizer.families, "
        "pipesched.optimizer.simulate; assert 'torch' not in sys.modules"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
