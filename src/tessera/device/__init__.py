"""The device interface: CPU and CUDA."""

from tessera.device.device import (
    CPU_BUDGET_SHARE,
    CUDA_BUDGET_SHARE,
    HOST_TIER_SHARE,
    CpuDevice,
    CudaDevice,
    Device,
    DeviceStats,
    default_host_budget_bytes,
    make_device,
)

__all__ = [
    "CPU_BUDGET_SHARE",
    "CUDA_BUDGET_SHARE",
    "HOST_TIER_SHARE",
    "CpuDevice",
    "CudaDevice",
    "Device",
    "DeviceStats",
    "default_host_budget_bytes",
    "make_device",
]
