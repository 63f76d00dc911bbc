"""Code habits hold from the first commit: ruff (lint and format) and mypy on optimizer/."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_ruff_lint() -> None:
    result = run("ruff", "check", "optimizer", "runtime", "api", "tests", "bench")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format() -> None:
    result = run("ruff", "format", "--check", "optimizer", "runtime", "api", "tests", "bench")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_optimizer() -> None:
    result = run("mypy")
    assert result.returncode == 0, result.stdout + result.stderr


def test_optimizer_never_imports_torch() -> None:
    code = "import sys, optimizer.solve, optimizer.families, optimizer.simulate; assert 'torch' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
