"""The tenant store and the audit log are tested on both of their databases:
the SQLite files of one machine and a real PostgreSQL server (tests/services.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services import postgres_schema


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """None for the SQLite file under the data dir; else a PostgreSQL URL on a
    schema of the test's own, dropped afterwards."""
    if request.param == "sqlite":
        yield None
        return
    with postgres_schema() as url:
        yield url
