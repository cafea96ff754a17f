"""Fresh models (``fresh.py``): protected from a load until the first batch or
the protection's end, on a fake clock."""

from __future__ import annotations

import pytest

from tessera.clock import FakeClock
from tessera.residency.fresh import FRESH_PROTECTION_S, FreshModels


def test_a_model_is_fresh_until_its_protection_ends() -> None:
    clock = FakeClock()
    fresh = FreshModels(clock)
    fresh.add("m")
    clock.advance(FRESH_PROTECTION_S - 0.001)
    assert fresh.names() == {"m"}
    assert fresh.seconds_to_expiries() == [pytest.approx(0.001)]
    clock.advance(0.001)
    assert fresh.names() == set()
    assert fresh.seconds_to_expiries() == []


def test_its_first_batch_ends_the_protection() -> None:
    fresh = FreshModels(FakeClock())
    fresh.add("a")
    fresh.add("b")
    fresh.discard("a")
    fresh.discard("never-added")
    assert fresh.names() == {"b"}


def test_a_new_load_restarts_the_protection() -> None:
    clock = FakeClock()
    fresh = FreshModels(clock, protection_s=2.0)
    fresh.add("m")
    clock.advance(1.5)
    fresh.add("m")
    clock.advance(1.5)
    assert fresh.names() == {"m"}
    assert fresh.seconds_to_expiries() == [pytest.approx(0.5)]
