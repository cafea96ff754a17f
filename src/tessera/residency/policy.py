"""Eviction policies: which idle models to unload to free bytes.

A policy is a Protocol, an enum of names, and a factory (as vLLM's request
queues). Policies see candidates only (ready and unpinned); they return the
victims in eviction order, or ``None`` if even all candidates are not enough.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Protocol

from tessera.residency.table import ModelEntry


class EvictionPolicy(Protocol):
    def choose(
        self,
        candidates: Sequence[ModelEntry],
        need_bytes: int,
        freed_by: Callable[[list[str]], int],
    ) -> list[str] | None: ...


class EvictionPolicyName(StrEnum):
    LRU = "lru"
    LARGEST = "largest"
    NONE = "none"  # a static partition: what is loaded stays; a batch waits for room


class _OrderedPolicy:
    """Evict in a fixed order of preference until enough bytes are freed."""

    def __init__(self, key: Callable[[ModelEntry], float]) -> None:
        self._key = key

    def choose(
        self,
        candidates: Sequence[ModelEntry],
        need_bytes: int,
        freed_by: Callable[[list[str]], int],
    ) -> list[str] | None:
        victims: list[str] = []
        for entry in sorted(candidates, key=self._key):
            if freed_by(victims) >= need_bytes:
                break
            victims.append(entry.name)
        return victims if freed_by(victims) >= need_bytes else None


class _NeverEvict:
    """Never unload a model to make room (models are preloaded into fixed slices)."""

    def choose(
        self,
        candidates: Sequence[ModelEntry],
        need_bytes: int,
        freed_by: Callable[[list[str]], int],
    ) -> list[str] | None:
        return None


def make_eviction_policy(name: EvictionPolicyName | str) -> EvictionPolicy:
    match EvictionPolicyName(name):
        case EvictionPolicyName.LRU:
            return _OrderedPolicy(lambda e: e.last_used)
        case EvictionPolicyName.LARGEST:
            return _OrderedPolicy(lambda e: -e.weights_bytes)
        case EvictionPolicyName.NONE:
            return _NeverEvict()
