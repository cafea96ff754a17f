"""The GPU check's figures of a load beside its requests: the batch
counters' difference between two snapshots, how busy the client processes
were, and the report's cells for them."""

from __future__ import annotations

from gpu_check import batches_between, client_busy
from gpu_check_report import batch_cell, clients_cell


def test_a_loads_batches_are_the_difference_of_two_snapshots() -> None:
    before = {"batches": 10.0, "batch_items": 100.0, "batch_seconds": 0.5}
    after = {"batches": 110.0, "batch_items": 3300.0, "batch_seconds": 0.65}
    got = batches_between(before, after)
    assert got == {
        "batches": 100,
        "mean_items": 32.0,
        "mean_ms": 1.5,
        "stacked_rounds": 0,  # a server of a tree before the counters: none
        "stacked_batches": 0,
    }
    assert batch_cell(got) == "32, 1.5 ms (100)"


def test_a_loads_stacked_rounds_are_counted_with_its_batches() -> None:
    before = {"batches": 10.0, "batch_items": 10.0, "batch_seconds": 0.5}
    before.update(stacked_rounds=2.0, stacked_batches=5.0)
    after = {"batches": 1010.0, "batch_items": 1010.0, "batch_seconds": 1.5}
    after.update(stacked_rounds=102.0, stacked_batches=905.0)
    got = batches_between(before, after)
    assert (got["stacked_rounds"], got["stacked_batches"]) == (100, 900)
    assert batch_cell(got) == "1, 1 ms (1,000); stacked 9 a round (100 rounds)"


def test_a_load_without_batches_has_no_means() -> None:
    same = {"batches": 4.0, "batch_items": 4.0, "batch_seconds": 0.1}
    got = batches_between(same, same)
    assert got == {
        "batches": 0,
        "mean_items": None,
        "mean_ms": None,
        "stacked_rounds": 0,
        "stacked_batches": 0,
    }
    assert batch_cell(got) == "-"
    assert batch_cell(None) == "-"


def test_busy_clients_are_their_cpu_over_their_seconds() -> None:
    assert client_busy([(9.0, 10.0), (8.0, 10.0)]) == 0.85
    assert client_busy([(9.0, 10.0), (None, 10.0)]) == 0.9  # a client of an older tree
    assert client_busy([(None, 10.0)]) is None
    assert client_busy([]) is None
    assert clients_cell({"processes": 4, "client_busy": 0.85}) == "4 (85% busy)"
    assert clients_cell({"processes": 4}) == "4"
