"""The README's "Use it from a job scheduler" section, run as written: its bash block in a fresh folder whose
``.venv`` is this environment (the block starts a service on port 8010, plans, writes the launch files)."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

PORT = 8010


def section_block() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Use it from a job scheduler", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return block


@pytest.mark.slow  # a service start and a 10 s plan search, as the README asks
def test_the_job_scheduler_section_runs_as_written(tmp_path: Path) -> None:
    if shutil.which("curl") is None:
        pytest.skip("the section waits for the service with curl, which this machine lacks")
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", PORT)) == 0:
            pytest.skip(f"port {PORT}, which the section serves on, is taken on this machine")
    (tmp_path / ".venv").symlink_to(sys.prefix)
    if not (tmp_path / ".venv" / "bin" / "activate").exists():
        pytest.skip("this interpreter is not a virtual environment's: the section sources .venv/bin/activate")
    done = subprocess.run(
        ["bash", "-e", "-c", section_block()],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"plan 1: pp 2 x tp \d+ x dp \d+", done.stdout), done.stdout
    assert "#SBATCH --nodes=2" in done.stdout
    written = {path.name for path in (tmp_path / "job").iterdir()}
    assert written == {"schedule.csv", "torchtitan.args", "job.sbatch"}
    args = (tmp_path / "job" / "torchtitan.args").read_text().splitlines()
    assert args[args.index("--training.global_batch_size") + 1] == "64"  # 524,288 tokens of 8,192-token sequences
