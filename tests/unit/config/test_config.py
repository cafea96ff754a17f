"""Server configuration: every documented key is accepted, overrides win."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from tessera import config as config_module
from tessera.config import build_config
from tessera.engine.executor import ACROSS_MODELS_THREADS
from tessera.errors import ConfigError
from tessera.residency import PATIENCE_SHARE


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
    assert settings.engine.long_work == "steps"


def test_the_host_tier_budget_is_a_size_zero_turns_it_off_and_absent_is_the_default() -> None:
    assert build_config({"host_memory_budget": "2GiB"}, {}).engine.host_memory_budget_bytes == (
        2 * 1024**3
    )
    assert build_config({}, {"host_memory_budget": "0"}).engine.host_memory_budget_bytes == 0
    assert build_config({}, {}).engine.host_memory_budget_bytes is None  # a quarter of the RAM
    assert documented_example()["host_memory_budget"] == "4GiB"
    with pytest.raises(ConfigError, match="not a size"):
        build_config({"host_memory_budget": "plenty"}, {})


def test_the_cache_is_kept_a_month_unbounded_in_size_unless_said() -> None:
    engine = build_config({}, {}).engine
    assert (engine.cache_max_age_s, engine.cache_max_bytes) == (30 * 86400, None)
    engine = build_config({"cache_max_age_days": 0.5, "cache_max_bytes": "2GiB"}, {}).engine
    assert (engine.cache_max_age_s, engine.cache_max_bytes) == (43200, 2 * 1024**3)
    engine = build_config({"cache_max_age_days": None}, {}).engine
    assert engine.cache_max_age_s is None
    with pytest.raises(ConfigError, match="not a size"):
        build_config({"cache_max_bytes": "lots"}, {})
    with pytest.raises(ConfigError, match="a number of days"):
        build_config({"cache_max_age_days": "forever"}, {})


def test_responses_are_kept_only_when_asked_a_day_by_default(tmp_path: Path) -> None:
    assert build_config({}, {}).response_store() is None
    settings = build_config({"store_responses": True, "data_dir": str(tmp_path)}, {})
    store = settings.response_store()
    assert store is not None
    assert store.retention_s == 24 * 3600
    store.close()
    for bad in (0, "soon"):
        with pytest.raises(ConfigError, match="responses_retention_hours"):
            build_config({"responses_retention_hours": bad}, {})


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


def test_stop_and_read_deadlines_are_seconds_with_bounds() -> None:
    defaults = build_config({}, {})
    assert (defaults.shutdown_grace_s, defaults.header_timeout_s, defaults.body_timeout_s) == (
        30.0,
        10.0,
        60.0,
    )
    settings = build_config({"shutdown_grace_s": 0, "header_timeout_s": "2.5"}, {})
    assert (settings.shutdown_grace_s, settings.header_timeout_s) == (0.0, 2.5)
    with pytest.raises(ConfigError, match="shutdown_grace_s must be at least 0"):
        build_config({"shutdown_grace_s": -1}, {})
    with pytest.raises(ConfigError, match="header_timeout_s must be above 0"):
        build_config({"header_timeout_s": 0}, {})
    with pytest.raises(ConfigError, match="body_timeout_s must be a number"):
        build_config({"body_timeout_s": "soon"}, {})


def test_no_proxy_is_trusted_unless_named() -> None:
    assert build_config({}, {}).trusted_proxies == ()
    assert build_config({"trusted_proxies": "10.0.0.5"}, {}).trusted_proxies == ("10.0.0.5",)
    named = build_config({"trusted_proxies": ["10.0.0.5", "10.0.0.6"]}, {})
    assert named.trusted_proxies == ("10.0.0.5", "10.0.0.6")
    with pytest.raises(ConfigError, match="trusted_proxies must be a list of addresses"):
        build_config({"trusted_proxies": [5]}, {})


def test_long_work_is_steps_or_lane() -> None:
    assert build_config({}, {}).engine.long_work == "steps"
    assert build_config({"long_work": "lane"}, {}).engine.long_work == "lane"
    with pytest.raises(ConfigError, match="long_work must be one of steps, lane"):
        build_config({"long_work": "threads"}, {})


def test_the_switch_interval_is_pythons_unless_given_in_milliseconds() -> None:
    assert build_config({}, {}).engine.gil_switch_interval_s is None
    given = build_config({"gil_switch_interval_ms": 0.5}, {}).engine
    assert given.gil_switch_interval_s == pytest.approx(0.0005)
    for bad in (0, -1):
        with pytest.raises(ConfigError, match="gil_switch_interval_ms must be positive"):
            build_config({"gil_switch_interval_ms": bad}, {})


def test_eviction_patience_is_half_the_target_unless_given() -> None:
    assert build_config({}, {}).engine.eviction_patience == PATIENCE_SHARE == 0.5
    assert build_config({"eviction_patience": 0}, {}).engine.eviction_patience == 0.0
    assert build_config({"eviction_patience": 0.25}, {}).engine.eviction_patience == 0.25
    for bad in (-0.1, None, True, "half"):
        with pytest.raises(ConfigError, match="eviction_patience must be a number"):
            build_config({"eviction_patience": bad}, {})


def test_the_threads_for_batches_across_models() -> None:
    assert build_config({}, {}).engine.across_models_threads == ACROSS_MODELS_THREADS
    assert build_config({"across_models_threads": 8}, {}).engine.across_models_threads == 8
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ConfigError, match="across_models_threads must be a whole number"):
            build_config({"across_models_threads": bad}, {})


def test_cluster_settings_and_the_routers_targets() -> None:
    config = build_config(
        {"cluster": "head:6380", "cluster_window": 8, "cluster_routing": {"target_p99_s": 0.2}},
        {},
    )
    assert (config.cluster, config.cluster_window) == ("head:6380", 8)
    assert config.cluster_routing.target_p99_s == 0.2
    assert config.cluster_routing.max_replicas == 8  # the rest stay at their defaults
    assert build_config({}, {}).cluster is None
    for bad in (
        {"cluster_routing": {"target_p99": 1}},
        {"cluster_routing": {"max_replicas": 0}},
        {"cluster_routing": {"scale_up_after_s": "soon"}},
        {"cluster_routing": [1]},
        {"cluster_window": 0},
    ):
        with pytest.raises(ConfigError):
            build_config(bad, {})


def test_fill_is_a_key_and_a_flag() -> None:
    assert build_config({}, {}).engine.fill is None  # the default rule: EngineConfig.fills
    assert build_config({"fill": False}, {}).engine.fill is False
    assert build_config({"fill": False}, {"fill": True}).engine.fill is True  # --fill wins
    with pytest.raises(ConfigError, match="fill"):
        build_config({"fill": "yes"}, {})


def test_the_access_log_is_off_unless_asked_for() -> None:
    from tessera.gateway.server import http_config

    async def app(scope: object, receive: object, send: object) -> None:
        raise AssertionError("not served")

    assert http_config(app, build_config({}, {}), "info").access_log is False
    assert http_config(app, build_config({"access_log": True}, {}), "info").access_log is True
