"""Which CPU storages the host tier may let go to the page cache: those that map
a file whole and unwritten, read from the process's mappings and, for written
pages, its page map (no torch here; tests/integration/runtimes/test_host_tier.py
moves real tensors)."""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from tessera.runtimes import filemap
from tessera.runtimes.filemap import Region, file_spans, read_maps, read_regions

SMAPS = """\
00400000-00452000 r-xp 00000000 fe:00 100 /usr/bin/python3
Size:                328 kB
Anonymous:             0 kB
VmFlags: rd ex mr mw me dw
7f0000000000-7f0000002000 rw-p 00000000 00:00 0
Size:                  8 kB
Anonymous:             8 kB
7f0000010000-7f0000012000 rw-p 00000000 fe:00 200 {weights}
Size:                  8 kB
Anonymous:             0 kB
7f0000012000-7f0000014000 rw-p 00002000 fe:00 200 {weights}
Size:                  8 kB
Anonymous:             0 kB
7f0000020000-7f0000022000 rw-p 00000000 fe:00 300 {written}
Size:                  8 kB
Anonymous:             4 kB
"""


@dataclass
class Storage:
    ptr: int
    size: int

    def data_ptr(self) -> int:
        return self.ptr

    def nbytes(self) -> int:
        return self.size


def regions(tmp_path: Path) -> tuple[list[Region], Path, Path]:
    weights, written = tmp_path / "model.safetensors", tmp_path / "written.safetensors"
    weights.write_bytes(bytes(0x4000))
    written.write_bytes(bytes(0x2000))
    smaps = tmp_path / "smaps"
    smaps.write_text(SMAPS.format(weights=weights, written=written))
    return read_regions(smaps), weights, written


def test_file_mappings_are_read_merged_and_their_written_pages_counted(tmp_path: Path) -> None:
    found, weights, written = regions(tmp_path)
    assert found == [
        Region(0x400000, 0x452000, 0, "/usr/bin/python3", 0),
        Region(0x7F0000010000, 0x7F0000014000, 0, str(weights), 0),  # two pieces, one mapping
        Region(0x7F0000020000, 0x7F0000022000, 0, str(written), 4096),
    ]


def test_only_storages_inside_an_unwritten_file_mapping_are_let_go(tmp_path: Path) -> None:
    found, weights, _ = regions(tmp_path)
    inside = Storage(0x7F0000011800, 0x1000)  # across the two merged pieces
    across_the_end = Storage(0x7F0000013800, 0x1000)
    anonymous = Storage(0x7F0000000100, 0x100)
    written = Storage(0x7F0000020000, 0x100)
    spans = file_spans([inside, across_the_end, anonymous, written], found)
    span = spans[0]
    assert span is not None
    assert (span.path, span.offset, span.nbytes) == (str(weights), 0x1800, 0x1000)
    assert spans[1:] == [None, None, None]


def test_no_proc_means_no_mappings(tmp_path: Path) -> None:
    assert read_regions(tmp_path / "absent") == []


MAPS = """\
00400000-00452000 r-xp 00000000 fe:00 100                                /usr/bin/python3
7f0000000000-7f0000002000 rw-p 00000000 00:00 0
7f0000010000-7f0000012000 rw-p 00000000 fe:00 200                        {weights}
7f0000012000-7f0000014000 rw-p 00002000 fe:00 200                        {weights}
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
"""


def test_file_mappings_are_read_from_maps_without_counts(tmp_path: Path) -> None:
    weights = tmp_path / "a model.safetensors"  # a space in the path
    maps = tmp_path / "maps"
    maps.write_text(MAPS.format(weights=weights))
    assert read_maps(maps) == [
        Region(0x400000, 0x452000, 0, "/usr/bin/python3", 0),
        Region(0x7F0000010000, 0x7F0000014000, 0, str(weights), 0),
    ]
    assert read_maps(tmp_path / "absent") == []


def test_a_storage_whose_own_pages_were_written_is_not_let_go(tmp_path: Path) -> None:
    found, weights, _ = regions(tmp_path)
    clean, touched = Storage(0x7F0000010000, 0x1000), Storage(0x7F0000012000, 0x1000)
    spans = file_spans([clean, touched], found, lambda start, n: start == touched.ptr)
    assert spans[0] is not None
    assert spans[0].path == str(weights)
    assert spans[1] is None


@pytest.mark.skipif(not os.access("/proc/self/pagemap", os.R_OK), reason="no page map")
def test_the_page_map_tells_a_written_private_page_from_a_read_one(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    page = mmap.PAGESIZE
    path.write_bytes(bytes(range(256)) * (4 * page // 256))
    with path.open("rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # as transformers maps
    start = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
    assert mapped[: 2 * page].count(b"\x00") == 2 * page // 256  # read: file pages
    mapped[2 * page] = 1  # written: copy-on-write, anonymous now
    pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        assert not filemap._written(pagemap, start, 2 * page)
        assert filemap._written(pagemap, start + 2 * page + 10, 100)
        assert filemap._written(pagemap, start, 4 * page)
    finally:
        os.close(pagemap)
