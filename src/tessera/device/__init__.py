"""The device interface: CPU and CUDA."""

from tessera.device.device import (
    CPU_BUDGET_SHARE,
    CUDA_BUDGET_SHARE,
    CpuDevice,
    CudaDevice,
    Device,
    DeviceStats,
    make_device,
)

__all__ = [
    "CPU_BUDGET_SHARE",
    "CUDA_BUDGET_SHARE",
    "CpuDevice",
    "CudaDevice",
    "Device",
    "DeviceStats",
    "make_device",
]
