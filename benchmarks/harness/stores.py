"""The PostgreSQL and Redis servers that tests and benchmarks of shared tenant state use:
real servers on loopback (this machine and CI run both), each test in a
namespace of its own (a PostgreSQL schema, a Redis key prefix) that is
removed afterwards (the tests import it as ``services``).

``TESSERA_TEST_POSTGRES_URL`` and ``TESSERA_TEST_REDIS_URL`` point elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from urllib.parse import quote

DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def postgres_url() -> str:
    return os.environ.get("TESSERA_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL)


def redis_url() -> str:
    return os.environ.get("TESSERA_TEST_REDIS_URL", DEFAULT_REDIS_URL)


@contextlib.contextmanager
def postgres_schema() -> Iterator[str]:
    """A URL whose connections use a new, empty schema; dropped afterwards."""
    import psycopg

    base = postgres_url()
    name = f"tessera_test_{secrets.token_hex(6)}"
    with psycopg.connect(base, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {name}")
    separator = "&" if "?" in base else "?"
    try:
        yield f"{base}{separator}options={quote(f'-csearch_path={name}')}"
    finally:
        with psycopg.connect(base, autocommit=True) as admin:
            admin.execute(f"DROP SCHEMA {name} CASCADE")


@contextlib.contextmanager
def redis_prefix() -> Iterator[str]:
    """A key prefix of its own; every key under it is deleted afterwards, and
    none may outlive that."""
    import redis

    prefix = f"tessera-test:{secrets.token_hex(6)}:"
    client = redis.Redis.from_url(redis_url())
    try:
        yield prefix
    finally:
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)
        assert not list(client.scan_iter(match=f"{prefix}*"))
        client.close()
