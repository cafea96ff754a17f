"""The load generator, against an app served in-process, on fake time.

The app answers after ``x-delay`` seconds of the same fake clock the driver
reads, so a step runs in no real time and its timings are exact.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from harness.driver import Driver, zipf_weights
from harness.scenario import RequestShape, TenantLoad
from tessera.clock import FakeClock


def make_app(clock: FakeClock) -> Starlette:
    """An embeddings endpoint that answers after ``x-delay`` seconds of ``clock``."""

    async def embeddings(request: Request) -> JSONResponse:
        body = await request.json()
        if body["model"] == "broken":
            return JSONResponse({"error": {"message": "no"}}, status_code=503)
        await clock.sleep(float(request.headers.get("x-delay", "0")))
        count = len(body["input"]) if isinstance(body["input"], list) else 1
        return JSONResponse({"data": [{"embedding": [0.0]} for _ in range(count)]})

    return Starlette(routes=[Route("/v1/embeddings", embeddings, methods=["POST"])])


class FakeEndpoint:
    """The driver's Endpoint over the app above; ``delay_s`` slows every answer."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.bodies: list[dict[str, Any]] = []

    def route(self, model: str) -> str:
        return "http://bench.test"

    def headers(self, tenant: str) -> dict[str, str]:
        return {"x-delay": str(self.delay_s), "x-tenant": tenant}

    def call(self, model: str, n: int, shape: RequestShape) -> tuple[str, dict[str, Any]]:
        inputs = shape.inputs
        text = [f"s{n}-{i}" for i in range(inputs)] if inputs > 1 else f"s{n}"
        body = {"model": model, "input": text}
        self.bodies.append(body)
        return "/v1/embeddings", body

    def ok(self, model: str, status: int, body: bytes) -> bool:
        return status == 200 and b"embedding" in body


def make_driver(
    endpoint: FakeEndpoint,
    models: list[str],
    zipf: float | None = None,
    on_answer: Callable[[], None] | None = None,
    round_robin: bool = False,
) -> Driver:
    """A driver and the app it calls, both on one fresh fake clock."""
    clock = FakeClock()
    transport = httpx.ASGITransport(app=make_app(clock))
    return Driver(
        endpoint,
        models,
        zipf,
        on_answer=on_answer,
        transport=transport,
        clock=clock,
        round_robin=round_robin,
    )


async def test_closed_loop_tenants_each_send_their_bound() -> None:
    tenants = [TenantLoad("a", concurrency=3), TenantLoad("b", concurrency=2, requests=7)]
    result = await make_driver(FakeEndpoint(), ["m"]).run(tenants, requests=10, duration_s=30)
    assert Counter(r.tenant for r in result.records) == {"a": 10, "b": 7}
    assert all(r.ok and r.status == "200" for r in result.records)
    assert result.seconds == 0  # the app answers at once on fake time


async def test_open_loop_is_bounded_by_its_requests() -> None:
    result = await make_driver(FakeEndpoint(), ["m"]).run(
        [TenantLoad("a", rate=2000.0)], requests=15, duration_s=30
    )
    assert len(result.records) == 15
    starts = sorted(r.start_s for r in result.records)
    # Poisson arrivals at 2000/s: 15 of them take about 7.5 ms, never all at once.
    assert 0 < starts[0] < starts[-1] < 0.05


async def test_duration_bounds_a_step_that_cannot_finish() -> None:
    result = await make_driver(FakeEndpoint(delay_s=0.05), ["m"]).run(
        [TenantLoad("a", concurrency=2)], requests=10_000, duration_s=0.3
    )
    # Each caller starts a request at 0, 0.05, ..., 0.25 s and none at 0.3 s.
    assert len(result.records) == 12
    assert all(r.latency_s == pytest.approx(0.05) for r in result.records)
    assert result.seconds == pytest.approx(0.3)


async def test_background_tenant_stops_when_the_others_are_done() -> None:
    answered = 0

    def count() -> None:
        nonlocal answered
        answered += 1

    endpoint = FakeEndpoint(delay_s=0.005)
    flood = TenantLoad("flood", concurrency=2, inputs=4, background=True)
    run = make_driver(endpoint, ["m"], on_answer=count)
    result = await run.run([TenantLoad("quiet", rate=200.0), flood], requests=20, duration_s=30)
    by_tenant = Counter(r.tenant for r in result.records)
    assert by_tenant["quiet"] == 20
    assert by_tenant["flood"] > 0
    assert answered == 20  # progress counts the bounded tenants only
    assert any(isinstance(b["input"], list) and len(b["input"]) == 4 for b in endpoint.bodies)


async def test_failures_are_recorded_with_their_status() -> None:
    result = await make_driver(FakeEndpoint(), ["broken"]).run(
        [TenantLoad("a", concurrency=1)], requests=3, duration_s=30
    )
    assert [(r.status, r.ok) for r in result.records] == [("503", False)] * 3


async def test_connection_errors_are_recorded_not_raised() -> None:
    endpoint = FakeEndpoint()
    endpoint.route = lambda model: "http://127.0.0.1:9"  # type: ignore[method-assign]
    result = await Driver(endpoint, ["m"], None).run(
        [TenantLoad("a", concurrency=1)], requests=2, duration_s=30
    )
    assert [r.ok for r in result.records] == [False, False]
    assert result.records[0].status == "ConnectError"


def test_zipf_weights() -> None:
    assert zipf_weights(3, None) == [1.0, 1.0, 1.0]
    assert zipf_weights(3, 1.0) == pytest.approx([1.0, 0.5, 1 / 3])


async def test_zipf_popularity_follows_the_listed_order() -> None:
    result = await make_driver(FakeEndpoint(), ["m1", "m2", "m3", "m4"], zipf=1.1).run(
        [TenantLoad("a", concurrency=4)], requests=400, duration_s=30
    )
    counts = Counter(r.model for r in result.records)
    assert counts["m1"] > counts["m2"] > counts["m4"]


async def test_round_robin_sends_each_model_in_turn() -> None:
    endpoint = FakeEndpoint()
    result = await make_driver(endpoint, ["m1", "m2", "m3"], round_robin=True).run(
        [TenantLoad("a", concurrency=1)], requests=7, duration_s=30
    )
    assert [b["model"] for b in endpoint.bodies] == ["m1", "m2", "m3"] * 2 + ["m1"]
    assert Counter(r.model for r in result.records) == {"m1": 3, "m2": 2, "m3": 2}
