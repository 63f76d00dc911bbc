"""Fixtures of the planner's tests: the service on a fresh SQLite database."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from pipesched.api.app import create_app
from pipesched.api.settings import Settings


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """The service (one solver worker, searches up to 20 s) on a database of the test module's own."""
    path = tmp_path_factory.mktemp("plans") / "pipesched.sqlite3"
    settings = Settings(database_url=f"sqlite:///{path}", solver_workers=1, max_time_limit_s=20)
    with TestClient(create_app(settings)) as test_client:
        yield test_client
