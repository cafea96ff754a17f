"""A lost admission store: each gateway admits on its share of every limit
(the limit divided by the gateways it saw live) until Redis returns, readiness
says ``degraded`` (still 200), and the units admitted meanwhile are counted in
Redis once it is back. A Redis of the test's own, stopped and started again by
its PID (never the shared one)."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from builders import write_fake_repository
from harness.fake_models import FAKE_ADAPTERS
from serverproc import free_port
from tessera.admission import Admission, TenantLimits
from tessera.admission.shared import RedisAdmissionController, gateway_share
from tessera.engine import Caller, Engine, EngineConfig
from tessera.errors import RateLimitedError
from tessera.gateway import create_app
from tessera.repository import ModelRepository
from tessera.tasks.types import Task, TextInput


class OwnRedis:
    """A redis-server on a free port, without persistence, for one test."""

    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        self.folder = folder
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""],
            cwd=self.folder,
            stdout=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        try:
            for _ in range(100):  # up to 10 s
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    time.sleep(0.1)
            raise RuntimeError("redis-server did not start")
        finally:
            client.close()

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    server = OwnRedis(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def gateways(own_redis: OwnRedis) -> Iterator[list[RedisAdmissionController]]:
    pair = [
        RedisAdmissionController.from_url(own_redis.url, lease_s=30.0, retry_s=30.0)
        for _ in range(2)
    ]
    for _ in range(2):  # both heartbeats in, then each counts two gateways
        for gateway in pair:
            gateway.renew()
    assert [g.num_gateways for g in pair] == [2, 2]
    yield pair
    for gateway in pair:
        gateway.close()


def test_a_share_divides_each_limit_among_the_gateways() -> None:
    limits = TenantLimits("acme", qps=10.0, burst=20, max_concurrency=5, daily_units=100.0)
    assert gateway_share(limits, 2) == TenantLimits(
        "acme", qps=5.0, burst=10, max_concurrency=2, daily_units=50.0
    )
    assert gateway_share(TenantLimits("acme", max_concurrency=1), 4).max_concurrency == 1
    assert gateway_share(limits, 1) == limits


def test_redis_lost_each_gateway_admits_its_share_then_shares_again(
    own_redis: OwnRedis, gateways: list[RedisAdmissionController]
) -> None:
    gateway = gateways[0]
    limits = TenantLimits("acme", max_concurrency=4, daily_units=10.0)
    shared = gateway.admit(limits, 1.0)
    gateway.release(shared)
    gateway.settle(shared, 1.0)
    own_redis.stop()
    # No 503 for the store's fault: the gateway's share, 2 of the 4 in flight.
    held = [gateway.admit(limits, 1.0) for _ in range(2)]
    assert gateway.degraded
    assert all(a.local for a in held)
    with pytest.raises(RateLimitedError) as refused:
        gateway.admit(limits, 1.0)
    assert refused.value.reason == "concurrency"
    assert gateway.in_flight("acme") == 2
    # Still lost: no return.
    assert not gateway.try_return()
    own_redis.start()
    assert gateway.try_return()
    assert not gateway.degraded
    for admission in held:  # admitted on the share: released there
        gateway.release(admission)
        gateway.settle(admission, 1.0)
    # The Redis started again (empty: no persistence) counts the 2 units
    # admitted while it was lost: 8 of the 10 are left.
    admitted: list[Admission] = []
    for _ in range(8):
        admitted.append(gateway.admit(limits, 1.0))
        gateway.release(admitted[-1])
    with pytest.raises(RateLimitedError) as over:
        gateway.admit(limits, 1.0)
    assert over.value.reason == "quota"
    assert not any(a.local for a in admitted)


def test_readiness_says_degraded_while_the_store_is_lost_and_requests_are_served(
    own_redis: OwnRedis, gateways: list[RedisAdmissionController], tmp_path: Path
) -> None:
    gateway = gateways[0]
    models = {"embed": {"task": "embedding", "preload": True}}

    async def run() -> None:
        repository = ModelRepository.from_folders([write_fake_repository(tmp_path, models)])
        config = EngineConfig(
            memory_budget_bytes=64 * 2**20, device="cpu", num_threads=2, adapters=FAKE_ADAPTERS
        )
        engine = Engine(repository, config, admission=gateway)
        await engine.preload()
        try:
            transport = httpx.ASGITransport(app=create_app(engine))
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:

                async def status() -> tuple[int, str]:
                    r = await client.get("/v2/health/ready")
                    return r.status_code, r.json()["status"]

                caller = Caller(TenantLimits("acme", qps=100.0))
                assert await status() == (200, "ready")
                own_redis.stop()
                submission = engine.submit("embed", Task.EMBEDDING, [TextInput("a")], caller=caller)
                await engine.wait(submission)  # admitted on the share, not refused
                assert await status() == (200, "degraded")
                own_redis.start()
                assert await asyncio.to_thread(gateway.try_return)
                assert await status() == (200, "ready")
        finally:
            await engine.close()

    asyncio.run(run())
