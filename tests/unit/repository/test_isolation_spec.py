"""``isolation``, ``mps_active_thread_percentage`` and ``threads`` on a model card."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tessera.errors import ConfigError
from tessera.repository.spec import parse_spec


def card(**fields: Any) -> dict[str, Any]:
    return {"name": "m", "task": "translate", "runtime": "native", "adapter": "fake", **fields}


def test_inline_is_the_default_and_process_takes_an_mps_share(tmp_path: Path) -> None:
    assert parse_spec(card(), tmp_path).isolation == "inline"
    spec = parse_spec(card(isolation="process", mps_active_thread_percentage=25), tmp_path)
    assert (spec.isolation, spec.mps_active_thread_percentage) == ("process", 25)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"isolation": "thread"}, "isolation must be one of"),
        ({"isolation": "process", "task": "generate"}, "not for generating models"),
        ({"isolation": "process", "adapter": "hf-vision-ocr", "task": "ocr"}, "generating"),
        (
            {"isolation": "process", "runtime": "external", "engine": "llamacpp"},
            "process of its own already",
        ),
        ({"mps_active_thread_percentage": 50}, "needs isolation: process"),
        ({"isolation": "process", "mps_active_thread_percentage": 0}, "1..100"),
        ({"isolation": "process", "mps_active_thread_percentage": True}, "1..100"),
    ],
)
def test_a_card_that_cannot_be_isolated_is_refused(
    tmp_path: Path, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_spec(card(**fields), tmp_path)


def test_threads_are_a_number_or_all(tmp_path: Path) -> None:
    assert parse_spec(card(), tmp_path).threads is None  # one worker's share
    assert parse_spec(card(threads="all"), tmp_path).threads == "all"
    assert parse_spec(card(threads=3), tmp_path).threads == 3
    for bad in (0, -1, True, "most", 1.5):
        with pytest.raises(ConfigError, match="threads must be a positive integer or all"):
            parse_spec(card(threads=bad), tmp_path)
