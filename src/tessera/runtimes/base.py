"""The interface between the engine and a model that runs: ``ModelLoader`` and ``LoadedModel``.

A *loader* knows one kind of model (an adapter: ``hf-encoder``, ``rapidocr``,
``bergamot``...). It estimates the bytes a model will hold from its files
before loading, and loads it into a ``LoadedModel``: a callable from a list of
task items to a list of outputs, one for one and in order, that reports the
bytes it really holds and how they were measured.

Components shared between models (one MiniLM encoder under embedding, rerank
and intent models) are acquired through ``SharedComponents``: the first model
loads it, the others get the same object, and the ``Footprint`` a model
reports names it by key so the budget counts it once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from tessera.footprint import Footprint
from tessera.runtimes.memory import Measured, measure_rss

if TYPE_CHECKING:
    from tessera.device import Device
    from tessera.repository.spec import ModelSpec

T = TypeVar("T")


class LoadedModel(Protocol):
    """A model resident on its device, ready to run batches.

    ``run`` is called on a compute worker thread, never two batches of the
    same model at once unless the model's spec allows it. It returns one output
    per item, in order, and raises on failure (the batch then fails as a whole).
    """

    def run(self, items: Sequence[Any]) -> list[Any]: ...

    def memory(self) -> Footprint:
        """The bytes it holds, with ``method`` saying how they were measured."""
        ...

    def unload(self) -> None: ...


@runtime_checkable
class SleepingModel(Protocol):
    """A loaded model that can be evicted by putting it to sleep (vLLM's sleep
    mode): its device bytes are freed but its process stays, and waking it is
    cheaper than a load."""

    def sleep(self) -> bool:
        """Free the device bytes; False where it cannot (then it is unloaded)."""
        ...

    def wake(self) -> None:
        """Hold them again, ready to run; raises if it cannot."""
        ...


@dataclass(frozen=True)
class LoadContext:
    """What a loader may use: the device, its thread share, shared components,
    a way to measure process memory around a call (exclusive of batches), and
    ``cache_dir``: a folder where loaders may keep converted weights between
    loads and restarts (None: no cache)."""

    device: Device
    threads: int
    shared: SharedComponents
    measure: Callable[[Callable[[], Any]], Measured]
    cache_dir: Path | None = None


class ModelLoader(Protocol):
    """Loads one kind of model (an adapter)."""

    def estimate_bytes(self, spec: ModelSpec) -> int:
        """Bytes the model is expected to hold, from its files, before loading."""
        ...

    def shared_keys(self, spec: ModelSpec) -> tuple[str, ...]:
        """Keys of the shared components this model would use (may be empty)."""
        ...

    def load(self, spec: ModelSpec, ctx: LoadContext) -> LoadedModel: ...


@dataclass
class _Shared:
    value: Any
    num_bytes: int
    refs: int


class SharedComponents:
    """Reference-counted components shared between loaded models.

    ``acquire(key, factory)`` returns the existing component or builds it with
    ``factory() -> (value, num_bytes)``; ``release(key)`` drops a reference and
    frees the component (calling ``on_free`` if given) when none are left.
    Thread-safe; a factory for one key runs once even if called concurrently.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[str, _Shared] = {}
        self._key_locks: dict[str, threading.Lock] = {}
        self._on_free: dict[str, Callable[[Any], None]] = {}

    def acquire(
        self,
        key: str,
        factory: Callable[[], tuple[T, int]],
        on_free: Callable[[T], None] | None = None,
    ) -> T:
        with self._lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                item = self._items.get(key)
                if item is not None:
                    item.refs += 1
                    value: T = item.value
                    return value
            built, num_bytes = factory()
            with self._lock:
                self._items[key] = _Shared(built, num_bytes, 1)
                if on_free is not None:
                    self._on_free[key] = on_free
            return built

    def release(self, key: str) -> None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return
            item.refs -= 1
            if item.refs > 0:
                return
            del self._items[key]
            on_free = self._on_free.pop(key, None)
        if on_free is not None:
            on_free(item.value)

    def bytes_of(self, key: str) -> int:
        with self._lock:
            item = self._items.get(key)
            return item.num_bytes if item is not None else 0

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._items)


def standalone_context(threads: int = 1) -> LoadContext:
    """A context for loading a model outside the engine (tests, the raw benchmark):
    the CPU device, its own shared components, and a plain RSS measurement."""
    from tessera.device import CpuDevice

    return LoadContext(
        device=CpuDevice(), threads=threads, shared=SharedComponents(), measure=measure_rss
    )
