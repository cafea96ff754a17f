"""Which bytes of which file a CPU storage maps, read from ``/proc/self``.

The host tier lets go of a storage that maps a weight file whole and
unwritten (``runtimes/hostcopy.py``): its pages stay in the kernel's page
cache, and a restore maps the same bytes again. A storage whose mapping was
written to (copy-on-write pages that the file does not hold) maps no file
here. A file is known by its identity (inode, size, mtime), so a file
changed on disk since is never mapped back as the weights.
"""

from __future__ import annotations

import bisect
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SMAPS = Path("/proc/self/smaps")
_MAPS = Path("/proc/self/maps")
_PAGEMAP = "/proc/self/pagemap"
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True, slots=True)
class FileSpan:
    """Where a CPU storage's bytes sit in a file, and the file as it was then."""

    path: str
    offset: int
    nbytes: int
    identity: tuple[int, int, int]  # inode, size, mtime (ns)


@dataclass(frozen=True, slots=True)
class Region:
    """A mapping of the process: [start, end) maps ``path`` from ``offset``;
    ``anonymous_bytes`` of it are copy-on-write pages (written since)."""

    start: int
    end: int
    offset: int
    path: str
    anonymous_bytes: int


def file_identity(path: str) -> tuple[int, int, int]:
    """A file as it is now: inode, size, mtime (ns)."""
    stat = os.stat(path)
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def mapped_spans(storages: list[Any]) -> list[FileSpan | None]:
    """``file_spans`` of ``storages`` in this process: the mappings from
    ``/proc/self/maps``, and whether a storage's pages were written from
    ``/proc/self/pagemap`` for its own pages only. ``/proc/self/smaps`` holds
    that too, but for every mapping of the process, which with torch and
    transformers imported is far more to make and parse at every eviction.
    Where pagemap cannot be read, smaps."""
    try:
        pagemap = os.open(_PAGEMAP, os.O_RDONLY)
    except OSError:
        return file_spans(storages, read_regions())
    try:
        return file_spans(storages, read_maps(), lambda s, n: _written(pagemap, s, n))
    finally:
        os.close(pagemap)


# A line of /proc/self/maps that maps a file (an inode): start-end perms offset dev inode path
_FILE_LINE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ ([0-9a-f]+) \S+ 0*[1-9]\d* +(.+)$", re.M)


def read_maps(maps: Path = _MAPS) -> list[Region]:
    """The file mappings of this process from ``maps`` (no anonymous bytes
    counted), adjacent pieces of one mapping merged; empty where /proc is absent."""
    try:
        text = maps.read_text()
    except OSError:
        return []
    found = [
        Region(int(start, 16), int(end, 16), int(offset, 16), path, 0)
        for start, end, offset, path in _FILE_LINE.findall(text)
    ]
    return _merged(found)


def _written(pagemap: int, start: int, nbytes: int) -> bool:
    """Whether a page of [start, start + nbytes) was written since it was mapped
    (copy-on-write made it anonymous: present and not a file page, or swapped
    out, which file pages never are); True where pagemap does not answer."""
    import numpy as np

    first, last = start // _PAGE, (start + nbytes - 1) // _PAGE
    try:
        data = os.pread(pagemap, 8 * (last - first + 1), 8 * first)
    except OSError:
        return True
    entries = np.frombuffer(data, dtype=np.uint64)
    if len(entries) != last - first + 1:
        return True
    present = (entries >> np.uint64(63)) & np.uint64(1)
    swapped = (entries >> np.uint64(62)) & np.uint64(1)
    file_page = (entries >> np.uint64(61)) & np.uint64(1)
    return bool(np.any((present & (file_page ^ np.uint64(1))) | swapped))


def read_regions(smaps: Path = _SMAPS) -> list[Region]:
    """The file mappings of this process with each one's anonymous bytes,
    adjacent pieces of one mapping merged (empty where /proc is absent)."""
    try:
        text = smaps.read_text()
    except OSError:
        return []
    regions: list[Region] = []
    in_file = False  # whether the lines read now describe a file mapping
    for line in text.splitlines():
        head = line.split(maxsplit=5)
        if head and not head[0].endswith(":"):  # a mapping's first line
            in_file = len(head) == 6 and head[4] != "0"  # an inode: a file
            if in_file:
                start, end = (int(x, 16) for x in head[0].split("-"))
                regions.append(Region(start, end, int(head[2], 16), head[5], 0))
        elif in_file and head[0] == "Anonymous:":
            last = regions[-1]
            regions[-1] = Region(last.start, last.end, last.offset, last.path, int(head[1]) * 1024)
    return _merged(regions)


def _merged(regions: list[Region]) -> list[Region]:
    merged: list[Region] = []
    for region in regions:
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.path == region.path
            and last.end == region.start
            and last.offset + (last.end - last.start) == region.offset
        ):
            anonymous = last.anonymous_bytes + region.anonymous_bytes
            merged[-1] = Region(last.start, region.end, last.offset, last.path, anonymous)
        else:
            merged.append(region)
    return merged


def file_spans(
    storages: list[Any],
    regions: list[Region],
    written: Callable[[int, int], bool] | None = None,
) -> list[FileSpan | None]:
    """For each storage, the span of a file it maps whole and unwritten; None
    for one that maps no file (or was written to since it was mapped: its
    region's anonymous bytes say so, or ``written`` of its own bytes where
    given)."""
    ordered = sorted(regions, key=lambda r: r.start)  # disjoint: found by bisection
    starts = [r.start for r in ordered]
    identities: dict[str, tuple[int, int, int] | None] = {}
    spans: list[FileSpan | None] = []
    for storage in storages:
        start, nbytes = storage.data_ptr(), storage.nbytes()
        at = bisect.bisect_right(starts, start) - 1
        region = ordered[at] if at >= 0 and start < ordered[at].end else None
        if (
            region is None
            or start + nbytes > region.end
            or region.anonymous_bytes
            or (written is not None and written(start, nbytes))
        ):
            spans.append(None)
            continue
        if region.path not in identities:
            try:
                identities[region.path] = file_identity(region.path)
            except OSError:  # deleted since it was mapped
                identities[region.path] = None
        identity = identities[region.path]
        if identity is None:
            spans.append(None)
            continue
        offset = region.offset + (start - region.start)
        spans.append(FileSpan(region.path, offset, nbytes, identity))
    return spans
