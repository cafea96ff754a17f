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

A model that can wait in the host tier when evicted (``OffloadingModel``)
moves its weights off the device and back; a shared component it holds moves
when the last of its holders on the device leaves (``SharedComponents.park``)
and comes back with the first that returns (``unpark``, or ``acquire`` by a
model loading beside it).

A model whose batches run on another machine's engine (``RemoteModel``: a
gateway's model on a Ray cluster) answers with the device time that engine
measured, which the engine charges instead of the wait it sees here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard, TypeVar, runtime_checkable

from tessera.footprint import Footprint
from tessera.runtimes.memory import Measured, measure_rss

if TYPE_CHECKING:
    from tessera.device import Device
    from tessera.repository.spec import ModelSpec

T = TypeVar("T")

log = logging.getLogger(__name__)


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


@runtime_checkable
class OffloadingModel(LoadedModel, Protocol):
    """A loaded model that can wait in the host tier when evicted: ``offload``
    moves its weights off the device into host memory (pinned on CUDA; on CPU
    mappings of its weight files, which the page cache backs), ``restore``
    brings them back, a copy rather than a load. ``unload`` still frees
    everything, offloaded or not. Shared components move with their holders
    (``SharedComponents.park``)."""

    def offload(self) -> Footprint | None:
        """Move the weights to host memory and return the host bytes they hold
        there (``method`` says how); None where it cannot, and then nothing moved
        (the caller unloads it)."""
        ...

    def restore(self) -> None:
        """Bring the weights back to the device, ready to run; raises if it
        cannot (the caller then unloads it and loads it from its files)."""
        ...


@dataclass(frozen=True, slots=True)
class RemoteRun:
    """A batch's answer from an engine on another machine: its ``outputs``,
    one per item, and the ``device_s`` that engine measured running them
    (its share of the batches they ran in there, ``tessera.costs``)."""

    outputs: list[Any]
    device_s: float


@runtime_checkable
class RemoteModel(LoadedModel, Protocol):
    """A loaded model whose batches run on another machine's engine (a model
    of a gateway in front of a Ray cluster): the time its ``run`` takes here
    is a wait (the remote engine's queue, the network, its run), not device
    time. The engine runs its batches with ``run_remote`` instead, and
    charges their requests the device time it reports (``tessera.costs``);
    ``run`` is ``run_remote(items).outputs``."""

    def run_remote(self, items: Sequence[Any]) -> RemoteRun:
        """Run ``items`` there: the outputs and the device-seconds they took."""
        ...


def runs_remotely(model: LoadedModel) -> TypeGuard[RemoteModel]:
    """Whether ``model`` runs elsewhere and reports its device time
    (``RemoteModel``): one method looked up, as ``offloads`` does."""
    return callable(getattr(model, "run_remote", None))


def offloads(model: LoadedModel) -> TypeGuard[OffloadingModel]:
    """Whether ``model`` can wait in the host tier (``OffloadingModel``): its
    two methods looked up, where ``isinstance`` with the protocol walks every
    member of it and ``LoadedModel`` (9 µs on Python 3.11, twice a swap)."""
    return callable(getattr(model, "offload", None)) and callable(getattr(model, "restore", None))


def stacks(model: LoadedModel) -> bool:
    """Whether ``model``'s batches may run in one forward with other models'
    (``runtimes/stacking.py``; its ``stacks_across_models``): the executor
    runs them on threads of their own, so that more of them than it has
    compute workers reach a round at once."""
    return bool(getattr(model, "stacks_across_models", False))


class EncoderHead(Protocol):
    """A loaded model that is a shared first stage (an encoder and its
    readout) and a head of its own over that stage's vectors: encoder
    batching (``engine/groups.py``) runs the first stage once for the rows
    of many such models and each row's head after.

    ``stage_key`` names the first stage: two models of one key make the same
    vector of an item, so ``vectors`` of either runs any of their items.
    ``run(items)`` is ``head(vectors(items))``."""

    @property
    def stage_key(self) -> str: ...

    def vectors(self, items: Sequence[Any]) -> Any:
        """The first stage's rows of ``items``, one row each, in order."""
        ...

    def head(self, vectors: Any) -> list[Any]:
        """Its own outputs of rows of ``vectors``, one each, in order."""
        ...


def is_encoder_head(model: LoadedModel) -> TypeGuard[EncoderHead]:
    """Whether ``model`` is an ``EncoderHead`` (its members looked up, as
    ``offloads`` does)."""
    return (
        isinstance(getattr(model, "stage_key", None), str)
        and callable(getattr(model, "vectors", None))
        and callable(getattr(model, "head", None))
    )


@runtime_checkable
class ItemsApart(Protocol):
    """A loader whose runtime runs some items one after another, each alone:
    their activations are freed before the next one's are taken."""

    def alone_units(self, spec: ModelSpec, item: object) -> float | None:
        """The work units whose activations ``item`` holds at its peak if it
        runs on its own (its own units, or fewer where it runs in parts, one
        after another); None where it runs beside the batch's other items."""
        ...


@dataclass(frozen=True)
class LoadContext:
    """What a loader may use: the device, its thread share, shared components,
    a way to measure process memory around a call (exclusive of batches),
    ``cache_dir``: a folder where loaders may keep converted weights between
    loads and restarts (None: no cache), and ``warm_up``: whether the loader
    runs its own warm-up inside the measurement (a first load: the bytes a
    run leaves allocated are the model's). A reload, whose figures are known,
    skips it: the first batch after pays the first run's small extra cost
    (rapidocr: a page of 0.54 s in a reload of 0.79 s, against ~0.05 s more
    on the first page)."""

    device: Device
    threads: int
    shared: SharedComponents
    measure: Callable[[Callable[[], Any]], Measured]
    cache_dir: Path | None = None
    warm_up: bool = True
    # Folders the operator trusts with pickle files (``repository/trust.py``).
    trusted_pickle_dirs: tuple[Path, ...] = ()


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
    refs: int  # holders, on the device or in the host tier
    active: int  # holders on the device


class SharedComponents:
    """Reference-counted components shared between loaded models.

    ``acquire(key, factory)`` returns the existing component or builds it with
    ``factory() -> (value, num_bytes)``; ``release(key)`` drops a reference and
    frees the component (calling ``on_free`` if given) when none are left.
    A holder evicted to the host tier keeps its reference but leaves the
    device (``park``): the component is offloaded (its ``offload()``, as
    ``OffloadingModel``'s) when no holder is left on the device, and restored
    when one comes back (``unpark``) or a new one acquires it.
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
                if item.active == 0:  # every holder waits in the host tier
                    item.value.restore()
                with self._lock:
                    item.refs += 1
                    item.active += 1
                value: T = item.value
                return value
            built, num_bytes = factory()
            with self._lock:
                self._items[key] = _Shared(built, num_bytes, 1, 1)
                if on_free is not None:
                    self._on_free[key] = on_free
            return built

    def park(self, key: str) -> bool:
        """A holder of ``key`` leaves the device for the host tier, keeping its
        reference; the last to leave offloads the component. False (nothing
        changed) where the component cannot be offloaded."""
        with self._lock:
            item = self._items.get(key)
            key_lock = self._key_locks.get(key)
        if item is None or key_lock is None:
            return False
        if not callable(getattr(item.value, "offload", None)):
            return False
        with key_lock:
            if item.active == 1 and item.value.offload() is None:
                return False
            with self._lock:
                item.active -= 1
        return True

    def unpark(self, key: str) -> None:
        """A parked holder of ``key`` comes back to the device; the first back
        restores the component (raises, changing nothing, if it cannot)."""
        with self._lock:
            item = self._items[key]
            key_lock = self._key_locks[key]
        with key_lock:
            if item.active == 0:
                item.value.restore()
            with self._lock:
                item.active += 1

    def release(self, key: str, *, parked: bool = False) -> None:
        """Drop a holder's reference (``parked``: a holder in the host tier).
        The last reference frees the component; the last holder on the device
        leaving while others wait in the host tier offloads it."""
        with self._lock:
            item = self._items.get(key)
            key_lock = self._key_locks.get(key)
        if item is None or key_lock is None:
            return
        with key_lock:
            with self._lock:
                item.refs -= 1
                if not parked:
                    item.active -= 1
                gone = item.refs == 0
                if gone:
                    del self._items[key]
                    on_free = self._on_free.pop(key, None)
            if gone:
                if on_free is not None:
                    on_free(item.value)
            elif not parked and item.active == 0 and item.value.offload() is None:
                log.warning("shared component %s stays on the device: it could not offload", key)

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
