"""The fake model's host-tier copies as the engine ceiling bench models a
device's (options offload_s, restore_s, copy_calls): each copy of more than
0 s first makes its calls that hand the interpreter lock over, then takes its
time on its own copy stream; a copy of 0 s (a kept buffer) makes none."""

from __future__ import annotations

from pathlib import Path

import pytest

from builders import fake_engine
from harness import fake_models as fake
from tessera.tasks.types import Task, TextInput

MIB = 1024**2


@pytest.mark.parametrize(("offload_s", "out_calls"), [(0.002, 3), (0.0, 0)])
async def test_a_swaps_copies_make_their_calls_then_take_their_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offload_s: float, out_calls: int
) -> None:
    sleeps: list[tuple[float, bool, bool]] = []
    sleep = fake.time.sleep

    def recorded(seconds: float) -> None:
        sleeps.append((seconds, fake._COPY_OUT.locked(), fake._COPY_BACK.locked()))
        sleep(seconds)

    options = {"own_bytes": 40 * MIB, "host_tier": True, "copy_calls": 3}
    options.update(offload_s=offload_s, restore_s=0.003)
    card = {"task": "embedding", "options": options}
    async with fake_engine(tmp_path, {"a": card, "b": card}) as engine:
        await engine.infer("a", Task.EMBEDDING, [TextInput("x")])
        monkeypatch.setattr(fake.time, "sleep", recorded)
        await engine.infer("b", Task.EMBEDDING, [TextInput("x")])  # a leaves: a copy out
        out = list(sleeps)
        sleeps.clear()
        await engine.infer("a", Task.EMBEDDING, [TextInput("x")])  # b out, a back
        monkeypatch.undo()
    expected_out = [(0, False, False)] * out_calls + (
        [(offload_s, True, False)] if offload_s else []
    )
    assert out == expected_out
    back = [s for s in sleeps if s[0] == 0.003]
    assert back == [(0.003, False, True)]  # a's return, on the copy stream back
    assert len([s for s in sleeps if s[0] == 0]) == out_calls + 3  # b's copy out, a's back
