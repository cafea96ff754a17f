"""Adapters beyond the built-in ones: a config's ``adapters`` (and ``--adapter``)."""

from __future__ import annotations

import pytest

from harness.fake_models import FAKE_ADAPTERS, FakeLoader
from tessera.cli import _adapters
from tessera.config import build_config
from tessera.errors import ConfigError
from tessera.runtimes.registry import ADAPTERS, get_loader, parse_adapters


def test_a_configured_adapter_loads_by_its_name() -> None:
    assert isinstance(get_loader("fake", FAKE_ADAPTERS), FakeLoader)


def test_an_adapter_neither_built_in_nor_configured_is_unknown() -> None:
    assert "fake" not in ADAPTERS
    with pytest.raises(ConfigError, match="unknown adapter 'fake'"):
        get_loader("fake")


def test_an_adapter_that_cannot_be_imported_says_which() -> None:
    with pytest.raises(ConfigError, match="cannot import no_such_module:Loader"):
        get_loader("gone", {"gone": "no_such_module:Loader"})
    with pytest.raises(ConfigError, match=r"cannot import harness\.fake_models:NoLoader"):
        get_loader("gone", {"gone": "harness.fake_models:NoLoader"})


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (["fake"], "must be a mapping"),
        ({"hf-encoder": "harness.fake_models:FakeLoader"}, "is a built-in adapter"),
        ({"fake": "harness.fake_models"}, "must name module:Class"),
        ({"fake": ":FakeLoader"}, "must name module:Class"),
        ({"fake": 3}, "must name module:Class"),
        ({"": "harness.fake_models:FakeLoader"}, "non-empty string"),
    ],
)
def test_a_bad_adapters_mapping_is_refused(raw: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_adapters(raw)


def test_the_config_key_and_the_option_reach_the_engine() -> None:
    assert build_config({}, {}).engine.adapters == {}
    assert build_config({"adapters": FAKE_ADAPTERS}, {}).engine.adapters == FAKE_ADAPTERS
    given = _adapters(["fake=harness.fake_models:FakeLoader"])
    assert build_config({"adapters": {"x": "m:C"}}, {"adapters": given}).engine.adapters == (
        FAKE_ADAPTERS
    )
    with pytest.raises(ConfigError, match="must name module:Class"):
        build_config({}, {"adapters": _adapters(["fake"])})
