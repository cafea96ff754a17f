"""Where each request goes: routing, placement and replication over engine reports.

Plain Python over the reports engines send every few hundred milliseconds;
time comes from the caller (``now``), so tests and the simulator drive it on a
fake clock. Every gateway runs its own ``Router`` over the same reports.

Design notes (the invariants the unit tests check):

- A model's replicas are the devices this router placed it on, plus those
  whose last report holds it (ready or loading: another gateway placed it, or
  it stayed resident), less those the router is draining it from. A placement
  that no report confirms within ``placement_ttl_s``, or that a later report no
  longer holds (the device's residency evicted it), is forgotten.
- A request for a model with replicas goes to the least loaded of them: the
  device's reported queue plus the requests this router sent it and has not
  seen answered. Placement does not depend on which router asks first: the same
  reports give the same choice, so gateways starting together agree.
- A model with no replica is placed on one device, chosen by free bytes and
  load: among the devices where its bytes fit beside what they hold (reported
  use plus placements not yet reported), the least loaded; if it fits nowhere,
  the least loaded of all (its residency evicts by cost there). Later requests
  go to that device while it loads: a cold model is loaded once, not
  everywhere at once.
- A model under pressure (queue per replica over ``max_queue_per_replica``, or
  a replica's p99 over ``target_p99_s``) with a ready replica and its replicas
  busy at ``target_utilization`` or more (compute-bound: latency made by loads
  is not cured by a copy), for ``scale_up_after_s`` together, gets one more
  replica on a device not holding it, placed as a cold model is: at most
  ``max_replicas``, one at a time (the last must be confirmed first). A model
  whose busy time would fit one replica fewer at ``target_utilization``, and under no pressure, for
  ``scale_down_after_s`` loses one replica (never the last): the router stops
  sending there, and its caller unloads it.
- A device removed (dead): its placements and report go; each model it held
  that now has no replica and was used in the last ``cold_after_s`` is placed
  again at once (``AddReplica``); the others wait for their next request.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from tessera.costs import CostLedger

# Model states in a report that hold (or are about to hold) the model's bytes.
HELD_STATES = frozenset({"ready", "loading"})

# The weight of the latest round in a model's smoothed busy share.
BUSY_SMOOTHING = 0.3


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """One model on one device, as its engine reported it."""

    name: str
    state: str  # ready | loading | unloaded | unloading | failed
    weights_bytes: int
    queue_depth: int  # requests queued, not yet running
    busy_s: float = 0.0  # seconds its batches ran during the report's window
    p99_s: float | None = None  # its requests' p99 (queue + run) over the window


@dataclass(frozen=True, slots=True)
class MemoryUse:
    """Byte-seconds of a model's memory on one device attributed to a tenant
    (``tessera.costs``; tenant '': held with no use)."""

    tenant: str
    model: str
    byte_s: float


def drain_memory(ledger: CostLedger) -> tuple[MemoryUse, ...]:
    """What ``ledger`` (an engine's) accounted since its last drain, for a
    report: drained, so each byte-second goes in one report to one gateway."""
    return tuple(
        MemoryUse(tenant, model, byte_s)
        for (tenant, model), byte_s in sorted(ledger.drain_memory().items())
    )


@dataclass(frozen=True, slots=True)
class DeviceReport:
    """One engine's residency and load: sent every ``report_interval_s``."""

    device: str
    at: float  # when it was read, on the routers' clock
    window_s: float  # what busy_s and p99_s cover
    budget_bytes: int
    used_bytes: int
    models: tuple[ModelLoad, ...]  # models held, loading, or with a queue
    # The memory its engine accounted since its last report to any gateway
    # (drained: each byte-second goes in one report), for the audit rows of
    # the gateway that asked; no part of routing.
    memory: tuple[MemoryUse, ...] = ()


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """The router's targets and bounds."""

    report_interval_s: float = 0.25
    target_p99_s: float = 0.5
    max_queue_per_replica: int = 8
    target_utilization: float = 0.6
    scale_up_after_s: float = 1.0
    scale_down_after_s: float = 20.0
    max_replicas: int = 8
    placement_ttl_s: float = 10.0
    cold_after_s: float = 60.0


@dataclass(frozen=True, slots=True)
class AddReplica:
    """Load ``model`` on ``device`` now (a hot model's extra copy, or a dead device's model)."""

    model: str
    device: str


@dataclass(frozen=True, slots=True)
class DropReplica:
    """The router no longer sends ``model`` to ``device``: unload it there."""

    model: str
    device: str


@dataclass(slots=True)
class _Placement:
    bytes: int
    at: float
    confirmed: bool = False


@dataclass(slots=True)
class _Pressure:
    """A model's load summed over its replicas' latest reports."""

    queue: int = 0
    busy: float = 0.0  # device-seconds per second
    p99_s: float | None = None
    ready: bool = False
    loads: dict[str, float] = field(default_factory=dict)  # device -> its busy share


class Router:
    """One gateway's view of where models live, and its choices (see the module notes)."""

    def __init__(self, config: RoutingConfig | None = None) -> None:
        self.config = config or RoutingConfig()
        self._reports: dict[str, DeviceReport] = {}
        self._loads: dict[str, dict[str, ModelLoad]] = {}  # device -> model -> load
        self._queued: dict[str, int] = {}  # device -> its reported queue, all models
        self._held: dict[str, set[str]] = {}  # model -> devices whose report holds it
        self._placed: dict[str, dict[str, _Placement]] = {}  # model -> device -> placement
        self._placed_on: dict[str, set[str]] = {}  # device -> models placed there
        self._draining: dict[str, set[str]] = {}  # model -> devices it is dropped from
        self._sent: dict[str, int] = {}  # device -> requests sent, not yet answered
        self._last_used: dict[str, float] = {}
        self._hot_since: dict[str, float] = {}
        self._cold_since: dict[str, float] = {}
        # Each model's busy share, smoothed over rounds of reports: a batch
        # longer than a report's window lands in one window of several.
        self._busy: dict[str, float] = {}

    # -- reports ------------------------------------------------------------

    def report(self, report: DeviceReport) -> None:
        """Take a device's latest report (a new device joins with its first)."""
        device = report.device
        for name in self._loads.get(device, {}):
            self._held.get(name, set()).discard(device)
        loads = {m.name: m for m in report.models}
        self._reports[device] = report
        self._loads[device] = loads
        self._queued[device] = sum(m.queue_depth for m in report.models)
        self._sent.setdefault(device, 0)
        for name, load in loads.items():
            if load.state in HELD_STATES:
                self._held.setdefault(name, set()).add(device)
        for name in list(self._placed_on.get(device, ())):
            placement = self._placed[name][device]
            held = name in loads and loads[name].state in HELD_STATES
            if held:
                placement.confirmed = True
            elif placement.confirmed or report.at - placement.at > self.config.placement_ttl_s:
                self._unplace(name, device)  # evicted there, or never loaded
        for name, devices in self._draining.items():
            if device in devices and device not in self._held.get(name, ()):
                devices.discard(device)

    def remove_device(self, device: str, now: float) -> list[AddReplica]:
        """Forget a dead device; place again at once the recently used models
        that it alone held."""
        lost = {n for n, d in self._held.items() if device in d}
        lost |= self._placed_on.get(device, set())
        for name in self._loads.pop(device, {}):
            self._held.get(name, set()).discard(device)
        self._reports.pop(device, None)
        self._queued.pop(device, None)
        self._sent.pop(device, None)
        for name in list(self._placed_on.get(device, ())):
            self._unplace(name, device)
        for devices in self._draining.values():
            devices.discard(device)
        actions: list[AddReplica] = []
        for name in sorted(lost):
            recent = now - self._last_used.get(name, -math.inf) <= self.config.cold_after_s
            if recent and not self.replicas(name):
                target = self._choose(self._bytes_of(name), exclude=set())
                if target is not None:
                    self._place(name, target, self._bytes_of(name), now)
                    actions.append(AddReplica(name, target))
        return actions

    # -- requests -----------------------------------------------------------

    def replicas(self, model: str) -> set[str]:
        """The devices requests for ``model`` may go to now."""
        devices = set(self._placed.get(model, {})) | self._held.get(model, set())
        return devices - self._draining.get(model, set())

    def route(self, model: str, weights_bytes: int, now: float) -> str | None:
        """The device for one request of ``model`` (placing it if no device holds
        it); None while no device has reported. Call ``answered`` when it ends."""
        self._last_used[model] = now
        replicas = self.replicas(model)
        if replicas:
            device = min(replicas, key=lambda d: (self._load(d), d))
        else:
            chosen = self._choose(weights_bytes, exclude=set())
            if chosen is None:
                return None
            device = chosen
            self._place(model, device, weights_bytes, now)
        self._sent[device] = self._sent.get(device, 0) + 1
        return device

    def answered(self, device: str) -> None:
        """A request sent to ``device`` has ended (answered, failed, or re-routed)."""
        if self._sent.get(device, 0) > 0:
            self._sent[device] -= 1

    # -- replication --------------------------------------------------------

    def rebalance(self, now: float) -> list[AddReplica | DropReplica]:
        """Replicas to add for models that stay hot and to drop for models that
        went cold (call it after each round of reports)."""
        actions: list[AddReplica | DropReplica] = []
        for name in sorted(set(self._held) | set(self._placed)):
            replicas = self.replicas(name)
            if not replicas:
                continue
            pressure = self._pressure(name, replicas)
            smoothed = self._busy.get(name, pressure.busy)
            pressure.busy = self._busy[name] = (
                BUSY_SMOOTHING * pressure.busy + (1 - BUSY_SMOOTHING) * smoothed
            )
            action = self._scale_up(name, replicas, pressure, now) or self._scale_down(
                name, replicas, pressure, now
            )
            if action is not None:
                actions.append(action)
        return actions

    def _scale_up(
        self, name: str, replicas: set[str], pressure: _Pressure, now: float
    ) -> AddReplica | None:
        config = self.config
        over_queue = pressure.queue > config.max_queue_per_replica * len(replicas)
        over_p99 = pressure.p99_s is not None and pressure.p99_s > config.target_p99_s
        # Compute-bound only: a p99 or queue made by loads (the device evicting
        # and loading) is not cured by one more copy, which takes more bytes.
        busy = pressure.busy >= config.target_utilization * len(replicas)
        if not (pressure.ready and busy and (over_queue or over_p99)):
            self._hot_since.pop(name, None)
            return None
        self._cold_since.pop(name, None)
        since = self._hot_since.setdefault(name, now)
        settling = any(not p.confirmed for p in self._placed.get(name, {}).values())
        if now - since < config.scale_up_after_s or settling:
            return None
        if len(replicas) >= config.max_replicas:
            return None
        weights = self._bytes_of(name)
        device = self._choose(weights, exclude=replicas)
        if device is None:
            return None
        self._place(name, device, weights, now)
        del self._hot_since[name]
        return AddReplica(name, device)

    def _scale_down(
        self, name: str, replicas: set[str], pressure: _Pressure, now: float
    ) -> DropReplica | None:
        config = self.config
        needed = max(1, math.ceil(pressure.busy / config.target_utilization))
        if len(replicas) <= 1 or needed >= len(replicas) or name in self._hot_since:
            self._cold_since.pop(name, None)
            return None
        since = self._cold_since.setdefault(name, now)
        if now - since < config.scale_down_after_s:
            return None
        device = min(replicas, key=lambda d: (pressure.loads.get(d, 0.0), self._load(d), d))
        self._unplace(name, device)
        self._draining.setdefault(name, set()).add(device)
        del self._cold_since[name]
        return DropReplica(name, device)

    # -- internals ----------------------------------------------------------

    def _pressure(self, name: str, replicas: Iterable[str]) -> _Pressure:
        pressure = _Pressure()
        for device in replicas:
            load = self._loads.get(device, {}).get(name)
            if load is None:
                continue
            report = self._reports[device]
            share = load.busy_s / report.window_s if report.window_s > 0 else 0.0
            pressure.queue += load.queue_depth
            pressure.busy += share
            pressure.loads[device] = share
            pressure.ready = pressure.ready or load.state == "ready"
            if load.p99_s is not None:
                pressure.p99_s = max(pressure.p99_s or 0.0, load.p99_s)
        return pressure

    def _load(self, device: str) -> int:
        return self._queued.get(device, 0) + self._sent.get(device, 0)

    def _free_bytes(self, device: str) -> int:
        """Reported free bytes less the placements there that no report shows yet."""
        report = self._reports[device]
        pending = sum(
            self._placed[name][device].bytes
            for name in self._placed_on.get(device, ())
            if not self._placed[name][device].confirmed
        )
        return report.budget_bytes - report.used_bytes - pending

    def _choose(self, weights_bytes: int, exclude: set[str]) -> str | None:
        """The device for a new copy: where it fits, the least loaded; else the
        least loaded of all. Ties to the most free bytes, then the name."""
        candidates = [d for d in self._reports if d not in exclude]
        if not candidates:
            return None

        def key(device: str) -> tuple[bool, int, int, str]:
            free = self._free_bytes(device)
            return (free < weights_bytes, self._load(device), -free, device)

        return min(candidates, key=key)

    def _place(self, name: str, device: str, weights_bytes: int, now: float) -> None:
        self._placed.setdefault(name, {})[device] = _Placement(weights_bytes, now)
        self._placed_on.setdefault(device, set()).add(name)
        self._draining.get(name, set()).discard(device)

    def _unplace(self, name: str, device: str) -> None:
        self._placed.get(name, {}).pop(device, None)
        self._placed_on.get(device, set()).discard(name)

    def _bytes_of(self, name: str) -> int:
        """The model's bytes as last reported or placed (0 if never seen)."""
        for loads in self._loads.values():
            load = loads.get(name)
            if load is not None and load.weights_bytes:
                return load.weights_bytes
        for placement in self._placed.get(name, {}).values():
            return placement.bytes
        return 0
