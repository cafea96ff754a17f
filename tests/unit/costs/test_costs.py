"""Device time split out of shared batches, memory held over time, per tenant;
drains of it; the device time a model that runs elsewhere reports."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest

from tessera.costs import UNATTRIBUTED, CostLedger, UseWindow, split_run
from tessera.engine.executor import BatchRun
from tessera.footprint import Footprint
from tessera.runtimes.base import RemoteModel, RemoteRun, runs_remotely


def test_a_batch_is_split_by_units_and_sums_to_its_run() -> None:
    assert split_run(1.0, [3.0, 1.0]) == pytest.approx([0.75, 0.25])
    assert sum(split_run(0.37, [5.0, 2.0, 11.0])) == pytest.approx(0.37)


def test_requests_with_no_units_counted_take_equal_parts() -> None:
    assert split_run(0.9, [0.0, 0.0, 0.0]) == pytest.approx([0.3, 0.3, 0.3])
    assert split_run(1.0, []) == []


def test_a_texts_four_times_longer_is_attributed_four_times_per_request() -> None:
    ledger = CostLedger()
    for i in range(100):
        ledger.batch_ran("m", 0.05, [("short", 10.0), ("long", 40.0)], now=float(i))
    by = ledger.by_tenant()
    assert by["long"].device_s / by["short"].device_s == pytest.approx(4.0)
    assert ledger.device_s == pytest.approx(5.0)
    assert sum(c.device_s for c in by.values()) == pytest.approx(ledger.device_s)


def test_steps_of_one_request_add_up() -> None:
    ledger = CostLedger()
    total = 0.0
    for step in range(5):
        total += ledger.batch_ran("m", 0.1, [("a", 2.0), ("b", 2.0)], now=float(step))[0]
    assert total == pytest.approx(0.25)
    assert ledger.totals()[("a", "m")].device_s == pytest.approx(0.25)


def test_memory_goes_to_the_users_of_the_window_by_their_device_time() -> None:
    ledger = CostLedger(window_s=60.0)
    ledger.batch_ran("m", 0.3, [("a", 3.0)], now=0.0)
    ledger.batch_ran("m", 0.1, [("b", 1.0)], now=0.0)
    ledger.held({"m": 1000}, now=0.0)
    ledger.held({"m": 1000}, now=10.0)
    totals = ledger.totals()
    assert totals[("a", "m")].byte_s == pytest.approx(7500.0)
    assert totals[("b", "m")].byte_s == pytest.approx(2500.0)
    assert ledger.byte_s == pytest.approx(10_000.0)


def test_a_model_held_with_no_use_in_the_window_is_unattributed() -> None:
    ledger = CostLedger(window_s=5.0)
    ledger.batch_ran("m", 0.1, [("a", 1.0)], now=0.0)
    ledger.held({"m": 100, "idle": 50}, now=1.0)
    ledger.held({"m": 100, "idle": 50}, now=3.0)  # a used m within the window
    ledger.held({"m": 100, "idle": 50}, now=13.0)  # the window passed: nobody's
    totals = ledger.totals()
    assert totals[("a", "m")].byte_s == pytest.approx(200.0)
    assert totals[(UNATTRIBUTED, "m")].byte_s == pytest.approx(1000.0)
    assert totals[(UNATTRIBUTED, "idle")].byte_s == pytest.approx(600.0)
    attributed = sum(c.byte_s for c in totals.values())
    assert attributed == pytest.approx(ledger.byte_s) == pytest.approx(1800.0)


def test_bytes_count_from_the_call_that_saw_them() -> None:
    ledger = CostLedger()
    ledger.held({}, now=0.0)
    ledger.held({"m": 10}, now=5.0)  # loaded in between: counted from here
    ledger.held({}, now=7.0)  # evicted in between: counted until here
    ledger.held({}, now=100.0)
    assert ledger.byte_s == pytest.approx(20.0)


def test_a_clock_that_goes_back_adds_nothing() -> None:
    ledger = CostLedger()
    ledger.held({"m": 10}, now=5.0)
    ledger.held({"m": 10}, now=4.0)
    assert ledger.byte_s == 0.0
    ledger.held({"m": 10}, now=6.0)
    assert ledger.byte_s == pytest.approx(10.0)


def test_the_window_forgets_old_use() -> None:
    window = UseWindow(window_s=10.0)
    window.ran("m", "a", 1.0, now=0.0)
    window.ran("m", "b", 3.0, now=5.0)
    assert window.shares("m", now=5.0) == pytest.approx({"a": 0.25, "b": 0.75})
    assert window.shares("m", now=12.0) == pytest.approx({"b": 1.0})
    assert window.shares("m", now=16.0) == {}
    assert window.shares("never", now=0.0) == {}


def test_three_to_one_traffic_is_attributed_three_to_one() -> None:
    ledger = CostLedger()
    now = 0.0
    for _ in range(400):
        tenants = [("a", 4.0)] * 3 + [("b", 4.0)]
        ledger.batch_ran("m", 0.02, tenants, now=now)
        ledger.held({"m": 1 << 20}, now=now)
        now += 0.25
    by = ledger.by_tenant()
    assert by["a"].device_s / by["b"].device_s == pytest.approx(3.0)
    assert by["a"].byte_s / by["b"].byte_s == pytest.approx(3.0)


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        UseWindow(0.0)


def test_memory_is_drained_once() -> None:
    ledger = CostLedger()
    ledger.batch_ran("m", 0.1, [("a", 1.0)], now=0.0)
    ledger.held({"m": 10}, now=0.0)
    ledger.held({"m": 10}, now=2.0)
    assert ledger.drain_memory() == {("a", "m"): pytest.approx(20.0)}
    assert ledger.drain_memory() == {}
    ledger.held({"m": 10}, now=3.0)
    assert ledger.drain_memory() == {("a", "m"): pytest.approx(10.0)}
    assert ledger.totals()[("a", "m")].byte_s == pytest.approx(30.0)


def test_drains_by_several_callers_are_disjoint_and_add_up() -> None:
    """Gateways polling one engine in turn: each byte-second in one report."""
    ledger = CostLedger(window_s=60.0)
    ledger.batch_ran("m", 0.3, [("a", 3.0), ("b", 1.0)], now=0.0)
    parts: list[dict[tuple[str, str], float]] = []
    for step in range(1, 11):
        ledger.held({"m": 100, "cold": 50}, now=float(step))
        first, second = ledger.drain_memory(), ledger.drain_memory()
        assert second == {}  # the first caller took it all
        parts += [first, second]
    assert ledger.byte_s == pytest.approx(9 * 150.0)
    by_key: dict[tuple[str, str], float] = {}
    for part in parts:
        for key, byte_s in part.items():
            by_key[key] = by_key.get(key, 0.0) + byte_s
    assert by_key == pytest.approx({k: c.byte_s for k, c in ledger.totals().items()})
    assert by_key == pytest.approx(
        {("a", "m"): 675.0, ("b", "m"): 225.0, (UNATTRIBUTED, "cold"): 450.0}
    )


def test_a_model_that_runs_elsewhere_reports_its_device_time() -> None:
    class Remote:
        def run_remote(self, items: Sequence[Any]) -> RemoteRun:
            return RemoteRun([len(items)], 0.25)

        def run(self, items: Sequence[Any]) -> list[Any]:
            return self.run_remote(items).outputs

        def memory(self) -> Footprint:
            return Footprint(0, method="remote")

        def unload(self) -> None:
            return

    class Local:
        def run(self, items: Sequence[Any]) -> list[Any]:
            return list(items)

        def memory(self) -> Footprint:
            return Footprint(0)

        def unload(self) -> None:
            return

    remote, local = Remote(), Local()
    assert runs_remotely(remote)
    assert isinstance(remote, RemoteModel)
    assert not runs_remotely(local)
    assert remote.run_remote(["x"]).device_s == 0.25
    measured = BatchRun(["x"], run_s=0.9, peak_bytes=None)
    assert measured.device_s == 0.9  # run here: what it measured
    assert dataclasses.replace(measured, reported_s=0.25).device_s == 0.25  # elsewhere: reported
