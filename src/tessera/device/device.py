"""The device a tessera process serves from: CPU here, CUDA where there is a GPU.

Both sit behind one small interface: total memory, the default budget, the
names the runtimes use for it, and live stats. On CPU the default budget is
half of the machine's RAM (the rest is for the OS, the server and the
tokenizers); on CUDA it is 80% of the card. The host tier (evicted models kept
ready in host memory) gets a quarter of the machine's RAM by default on both:
pinned memory on CUDA; on CPU mostly page cache that the kernel may reclaim
(see docs/architecture.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import psutil

CPU_BUDGET_SHARE = 0.5
CUDA_BUDGET_SHARE = 0.8
HOST_TIER_SHARE = 0.25  # of the machine's RAM, on either device


def default_host_budget_bytes() -> int:
    """The host tier's default budget: a share of the machine's RAM."""
    return int(psutil.virtual_memory().total * HOST_TIER_SHARE)


@dataclass(frozen=True, slots=True)
class DeviceStats:
    """A snapshot of the device's own accounting."""

    used_bytes: int
    total_bytes: int
    utilization: float | None  # 0..1 where the device reports it
    temperature_c: float | None = None


class Device(Protocol):
    kind: Literal["cpu", "cuda"]
    index: int

    @property
    def name(self) -> str: ...

    def total_bytes(self) -> int: ...

    def default_budget_bytes(self) -> int: ...

    def torch_device(self) -> str: ...

    def onnx_providers(self, mem_limit_bytes: int | None) -> list[Any]: ...

    def stats(self) -> DeviceStats: ...


class CpuDevice:
    kind: Literal["cpu", "cuda"] = "cpu"
    index = 0

    @property
    def name(self) -> str:
        return f"cpu ({os.cpu_count()} cores)"

    def total_bytes(self) -> int:
        return int(psutil.virtual_memory().total)

    def default_budget_bytes(self) -> int:
        return int(self.total_bytes() * CPU_BUDGET_SHARE)

    def torch_device(self) -> str:
        return "cpu"

    def onnx_providers(self, mem_limit_bytes: int | None) -> list[Any]:
        return ["CPUExecutionProvider"]

    def stats(self) -> DeviceStats:
        process = psutil.Process()
        return DeviceStats(
            used_bytes=int(process.memory_info().rss),
            total_bytes=self.total_bytes(),
            utilization=psutil.cpu_percent(interval=None) / 100.0,
        )


class CudaDevice:
    """One CUDA card; memory and utilization from NVML when present, else torch."""

    kind: Literal["cpu", "cuda"] = "cuda"

    def __init__(self, index: int = 0) -> None:
        self.index = index

    @property
    def name(self) -> str:
        import torch

        return f"cuda:{self.index} ({torch.cuda.get_device_name(self.index)})"

    def total_bytes(self) -> int:
        import torch

        _free, total = torch.cuda.mem_get_info(self.index)
        return int(total)

    def default_budget_bytes(self) -> int:
        return int(self.total_bytes() * CUDA_BUDGET_SHARE)

    def torch_device(self) -> str:
        return f"cuda:{self.index}"

    def onnx_providers(self, mem_limit_bytes: int | None) -> list[Any]:
        options: dict[str, Any] = {
            "device_id": self.index,
            "arena_extend_strategy": "kSameAsRequested",
        }
        if mem_limit_bytes is not None:
            options["gpu_mem_limit"] = mem_limit_bytes
        return [("CUDAExecutionProvider", options), "CPUExecutionProvider"]

    def stats(self) -> DeviceStats:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            temp = pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
            return DeviceStats(int(mem.used), int(mem.total), util.gpu / 100.0, float(temp))
        except Exception:  # NVML absent or failing: fall back to torch's view
            import torch

            free, total = torch.cuda.mem_get_info(self.index)
            return DeviceStats(int(total - free), int(total), None)


def make_device(spec: str) -> Device:
    """``cpu``, ``cuda`` or ``cuda:N``; ``auto`` picks CUDA when torch sees one."""
    if spec == "auto":
        try:
            import torch

            spec = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            spec = "cpu"
    if spec == "cpu":
        return CpuDevice()
    if spec.startswith("cuda"):
        _, _, index = spec.partition(":")
        return CudaDevice(int(index or 0))
    raise ValueError(f"unknown device {spec!r}: use cpu, cuda, cuda:N or auto")
