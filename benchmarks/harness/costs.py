"""What each tenant cost in a step, by the servers' own cost ledgers.

Read from each tessera server's cost counters (``/metrics``:
``tessera_tenant_device_seconds_total`` and
``tessera_tenant_memory_byte_seconds_total``) just before the step's load
starts and just after its last answer: their differences are the step's
exactly. A batch's device time is counted when the batch ends (the warm-up's
have all ended before the first read; the step's, before the second), and a
scrape accounts the memory held up to its own instant. The audit log
(``/admin/usage``) names the same device-seconds, but writes its memory rows
every 10 s: a step's window there would be off by up to 10 s of memory at
each end. A configuration of several processes (dedicated: one a model)
is the sum of their differences: a tenant's cost is what every process spent
on its traffic.

Each server names at most 50 tenants in its counters and sums the rest as
``other`` (``tessera.metrics.prometheus``); a step's requests of tenants no
server names are counted in that row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tessera.metrics.prometheus import OTHER_TENANT, UNATTRIBUTED_LABEL

DEVICE = "tessera_tenant_device_seconds_total"
MEMORY = "tessera_tenant_memory_byte_seconds_total"
GB = 1e9
ALL = "all"  # every tenant's cost and memory held with no use, over every request within target

# One server's costs so far: tenant label -> (device-seconds, byte-seconds), over its models.
Costs = dict[str, tuple[float, float]]


def parse_costs(text: str) -> Costs:
    """The tenants' cost counters of one ``/metrics`` text, summed over models."""
    out: Costs = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name not in (DEVICE, MEMORY):
                continue
            tenant = sample.labels.get("tenant", "")
            device_s, byte_s = out.get(tenant, (0.0, 0.0))
            if sample.name == DEVICE:
                device_s += sample.value
            else:
                byte_s += sample.value
            out[tenant] = (device_s, byte_s)
    return out


async def read_costs(base_urls: Sequence[str], headers: Mapping[str, str]) -> list[Costs]:
    """Each server's costs now, in the order of ``base_urls``."""
    out = []
    async with httpx.AsyncClient(timeout=30, headers=dict(headers)) as client:
        for base_url in base_urls:
            response = await client.get(f"{base_url}/metrics")
            response.raise_for_status()
            out.append(parse_costs(response.text))
    return out


def spent(before: Sequence[Costs], after: Sequence[Costs]) -> Costs:
    """What every server spent between two reads, per tenant label, summed over servers."""
    if len(before) != len(after):
        raise ValueError("before and after must read the same servers")
    out: Costs = {}
    for then, now in zip(before, after, strict=True):
        for tenant, (device_s, byte_s) in now.items():
            was_device, was_byte = then.get(tenant, (0.0, 0.0))
            sum_device, sum_byte = out.get(tenant, (0.0, 0.0))
            out[tenant] = (sum_device + device_s - was_device, sum_byte + byte_s - was_byte)
    return out


def _row(within: int, device_s: float, byte_s: float) -> dict[str, Any]:
    thousands = within / 1000
    return {
        "within_target": within,
        "device_s": round(device_s, 4),
        "byte_s": round(byte_s),
        "device_s_per_1k_within_target": round(device_s / thousands, 3) if within else None,
        "gb_s_per_1k_within_target": round(byte_s / GB / thousands, 3) if within else None,
    }


def tenant_costs(
    costs: Costs, within: Mapping[str, int], groups: Mapping[str, str] | None = None
) -> dict[str, dict[str, Any]]:
    """Per tenant (a group of tenants pooled under its name, ``groups``:
    tenant -> group): requests within target (``within``), device-seconds,
    byte-seconds, and both per 1,000 requests within target. Then ``other``
    (where a server summed tenants past its labels), ``unattributed``
    (memory held with no use, per 1,000 of every tenant's requests within
    target) and ``all`` (everything, over the same)."""
    groups = groups or {}
    named = set(costs) - {OTHER_TENANT, UNATTRIBUTED_LABEL}

    def row_of(tenant: str) -> str:
        if tenant not in named and OTHER_TENANT in costs:
            return OTHER_TENANT
        return groups.get(tenant, tenant)

    rows_within: dict[str, int] = {}
    for tenant, n in within.items():
        rows_within[row_of(tenant)] = rows_within.get(row_of(tenant), 0) + n
    rows_cost: dict[str, tuple[float, float]] = {}
    for tenant, (device_s, byte_s) in costs.items():
        if tenant == UNATTRIBUTED_LABEL:
            continue
        key = row_of(tenant)
        sum_device, sum_byte = rows_cost.get(key, (0.0, 0.0))
        rows_cost[key] = (sum_device + device_s, sum_byte + byte_s)
    tenants = sorted((set(rows_within) | set(rows_cost)) - {OTHER_TENANT})
    if OTHER_TENANT in rows_within or OTHER_TENANT in rows_cost:
        tenants.append(OTHER_TENANT)
    out = {t: _row(rows_within.get(t, 0), *rows_cost.get(t, (0.0, 0.0))) for t in tenants}
    every = sum(within.values())
    held_unused = costs.get(UNATTRIBUTED_LABEL, (0.0, 0.0))[1]
    out[UNATTRIBUTED_LABEL] = _row(every, 0.0, held_unused)
    device_total = sum(device_s for device_s, _ in costs.values())
    byte_total = sum(byte_s for _, byte_s in costs.values())
    out[ALL] = _row(every, device_total, byte_total)
    return out
