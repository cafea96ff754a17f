"""Measuring the bytes a model holds.

- torch: the bytes of every distinct tensor storage in the module (exact).
- onnx and native engines: the process's resident-set growth around the load
  and a warm-up run (``rss delta``), which takes in the initializers and the
  allocator arena. The engine runs such measurements while no batch runs.
- activation peaks: the high-water mark of the resident set above its level
  before the batch (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``),
  less the pages of mapped files it brought in meanwhile (``RssFile`` and
  ``RssShmem`` growth: weights mapped from their files and first touched by
  this batch are the model's bytes, not its activations; they stay mapped, so
  their growth is read at the end), or the CUDA allocator's peak on a GPU.
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The lines of /proc/self/status read, as "\nName:" (found by ``bytes.find``: a
# regular expression over the file took longer than the kernel wrote it).
_FIELDS = tuple((name, f"\n{name}:".encode()) for name in ("VmRSS", "VmHWM", "RssFile", "RssShmem"))
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True, slots=True)
class Measured:
    """A value produced while memory was measured around it."""

    value: Any
    rss_delta_bytes: int
    peak_delta_bytes: int


class _ProcFiles:
    """This process's ``/proc/self`` files, each opened once and read with
    ``pread`` (a batch's peak is read twice a batch: opening the files each
    time was two thirds of its cost, 85 -> 17 µs on Python 3.11, with the fields found by
    ``bytes.find``). A forked
    child opens its own: the parent's point at the parent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._fds: dict[str, int | None] = {}

    def fd(self, name: str, flags: int) -> int | None:
        """The open file ``/proc/self/<name>``; None where it cannot be opened."""
        fds = self._fds
        if self._pid != os.getpid() or name not in fds:
            with self._lock:
                if self._pid != os.getpid():
                    self._fds = fds = {}  # a fork's: the files are the parent's
                    self._pid = os.getpid()
                if name not in fds:
                    try:
                        fds[name] = os.open(f"/proc/self/{name}", flags)
                    except OSError:
                        fds[name] = None
        return fds[name]

    def read(self, name: str) -> bytes | None:
        fd = self.fd(name, os.O_RDONLY)
        if fd is None:
            return None
        try:
            return os.pread(fd, 1 << 16, 0)
        except OSError:
            return None


_PROC = _ProcFiles()


def _status() -> dict[str, int]:
    text = _PROC.read("status")
    if text is None:
        return {}
    found: dict[str, int] = {}
    for name, line in _FIELDS:
        at = text.find(line)
        if at >= 0:
            end = text.find(b"kB", at)
            found[name] = int(text[at + len(line) : end]) * 1024
    return found


def _statm() -> tuple[int, int] | None:
    """(resident, resident of mapped files and shared memory) bytes: what
    ``VmRSS`` and ``RssFile + RssShmem`` say, from the kernel's cheaper file."""
    text = _PROC.read("statm")
    if text is None:
        return None
    fields = text.split()
    return int(fields[1]) * _PAGE_BYTES, int(fields[2]) * _PAGE_BYTES


def rss_bytes() -> int:
    """The process's resident set now (0 where /proc is absent)."""
    return _status().get("VmRSS", 0)


def reset_peak() -> bool:
    """Reset the resident-set high-water mark; False where unsupported."""
    fd = _PROC.fd("clear_refs", os.O_WRONLY)
    if fd is None:
        return False
    try:
        os.write(fd, b"5")
    except OSError:
        return False
    return True


def _mapped(status: dict[str, int]) -> int:
    return status.get("RssFile", 0) + status.get("RssShmem", 0)


def start_peak() -> Callable[[], int] | None:
    """Start measuring a peak of process memory; the call returned gives the
    peak so far above the level now, pages of mapped files left out (see the
    module notes). None where the high-water mark cannot be reset."""
    if not reset_peak():
        return None
    before = _statm()
    if before is None:
        return None
    rss_before, mapped_before = before

    def peak_above() -> int:
        now = _status()
        mapped = max(0, _mapped(now) - mapped_before)
        return max(0, now.get("VmHWM", 0) - rss_before - mapped)

    return peak_above


_freezes = 0  # how many times ``freeze_heap`` ran (``freezes``)


def freeze_heap() -> None:
    """Move every object alive now out of the garbage collector's reach
    (``gc.freeze``): modules, the models alive now. A full collection holds
    the interpreter lock for as long as it walks every object (about 200 ms
    with a MiniLM's libraries imported, over 400,000 objects), and every
    request's thread waits meanwhile. Called where libraries have just been
    imported (the server's start, an adapter's first load), not after each
    load: a model loaded later stays where an ordinary collection reaches its
    cycles (a few milliseconds with twenty models). ``collect_all`` reaches the
    frozen objects again."""
    global _freezes
    gc.freeze()
    _freezes += 1


def freezes() -> int:
    """How many times the heap was frozen: an object made when this read ``n``
    is frozen if it is still alive when it reads more."""
    return _freezes


def collect_all() -> None:
    """A full collection that frozen objects take part in too, then freeze the
    survivors again: an ended model's objects in reference cycles are freed.
    Not counted by ``freezes``: the models it freezes again were collected
    with the libraries; a cycle one of them leaves when it ends is found by the
    next full collection."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def trim_heap() -> None:
    """Collect garbage and hand freed heap pages back to the OS, so that a
    reading of the resident set counts live memory, not the allocator's cache."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        return


def measure_rss(fn: Callable[[], Any]) -> Measured:
    """Run ``fn`` and report how much the resident set grew, and its peak growth.

    Only meaningful while nothing else allocates in the process; callers that
    serve concurrently go through the engine's exclusive measurement instead.
    """
    trim_heap()
    before = rss_bytes()
    peak_above = start_peak()
    value = fn()
    trim_heap()
    after = rss_bytes()
    peak = peak_above() if peak_above is not None else after - before
    return Measured(value, max(0, after - before), max(0, peak))


def torch_module_bytes(module: Any) -> int:
    """Bytes of the distinct tensor storages (parameters and buffers) of a torch module."""
    seen: set[int] = set()
    total = 0
    for tensor in [*module.parameters(), *module.buffers()]:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        total += storage.nbytes()
    return total


def files_bytes(path: Path, suffixes: tuple[str, ...] = ()) -> int:
    """Bytes of a file, or of the files under a folder (optionally by suffix)."""
    if path.is_file():
        return path.stat().st_size
    return sum(
        p.stat().st_size
        for p in path.rglob("*")
        if p.is_file() and (not suffixes or p.suffix in suffixes)
    )
