"""Activation peaks on the CPU: memory a batch allocates counts, pages of a
mapped file it touches (weights mapped from safetensors, read for the first
time) do not: they are the model's bytes, and they stay mapped after it."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest

from tessera.runtimes.memory import measure_rss, reset_peak, start_peak

MIB = 1024 * 1024
SIZE = 64 * MIB

pytestmark = pytest.mark.skipif(not reset_peak(), reason="needs Linux's /proc/self/clear_refs")


def touch_anonymous() -> int:
    buffer = bytearray(SIZE)  # zeroed: every page written
    for i in range(0, SIZE, 4096):
        buffer[i] = 1
    return len(buffer)


def test_memory_a_call_allocates_is_its_peak() -> None:
    measured = measure_rss(touch_anonymous)
    assert measured.peak_delta_bytes >= 0.9 * SIZE


def test_pages_of_a_mapped_file_are_not(tmp_path: Path) -> None:
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"\x01" * SIZE)
    with weights.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        peak_above = start_peak()
        assert peak_above is not None
        total = sum(mapped[i] for i in range(0, SIZE, 4096))  # every page read once
        assert total == SIZE // 4096
        assert peak_above() < 0.25 * SIZE  # what stays: the interpreter's own noise
