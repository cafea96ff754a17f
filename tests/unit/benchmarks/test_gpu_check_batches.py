"""The GPU check's batch figures of a load: the batch counters' difference
between two snapshots, and the report's cell for them."""

from __future__ import annotations

from gpu_check import batches_between
from gpu_check_report import batch_cell


def test_a_loads_batches_are_the_difference_of_two_snapshots() -> None:
    before = {"batches": 10.0, "batch_items": 100.0, "batch_seconds": 0.5}
    after = {"batches": 110.0, "batch_items": 3300.0, "batch_seconds": 0.65}
    got = batches_between(before, after)
    assert got == {"batches": 100, "mean_items": 32.0, "mean_ms": 1.5}
    assert batch_cell(got) == "32, 1.5 ms (100)"


def test_a_load_without_batches_has_no_means() -> None:
    same = {"batches": 4.0, "batch_items": 4.0, "batch_seconds": 0.1}
    got = batches_between(same, same)
    assert got == {"batches": 0, "mean_items": None, "mean_ms": None}
    assert batch_cell(got) == "-"
    assert batch_cell(None) == "-"
