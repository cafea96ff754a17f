"""Many devices: engines as Ray actors, and routers that send each request where
its model lives. The routing policy (``cluster.routing``) is plain Python over
engine reports, testable on a fake clock; only ``cluster.actor`` and
``cluster.remote`` import ray, and only when a cluster is used."""

from tessera.cluster.routing import (
    AddReplica,
    DeviceReport,
    DropReplica,
    MemoryUse,
    ModelLoad,
    Router,
    RoutingConfig,
)

__all__ = [
    "AddReplica",
    "DeviceReport",
    "DropReplica",
    "MemoryUse",
    "ModelLoad",
    "Router",
    "RoutingConfig",
]
