"""Kept Responses API answers (``tenants/responses.py``), on SQLite and
PostgreSQL: a tenant's own only, gone past their retention, deleted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tessera.errors import ConfigError
from tessera.tenants.responses import ResponseStore

T0 = 1_700_000_000.0
HOUR = 3600.0


class Wall:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def wall() -> Wall:
    return Wall()


@pytest.fixture
def store(tmp_path: Path, database_url: str | None, wall: Wall) -> Iterator[ResponseStore]:
    made = ResponseStore(tmp_path, database_url, 24 * HOUR, wall_clock=wall)
    yield made
    made.close()


def response(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response", "output": [{"type": "message"}]}


TURNS = [{"type": "message", "role": "user", "content": "hi"}]


def test_a_tenant_finds_its_own_responses_only(store: ResponseStore) -> None:
    store.put("shop", response("resp_1"), TURNS)
    found = store.get("shop", "resp_1")
    assert found is not None
    assert (found.response, found.conversation) == (response("resp_1"), TURNS)
    assert store.get("app", "resp_1") is None
    assert store.get("shop", "resp_2") is None
    assert not store.delete("app", "resp_1")
    assert store.delete("shop", "resp_1")
    assert store.get("shop", "resp_1") is None


def test_past_its_retention_a_response_is_not_found_and_goes(
    store: ResponseStore, wall: Wall
) -> None:
    store.put("shop", response("resp_old"), TURNS)
    wall.now += 23 * HOUR
    store.put("shop", response("resp_new"), TURNS)
    assert store.get("shop", "resp_old") is not None
    wall.now += 2 * HOUR
    assert store.get("shop", "resp_old") is None
    assert store.get("shop", "resp_new") is not None
    assert store.purge() == 1


def test_two_stores_on_one_database_see_each_others_rows(
    tmp_path: Path, database_url: str | None, wall: Wall
) -> None:
    first = ResponseStore(tmp_path, database_url, HOUR, wall_clock=wall)
    second = ResponseStore(tmp_path, database_url, HOUR, wall_clock=wall)
    try:
        first.put("shop", response("resp_1"), TURNS)
        assert second.get("shop", "resp_1") is not None
    finally:
        first.close()
        second.close()


def test_a_retention_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="positive"):
        ResponseStore(tmp_path, None, 0)
