"""The head's caps and the bound on silent connections, from the config file to
the protocol's settings (``http_config``)."""

from __future__ import annotations

import pytest

from tessera.config import build_config
from tessera.errors import ConfigError
from tessera.gateway.server import http_config


async def app(scope: object, receive: object, send: object) -> None:
    raise AssertionError("not served")


def test_the_defaults_reach_the_protocol() -> None:
    config = http_config(app, build_config({}, {}), "info")
    assert config.head_limits.max_url_bytes == 8 * 1024
    assert config.head_limits.max_header_bytes == 16 * 1024
    assert config.head_limits.max_head_bytes == 64 * 1024
    assert config.head_limits.max_num_headers == 100
    assert config.opening.max_num_per_address == 32
    assert config.ws_max_size > 16 * 1024 * 1024  # max_body_bytes and a margin


def test_sizes_read_as_sizes_and_null_lifts_the_bound() -> None:
    settings = build_config(
        {"max_head_bytes": "1MiB", "max_url_bytes": 2048, "max_num_opening_connections": None},
        {},
    )
    config = http_config(app, settings, "info")
    assert config.head_limits.max_head_bytes == 1024 * 1024
    assert config.head_limits.max_url_bytes == 2048
    assert config.opening.max_num_per_address is None


def test_the_engine_processes_own_socket_is_not_bound() -> None:
    """In the process split the engine process's app hears only its gateways."""
    config = http_config(app, build_config({}, {}), "info", trust_forwarded=True)
    assert config.opening.max_num_per_address is None


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("max_head_bytes", 0),
        ("max_header_bytes", "lots"),
        ("max_url_bytes", -1),
        ("max_num_headers", 0),
        ("max_num_opening_connections", "many"),
    ],
)
def test_bad_values_are_one_config_error(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=key):
        build_config({key: value}, {})
