"""Eviction policies: which idle models to unload to free bytes.

A policy is a Protocol, an enum of names, and a factory (as vLLM's request
queues). Policies see candidates only (ready and unpinned); they return the
victims in eviction order, or ``None`` if even all candidates are not enough.

``cost`` (the default) evicts by expected cost, GreedyDual-Size-Frequency
style: a model's score is how often it is used (a decayed count of uses, half
a minute's weight after a minute) times what a miss of it costs, per byte it
frees. A miss costs what its callers waited when it was last needed and not
resident: from the first caller's arrival until it was ready, the room made
for it included (``ModelEntry.miss_s``); before any miss, its load seconds.
Those seconds count against the model's latency target (its card's
``latency_target_ms``; 1 s where it gives none): a second's reload is a tenth
of a chat answer's 10 s target and five times an embedding's 200 ms, so of
two models used alike the chat model goes, and its callers still get their
answers within target while the embedding's would all have missed it.
Its own load is not enough: a model that comes back from the host tier in
5 ms still needs room on the device, and under a budget that every model does
not fit that room is made by evicting others and waiting for their batches,
seconds in which every request for it waits. The lowest score goes first: a
large model used once an hour before a small one used every second, a model
whose callers waited 50 ms before one whose callers waited 2 s. Ties (models
never used) go least recently used first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Protocol

from tessera.clock import Clock, MonotonicClock
from tessera.residency.table import ModelEntry

# What a reload is assumed to cost before a model's first load was timed, and
# the least it is taken to cost (a load timed at zero still costs its uses).
DEFAULT_LOAD_S = 1.0
MIN_LOAD_S = 0.001
# The latency target a miss is weighed against for a model whose card names none.
DEFAULT_TARGET_S = 1.0


def expected_cost(entry: ModelEntry, now: float) -> float:
    """What evicting ``entry`` is expected to cost: uses x (miss seconds /
    latency target)."""
    return eviction_score(entry, now) * max(1, entry.weights_bytes)


def eviction_score(entry: ModelEntry, now: float) -> float:
    """What evicting ``entry`` is expected to cost per byte it frees: uses x
    (miss seconds / latency target) / bytes, where a miss costs its
    ``miss_s``, else its ``load_s``, at least ``MIN_LOAD_S``. Written out in
    one function: the cost policy reads it for every idle model at each load."""
    seconds = entry.miss_s if entry.miss_s is not None else entry.load_s
    miss_s = DEFAULT_LOAD_S if seconds is None else max(MIN_LOAD_S, seconds)
    per_s = (entry.target_s or DEFAULT_TARGET_S) * max(1, entry.footprint.total_bytes)
    return entry.uses_at(now) * miss_s / per_s


class EvictionPolicy(Protocol):
    def order(self, candidates: Sequence[ModelEntry]) -> list[ModelEntry]:
        """The candidates in the order this policy would evict them (none if
        it never evicts)."""
        ...

    def choose(
        self,
        candidates: Sequence[ModelEntry],
        need_bytes: int,
        freed_by: Callable[[list[str]], int],
    ) -> list[str] | None: ...


def take(
    ordered: Sequence[ModelEntry], need_bytes: int, freed_by: Callable[[list[str]], int]
) -> list[str] | None:
    """The first of ``ordered`` that together free ``need_bytes`` (as
    ``freed_by`` counts them); None if all of them do not."""
    victims: list[str] = []
    freed = freed_by(victims)
    for entry in ordered:
        if freed >= need_bytes:
            break
        victims.append(entry.name)
        freed = freed_by(victims)
    return victims if freed >= need_bytes else None


class EvictionPolicyName(StrEnum):
    COST = "cost"
    LRU = "lru"
    LARGEST = "largest"
    NONE = "none"  # a static partition: what is loaded stays; a batch waits for room


class _OrderedPolicy:
    """Evict in a fixed order of preference until enough bytes are freed:
    ``key(entry, now)``, read at one ``now`` a choice (one clock read, not
    one per candidate)."""

    def __init__(
        self,
        key: Callable[[ModelEntry, float], tuple[float, ...]],
        now: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self._key = key
        self._now = now

    def order(self, candidates: Sequence[ModelEntry]) -> list[ModelEntry]:
        now = self._now()
        return sorted(candidates, key=lambda e: self._key(e, now))

    def choose(
        self,
        candidates: Sequence[ModelEntry],
        need_bytes: int,
        freed_by: Callable[[list[str]], int],
    ) -> list[str] | None:
        """Evict in this policy's order until ``need_bytes`` are freed; None if
        every candidate is not enough."""
        return take(self.order(candidates), need_bytes, freed_by)


class _NeverEvict:
    """Never unload a model to make room (models are preloaded into fixed slices)."""

    def order(self, candidates: Sequence[ModelEntry]) -> list[ModelEntry]:
        return []

    def choose(
        self,
        candidates: Sequence[ModelEntry],
        need_bytes: int,
        freed_by: Callable[[list[str]], int],
    ) -> list[str] | None:
        return None


def make_eviction_policy(
    name: EvictionPolicyName | str, clock: Clock | None = None
) -> EvictionPolicy:
    """A policy by name; ``cost`` reads ``clock`` to decay use counts."""
    match EvictionPolicyName(name):
        case EvictionPolicyName.COST:
            return _OrderedPolicy(
                lambda e, now: (eviction_score(e, now), e.last_used),
                (clock or MonotonicClock()).now,
            )
        case EvictionPolicyName.LRU:
            return _OrderedPolicy(lambda e, _: (e.last_used,))
        case EvictionPolicyName.LARGEST:
            return _OrderedPolicy(lambda e, _: (-e.weights_bytes,))
        case EvictionPolicyName.NONE:
            return _NeverEvict()
