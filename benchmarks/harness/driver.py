"""The load generator: every tenant of a step at once, each request recorded.

Closed-loop tenants keep ``concurrency`` callers busy, each with a connection
of its own (a shared httpx pool costs milliseconds of client CPU a request at
64 connections, which the server would feel on a small machine). Open-loop
tenants send on a Poisson schedule fixed in advance, whatever the answers
take, so a slow server cannot slow the arrivals. Background tenants run until
every other tenant is done.

Time goes through a ``tessera.clock.Clock`` (now and sleep only): the real one
measures a benchmark, a fake one lets the tests run a step in no real time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import ssl
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from harness.scenario import RequestShape, TenantLoad
from tessera.clock import Clock, MonotonicClock

REQUEST_TIMEOUT_S = 120.0


class Endpoint(Protocol):
    """Where and how a configuration takes a request."""

    def route(self, model: str) -> str:
        """The base URL that serves ``model``."""
        ...

    def headers(self, tenant: str) -> dict[str, str]: ...

    def call(self, model: str, n: int, shape: RequestShape) -> tuple[str, dict[str, Any]]:
        """The path and JSON body of the ``n``-th request for ``model``, of ``shape``."""
        ...

    def ok(self, model: str, status: int, body: bytes) -> bool:
        """Whether an answer is a success (status and the expected content)."""
        ...


@dataclass(frozen=True, slots=True)
class Record:
    tenant: str
    model: str
    start_s: float  # since the step began
    latency_s: float
    status: str  # the HTTP status, or the client error's name
    ok: bool


@dataclass
class _Tenant:
    load: TenantLoad
    models: list[str]
    weights: list[float]
    rng: random.Random
    bound: int | None  # None: background
    issued: int = 0
    done: bool = False


@dataclass
class DriveResult:
    records: list[Record] = field(default_factory=list)
    seconds: float = 0.0


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One TLS context for every client: httpx builds one per client otherwise,
    loading the CA bundle each time (24 ms of CPU; 1.5 s for 64 callers, inside
    the measured step)."""
    return ssl.create_default_context()


class _Clients:
    """One httpx client per server a caller talks to, each with its base URL (a
    relative path costs the client less than a full URL on every request)."""

    def __init__(self, headers: dict[str, str], transport: httpx.AsyncBaseTransport | None):
        self._headers, self._transport = headers, transport
        self._clients: dict[str, httpx.AsyncClient] = {}

    def get(self, base_url: str) -> httpx.AsyncClient:
        client = self._clients.get(base_url)
        if client is None:
            client = httpx.AsyncClient(
                base_url=base_url,
                headers=self._headers,
                verify=_tls_context(),
                timeout=REQUEST_TIMEOUT_S,
                limits=httpx.Limits(max_connections=512, max_keepalive_connections=512),
                transport=self._transport,
            )
            self._clients[base_url] = client
        return client

    async def __aenter__(self) -> _Clients:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for client in self._clients.values():
            await client.aclose()


def zipf_weights(count: int, exponent: float | None) -> list[float]:
    """Popularity of ranks 1..count: 1/rank**exponent, or uniform without one."""
    if exponent is None:
        return [1.0] * count
    return [1.0 / (rank**exponent) for rank in range(1, count + 1)]


def _seed(name: str, seed: int) -> int:
    return zlib.crc32(name.encode()) ^ seed


class Driver:
    """Runs one step of a workload against an endpoint."""

    def __init__(
        self,
        endpoint: Endpoint,
        models: list[str],
        zipf: float | None,
        seed: int = 0,
        on_answer: Callable[[], None] | None = None,  # after each foreground answer
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Clock | None = None,
        round_robin: bool = False,  # each tenant's n-th request to its models[n % len]
        model_headers: Callable[[str], dict[str, str]] | None = None,  # per request, by model
    ) -> None:
        self._endpoint = endpoint
        self._models = models
        self._zipf = zipf
        self._round_robin = round_robin
        self._seed = seed
        self._on_answer = on_answer or (lambda: None)
        self._transport = transport  # tests serve an app in-process
        self._clock = clock or MonotonicClock()
        self._model_headers = model_headers
        self._start = 0.0
        self._result = DriveResult()

    async def run(self, tenants: list[TenantLoad], requests: int, duration_s: float) -> DriveResult:
        """Every tenant at once until each has sent its bound or ``duration_s`` passed."""
        states = []
        for load in tenants:
            models = list(load.models or self._models)
            states.append(
                _Tenant(
                    load=load,
                    models=models,
                    weights=zipf_weights(len(models), self._zipf),
                    rng=random.Random(_seed(load.name, self._seed)),
                    bound=None if load.background else (load.requests or requests),
                )
            )
        self._result = DriveResult()
        self._start = self._clock.now()
        deadline = self._start + duration_s
        foreground = [s for s in states if s.bound is not None]
        stop = asyncio.Event()

        async def run_tenant(state: _Tenant) -> None:
            if state.load.rate is None:
                await self._closed(state, deadline, stop)
            else:
                await self._open(state, deadline, stop)
            state.done = True
            if all(s.done for s in foreground):
                stop.set()

        await asyncio.gather(*(run_tenant(s) for s in states))
        self._result.seconds = self._clock.now() - self._start
        return self._result

    def _more(self, state: _Tenant, deadline: float, stop: asyncio.Event) -> bool:
        if self._clock.now() >= deadline:
            return False
        if state.bound is None:
            return not stop.is_set()
        return state.issued < state.bound

    async def _one(self, clients: _Clients, state: _Tenant, model: str, n: int) -> None:
        path, body = self._endpoint.call(model, n, state.load.shape)
        client = clients.get(self._endpoint.route(model))
        headers = None if self._model_headers is None else self._model_headers(model)
        began = self._clock.now()
        try:
            response = await client.post(path, json=body, headers=headers)
            status, ok = (
                str(response.status_code),
                self._endpoint.ok(model, response.status_code, response.content),
            )
        except httpx.HTTPError as e:
            status, ok = type(e).__name__, False
        ended = self._clock.now()
        record = Record(state.load.name, model, began - self._start, ended - began, status, ok)
        self._result.records.append(record)
        if not state.load.background:
            self._on_answer()

    def _pick(self, state: _Tenant) -> str:
        """The model of the request just issued: in turn, or drawn by popularity."""
        if self._round_robin:
            return state.models[(state.issued - 1) % len(state.models)]
        return state.rng.choices(state.models, state.weights)[0]

    def _clients(self, state: _Tenant) -> _Clients:
        return _Clients(self._endpoint.headers(state.load.name), self._transport)

    async def _closed(self, state: _Tenant, deadline: float, stop: asyncio.Event) -> None:
        async def caller() -> None:
            async with self._clients(state) as clients:
                while self._more(state, deadline, stop):
                    state.issued += 1
                    await self._one(clients, state, self._pick(state), state.issued)

        await asyncio.gather(*(caller() for _ in range(state.load.concurrency or 1)))

    async def _open(self, state: _Tenant, deadline: float, stop: asyncio.Event) -> None:
        rate = state.load.rate or 1.0
        running: set[asyncio.Task[None]] = set()
        async with self._clients(state) as client:
            due = self._clock.now()
            while self._more(state, deadline, stop):
                due += state.rng.expovariate(rate)
                await self._clock.sleep(due - self._clock.now())
                if not self._more(state, deadline, stop):
                    break
                state.issued += 1
                task = asyncio.ensure_future(
                    self._one(client, state, self._pick(state), state.issued)
                )
                running.add(task)
                task.add_done_callback(running.discard)
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*running)
