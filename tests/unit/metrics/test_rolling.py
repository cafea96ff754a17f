"""The rolling window behind /admin/stats and /admin/slo, on a fake clock."""

from __future__ import annotations

import pytest

from tessera.clock import FakeClock
from tessera.metrics import FanoutSink, RequestEvent
from tessera.metrics.rolling import (
    BATCH_BUCKETS,
    RollingStats,
    batch_bucket,
    quantile,
)


def event(
    model: str | None = "embed",
    *,
    status: int = 200,
    total_s: float = 0.01,
    tier: str | None = None,
    tenant: str | None = None,
    reason: str | None = None,
) -> RequestEvent:
    return RequestEvent(model, "embedding", tier, tenant, status, total_s, 0.0, reason)


def make_stats(window_s: float = 60.0) -> tuple[RollingStats, FakeClock]:
    clock = FakeClock(1000.0)
    return RollingStats(window_s, clock=clock, wall_clock=lambda: 1.7e9 + clock.now()), clock


def test_quantile_is_nearest_rank() -> None:
    assert quantile([], 0.5) is None
    assert quantile([3.0], 0.99) == 3.0
    values = [float(v) for v in range(1, 101)]
    assert quantile(values, 0.5) in (50.0, 51.0)
    assert quantile(values, 0.99) == 99.0
    assert quantile(values, 1.0) == 100.0


def test_models_and_tiers_over_the_window() -> None:
    stats, clock = make_stats()
    clock.advance(60.0)  # a full window has passed: QPS divides by 60
    for i in range(100):
        stats.on_request(event(total_s=(i + 1) / 1000.0, tier="vip"))
    stats.on_request(event("rerank", status=500, tier="standard"))
    stats.on_request(event("rerank", status=429, reason="rate", tier="standard"))
    snap = stats.snapshot()
    assert snap.window_s == 60.0
    embed, rerank = snap.models
    assert (embed.name, embed.requests, embed.errors, embed.rejected) == ("embed", 100, 0, 0)
    assert embed.qps == pytest.approx(100 / 60, abs=1e-3)
    assert embed.p50_ms in (50.0, 51.0)
    assert embed.p99_ms == 99.0
    # Failed and refused requests count, but do not enter the latencies.
    assert (rerank.requests, rerank.errors, rerank.rejected) == (2, 2, 1)
    assert (rerank.p50_ms, rerank.p99_ms) == (None, None)
    assert [(t.tier, t.requests) for t in snap.tiers] == [("standard", 2), ("vip", 100)]


def test_old_events_leave_the_window() -> None:
    stats, clock = make_stats(window_s=10.0)
    clock.advance(10.0)
    stats.on_request(event(total_s=5.0))
    stats.on_batch("embed", 4, 0.01)
    clock.advance(6.0)
    stats.on_request(event(total_s=0.002))
    assert stats.snapshot().models[0].requests == 2
    clock.advance(5.0)  # the first events are 11 s old now
    snap = stats.snapshot()
    assert snap.models[0].requests == 1
    assert snap.models[0].p99_ms == 2.0
    assert snap.batch_sizes == {}
    clock.advance(10.0)
    assert stats.snapshot().models == []


def test_qps_of_a_young_window_divides_by_its_age() -> None:
    stats, clock = make_stats()
    clock.advance(10.0)
    for _ in range(20):
        stats.on_request(event())
    assert stats.snapshot().models[0].qps == pytest.approx(2.0)


def test_no_auth_tier_is_none_and_unknown_models_are_folded() -> None:
    clock = FakeClock()
    stats = RollingStats(clock=clock, models={"embed"})
    stats.on_request(event("nope-1", status=404, reason="ModelNotFoundError"))
    stats.on_request(event("nope-2", status=404, reason="ModelNotFoundError"))
    stats.on_request(event(None, status=401, reason="auth"))
    snap = stats.snapshot()
    assert [(m.name, m.requests) for m in snap.models] == [("none", 1), ("unknown", 2)]
    assert [t.tier for t in snap.tiers] == ["none"]
    assert snap.tenants == []
    # Only the six refusal reasons are rejections; a 404 is an error.
    assert [r.reason for r in snap.rejections] == ["auth"]


def test_rejections_keep_the_last_fifty_newest_first() -> None:
    stats, clock = make_stats()
    for i in range(60):
        clock.advance(1.0)
        stats.on_request(event(status=429, reason="quota", tenant=f"t{i}"))
    stats.on_request(event(status=503, reason="queue_full", tenant="acme"))
    rejections = stats.snapshot().rejections
    assert len(rejections) == 50
    newest = rejections[0]
    assert (newest.tenant, newest.model, newest.reason, newest.status) == (
        "acme",
        "embed",
        "queue_full",
        503,
    )
    assert newest.time == pytest.approx(1.7e9 + clock.now())
    assert rejections[1].tenant == "t59"
    assert rejections[-1].tenant == "t11"  # 61 refused: the oldest 11 dropped
    # Rejections are a list of the latest, not windowed.
    clock.advance(3600.0)
    assert len(stats.snapshot().rejections) == 50


BUCKET_CASES = [
    (1, "1"), (2, "2-4"), (4, "2-4"), (5, "5-8"), (8, "5-8"), (9, "9-16"), (16, "9-16"),
    (17, "17-32"), (32, "17-32"), (33, "33+"), (256, "33+"),
]  # fmt: skip


@pytest.mark.parametrize(("size", "bucket"), BUCKET_CASES)
def test_batch_buckets(size: int, bucket: str) -> None:
    assert batch_bucket(size) == bucket


def test_batch_size_distribution_per_model() -> None:
    stats, _ = make_stats()
    for size in (1, 1, 3, 8, 40):
        stats.on_batch("embed", size, 0.01)
    stats.on_batch("ocr", 1, 0.5)
    sizes = stats.snapshot().batch_sizes
    assert list(sizes["embed"]) == list(BATCH_BUCKETS)
    assert sizes["embed"] == {"1": 2, "2-4": 1, "5-8": 1, "9-16": 0, "17-32": 0, "33+": 1}
    assert sizes["ocr"]["1"] == 1


def test_tenant_counts() -> None:
    stats, _ = make_stats()
    for tenant in ("acme", "acme", "beta", None):
        stats.on_request(event(tenant=tenant, tier="standard"))
    tenants = stats.snapshot().tenants
    assert [(t.tenant, t.requests) for t in tenants] == [("acme", 2), ("beta", 1)]


def test_snapshot_json_shape() -> None:
    stats, _ = make_stats()
    stats.on_request(event(tenant="acme", tier="vip"))
    stats.on_request(event(status=429, reason="rate", tenant="acme", tier="vip"))
    stats.on_batch("embed", 2, 0.01)
    body = stats.snapshot().to_json()
    assert set(body) == {"window_s", "models", "tiers", "tenants", "rejections", "batch_sizes"}
    assert {"name", "qps", "p50_ms", "p99_ms", "requests", "errors"} <= set(body["models"][0])
    assert set(body["tiers"][0]) == {"tier", "qps", "p50_ms", "p99_ms", "requests"}
    assert body["tenants"] == [{"tenant": "acme", "requests": 2}]
    assert set(body["rejections"][0]) == {"time", "tenant", "model", "reason", "status"}
    assert body["batch_sizes"]["embed"]["2-4"] == 1


def test_slo_share_within_target() -> None:
    stats, _ = make_stats()
    for _ in range(98):
        stats.on_request(event(total_s=0.1))
    stats.on_request(event(total_s=0.2))  # exactly on target counts as within
    stats.on_request(event(total_s=0.5))
    stats.on_request(event(status=503, total_s=5.0, reason="queue_full"))  # refused: not judged
    stats.on_request(event("ocr", total_s=1.0))
    targets = {"embed": 200.0, "ocr": None, "mt": 300.0}
    by_name = {w.name: w for w in stats.slo(targets)}
    embed = by_name["embed"]
    assert (embed.target_ms, embed.requests, embed.within_target) == (200.0, 100, 99)
    assert embed.share_within == pytest.approx(0.99)
    assert embed.p99_ms == 200.0
    assert embed.ok is True
    assert by_name["embed"].ok is True
    assert [w.ok for w in stats.slo(targets, objective=0.995) if w.name == "embed"] == [False]
    # No target, or nothing answered: nothing to judge.
    assert (by_name["ocr"].share_within, by_name["ocr"].ok, by_name["ocr"].requests) == (
        None,
        None,
        1,
    )
    assert (by_name["mt"].requests, by_name["mt"].ok) == (0, None)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def on_request(self, event: RequestEvent) -> None:
        self.calls.append(("request", event.status))

    def on_batch(self, model: str, size: int, run_s: float) -> None:
        self.calls.append(("batch", size))

    def on_load(self, model: str, seconds: float, ok: bool) -> None:
        self.calls.append(("load", ok))


def test_fanout_feeds_every_sink() -> None:
    first, second = Recorder(), Recorder()
    sink = FanoutSink(first, second)
    sink.on_request(event(status=201))
    sink.on_batch("embed", 3, 0.1)
    sink.on_load("embed", 1.0, False)
    assert first.calls == second.calls == [("request", 201), ("batch", 3), ("load", False)]


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window_s"):
        RollingStats(0.0)
