"""What each tenant costs: device time split out of shared batches, and the
memory its models hold over time.

Device time. A batch's measured run time is split among its requests in
proportion to their work units in it (texts' tokens, pages, generated
tokens: what a batch's run grows with, ``tessera.units``); when none has a
unit counted they take equal parts. The parts of one batch sum to its run
time, so the tenants' device-seconds sum to the workers' busy time. A request
run in parts, or a generation in steps, adds up its shares.

Memory. Each resident model's part of the budget's used bytes (its own
bytes, its activation room, an equal part of each weight it shares with other
resident models: ``ResidencyTable.shares``) times the time it is held goes to
the tenants that ran work on it in the last ``window_s``, in proportion to
their device time there. Time a model is held with no use in the window is
*unattributed* (tenant ``UNATTRIBUTED``): no tenant's work asked for it; it
stays because the budget had room, and it is the first evicted when room is
needed. Billing it to the last users would charge a tenant for the
operator's choice to keep a cold model. Attributed plus unattributed is the
budget's used bytes times time, sampled at each ``held`` call.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

UNATTRIBUTED = ""
DEFAULT_WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class Cost:
    """Device-seconds and byte-seconds of memory, for one tenant and model."""

    device_s: float = 0.0
    byte_s: float = 0.0

    def plus(self, other: Cost) -> Cost:
        return Cost(self.device_s + other.device_s, self.byte_s + other.byte_s)


def split_run(run_s: float, units: Sequence[float]) -> list[float]:
    """``run_s`` split by ``units``' shares (equal shares when none is positive)."""
    if not units:
        return []
    weights = [max(0.0, u) for u in units]
    total = sum(weights)
    if total <= 0.0:
        return [run_s / len(units)] * len(units)
    return [run_s * w / total for w in weights]


class UseWindow:
    """Device time each tenant ran on each model in the last ``window_s``.

    Invariant: ``_sums[model][tenant]`` is the sum of that tenant's entries
    still in ``_uses[model]``; entries older than ``now - window_s`` are gone
    after any call with ``now``.
    """

    def __init__(self, window_s: float = DEFAULT_WINDOW_S) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._uses: dict[str, collections.deque[tuple[float, str, float]]] = {}
        self._sums: dict[str, dict[str, float]] = {}

    def ran(self, model: str, tenant: str, device_s: float, now: float) -> None:
        if device_s <= 0.0:
            return
        self._uses.setdefault(model, collections.deque()).append((now, tenant, device_s))
        sums = self._sums.setdefault(model, {})
        sums[tenant] = sums.get(tenant, 0.0) + device_s
        self._expire(model, now)

    def shares(self, model: str, now: float) -> dict[str, float]:
        """Each tenant's fraction of the model's use in the window (summing
        to 1); empty when no tenant used it there."""
        self._expire(model, now)
        sums = self._sums.get(model, {})
        total = sum(sums.values())
        if total <= 0.0:
            return {}
        return {tenant: s / total for tenant, s in sums.items()}

    def _expire(self, model: str, now: float) -> None:
        uses = self._uses.get(model)
        if uses is None:
            return
        sums = self._sums[model]
        while uses and uses[0][0] < now - self.window_s:
            _, tenant, device_s = uses.popleft()
            left = sums[tenant] - device_s
            if left > 1e-12:
                sums[tenant] = left
            else:
                del sums[tenant]
        if not uses:
            del self._uses[model]
            del self._sums[model]


class CostLedger:
    """Running totals of device-seconds and byte-seconds per (tenant, model).

    ``batch_ran`` splits each batch's run; ``held`` integrates resident bytes
    over time, each interval's bytes being those seen at its start (a model
    loaded or evicted in between counts from the next call).
    """

    def __init__(self, window_s: float = DEFAULT_WINDOW_S) -> None:
        self._window = UseWindow(window_s)
        self._totals: dict[tuple[str, str], Cost] = {}
        self._undrained: dict[tuple[str, str], float] = {}  # byte-seconds not yet drained
        self._held: dict[str, int] = {}
        self._held_since: float | None = None
        self.device_s = 0.0  # every batch's run time, split or not
        self.byte_s = 0.0  # every resident byte-second, attributed or not

    def batch_ran(
        self, model: str, run_s: float, requests: Sequence[tuple[str, float]], now: float
    ) -> list[float]:
        """Split a batch's ``run_s`` among its ``requests`` (tenant, units);
        each request's device-seconds, in order."""
        shares = split_run(run_s, [units for _, units in requests])
        for (tenant, _), device_s in zip(requests, shares, strict=True):
            self._add(tenant, model, Cost(device_s=device_s))
            self._window.ran(model, tenant, device_s, now)
        self.device_s += run_s if requests else 0.0
        return shares

    def held(self, resident: Mapping[str, int], now: float) -> None:
        """Account the bytes held since the last call, then note ``resident``
        (each held model's part of the used bytes) as held from ``now``."""
        since = self._held_since
        if since is not None and now > since:
            elapsed = now - since
            for model, num_bytes in self._held.items():
                byte_s = num_bytes * elapsed
                self.byte_s += byte_s
                shares = self._window.shares(model, now) or {UNATTRIBUTED: 1.0}
                for tenant, share in shares.items():
                    self._add(tenant, model, Cost(byte_s=byte_s * share))
                    key = (tenant, model)
                    self._undrained[key] = self._undrained.get(key, 0.0) + byte_s * share
        if since is None or now >= since:
            self._held = {m: b for m, b in resident.items() if b > 0}
            self._held_since = now

    def totals(self) -> dict[tuple[str, str], Cost]:
        """Every (tenant, model)'s cost so far (tenant ``UNATTRIBUTED``: held unused)."""
        return dict(self._totals)

    def drain_memory(self) -> dict[tuple[str, str], float]:
        """Byte-seconds per (tenant, model) accounted since the last drain: each
        goes to exactly one caller (the gateway that writes it down)."""
        drained, self._undrained = self._undrained, {}
        return drained

    def by_tenant(self) -> dict[str, Cost]:
        out: dict[str, Cost] = {}
        for (tenant, _), cost in self._totals.items():
            out[tenant] = out.get(tenant, Cost()).plus(cost)
        return out

    def _add(self, tenant: str, model: str, cost: Cost) -> None:
        key = (tenant, model)
        self._totals[key] = self._totals.get(key, Cost()).plus(cost)
