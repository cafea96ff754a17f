"""The engine process's interpreter switch interval: the config's while the
engine runs, Python's own again once it is closed, untouched when not given."""

from __future__ import annotations

import sys
from pathlib import Path

from builders import fake_engine

MODELS = {"echo": {"task": "embedding"}}


async def test_the_engine_sets_the_switch_interval_and_restores_it_when_closed(
    tmp_path: Path,
) -> None:
    before = sys.getswitchinterval()
    async with fake_engine(tmp_path / "a", MODELS, gil_switch_interval_s=0.0005):
        assert sys.getswitchinterval() == 0.0005
    assert sys.getswitchinterval() == before
    async with fake_engine(tmp_path / "b", MODELS):
        assert sys.getswitchinterval() == before
