"""Admission shared by gateways through a real Redis: two controllers stand
for two gateways, each with its own client and gateway id, on a key prefix of
the test's own. Limits hold across both together; a gateway that dies
without releasing gives its slots back once its lease lapses."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from services import redis_prefix, redis_url
from tessera.admission import Admission, AdmissionController, TenantLimits
from tessera.admission.shared import RedisAdmissionController
from tessera.clock import FakeClock
from tessera.errors import PayloadTooLargeError, RateLimitedError

LEASE_S = 1.0


@pytest.fixture
def prefix() -> Iterator[str]:
    with redis_prefix() as prefix:
        yield prefix


@pytest.fixture
def gateways(prefix: str) -> Iterator[list[RedisAdmissionController]]:
    pair = [
        RedisAdmissionController.from_url(redis_url(), prefix=prefix, lease_s=LEASE_S)
        for _ in range(2)
    ]
    yield pair
    for gateway in pair:
        gateway.close()


def try_admit(
    gateway: RedisAdmissionController, limits: TenantLimits, units: float = 1.0
) -> Admission | RateLimitedError:
    try:
        return gateway.admit(limits, units)
    except RateLimitedError as e:
        return e


def test_a_burst_from_two_gateways_passes_exactly_the_buckets_worth(
    gateways: list[RedisAdmissionController],
) -> None:
    # One token every 1000 s: no refill within the test, so the count is exact.
    limits = TenantLimits("acme", qps=0.001, burst=10)
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(lambda i: try_admit(gateways[i % 2], limits), range(30)))
    admitted = [r for r in results if isinstance(r, Admission)]
    refused = [r for r in results if isinstance(r, RateLimitedError)]
    assert len(admitted) == 10
    assert {r.reason for r in refused} == {"rate"}
    # The same figures as the in-process bucket: about one token's wait, a full refill.
    assert refused[0].retry_after_s == pytest.approx(1000, rel=1e-3)
    assert refused[0].reset_s == pytest.approx(10_000, rel=1e-3)
    assert (refused[0].limit, refused[0].remaining) == (0.001, 0)
    assert gateways[1].remaining(limits) == 0
    for admission in admitted:
        gateways[0].release(admission)


def test_in_flight_across_two_gateways_never_exceeds_the_limit(
    gateways: list[RedisAdmissionController],
) -> None:
    # Eight callers over two gateways, in rounds: each tries once while those
    # admitted hold their places, then all release. A place held for no time
    # at all (the first version) let every try through in some runs, so the
    # limit went untested (CI saw 0 refusals).
    limits = TenantLimits("acme", max_concurrency=3)
    callers, rounds = 8, 20
    lock = threading.Lock()
    held = {"now": 0, "most": 0, "refused": 0}
    tried = threading.Barrier(callers, timeout=30)
    released = threading.Barrier(callers, timeout=30)

    def caller(i: int) -> None:
        gateway = gateways[i % 2]
        for _ in range(rounds):
            result = try_admit(gateway, limits)
            if isinstance(result, RateLimitedError):
                assert result.reason == "concurrency"
                with lock:
                    held["refused"] += 1
            else:
                with lock:
                    held["now"] += 1
                    held["most"] = max(held["most"], held["now"])
            tried.wait()  # every caller has tried while the admitted hold
            if not isinstance(result, RateLimitedError):
                with lock:
                    held["now"] -= 1
                gateway.release(result)
            released.wait()  # every place is free again before the next round

    with ThreadPoolExecutor(max_workers=callers) as pool:
        list(pool.map(caller, range(callers)))
    assert held["most"] == 3
    assert held["refused"] == (callers - 3) * rounds  # exactly the limit, every round
    assert gateways[0].in_flight("acme") == gateways[1].in_flight("acme") == 0


def test_concurrency_and_daily_units_hold_across_two_gateways(
    gateways: list[RedisAdmissionController],
) -> None:
    a, b = gateways
    limits = TenantLimits("acme", max_concurrency=2, daily_units=100)
    first = a.admit(limits, 30)
    second = b.admit(limits, 30)
    assert a.in_flight("acme") == b.in_flight("acme") == 2
    refused = try_admit(a, limits, 30)
    assert isinstance(refused, RateLimitedError)
    assert (refused.reason, refused.limit, refused.retry_after_s) == ("concurrency", 2, 1.0)
    assert "2 requests in flight" in str(refused)
    b.release(first)  # released by the other gateway than admitted it: still one slot
    b.settle(first, 10)  # it ran 10 units, not the 30 estimated
    third = a.admit(limits, 30)  # 10 + 30 + 30 = 70 units today
    a.release(second)
    b.settle(second, 30)
    fourth = b.admit(limits, 30)  # 100: exactly the quota
    a.release(third)
    a.settle(third, 30)
    # Over the quota only by the estimate the fourth holds in flight: a retry
    # once it settles may fit, so the wait is a second, not the day's end.
    held = try_admit(a, limits, 1)
    assert isinstance(held, RateLimitedError)
    assert (held.reason, held.limit, held.remaining, held.retry_after_s) == (
        "quota",
        100,
        0.0,
        1.0,
    )
    assert "hold 30 of the 100 counted" in str(held)
    b.settle(fourth, 30)  # it ran whole, still in flight: 100 used, none held
    over = try_admit(a, limits, 1)
    assert isinstance(over, RateLimitedError)
    assert (over.reason, over.limit, over.remaining) == ("quota", 100, 0.0)
    assert "(100 used, this request needs 1)" in str(over)
    assert over.retry_after_s == over.reset_s
    assert over.reset_s is not None
    assert 0 < over.reset_s <= 86_400
    b.release(fourth)


def test_seeding_fills_only_a_day_redis_does_not_hold(
    gateways: list[RedisAdmissionController],
) -> None:
    a, b = gateways
    limits = TenantLimits("acme", daily_units=100)
    a.seed_usage("acme", 60)  # the first gateway up, from the audit log
    a.admit(limits, 30)
    b.seed_usage("acme", 60)  # a second one: Redis already counts 90
    refused = try_admit(b, limits, 20)
    assert isinstance(refused, RateLimitedError)
    assert refused.remaining == 10


def test_the_same_refusals_as_the_in_process_controller(
    gateways: list[RedisAdmissionController],
) -> None:
    limits = TenantLimits("acme", qps=0.001, burst=3, max_concurrency=2, daily_units=50)
    local = AdmissionController(FakeClock(), wall_time=lambda: 1_700_000_000.0)
    steps = [("admit", 20), ("admit", 20), ("admit", 5), ("release", 0), ("release", 0)]
    steps += [("admit", 20), ("admit", 5), ("release", 0), ("admit", 1)]
    seen: dict[str, list[tuple[str, float | None, float | None]]] = {}
    for name, controller in (("local", local), ("shared", gateways[0])):
        held: list[Admission] = []
        seen[name] = []
        for action, units in steps:
            if action == "release":
                controller.release(held.pop())
                continue
            try:
                held.append(controller.admit(limits, units))
                seen[name].append(("ok", None, None))
            except RateLimitedError as e:
                seen[name].append((e.reason, e.limit, e.remaining))
        for admission in held:
            controller.release(admission)
    assert seen["shared"] == seen["local"]
    assert [reason for reason, _, _ in seen["shared"]] == [
        "ok",
        "ok",
        "concurrency",
        "quota",
        "ok",
        "rate",
    ]
    # A request over the whole quota: the same 413 from both, nothing charged.
    for controller in (local, gateways[0]):
        with pytest.raises(PayloadTooLargeError, match="whole daily quota of 50"):
            controller.admit(limits, 51)


def test_the_same_refusals_while_requests_in_flight_hold_their_estimates(
    gateways: list[RedisAdmissionController],
) -> None:
    limits = TenantLimits("acme", daily_units=100)
    local = AdmissionController(FakeClock(), wall_time=lambda: 1_700_000_000.0)
    for controller in (local, gateways[0]):
        first = controller.admit(limits, 80)  # a chat's prompt and max_tokens, say
        held = try_admit(controller, limits, 30)
        assert isinstance(held, RateLimitedError)
        assert (held.reason, held.retry_after_s, held.remaining) == ("quota", 1.0, 20)
        assert "hold 80 of the 80 counted" in str(held)
        assert held.reset_s is not None
        assert held.reset_s > 1.0
        controller.settle(first, 20)  # it ran 20: the retry fits
        second = controller.admit(limits, 30)
        # 50 counted, 30 of them held: 90 more would not fit even without them.
        over = try_admit(controller, limits, 90)
        assert isinstance(over, RateLimitedError)
        assert over.retry_after_s == over.reset_s
        assert "(50 used, this request needs 90)" in str(over)
        controller.release(first)
        controller.release(second)
        # Nothing in flight: an estimate never settled (a gateway that died) is used.
        over = try_admit(controller, limits, 60)
        assert isinstance(over, RateLimitedError)
        assert over.retry_after_s == over.reset_s


def redis_now(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1e6


def test_a_dead_gateways_slots_come_back_after_its_lease(prefix: str) -> None:
    client = redis.Redis.from_url(redis_url())
    living = RedisAdmissionController.from_url(redis_url(), prefix=prefix, lease_s=LEASE_S)
    dying = RedisAdmissionController.from_url(redis_url(), prefix=prefix, lease_s=LEASE_S)
    try:
        limits = TenantLimits("acme", max_concurrency=2)
        dying.admit(limits, 1)
        dying.admit(limits, 1)
        # While it lives, its renewals keep the slots past the first lease.
        lease_end = redis_now(client) + LEASE_S
        while redis_now(client) < lease_end + LEASE_S / 2:
            time.sleep(0.05)
        refused = try_admit(living, limits)
        assert isinstance(refused, RateLimitedError)
        assert refused.reason == "concurrency"
        # It dies: no release, no more renewals.
        dying.close()
        died_at = redis_now(client)
        while redis_now(client) < died_at + LEASE_S + 0.05:
            time.sleep(0.05)
        assert living.in_flight("acme") == 0
        admitted = [living.admit(limits, 1), living.admit(limits, 1)]
        assert isinstance(try_admit(living, limits), RateLimitedError)
        for admission in admitted:
            living.release(admission)
    finally:
        living.close()
        client.close()


def test_a_gateway_dropped_while_alive_writes_its_count_back(prefix: str) -> None:
    gateway = RedisAdmissionController.from_url(redis_url(), prefix=prefix, lease_s=LEASE_S)
    other = RedisAdmissionController.from_url(redis_url(), prefix=prefix, lease_s=LEASE_S)
    client = redis.Redis.from_url(redis_url())
    try:
        limits = TenantLimits("acme", max_concurrency=1)
        admission = gateway.admit(limits, 1)
        # A stall longer than the lease: another gateway drops the count...
        client.hset(f"{prefix}{{acme}}:flight", f"u:{gateway.gateway_id}", 0)
        assert other.in_flight("acme") == 0
        # ...and the next renewal puts it back, so the limit holds again.
        gateway.renew()
        assert other.in_flight("acme") == 1
        assert isinstance(try_admit(other, limits), RateLimitedError)
        gateway.release(admission)
        assert other.in_flight("acme") == 0
    finally:
        gateway.close()
        other.close()
        client.close()


def test_renewals_beside_releases_never_bring_back_a_slot_given_up(
    gateways: list[RedisAdmissionController],
) -> None:
    # A renewal that read the count before a release and wrote it back after
    # brought back a slot no request held (for a lease), so the next round
    # was refused one place short.
    limits = TenantLimits("acme", max_concurrency=1)
    gateway = gateways[0]
    stop = threading.Event()
    # The renewal's script starts a little late, as it does on a busy machine
    # when the thread is switched out, so a release can fall in between.
    renew_script = gateway._renew

    def late_renewal(keys: list[str], args: list[str | int | float]) -> object:
        time.sleep(0.002)
        return renew_script(keys=keys, args=args)

    gateway._renew = late_renewal  # type: ignore[assignment]

    def renew_all_the_time() -> None:
        while not stop.is_set():
            gateway.renew()

    renewer = threading.Thread(target=renew_all_the_time)
    renewer.start()
    try:
        for _ in range(200):
            gateway.release(gateway.admit(limits, 1))
            assert gateways[1].in_flight("acme") == 0
    finally:
        stop.set()
        renewer.join()
