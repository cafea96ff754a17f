"""Server configuration: every documented key is accepted, overrides win."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from tessera import config as config_module
from tessera.config import build_config
from tessera.errors import ConfigError


def documented_example() -> dict[str, object]:
    doc = config_module.__doc__ or ""
    block = doc.split("A config file may hold any of::", 1)[1]
    values = yaml.safe_load(textwrap.dedent(block))
    assert isinstance(values, dict)
    return values


def test_documented_example_is_accepted() -> None:
    values = documented_example()
    assert {"memory_budget", "tiers", "scheduling", "auth"} <= set(values)
    settings = build_config(values, {})
    assert settings.engine.memory_budget_bytes == 700 * 1024**2
    assert settings.tiers["vip"].latency_target_s == pytest.approx(0.25)
    assert settings.engine.scheduling == "fair"


def test_command_line_wins_and_none_means_unset() -> None:
    settings = build_config({"port": 1, "auth": True}, {"port": 2, "auth": False, "host": None})
    assert settings.port == 2
    assert settings.auth is False
    assert settings.host == "127.0.0.1"


def test_unknown_keys_and_bad_sizes_are_refused() -> None:
    with pytest.raises(ConfigError, match="unknown config keys"):
        build_config({"memroy_budget": "1GiB"}, {})
    with pytest.raises(ConfigError, match="not a size"):
        build_config({"memory_budget": "lots"}, {})
