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
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_FIELD = re.compile(r"^(VmRSS|VmHWM|RssFile|RssShmem):\s+(\d+)\s+kB", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Measured:
    """A value produced while memory was measured around it."""

    value: Any
    rss_delta_bytes: int
    peak_delta_bytes: int


def _status() -> dict[str, int]:
    try:
        text = _STATUS.read_text()
    except OSError:
        return {}
    return {name: int(kib) * 1024 for name, kib in _FIELD.findall(text)}


def rss_bytes() -> int:
    """The process's resident set now (0 where /proc is absent)."""
    return _status().get("VmRSS", 0)


def reset_peak() -> bool:
    """Reset the resident-set high-water mark; False where unsupported."""
    try:
        _CLEAR_REFS.write_text("5")
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
    before = _status()

    def peak_above() -> int:
        now = _status()
        mapped = max(0, _mapped(now) - _mapped(before))
        return max(0, now.get("VmHWM", 0) - before.get("VmRSS", 0) - mapped)

    return peak_above


def freeze_heap() -> None:
    """Move every object alive now out of the garbage collector's reach
    (``gc.freeze``): modules, a loaded model's objects. A full collection holds
    the interpreter lock for as long as it walks every object (220 ms with the
    default models' libraries imported, over 400,000 objects), and every
    request's thread waits meanwhile: each load's measurements collected four
    times, and the automatic collections the objects of loads set off came on
    top. ``collect_all`` reaches the frozen objects again when a model ends."""
    gc.freeze()


def collect_all() -> None:
    """A full collection that frozen objects take part in too, then freeze the
    survivors again: an ended model's objects in reference cycles are freed."""
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
