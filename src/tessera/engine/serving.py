"""What a gateway needs of an engine: ``ServingEngine``.

The gateway (HTTP, authentication, JSON, the audit) talks to the engine
through this face only. ``Engine`` is one, in the gateway's own process;
``RemoteEngine`` (``engine/remote.py``) is one in a gateway process of its
own, over a Unix socket to the process that owns the engine
(``engine/core.py``): queues, the fair scheduler, admission, residency and
the device stay in one place, whatever the number of gateways.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tessera.metrics import EngineStats, ModelStats, RolloutStats, StatsSink
    from tessera.repository.spec import ModelSpec
    from tessera.repository.watch import RepositoryWatcher
    from tessera.tasks.types import Task

    from .types import Caller, PreloadProgress, RequestTrace, Submission


class ServingEngine(Protocol):
    """The engine as the gateway's routes, probes and lifespan see it."""

    # -- what every reader sees ---------------------------------------------
    def model_names(self) -> list[str]: ...

    def versions(self, name: str) -> list[ModelSpec]: ...

    def spec(self, name: str) -> ModelSpec: ...

    def spec_for(self, name: str, task: Task) -> ModelSpec: ...

    def snapshot(self) -> EngineStats: ...

    @property
    def phase(self) -> str: ...

    @property
    def ready(self) -> bool: ...

    def subscribe(self, sink: StatsSink) -> None: ...

    # -- the request path -----------------------------------------------------
    async def asubmit(
        self,
        name: str,
        task: Task,
        items: Sequence[Any],
        *,
        timeout_s: float | None = None,
        caller: Caller | None = None,
    ) -> Submission: ...

    async def wait(
        self, submission: Submission, trace: RequestTrace | None = None
    ) -> list[Any]: ...

    # -- lifecycle ------------------------------------------------------------
    async def preload(self, progress: PreloadProgress | None = None) -> None: ...

    async def watch_repository(self, watcher: RepositoryWatcher, interval_s: float) -> None: ...

    async def load(self, name: str) -> ModelStats: ...

    async def unload(self, name: str) -> bool: ...

    async def add_model(self, folder: Path, via_api: bool = False) -> list[RolloutStats]: ...

    async def remove_model(self, name: str) -> int: ...

    async def drain(self, grace_s: float) -> int: ...

    async def close(self) -> None: ...
