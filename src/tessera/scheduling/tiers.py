"""Priority tiers: a weight for fair sharing, and optionally a latency target."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tessera.errors import ConfigError


@dataclass(frozen=True, slots=True)
class TierSpec:
    name: str
    weight: float
    latency_target_s: float | None = None


DEFAULT_TIERS: dict[str, TierSpec] = {
    "vip": TierSpec("vip", 4.0, 0.25),
    "standard": TierSpec("standard", 2.0),
    "batch": TierSpec("batch", 1.0),
}


def parse_tiers(raw: Mapping[str, Any] | None) -> dict[str, TierSpec]:
    """Tiers from config (``{name: {weight, latency_target_ms}}``) over the defaults."""
    tiers = dict(DEFAULT_TIERS)
    for name, values in (raw or {}).items():
        if not isinstance(values, Mapping):
            raise ConfigError(f"tier {name!r} must be a mapping")
        base = tiers.get(name, TierSpec(name, 1.0))
        weight = values.get("weight", base.weight)
        if not isinstance(weight, int | float) or weight <= 0:
            raise ConfigError(f"tier {name!r}: weight must be positive")
        target_ms = values.get(
            "latency_target_ms",
            base.latency_target_s * 1000 if base.latency_target_s is not None else None,
        )
        if target_ms is not None and (not isinstance(target_ms, int | float) or target_ms <= 0):
            raise ConfigError(f"tier {name!r}: latency_target_ms must be positive")
        tiers[name] = TierSpec(
            name, float(weight), float(target_ms) / 1000 if target_ms is not None else None
        )
    return tiers
