"""The HTML view in a real browser: ``pipesched serve``, ``GET /v1/schedules/{id}/view``, headless Chromium.

Skips when ``/usr/bin/chromium`` is absent (``.ci/chromium.sh`` installs it).
"""

from __future__ import annotations

import io
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import matplotlib.image
import numpy as np
import pytest

from pipesched.api.render import KIND_COLORS
from tests.conftest import REPO, paper_problem, paper_settings

CHROMIUM = Path("/usr/bin/chromium")

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="headless Chromium is not installed (/usr/bin/chromium); run .ci/chromium.sh"
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``pipesched serve`` on a free loopback port with its own SQLite file."""
    folder = tmp_path_factory.mktemp("serve")
    port = _free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIPESCHED_")}
    env["PIPESCHED_DATABASE_URL"] = f"sqlite:///{folder / 'pipesched.sqlite3'}"
    log = (folder / "serve.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "pipesched.api.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                pytest.fail(f"pipesched serve exited with {process.returncode}: {(folder / 'serve.log').read_text()}")
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"pipesched serve did not answer /healthz in 60 s: {(folder / 'serve.log').read_text()}")
            time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / f"chromium-profile-{time.monotonic_ns()}"
    profile.mkdir()
    command = [
        str(CHROMIUM),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--window-size=1400,900",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def test_served_view_renders_in_headless_chromium(service: str, tmp_path: Path) -> None:
    problem = paper_problem(paper_settings()[0], **{"pipeline.num_microbatches": 24, "solver.method": "zb-h1"})
    created = httpx.post(
        f"{service}/v1/schedules",
        content=problem.model_dump_json(),
        headers={"content-type": "application/json"},
        timeout=120,
    )
    assert created.status_code == 200, created.text
    schedule_id = created.json()["id"]
    url = f"{service}/v1/schedules/{schedule_id}/view?compare=1f1b"
    page = httpx.get(url, timeout=120)
    assert page.status_code == 200, page.text
    assert page.headers["content-type"].startswith("text/html")
    assert "Compared with 1f1b" in page.text

    # The page's script ran to its end (it stamps the number of action bars it wired up on <body>), and a
    # link to one action (#at=3I5) shows that action's tooltip with the schedule's own times.
    dom = _chromium(tmp_path, "--dump-dom", f"{url}#at=3I5")
    ready = re.search(r'<body[^>]*data-ready="(\d+)"', dom.stdout)
    assert ready is not None, f"the view's script did not run: {dom.stderr[-2000:]}"
    assert int(ready.group(1)) == 2 * 8 * 24 * 3  # zb-h1 and 1f1b, 8 ranks × 24 microbatches × F, I, W
    action = next(a for a in created.json()["ranks"][3]["actions"] if a["action"] == "3I5")
    tip = re.search(r'<div id="tip"[^>]*>(.*?)</div>', dom.stdout, re.S)
    assert tip is not None and "<b>3I5</b> on rank 3" in tip.group(1), dom.stdout[-3000:]
    assert f"start {action['start']:.3f} ms · end {action['end']:.3f} ms" in tip.group(1)
    assert re.search(r"memory \d+\.\d\d MiB", tip.group(1))

    shot = tmp_path / "view.png"
    result = _chromium(tmp_path, f"--screenshot={shot}", url)
    assert shot.exists(), f"no screenshot: {result.stderr[-2000:]}"
    image = matplotlib.image.imread(io.BytesIO(shot.read_bytes()), format="png")
    pixels = np.round(image[:, :, :3] * 255).astype(int)
    assert pixels.shape[:2] == (900, 1400)
    distinct = len(np.unique(pixels.reshape(-1, 3), axis=0))
    assert distinct >= 50, f"the screenshot looks blank: {distinct} distinct colours"
    non_white = float((pixels.min(axis=2) < 235).mean())
    assert non_white > 0.15, f"the screenshot is {100 * (1 - non_white):.0f}% white"
    for kind in ("F", "I", "W"):
        rgb = np.array([int(KIND_COLORS[kind][i : i + 2], 16) for i in (1, 3, 5)])
        assert (np.abs(pixels - rgb).max(axis=2) <= 12).sum() > 1000, f"no {kind} bars on screen"
