"""Torch weights in the host tier: moved off the device when a model is
evicted, brought back by a copy (or a mapping) when it is needed again.

- CUDA: every tensor storage of the modules is copied into one host buffer
  that is page-locked (registered with CUDA at its exact size: torch's
  caching host allocator would round each block up to a power of two and keep
  it after use), asynchronously on the device's stream for copies to the host
  (``copy_stream``: beside other models' kernels, not behind them, and beside
  the copies coming back, which have a stream of their own), then that stream
  is synchronised and the device storage freed; restoring copies each back
  the same way and hands the buffer to ``PINNED_POOL``, where the next copy of
  that size takes it rather than page-lock a new one; a model's own weights
  (an ``owner`` given) find their buffer there at their next eviction, still
  holding them, and are not copied out again. What the tier holds is that
  buffer's bytes.
- CPU: a storage that maps a weight file (transformers maps safetensors files
  rather than reading them) is let go: the process unmaps it, its pages stay
  in the kernel's page cache (outside the resident set, reclaimable under
  memory pressure, then read from disk on the next restore), and restoring
  maps the same bytes of the same file again, read nowhere and parsed by no
  one. A storage that maps no file, or whose mapping was written to
  (copy-on-write pages that the file does not hold), is left as it is: it
  stays in process memory, counted as such.

Views keep their storage offsets and strides, so tied weights stay tied. The
skeleton (modules, config) and whatever the caller keeps beside it (a
tokenizer) stay in process memory, unmeasured (``benchmarks/reload_bench.py``
measures them). Which bytes of a file a CPU storage maps is read from
``/proc/self`` (``runtimes/filemap.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tessera.errors import ModelUnavailableError
from tessera.footprint import Footprint
from tessera.runtimes.filemap import FileSpan, file_identity, mapped_spans

PINNED = "pinned host memory"
_ALIGN = 512  # bytes between storages in the pinned buffer (any dtype's alignment)
TO_HOST, TO_DEVICE = "to host", "to device"  # the directions of copies, a stream each
PIECE_BYTES = 4 << 20  # the most one copy of the host tier moves (``copy_in_pieces``)


class HostCopyError(RuntimeError):
    """A host copy cannot be restored (its weight file changed on disk)."""


@dataclass(frozen=True, slots=True)
class _View:
    """A parameter or buffer, and where its data sits in its storage."""

    tensor: Any
    storage: int  # index of its storage in the copy
    offset: int  # in elements of its dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]


class HostCopy:
    """The tensors of some torch modules, held in the host tier (see the module
    docstring). ``offload`` moves them; ``restore`` brings them back once."""

    def __init__(
        self,
        device: str,
        views: list[_View],
        nbytes: list[int],
        pinned: _Pinned | None,
        spans: list[FileSpan | None],
        block: Any = None,
        owner: object | None = None,
    ) -> None:
        self.device = device
        self._views = views
        self._nbytes = nbytes  # per storage
        # CUDA: the page-locked buffer holding every storage; CPU: per storage,
        # the file span it maps, None for one left in place (process memory).
        self._pinned = pinned
        self._spans = spans
        # CUDA, a model restored before: the one storage every tensor views,
        # emptied (its views untouched) and refilled on restore.
        self._block = block
        # Who the weights are, where they never change on the device: a
        # restore leaves the buffer marked as theirs (``PinnedPool``).
        self._owner = owner
        self._restored = False

    @classmethod
    def offload(
        cls,
        modules: Iterable[Any],
        device: str,
        tensors: Sequence[Any] | None = None,
        owner: object | None = None,
    ) -> HostCopy:
        """Move the parameters and buffers of ``modules`` (on ``device``) to host
        memory; ``tensors``: those, as ``tensors_of(modules)`` gave them earlier
        (a model offloaded again and again need not walk its modules each time);
        ``owner``: a token of the caller's, only where these weights never
        change on the device (then a buffer its last restore left in the pool
        is taken back instead of a copy: ``PinnedPool``)."""
        tensors = tensors if tensors is not None else tensors_of(modules)
        if device.startswith("cuda"):
            block = one_block(tensors)
            if block is not None:
                # Restored before: every tensor views one block. Its bytes go
                # and the storage stays, as FSDP frees a flat parameter's, so a
                # swap costs two calls, not two for each of a hundred tensors.
                size = int(block.nbytes())
                # A buffer kept as the owner's holds the bytes restored, unchanged since.
                kept = PINNED_POOL.reclaim(owner, size) if owner is not None else None
                whole = _Pinned(kept, [0]) if kept is not None else _Pinned.copy_of([block], device)
                block.resize_(0)
                return cls(device, [], [size], whole, [None], block, owner)
        storages, views = _views_of(tensors)
        nbytes = [int(s.nbytes()) for s in storages]
        pinned: _Pinned | None = None
        spans: list[FileSpan | None] = [None] * len(storages)
        if device.startswith("cuda"):
            pinned = _Pinned.copy_of(storages, device)
        else:
            spans = mapped_spans(storages)
        del storages  # the views below hold the last references
        empty: dict[Any, Any] = {}  # one per dtype: their storages hold nothing
        for view in views:
            if pinned is not None or spans[view.storage] is not None:
                dtype = view.tensor.dtype
                if dtype not in empty:
                    empty[dtype] = _empty(view.tensor)
                view.tensor.data = empty[dtype]
        return cls(device, views, nbytes, pinned, spans, owner=owner)

    @property
    def moved(self) -> bool:
        """Whether any storage left the modules (to pinned memory, or as a file
        mapping let go); False where every one stayed in process memory."""
        return self._pinned is not None or any(s is not None for s in self._spans)

    def footprint(self) -> Footprint:
        """The host bytes this copy holds and how."""
        if self._pinned is not None:
            return Footprint(self._pinned.nbytes, method=PINNED)
        mapped = sum(s.nbytes for s in self._spans if s is not None)
        kept = sum(n for n, s in zip(self._nbytes, self._spans, strict=True) if s is None)
        return Footprint(
            mapped + kept,
            method=f"page cache, mapped weight files ({mapped} B); process memory ({kept} B)",
        )

    def restore(self) -> None:
        """Put every tensor back on the device; raises ``HostCopyError`` if a
        mapped file changed since (then the modules are unusable: unload them)."""
        if self._restored:
            raise HostCopyError("this host copy was restored already")
        if self._pinned is not None and self._block is not None:
            self._pinned.refill(self._block, self._nbytes[0], self.device)
        elif self._pinned is not None:
            # One device block for every storage, laid out as the buffer is:
            # one copy, one allocation (which a model of the same size evicted
            # before left in torch's cache), and the next offload copies one
            # storage. Offsets in the buffer are multiples of 512 bytes, so of
            # every dtype's size.
            block = self._pinned.to_device(self.device)
            offsets = self._pinned.offsets
            for view in self._views:
                first = offsets[view.storage] // view.tensor.dtype.itemsize
                view.tensor.data = _view_on(block, view, first)
        else:
            storages = _map_spans(self._spans)
            for view in self._views:
                storage = storages[view.storage]
                if storage is not None:
                    view.tensor.data = _view_on(storage, view, 0)
        if self._pinned is not None:
            self._pinned.free(self._owner)  # still the weights now on the device
            self._pinned = None
        self._restored = True

    def close(self) -> None:
        """Free what this copy holds in host memory (the pinned buffer)."""
        if self._pinned is not None:
            self._pinned.free()
            self._pinned = None


class HostSlot:
    """Where a runtime's module stands with the host tier: on the device, or
    waiting in host memory as a ``HostCopy``; its tensors walked once. For a
    runtime that is not offloaded where that would free nothing (on the CPU,
    weights read into process memory). Offload and restore hold ``lock``, the
    runtime's own around its batches; the runtime refuses to run while
    ``waiting``."""

    def __init__(self, name: str, device: str, lock: threading.Lock) -> None:
        self._name = name
        self._device = device
        self._lock = lock
        self._copy: HostCopy | None = None
        self._tensors: list[Any] | None = None
        # A runtime's weights never change on the device: a restore's pinned
        # buffer is kept as theirs for the next eviction (``PinnedPool``).
        self._owner = object()

    @property
    def waiting(self) -> bool:
        return self._copy is not None

    def offload(self, module: Any) -> Footprint | None:
        """Move ``module``'s weights to host memory; None where there is no
        module (unloaded), it waits there already, or nothing would leave the
        process (nothing moved)."""
        with self._lock:
            if module is None or self._copy is not None:
                return None
            if self._tensors is None:
                self._tensors = tensors_of([module])
            copy = HostCopy.offload([module], self._device, self._tensors, owner=self._owner)
            if not copy.moved:
                copy.restore()  # nothing left: nothing to bring back
                return None
            self._copy = copy
            return copy.footprint()

    def restore(self) -> None:
        """The weights back where they were; raises if they are not waiting."""
        with self._lock:
            copy = self._copy
            if copy is None:
                raise ModelUnavailableError(self._name, "its weights are not in the host tier")
            copy.restore()
            self._copy = None

    def close(self) -> None:
        """Free the host copy, if there is one (the model is being unloaded)."""
        copy, self._copy = self._copy, None
        if copy is not None:
            copy.close()


def gather_block(tensors: Sequence[Any]) -> Any:
    """Every one of ``tensors`` made a view of one new storage on their device,
    laid out as a restore from the host tier lays a model (``_layout``), their
    bytes copied in; that storage (the one they share already, where they do;
    None where they hold no bytes). Two models of one architecture so gathered
    are one block alike, so one's weights go into the other's as one copy
    (``graphs.SharedGraphs``), and the first eviction empties one storage.
    For a device's weights: on the CPU a storage that maps a weight file
    would become process memory."""
    import torch

    block = one_block(tensors)
    if block is not None:
        return block
    storages, views = _views_of(tensors)
    if not storages:
        return None
    offsets, total = _layout(storages)
    whole = device_bytes(total, str(storages[0].device))
    with torch.no_grad():
        for storage, offset in zip(storages, offsets, strict=True):
            source = storage_bytes(storage)
            whole[offset : offset + source.numel()].copy_(source)
    block = whole.untyped_storage()
    del storages  # the views below hold the last references
    for view in views:
        first = offsets[view.storage] // view.tensor.dtype.itemsize
        view.tensor.data = _view_on(block, view, first)
    return block


def _views_of(tensors: Sequence[Any]) -> tuple[list[Any], list[_View]]:
    """The distinct storages of ``tensors`` that hold bytes, in order of first
    use, and each tensor's place in its storage (the empty ones left out)."""
    storages: list[Any] = []
    index: dict[int, int] = {}
    views: list[_View] = []
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            continue
        position = index.setdefault(storage.data_ptr(), len(storages))
        if position == len(storages):
            storages.append(storage)
        offset, size, stride = tensor.storage_offset(), tuple(tensor.size()), tensor.stride()
        views.append(_View(tensor, position, offset, size, tuple(stride)))
    return storages, views


def _layout(storages: Sequence[Any]) -> tuple[list[int], int]:
    """Where each of ``storages`` begins in one block holding them all, in
    bytes (multiples of ``_ALIGN``, so of every dtype's size), and its size."""
    offsets, total = [], 0
    for storage in storages:
        offsets.append(total)
        total += -(-int(storage.nbytes()) // _ALIGN) * _ALIGN
    return offsets, total


def block_layout(tensors: Sequence[Any]) -> tuple[int, list[int]] | None:
    """The bytes of one block holding ``tensors`` and where each begins in it
    (in elements of its dtype): theirs where they are one block, else as
    ``gather_block`` would lay them; None where one of them holds no bytes."""
    block = one_block(tensors)
    if block is not None:
        return int(block.nbytes()), [int(t.storage_offset()) for t in tensors]
    storages, views = _views_of(tensors)
    if len(views) != len(tensors):
        return None
    offsets, total = _layout(storages)
    return total, [offsets[v.storage] // v.tensor.dtype.itemsize + v.offset for v in views]


def one_block(tensors: Sequence[Any]) -> Any:
    """The storage every one of ``tensors`` views, where they share one that
    holds bytes and can be resized (as ``HostCopy.restore`` and
    ``gather_block`` leave a model); else None."""
    if not tensors:
        return None
    block = tensors[0].untyped_storage()
    if block.nbytes() == 0 or not block.resizable():
        return None
    first = block.data_ptr()
    if any(t.untyped_storage().data_ptr() != first for t in tensors):
        return None
    return block


def tensors_of(modules: Iterable[Any]) -> list[Any]:
    """Every distinct parameter and buffer of ``modules`` (the same objects
    through offloads and restores: only their data moves)."""
    seen: set[int] = set()
    tensors = []
    for module in modules:
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                tensors.append(tensor)
    return tensors


def _empty(tensor: Any) -> Any:
    import torch

    return torch.empty(0, dtype=tensor.dtype, device=tensor.device)


def _view_on(storage: Any, view: _View, first: int) -> Any:
    """``view``'s tensor over ``storage``, whose element ``first`` (of the view's
    dtype) is where its own storage began."""
    return typed_view(storage, view.tensor.dtype, first + view.offset, view.size, view.stride)


def typed_view(storage: Any, dtype: Any, offset: int, size: Any, stride: Any) -> Any:
    """A tensor of ``dtype`` over ``storage`` from element ``offset``."""
    import torch

    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)


def storage_bytes(storage: Any) -> Any:
    """A uint8 tensor over the whole of ``storage``. It stays right while the
    storage is emptied and refilled to its size (an eviction and a restore
    keep the storage object), so a caller may keep it; made outside
    inference mode, so a copy into it may run outside too."""
    import torch

    with torch.inference_mode(False):
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def block_like(tensors: Sequence[Any], like: Sequence[Any]) -> Any:
    """Where ``like`` (a module's tensors) view one block: ``tensors`` (those of
    a copy of the module, in the same order) made views of a copy of that
    block, each where its twin sits, and that copy's storage; else None,
    nothing changed. A deep copy of a module is no such copy: it clones each
    parameter on its own and copies a buffer's whole storage (the block)."""
    import torch

    source = one_block(like)
    if source is None:
        return None
    whole = device_bytes(source.nbytes(), str(source.device))
    with torch.no_grad():
        whole.copy_(storage_bytes(source))
    block = whole.untyped_storage()
    for tensor, twin in zip(tensors, like, strict=True):
        offset, size, stride = twin.storage_offset(), twin.size(), twin.stride()
        tensor.data = typed_view(block, twin.dtype, offset, size, stride)
    return block


class PinnedPool:
    """Page-locked host buffers that no copy holds, kept for the next copy of
    the same size. Page-locking a buffer pins (and first faults in) every page
    of it, and unlocking and freeing it after each restore made every swap pay
    for a new one; the models of one architecture are copies of one size, so
    a restore's buffer is the next eviction's.

    A restore of weights that never change on the device (a model's own,
    not the graphs' template, into which each model's are copied) leaves its
    buffer marked with the copy's ``owner``: while the buffer waits here it
    still holds those weights, so the owner's next eviction takes it back
    (``reclaim``) and copies nothing to the host (a copy out is a large part
    of a swap-in). A copy of another
    model takes an unmarked buffer of its size first, else a new one while
    the pool has room to keep it when it comes back, and only at the pool's
    bounds the newest marked one (whose owner then copies when evicted): the
    buffer of the model restored last, which least-recently-used eviction
    takes last, where the oldest marked one is the next victim's own.
    Taking a marked buffer whenever no unmarked one waited had kept none: a
    swap's restore gives one buffer back and its eviction takes one, so the
    pool held about one, and each eviction of a model not restored last took
    it (a hundred models swapping through twenty places: every swap copied
    out). With room, the pool comes to hold a buffer for each model restored
    and still on the device, and their evictions copy nothing. At most
    ``max_buffers`` buffers and ``max_bytes`` bytes wait here, outside the
    host tier's budget (as the CUDA context is outside the device's);
    unmarked ones go first, the oldest first."""

    def __init__(self, max_buffers: int = 64, max_bytes: int = 2 << 30) -> None:
        self.max_buffers = max_buffers
        self.max_bytes = max_bytes
        self._free: deque[tuple[Any, object | None]] = deque()  # (buffer, owner)
        self._lock = threading.Lock()
        # Evictions to page-locked memory: weights copied out, and weights a
        # kept buffer still held (nothing copied; ``reclaim``).
        self.copies_out = 0
        self.copies_kept = 0

    def take(self, nbytes: int) -> Any:
        """A page-locked buffer of exactly ``nbytes`` (uint8) for a copy out
        (counted): a kept unmarked one, else a new one while the pool could
        keep one more of that size, else a marked one (the newest), else new."""
        import torch

        with self._lock:
            self.copies_out += 1
            at = self._first(nbytes, marked=False)
            if at is None and not self._has_room(nbytes):
                at = self._last_marked(nbytes)
            if at is not None:
                buffer, _ = self._free[at]
                del self._free[at]  # by place: tensors compare element by element
                return buffer
        return _register(torch.empty(nbytes, dtype=torch.uint8))

    def reclaim(self, owner: object, nbytes: int) -> Any:
        """The buffer of ``nbytes`` a restore of ``owner``'s left here, its
        bytes still the weights restored; None where it was taken or freed."""
        with self._lock:
            for i, (buffer, mark) in enumerate(self._free):
                if mark is owner and buffer.numel() == nbytes:
                    del self._free[i]
                    self.copies_kept += 1
                    return buffer
        return None

    def copies(self) -> tuple[int, int]:
        """Evictions to page-locked memory so far: those that copied the
        weights out, and those whose kept buffer still held them."""
        with self._lock:
            return self.copies_out, self.copies_kept

    def give(self, buffer: Any, owner: object | None = None) -> None:
        """Keep ``buffer`` (page-locked, no longer read by the device) for a
        later ``take``, or ``owner``'s ``reclaim``; what the pool's bounds
        leave out is unlocked and freed."""
        with self._lock:
            self._free.append((buffer, owner))
            released = []
            while self._free and (
                len(self._free) > self.max_buffers or self.held_bytes() > self.max_bytes
            ):
                at = next((i for i, (_, mark) in enumerate(self._free) if mark is None), 0)
                released.append(self._free[at][0])
                del self._free[at]
        for old in released:
            _unregister(old)

    def _first(self, nbytes: int, *, marked: bool) -> int | None:
        for i, (buffer, mark) in enumerate(self._free):
            if (mark is not None) == marked and buffer.numel() == nbytes:
                return i
        return None

    def _last_marked(self, nbytes: int) -> int | None:
        for i in range(len(self._free) - 1, -1, -1):
            buffer, mark = self._free[i]
            if mark is not None and buffer.numel() == nbytes:
                return i
        return None

    def _has_room(self, nbytes: int) -> bool:
        """Whether one more buffer of ``nbytes`` could wait here within the bounds."""
        return len(self._free) < self.max_buffers and self.held_bytes() + nbytes <= self.max_bytes

    def held_bytes(self) -> int:
        return sum(int(b.numel()) for b, _ in self._free)

    def clear(self) -> None:
        """Unlock and free every buffer kept."""
        with self._lock:
            released, self._free = [b for b, _ in self._free], deque()
        for old in released:
            _unregister(old)


PINNED_POOL = PinnedPool()


class _Pinned:
    """One host buffer, registered with CUDA as page-locked at its exact size,
    holding CUDA storages at ``offsets``; given back to ``PINNED_POOL`` by
    ``free``, unregistered if it is collected without that."""

    def __init__(self, buffer: Any, offsets: list[int]) -> None:
        self.nbytes = int(buffer.numel())
        self._buffer = buffer
        self.offsets = offsets  # of each storage, in bytes
        self._release = weakref.finalize(self, _unregister, buffer)

    @classmethod
    def copy_of(cls, storages: list[Any], device: str) -> _Pinned:
        """A pinned copy of ``storages`` (the copies overlap; one synchronise
        before the device storages may go)."""

        offsets, total = _layout(storages)
        pinned = cls(PINNED_POOL.take(total), offsets)
        # The weights are only read: the copy need not wait for other models'
        # kernels, and their blocks, freed after it, are reused in the order of
        # the stream that allocated them.
        with copying(device, TO_HOST):
            for storage, offset in zip(storages, offsets, strict=True):
                source = storage_bytes(storage)
                copy_in_pieces(pinned._buffer[offset : offset + source.numel()], source)
        return pinned

    def to_device(self, device: str) -> Any:
        """One new device storage holding the whole buffer (one ``non_blocking``
        copy, one synchronise)."""
        with copying(device, TO_DEVICE) as used_after:  # a block of the copy stream's own
            block = device_bytes(self.nbytes, device)
            copy_in_pieces(block, self._buffer)
            used_after(block)
        return block.untyped_storage()

    def refill(self, storage: Any, nbytes: int, device: str) -> None:
        """Give the emptied device ``storage`` its ``nbytes`` again, copied from
        the buffer's start (``non_blocking``, one synchronise)."""

        with copying(device, TO_DEVICE) as used_after:  # a block of the copy stream's own
            storage.resize_(nbytes)
            target = storage_bytes(storage)
            copy_in_pieces(target, self._buffer[:nbytes])
            used_after(target)

    def free(self, owner: object | None = None) -> None:
        """Hand the buffer to ``PINNED_POOL`` (once; the device reads it no
        more), marked as ``owner``'s where it holds weights ``owner`` has on
        the device (``PinnedPool``)."""
        if self._release.detach() is not None:
            PINNED_POOL.give(self._buffer, owner)


def copy_in_pieces(into: Any, source: Any, piece: int = PIECE_BYTES) -> None:
    """``source`` into ``into`` (uint8, one size) without blocking, as copies of
    at most ``piece`` bytes. A device runs one copy a direction at a time on
    each copy engine, in the order they come: a batch's inputs (or vectors)
    behind a whole model's weights would wait for all of them, behind a
    piece only for it. The pieces are views made by two calls, not two
    slices a piece: each torch call hands the interpreter lock to a thread
    waiting for it."""
    for to, values in zip(into.split(piece), source.split(piece), strict=True):
        to.copy_(values, non_blocking=True)


def device_bytes(nbytes: int, device: str) -> Any:
    """An uninitialised uint8 tensor of ``nbytes`` on ``device``."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, device=device)


_COPY_STREAMS: dict[tuple[str, str], Any] = {}
_COPY_STREAMS_LOCK = threading.Lock()


def copy_stream(device: str, direction: str) -> Any:
    """The device's stream for the host tier's copies in ``direction``
    (``TO_HOST`` or ``TO_DEVICE``): they run beside the batches' kernels (a
    GPU has copy engines of its own, one each way at least), an eviction's
    copy beside a restore's, and a copy waits for itself only, where a
    device-wide synchronise waited for every model's queued work."""
    import torch

    with _COPY_STREAMS_LOCK:
        stream = _COPY_STREAMS.get((device, direction))
        if stream is None:
            stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # untyped upstream
            _COPY_STREAMS[device, direction] = stream
        return stream


@contextlib.contextmanager
def copying(device: str, direction: str) -> Iterator[Callable[[Any], None]]:
    """Copies made inside run on ``device``'s copy stream for ``direction``; on
    leaving, that stream is synchronised, and each tensor handed to the
    function yielded is marked as used on the caller's stream from then on
    (its block is reused only after that stream's work, once freed)."""
    import torch

    consumer = torch.cuda.current_stream(device)
    kept: list[Any] = []
    stream = copy_stream(device, direction)
    with torch.cuda.stream(stream):
        yield kept.append
    stream.synchronize()
    for tensor in kept:
        tensor.record_stream(consumer)


def _register(buffer: Any) -> Any:
    """Page-lock ``buffer`` for CUDA (cudaHostRegister, portable); returns it."""
    import torch

    if buffer.numel():
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # untyped upstream
        error = int(cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), 1))
        if error:
            raise HostCopyError(f"cudaHostRegister of {buffer.numel()} bytes failed: {error}")
    return buffer


def _unregister(buffer: Any) -> None:
    import torch

    if buffer.numel():
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # untyped upstream
        cudart.cudaHostUnregister(buffer.data_ptr())


def _map_spans(spans: list[FileSpan | None]) -> list[Any]:
    """Storages over the files' bytes again: one private mapping a file
    (copy-on-write, as transformers maps them), nothing read."""
    import torch

    maps: dict[str, mmap.mmap] = {}
    storages: list[Any] = []
    for span in spans:
        if span is None:
            storages.append(None)
            continue
        mapped = maps.get(span.path)
        if mapped is None:
            if file_identity(span.path) != span.identity:
                raise HostCopyError(f"{span.path} changed since its model was evicted")
            with open(span.path, "rb") as f:
                mapped = maps[span.path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        tensor = torch.frombuffer(mapped, dtype=torch.uint8, count=span.nbytes, offset=span.offset)
        storages.append(tensor.untyped_storage())
    return storages
