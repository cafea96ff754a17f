"""The cluster's routing policy over engine reports, on a fake clock.

Each test builds the reports engines would send (``report``) and reads the
router's choices; time is a ``FakeClock`` advanced by hand.
"""

from __future__ import annotations

from tessera.clock import FakeClock
from tessera.cluster import (
    AddReplica,
    DeviceReport,
    DropReplica,
    ModelLoad,
    Router,
    RoutingConfig,
)

BUDGET = 1000


def held(name: str, *, weights: int = 300, queue: int = 0, busy_s: float = 0.0,
         p99_s: float | None = None, state: str = "ready") -> ModelLoad:  # fmt: skip
    return ModelLoad(name, state, weights, queue, busy_s, p99_s)


def report(device: str, clock: FakeClock, *models: ModelLoad, used: int | None = None,
           window_s: float = 1.0) -> DeviceReport:  # fmt: skip
    held_bytes = sum(m.weights_bytes for m in models if m.state in ("ready", "loading"))
    return DeviceReport(
        device, clock.now(), window_s, BUDGET, held_bytes if used is None else used, models
    )


def make_router(clock: FakeClock, *devices: str, **config: float) -> Router:
    router = Router(RoutingConfig(**config))  # type: ignore[arg-type]
    for device in devices:
        router.report(report(device, clock))
    return router


def test_request_goes_where_its_model_is_resident() -> None:
    clock = FakeClock()
    router = make_router(clock, "a", "b", "c")
    router.report(report("b", clock, held("m")))
    assert {router.route("m", 300, clock.now()) for _ in range(5)} == {"b"}


def test_replicas_share_requests_by_load() -> None:
    clock = FakeClock()
    router = make_router(clock, "a", "b")
    router.report(report("a", clock, held("m", queue=3)))
    router.report(report("b", clock, held("m")))
    sent = [router.route("m", 300, clock.now()) for _ in range(5)]
    # b takes requests until its own count reaches a's reported queue, then they alternate
    assert sent == ["b", "b", "b", "a", "b"]
    for device in sent:
        router.answered(device)  # type: ignore[arg-type]
    assert router.route("m", 300, clock.now()) == "b"


def test_cold_model_placed_once_where_it_fits_and_load_is_least() -> None:
    clock = FakeClock()
    router = make_router(clock, "a", "b", "c")
    router.report(report("a", clock, held("x", weights=900)))  # no room for 300
    router.report(report("b", clock, held("y", weights=100, queue=4)))
    router.report(report("c", clock, held("z", weights=100, queue=1)))
    # before any report shows it, every request goes to the device chosen first
    assert {router.route("m", 300, clock.now()) for _ in range(10)} == {"c"}
    assert router.replicas("m") == {"c"}


def test_placements_not_yet_reported_count_against_free_bytes() -> None:
    clock = FakeClock()
    router = make_router(clock, "a", "b")
    first = router.route("m", 600, clock.now())
    second = router.route("n", 600, clock.now())
    assert {first, second} == {"a", "b"}


def test_model_fitting_nowhere_goes_to_least_loaded() -> None:
    clock = FakeClock()
    router = make_router(clock, "a", "b")
    router.report(report("a", clock, held("x", weights=900, queue=5)))
    router.report(report("b", clock, held("y", weights=900)))
    assert router.route("m", 300, clock.now()) == "b"


def test_same_reports_give_every_router_the_same_placement() -> None:
    clock = FakeClock()
    routers = [make_router(clock, "a", "b", "c") for _ in range(2)]
    for router in routers:
        router.report(report("a", clock, held("x", weights=500)))
    assert {r.route("m", 300, clock.now()) for r in routers} == {"b"}


def test_unconfirmed_placement_forgotten_after_ttl() -> None:
    clock = FakeClock()
    router = make_router(clock, "a", "b", placement_ttl_s=5.0)
    assert router.route("m", 300, clock.now()) == "a"
    clock.advance(4)
    router.report(report("a", clock))
    assert router.replicas("m") == {"a"}
    clock.advance(2)
    router.report(report("a", clock))
    assert router.replicas("m") == set()


def test_evicted_model_leaves_its_replicas() -> None:
    clock = FakeClock()
    router = make_router(clock, "a", "b")
    assert router.route("m", 300, clock.now()) == "a"
    router.report(report("a", clock, held("m", state="loading")))
    router.report(report("a", clock, held("m")))
    router.report(report("a", clock, held("other")))  # a's residency evicted m
    assert router.replicas("m") == set()


def hot_round(router: Router, clock: FakeClock, devices: list[str], queue: int) -> list[object]:
    for device in devices:
        router.report(report(device, clock, held("m", queue=queue, busy_s=1.0)))
    return list(router.rebalance(clock.now()))


def test_hot_model_gets_a_replica_after_staying_hot() -> None:
    clock = FakeClock()
    router = make_router(clock, "a", "b", "c", scale_up_after_s=1.0, max_queue_per_replica=4)
    router.report(report("b", clock, held("n", weights=600)))
    assert hot_round(router, clock, ["a"], queue=10) == []
    clock.advance(0.5)
    assert hot_round(router, clock, ["a"], queue=10) == []
    clock.advance(0.5)
    assert hot_round(router, clock, ["a"], queue=10) == [AddReplica("m", "c")]
    assert router.replicas("m") == {"a", "c"}
    # one at a time: no third copy before the second is confirmed by a report
    clock.advance(2)
    assert hot_round(router, clock, ["a"], queue=30) == []
    assert hot_round(router, clock, ["a", "c"], queue=30) == []
    clock.advance(1)
    assert hot_round(router, clock, ["a", "c"], queue=30) == [AddReplica("m", "b")]


def test_p99_over_target_makes_a_model_hot() -> None:
    clock = FakeClock()
    router = make_router(clock, "a", "b", scale_up_after_s=0.0, target_p99_s=0.2)
    router.report(report("a", clock, held("m", p99_s=0.1, busy_s=0.9)))
    assert router.rebalance(clock.now()) == []
    router.report(report("a", clock, held("m", p99_s=0.3, busy_s=0.9)))
    assert router.rebalance(clock.now()) == [AddReplica("m", "b")]


def test_latency_made_by_loads_is_not_replicated() -> None:
    clock = FakeClock()
    router = make_router(clock, "a", "b", scale_up_after_s=0.0, target_p99_s=0.2)
    router.report(report("a", clock, held("m", p99_s=3.0, queue=50, busy_s=0.1)))
    assert router.rebalance(clock.now()) == []


def test_loading_model_is_not_replicated_for_its_queue() -> None:
    clock = FakeClock()
    router = make_router(clock, "a", "b", scale_up_after_s=0.0, max_queue_per_replica=1)
    router.report(report("a", clock, held("m", state="loading", queue=50)))
    assert router.rebalance(clock.now()) == []


def test_replicas_bounded_by_max_replicas() -> None:
    clock = FakeClock()
    router = make_router(clock, "a", "b", "c", scale_up_after_s=0.0, max_replicas=2)
    assert hot_round(router, clock, ["a"], queue=100) == [AddReplica("m", "b")]
    assert hot_round(router, clock, ["a", "b"], queue=100) == []


def test_cold_replica_dropped_after_staying_cold_never_the_last() -> None:
    clock = FakeClock()
    router = make_router(clock, "a", "b", scale_down_after_s=10.0, target_utilization=0.5)
    router.report(report("a", clock, held("m", busy_s=0.2)))
    router.report(report("b", clock, held("m", busy_s=0.1)))
    assert router.rebalance(clock.now()) == []
    clock.advance(10)
    assert router.rebalance(clock.now()) == [DropReplica("m", "b")]
    assert router.replicas("m") == {"a"}
    # b's report still holds it until it is unloaded: no request goes there
    router.report(report("b", clock, held("m")))
    assert {router.route("m", 300, clock.now()) for _ in range(3)} == {"a"}
    clock.advance(100)
    assert router.rebalance(clock.now()) == []


def test_busy_replicas_are_kept() -> None:
    clock = FakeClock()
    router = make_router(clock, "a", "b", scale_down_after_s=1.0, target_utilization=0.5)
    router.report(report("a", clock, held("m", busy_s=0.4)))
    router.report(report("b", clock, held("m", busy_s=0.4)))
    router.rebalance(clock.now())
    clock.advance(5)
    assert router.rebalance(clock.now()) == []  # 0.8 busy needs two at 0.5


def test_dead_device_models_placed_again_if_recently_used() -> None:
    clock = FakeClock()
    router = make_router(clock, "a", "b", "c", cold_after_s=60.0)
    router.report(report("a", clock, held("m"), held("old")))
    router.report(report("b", clock, held("n", weights=500)))
    router.route("old", 300, clock.now())
    clock.advance(100)
    router.route("m", 300, clock.now())
    assert router.remove_device("a", clock.now()) == [AddReplica("m", "c")]
    assert router.replicas("m") == {"c"}
    assert router.replicas("old") == set()
    assert router.route("old", 300, clock.now()) in {"b", "c"}


def test_no_device_no_route() -> None:
    clock = FakeClock()
    assert Router().route("m", 1, clock.now()) is None


def test_batches_longer_than_a_window_still_count_as_busy() -> None:
    clock = FakeClock()
    router = make_router(clock, "a", "b", scale_up_after_s=1.0, max_queue_per_replica=4)
    actions: list[object] = []
    for i in range(8):  # a long batch ends in every other window of 0.25 s
        busy = 0.5 if i % 2 else 0.0
        router.report(report("a", clock, held("m", queue=20, busy_s=busy), window_s=0.25))
        actions += router.rebalance(clock.now())
        clock.advance(0.25)
    assert actions == [AddReplica("m", "b")]
