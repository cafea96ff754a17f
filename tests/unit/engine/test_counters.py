"""A model version's recent batches, and those run after a count of them."""

from __future__ import annotations

from tessera.engine.counters import RECENT_BATCHES, ModelCounters


def ran(counters: ModelCounters, sizes: range) -> None:
    for size in sizes:
        counters.batch_ran(size, size / 1000)


def test_batches_since_a_count_are_the_newest_of_the_window() -> None:
    counters = ModelCounters()
    ran(counters, range(1, 11))
    assert counters.batches_since(7) == ((8, 0.008), (9, 0.009), (10, 0.01))
    assert counters.batches_since(10) == ()
    assert counters.batches_since(0) == tuple(counters.recent_batches)


def test_a_count_past_the_window_or_from_older_counters_gives_the_whole_window() -> None:
    counters = ModelCounters()
    ran(counters, range(RECENT_BATCHES + 50))
    assert len(counters.recent_batches) == RECENT_BATCHES
    assert counters.batches_since(10) == tuple(counters.recent_batches)  # 50 fell out
    # These counters were made anew after an older version's count was taken.
    assert counters.batches_since(RECENT_BATCHES + 60) == tuple(counters.recent_batches)
    newest = counters.batches_since(RECENT_BATCHES + 45)
    assert [size for size, _ in newest] == list(range(RECENT_BATCHES + 45, RECENT_BATCHES + 50))
