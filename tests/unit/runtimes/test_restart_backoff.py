"""The restart backoff of external engines and isolated workers: none after a
first crash, then 1 s for the second in a row, doubling with each crash up to
30 s, and a success starts the count again (on a clock the test moves)."""

from __future__ import annotations

import pytest

from tessera.runtimes import external
from tessera.runtimes.external import RestartBackoff


@pytest.fixture
def now(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    clock = [1000.0]
    monkeypatch.setattr(external.time, "monotonic", lambda: clock[0])
    return clock


def test_no_wait_after_a_first_crash_then_doubling_up_to_the_cap(now: list[float]) -> None:
    backoff = RestartBackoff()
    assert backoff.wait_s() <= 0  # never crashed
    waits = []
    for _ in range(9):
        backoff.crashed()
        waits.append(backoff.wait_s())
    assert waits == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert backoff.num_crashes == 9
    now[0] += 29.5
    assert backoff.wait_s() == pytest.approx(0.5)
    now[0] += 0.5
    assert backoff.wait_s() <= 0  # a restart may be tried now


def test_a_success_starts_the_count_again(now: list[float]) -> None:
    backoff = RestartBackoff()
    for _ in range(3):
        backoff.crashed()
    assert backoff.wait_s() == 2.0
    backoff.succeeded()
    assert backoff.num_crashes == 0
    backoff.crashed()  # the first crash of a new run: restart at once
    assert backoff.wait_s() <= 0
    backoff.crashed()
    assert backoff.wait_s() == 1.0
