"""A discrete-event simulation of many devices, for sizes this machine cannot hold.

It drives tessera's real policy code on a ``FakeClock``: the cluster's
``Router`` (routing, placement, replication; ``tessera.cluster.routing``) and,
on every device, a real ``ResidencyManager`` with the ``cost`` eviction policy
over a ``FakeModelHost`` whose loads take fake seconds. What is simulated is
only what a device does with its time: a load takes ``load_s`` (from the
model's bytes), a batch of n requests ``scale x (base + n x per_item)`` (the
figures measured here for all-minilm-l6-v2, scaled by the model's bytes), one
batch at a time per device, loads beside batches.

Three fleets, each with the same arrivals (seeded Zipf popularity over the
models, plus bursts on random models):

- ``tessera``: the Router and byte-budgeted residency (evict by expected cost);
- ``rayserve``: Ray Serve's model multiplexing as documented: each replica
  holds at most ``max_num_models_per_replica`` models (set so the largest
  models fit: count-based, LRU), a request goes to a replica holding its model
  unless all those are at ``max_ongoing_requests``, then to the least loaded
  replica, which loads it; no replication on demand;
- ``dedicated``: one model per device, preloaded, with as many devices for a
  model as its peak rate needs at ``target_utilization``.

``devices_needed`` searches the fewest devices whose p99 (after warm-up) meets
the target with no request failed.

    make scaleout-sim [ARGS=--quick]    (PYTHONPATH=benchmarks python -m harness.scaleout)
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import math
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from harness.fake_host import FakeModelHost
from harness.report import output_stem
from tessera.clock import FakeClock
from tessera.cluster import AddReplica, DeviceReport, ModelLoad, Router, RoutingConfig
from tessera.errors import TesseraError
from tessera.repository.spec import BatchingSpec, ModelSpec
from tessera.residency import ModelState, ResidencyManager, make_eviction_policy
from tessera.tasks.types import Task

MB = 1_000_000
GIB = 1 << 30

# Measured here (benchmarks/results/engine-2026-11-30-4.md): all-minilm-l6-v2 on
# two CPU threads runs a batch of 32 sentences in 98 ms and one in about 18 ms.
MINILM_BYTES = 90 * MB
BATCH_BASE_S = 0.015
BATCH_PER_ITEM_S = 0.003


@dataclass(frozen=True, slots=True)
class SimConfig:
    num_models: int = 1000
    zipf_s: float = 1.0
    rate: float = 1000.0  # requests a second, all models, outside bursts
    duration_s: float = 40.0
    warmup_s: float = 10.0  # requests arriving before are not in the p99
    burst_every_s: float = 5.0  # a burst starts on a random model this often (mean)
    burst_rate: float = 150.0  # requests a second added to the burst's model
    burst_s: float = 10.0
    device_budget_bytes: int = 4 * GIB
    min_model_bytes: int = 20 * MB
    max_model_bytes: int = 800 * MB
    load_bytes_per_s: float = 100 * MB  # a load: 0.25 s + bytes at this rate
    max_batch_size: int = 32
    target_p99_s: float = 1.0
    timeout_s: float = 30.0
    seed: int = 1


@dataclass(frozen=True, slots=True)
class SimModel:
    spec: ModelSpec
    bytes: int
    load_s: float
    scale: float  # run time relative to all-minilm-l6-v2's

    def run_s(self, num: int) -> float:
        return self.scale * (BATCH_BASE_S + BATCH_PER_ITEM_S * num)


@dataclass(frozen=True, slots=True)
class Arrival:
    at: float
    model: int


@dataclass
class SimResult:
    fleet: str
    num_devices: int
    num_requests: int
    num_failed: int
    p50_s: float
    p99_s: float
    loads: int
    replicas_added: int
    affinity: float  # requests that found their model resident (or loading for them)
    meets: bool = False


def make_models(config: SimConfig) -> list[SimModel]:
    rng = random.Random(config.seed)
    low, high = math.log(config.min_model_bytes), math.log(config.max_model_bytes)
    models = []
    for i in range(config.num_models):
        size = int(math.exp(rng.uniform(low, high)))
        load_s = 0.25 + size / config.load_bytes_per_s
        spec = ModelSpec(
            name=f"m{i:04d}",
            task=Task.EMBEDDING,
            runtime="torch",
            adapter="fake",
            folder=Path("/nonexistent"),
            batching=BatchingSpec(max_batch_size=config.max_batch_size),
            options={"own_bytes": size, "load_s": load_s},
        )
        scale = min(4.0, max(0.25, size / MINILM_BYTES))
        models.append(SimModel(spec, size, load_s, scale))
    return models


def make_arrivals(config: SimConfig) -> list[Arrival]:
    """Poisson arrivals over Zipf popularity (rank i weighs 1/i^s, ranks
    shuffled against sizes by the seed), and bursts on uniformly random models."""
    rng = random.Random(config.seed + 1)
    weights = [1.0 / (i + 1) ** config.zipf_s for i in range(config.num_models)]
    order = list(range(config.num_models))
    rng.shuffle(order)
    cumulative: list[float] = []
    total = 0.0
    for w in weights:
        total += w
        cumulative.append(total)
    arrivals = []
    t = rng.expovariate(config.rate)
    while t < config.duration_s:
        rank = bisect.bisect_left(cumulative, rng.random() * total)
        arrivals.append(Arrival(t, order[min(rank, config.num_models - 1)]))
        t += rng.expovariate(config.rate)
    start = rng.expovariate(1 / config.burst_every_s)
    while start < config.duration_s:
        model = rng.randrange(config.num_models)
        t = start + rng.expovariate(config.burst_rate)
        while t < min(config.duration_s, start + config.burst_s):
            arrivals.append(Arrival(t, model))
            t += rng.expovariate(config.burst_rate)
        start += rng.expovariate(1 / config.burst_every_s)
    arrivals.sort(key=lambda a: a.at)
    return arrivals


@dataclass(eq=False)
class SimRequest:
    model: SimModel
    arrival: float
    deadline: float
    done: asyncio.Future[bool]
    found_resident: bool = False


class ModelCache(Protocol):
    """A device's memory: the real residency manager, or Ray Serve's count-based LRU."""

    def held(self, name: str) -> bool: ...

    def states(self) -> list[tuple[str, str, int]]:
        """(name, state, bytes) of the models it holds or knows."""
        ...

    async def ensure(self, model: SimModel) -> None: ...

    async def drop(self, name: str) -> None: ...

    @property
    def used_bytes(self) -> int: ...

    @property
    def loads(self) -> int: ...


class ResidencyCache:
    """tessera's residency: a ``ResidencyManager`` with its ``cost`` policy."""

    def __init__(self, budget: int, clock: FakeClock, wait_s: float) -> None:
        self.manager = ResidencyManager(
            budget,
            FakeModelHost(clock),
            make_eviction_policy("cost", clock),
            clock,
            wait_s=wait_s,
        )

    def held(self, name: str) -> bool:
        return self.manager.state(name) in (ModelState.READY, ModelState.LOADING)

    def states(self) -> list[tuple[str, str, int]]:
        entries = self.manager.table.entries.values()
        return [(e.name, e.state.value, e.weights_bytes) for e in entries]

    async def ensure(self, model: SimModel) -> None:
        lease = await self.manager.acquire(model.spec, 0)
        self.manager.release(lease)

    async def drop(self, name: str) -> None:
        await self.manager.unload(name)

    @property
    def used_bytes(self) -> int:
        return self.manager.table.used_bytes()

    @property
    def loads(self) -> int:
        return self.manager.stats().loads_total


class CountLruCache:
    """Ray Serve's ``_ModelMultiplexWrapper``: at most ``max_models`` models,
    the least recently used unloaded first, bytes not counted."""

    def __init__(self, max_models: int, clock: FakeClock) -> None:
        self._max = max_models
        self._clock = clock
        self._models: OrderedDict[str, SimModel] = OrderedDict()
        self._loading: dict[str, asyncio.Future[None]] = {}
        self._loads = 0

    def held(self, name: str) -> bool:
        return name in self._models or name in self._loading

    def states(self) -> list[tuple[str, str, int]]:
        return [(n, "ready", m.bytes) for n, m in self._models.items()] + [
            (n, "loading", 0) for n in self._loading
        ]

    async def ensure(self, model: SimModel) -> None:
        name = model.spec.key
        if name in self._models:
            self._models.move_to_end(name)
            return
        if name in self._loading:
            await asyncio.shield(self._loading[name])
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._loading[name] = done
        while len(self._models) + len(self._loading) > self._max and self._models:
            self._models.popitem(last=False)
        self._loads += 1
        await self._clock.sleep(model.load_s)
        self._models[name] = model
        del self._loading[name]
        done.set_result(None)

    async def drop(self, name: str) -> None:
        self._models.pop(name, None)

    @property
    def used_bytes(self) -> int:
        return sum(m.bytes for m in self._models.values())

    @property
    def loads(self) -> int:
        return self._loads


class SimDevice:
    """One device: a queue per model, one batch at a time, loads beside batches."""

    def __init__(self, name: str, cache: ModelCache, clock: FakeClock, max_batch: int) -> None:
        self.name = name
        self.cache = cache
        self._clock = clock
        self._max_batch = max_batch
        self._compute = asyncio.Lock()
        self.queues: dict[str, deque[SimRequest]] = {}
        self._active: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.busy_s: dict[str, float] = {}
        self.latencies: dict[str, list[float]] = {}
        self.alive = True

    def submit(self, request: SimRequest) -> None:
        name = request.model.spec.key
        request.found_resident = self.cache.held(name)
        self.queues.setdefault(name, deque()).append(request)
        if name not in self._active:
            self._active.add(name)
            self.spawn(self._serve(request.model))

    def spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def queue_depth(self) -> int:
        return sum(len(q) for q in self.queues.values())

    async def _serve(self, model: SimModel) -> None:
        name = model.spec.key
        queue = self.queues[name]
        try:
            while queue and self.alive:
                try:
                    await self.cache.ensure(model)  # loads beside other models' batches
                    async with self._compute:
                        await self.cache.ensure(model)  # evicted meanwhile: reload
                        batch = [queue.popleft() for _ in range(min(len(queue), self._max_batch))]
                        run_s = model.run_s(len(batch))
                        await self._clock.sleep(run_s)
                except TesseraError:
                    batch = [queue.popleft() for _ in range(len(queue))]
                    for request in batch:
                        request.done.set_result(False)
                    continue
                self.busy_s[name] = self.busy_s.get(name, 0.0) + run_s
                now = self._clock.now()
                for request in batch:
                    self.latencies.setdefault(name, []).append(now - request.arrival)
                    request.done.set_result(now <= request.deadline)
        finally:
            self._active.discard(name)

    def report(self, now: float, window_s: float, budget: int) -> DeviceReport:
        """What the engine actor sends: residency, queues, busy time and p99 since the last."""
        loads = []
        seen = set()
        for name, state, num_bytes in self.cache.states():
            seen.add(name)
            loads.append(self._load(name, state, num_bytes))
        for name, queue in self.queues.items():
            if queue and name not in seen:
                loads.append(self._load(name, "unloaded", 0))
        self.busy_s.clear()
        self.latencies.clear()
        return DeviceReport(self.name, now, window_s, budget, self.cache.used_bytes, tuple(loads))

    def _load(self, name: str, state: str, num_bytes: int) -> ModelLoad:
        queue = self.queues.get(name)
        latencies = self.latencies.get(name)
        return ModelLoad(
            name,
            state,
            num_bytes,
            len(queue) if queue else 0,
            self.busy_s.get(name, 0.0),
            percentile(latencies, 0.99) if latencies else None,
        )


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class _Tally:
    latencies: list[float] = field(default_factory=list)
    failed: int = 0
    resident: int = 0
    counted: int = 0
    replicas_added: int = 0


async def _drive(
    config: SimConfig,
    models: list[SimModel],
    arrivals: list[Arrival],
    devices: list[SimDevice],
    pick: Callable[[SimModel, float], SimDevice],
    clock: FakeClock,
    tally: _Tally,
    answered: Callable[[SimDevice], None],
) -> None:
    async def one(arrival: Arrival) -> None:
        model = models[arrival.model]
        device = pick(model, clock.now())
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        request = SimRequest(model, clock.now(), clock.now() + config.timeout_s, done)
        device.submit(request)
        ok = await done
        answered(device)
        if arrival.at < config.warmup_s:
            return
        tally.counted += 1
        tally.resident += request.found_resident
        if ok:
            tally.latencies.append(clock.now() - request.arrival)
        else:
            tally.failed += 1

    pending: set[asyncio.Task[None]] = set()
    for arrival in arrivals:
        await clock.sleep(arrival.at - clock.now())
        task = asyncio.ensure_future(one(arrival))
        pending.add(task)
        task.add_done_callback(pending.discard)
    while pending:
        await asyncio.gather(*list(pending))


def _result(
    fleet: str, n: int, tally: _Tally, devices: list[SimDevice], target: float
) -> SimResult:
    latencies = tally.latencies or [math.inf]
    result = SimResult(
        fleet,
        n,
        tally.counted,
        tally.failed,
        percentile(latencies, 0.5),
        percentile(latencies, 0.99),
        sum(d.cache.loads for d in devices),
        tally.replicas_added,
        tally.resident / max(1, tally.counted),
    )
    result.meets = result.num_failed == 0 and result.p99_s <= target
    return result


async def run_tessera(config: SimConfig, num_devices: int, routing: RoutingConfig) -> SimResult:
    clock = FakeClock()
    models = make_models(config)
    by_name = {m.spec.key: m for m in models}
    devices = [
        SimDevice(
            f"d{i:03d}",
            ResidencyCache(config.device_budget_bytes, clock, config.timeout_s),
            clock,
            config.max_batch_size,
        )
        for i in range(num_devices)
    ]
    by_device = {d.name: d for d in devices}
    router = Router(routing)
    tally = _Tally()

    def report_all() -> None:
        for device in devices:
            router.report(
                device.report(clock.now(), routing.report_interval_s, config.device_budget_bytes)
            )

    async def reporter() -> None:
        while True:
            await clock.sleep(routing.report_interval_s)
            report_all()
            for action in router.rebalance(clock.now()):
                device = by_device[action.device]
                model = by_name[action.model]
                if isinstance(action, AddReplica):
                    tally.replicas_added += 1
                    device.spawn(device.cache.ensure(model))
                else:
                    device.spawn(device.cache.drop(action.model))

    def pick(model: SimModel, now: float) -> SimDevice:
        name = router.route(model.spec.key, model.bytes, now)
        assert name is not None  # every device reported before the first arrival
        return by_device[name]

    report_all()
    task = asyncio.ensure_future(reporter())
    arrivals = make_arrivals(config)
    await _drive(
        config, models, arrivals, devices, pick, clock, tally, lambda d: router.answered(d.name)
    )
    task.cancel()
    return _result("tessera", num_devices, tally, devices, config.target_p99_s)


# Ray Serve's defaults: a replica takes 5 requests at once (max_ongoing_requests).
RAY_MAX_ONGOING = 5


async def run_rayserve(config: SimConfig, num_devices: int) -> SimResult:
    clock = FakeClock()
    models = make_models(config)
    per_replica = max(1, config.device_budget_bytes // config.max_model_bytes)
    devices = [
        SimDevice(f"d{i:03d}", CountLruCache(per_replica, clock), clock, config.max_batch_size)
        for i in range(num_devices)
    ]
    ongoing = dict.fromkeys(range(num_devices), 0)
    tally = _Tally()

    def pick(model: SimModel, now: float) -> SimDevice:
        name = model.spec.key
        holding = [i for i, d in enumerate(devices) if d.cache.held(name)]
        free = [i for i in holding if ongoing[i] < RAY_MAX_ONGOING]
        chosen = min(free or range(num_devices), key=lambda i: (ongoing[i], i))
        ongoing[chosen] += 1
        return devices[chosen]

    def answered(device: SimDevice) -> None:
        ongoing[int(device.name[1:])] -= 1

    await _drive(config, models, make_arrivals(config), devices, pick, clock, tally, answered)
    return _result("rayserve", num_devices, tally, devices, config.target_p99_s)


def dedicated_devices(config: SimConfig, models: list[SimModel], utilization: float) -> list[int]:
    """Devices per model for one model per device: its peak rate (base share
    plus any burst on it) at full batches, at ``utilization``."""
    arrivals = make_arrivals(config)
    peak = [0] * len(models)
    buckets: dict[tuple[int, int], int] = {}
    for a in arrivals:
        key = (a.model, int(a.at))
        buckets[key] = buckets.get(key, 0) + 1
        peak[a.model] = max(peak[a.model], buckets[key])
    counts = []
    for model, rate in zip(models, peak, strict=True):
        per_s = config.max_batch_size / model.run_s(config.max_batch_size)
        counts.append(max(1, math.ceil(rate / (per_s * utilization))))
    return counts


async def run_dedicated(config: SimConfig, utilization: float) -> SimResult:
    clock = FakeClock()
    models = make_models(config)
    counts = dedicated_devices(config, models, utilization)
    devices: list[SimDevice] = []
    owned: list[list[SimDevice]] = []
    for count in counts:
        mine = []
        for _ in range(count):
            cache = CountLruCache(1, clock)  # preloaded below
            device = SimDevice(f"d{len(devices):04d}", cache, clock, config.max_batch_size)
            devices.append(device)
            mine.append(device)
        owned.append(mine)
    for model, mine in zip(models, owned, strict=True):
        for device in mine:
            await device.cache.ensure(model)
    start = clock.now()
    shifted = [Arrival(a.at + start, a.model) for a in make_arrivals(config)]
    outstanding = {d.name: 0 for d in devices}
    tally = _Tally()
    index = {m.spec.key: i for i, m in enumerate(models)}

    def pick(model: SimModel, now: float) -> SimDevice:
        device = min(owned[index[model.spec.key]], key=lambda d: outstanding[d.name])
        outstanding[device.name] += 1
        return device

    def answered(device: SimDevice) -> None:
        outstanding[device.name] -= 1

    shifted_config = SimConfig(**{**asdict(config), "warmup_s": config.warmup_s + start})
    await _drive(shifted_config, models, shifted, devices, pick, clock, tally, answered)
    result = _result("dedicated", len(devices), tally, devices, config.target_p99_s)
    result.loads = 0  # the loads above were the preload
    return result


def simulate(fleet: str, config: SimConfig, num_devices: int, routing: RoutingConfig) -> SimResult:
    if fleet == "tessera":
        return asyncio.run(run_tessera(config, num_devices, routing))
    if fleet == "rayserve":
        return asyncio.run(run_rayserve(config, num_devices))
    return asyncio.run(run_dedicated(config, routing.target_utilization))


def devices_needed(
    fleet: str,
    config: SimConfig,
    routing: RoutingConfig,
    sizes: Sequence[int],
    progress: Callable[[SimResult], None],
) -> tuple[SimResult | None, list[SimResult]]:
    """The smallest of ``sizes`` (ascending) that meets the target, by bisection
    (assumes more devices never do worse), and every run made."""
    runs: list[SimResult] = []
    low, high = 0, len(sizes) - 1
    best: SimResult | None = None
    while low <= high:
        mid = (low + high) // 2
        result = simulate(fleet, config, sizes[mid], routing)
        progress(result)
        runs.append(result)
        if result.meets:
            best = result
            high = mid - 1
        else:
            low = mid + 1
    return best, runs


@dataclass(frozen=True, slots=True)
class FleetRuns:
    best: SimResult | None  # the fewest devices that met the target
    runs: list[SimResult]


def write_report(rows: dict[str, FleetRuns], out: Path, name: str) -> str:
    """The Markdown table and the plot (p99 against devices per fleet); returns the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [
        "| fleet | devices needed | p99 s | p50 s | failed | loads | replicas added | affinity |",
        "|---|---|---|---|---|---|---|---|",
    ]
    figure, axis = plt.subplots(figsize=(7, 4))
    for fleet, row in rows.items():
        best = row.best
        runs = sorted(row.runs, key=lambda r: r.num_devices)
        if best is not None:
            lines.append(
                f"| {fleet} | {best.num_devices} | {best.p99_s:.3f} | {best.p50_s:.3f} |"
                f" {best.num_failed} | {best.loads} | {best.replicas_added} | {best.affinity:.3f} |"
            )
        else:
            worst = max(runs, key=lambda r: r.num_devices)
            lines.append(
                f"| {fleet} | > {worst.num_devices} | {worst.p99_s:.3f} | {worst.p50_s:.3f} |"
                f" {worst.num_failed} | {worst.loads} | {worst.replicas_added} |"
                f" {worst.affinity:.3f} |"
            )
        axis.plot(
            [r.num_devices for r in runs],
            [min(r.p99_s, 60.0) for r in runs],
            marker="o",
            label=fleet,
        )
    axis.set_xlabel("devices")
    axis.set_ylabel("p99 s after warm-up (capped at 60)")
    axis.set_yscale("log")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out / f"{name}-p99.png", dpi=100)
    plt.close(figure)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="100 models, 20 s, for a smoke run")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--name", default="scaleout-sim")
    args = parser.parse_args(argv)
    config = SimConfig()
    if args.quick:
        config = SimConfig(num_models=100, rate=200.0, duration_s=20.0, warmup_s=5.0)
    routing = RoutingConfig(target_p99_s=config.target_p99_s / 2)
    sizes = list(range(10, 101, 10))
    rows: dict[str, FleetRuns] = {}
    for fleet in ("tessera", "rayserve"):
        rows[fleet] = FleetRuns(*devices_needed(fleet, config, routing, sizes, print))
    dedicated = simulate("dedicated", config, 0, routing)
    print(dedicated)
    rows["one model per device"] = FleetRuns(dedicated, [dedicated])
    args.out.mkdir(parents=True, exist_ok=True)
    day = datetime.now(UTC).date().isoformat()
    name = output_stem(args.out, day, args.name).name  # NAME-DAY[-N]: never overwritten
    table = write_report(rows, args.out, name)
    print(table)
    data = {
        "config": asdict(config),
        "routing": asdict(routing),
        "fleets": {fleet: [asdict(r) for r in row.runs] for fleet, row in rows.items()},
    }
    (args.out / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    (args.out / f"{name}.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
