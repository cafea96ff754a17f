"""A request's image bounds come from the config, with defaults that let a
normal multi-page request through."""

from __future__ import annotations

import pytest

from tessera.config import build_config
from tessera.errors import ConfigError
from tessera.tasks.image import RequestImageLimits


def test_request_image_limits_default_and_are_read_from_the_file() -> None:
    assert build_config({}, {}).image_limits == RequestImageLimits(120_000_000, 64)
    config = build_config({"max_request_pixels": 50_000_000, "max_request_pages": 8}, {})
    assert config.image_limits == RequestImageLimits(50_000_000, 8)


@pytest.mark.parametrize("value", [0, -1, "many", 1.5, True])
def test_request_image_limits_are_whole_numbers_above_zero(value: object) -> None:
    for key in ("max_request_pixels", "max_request_pages"):
        with pytest.raises(ConfigError, match=key):
            build_config({key: value}, {})
