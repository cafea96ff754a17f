"""Activation peaks on the CPU: memory a batch allocates counts, pages of a
mapped file it touches (weights mapped from safetensors, read for the first
time) do not: they are the model's bytes, and they stay mapped after it."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from tessera.runtimes import memory
from tessera.runtimes.memory import measure_rss, reset_peak, rss_bytes, start_peak

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


def test_a_forked_child_reads_its_own_files_not_its_parents() -> None:
    assert rss_bytes() > 0  # the parent's files are open
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: which process's status its reading opens
        try:
            fd = memory._PROC.fd("status", os.O_RDONLY)
            os.write(write, os.readlink(f"/proc/self/fd/{fd}").encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        opened = os.read(read, 4096).decode()
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert opened == f"/proc/{pid}/status"
    parent_fd = memory._PROC.fd("status", os.O_RDONLY)
    assert os.readlink(f"/proc/self/fd/{parent_fd}") == f"/proc/{os.getpid()}/status"
