"""Config keys of tenant state shared by many gateways: PostgreSQL, the key secret, Redis."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.config import build_config
from tessera.errors import ConfigError


def test_tenant_state_defaults_to_the_data_dir() -> None:
    settings = build_config({}, {})
    assert (settings.tenant_store, settings.key_secret_file) == (None, None)


def test_gateways_name_a_database_and_a_secret_file() -> None:
    settings = build_config(
        {"tenant_store": "postgresql://db.internal/tessera", "key_secret_file": "/run/key"}, {}
    )
    assert settings.tenant_store == "postgresql://db.internal/tessera"
    assert settings.key_secret_file == Path("/run/key")


@pytest.mark.parametrize("key", ["tenant_store", "key_secret_file"])
def test_a_url_or_path_must_be_a_string(key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        build_config({key: 5432}, {})


def test_admission_counters_default_to_this_process() -> None:
    settings = build_config({}, {})
    assert settings.admission_store is None
    assert (settings.admission_prefix, settings.admission_lease_s) == ("tessera:", 30.0)


def test_gateways_name_a_redis_for_admission() -> None:
    settings = build_config(
        {
            "admission_store": "redis://cache.internal:6379/0",
            "admission_prefix": "prod:",
            "admission_lease_s": 10,
        },
        {},
    )
    assert settings.admission_store == "redis://cache.internal:6379/0"
    assert (settings.admission_prefix, settings.admission_lease_s) == ("prod:", 10.0)
    with pytest.raises(ConfigError, match="admission_lease_s"):
        build_config({"admission_lease_s": 0}, {})
