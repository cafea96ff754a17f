"""An external engine's (or isolated worker's) device bytes on CUDA: what NVML
counts for the pids of its process tree on its card, read here from a
stand-in ``pynvml`` (no GPU); None, so that the caller falls back to the
resident set, where NVML is missing, fails or lists none of them."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from tessera.runtimes.external import nvml_bytes

MiB = 2**20


def stand_in(processes: dict[int, list[tuple[int, int | None]]], *, fails: bool = False) -> object:
    """A ``pynvml`` whose card ``index`` runs ``processes[index]``: (pid, bytes)."""

    def init() -> None:
        if fails:
            raise RuntimeError("NVML Shared Library Not Found")

    def running(handle: int) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in processes[handle]]

    return SimpleNamespace(
        nvmlInit=init,
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetComputeRunningProcesses=running,
    )


def test_the_bytes_of_the_trees_pids_on_its_card(monkeypatch: pytest.MonkeyPatch) -> None:
    cards = {
        0: [(10, 700 * MiB), (11, 50 * MiB), (99, 4000 * MiB)],  # 99: another process
        1: [(10, 300 * MiB), (12, None)],  # None: NVML could not tell (counted as 0)
    }
    monkeypatch.setitem(sys.modules, "pynvml", stand_in(cards))
    assert nvml_bytes([10, 11], 0) == 750 * MiB
    assert nvml_bytes([10, 12], 1) == 300 * MiB
    assert nvml_bytes([20, 21], 0) is None  # none of them on the card


def test_none_without_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", stand_in({0: [(10, MiB)]}, fails=True))
    assert nvml_bytes([10], 0) is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: the import fails
    assert nvml_bytes([10], 0) is None
