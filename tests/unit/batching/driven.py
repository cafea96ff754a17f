"""``DrivenBatcher``: a ``ModelBatcher`` with the loop the engine runs around it.

The engine's ``ModelLoop`` (``engine/step.py``) asks the batcher for each
batch, runs it as a task of its own and reports its end; this driver does the
same with a test's ``execute`` in place of the engine's step, so the batcher's
policy is tested alone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from tessera.batching import ModelBatcher
from tessera.clock import Clock
from tessera.repository.spec import BatchingSpec
from tessera.request import Batch, QueuedRequest

Execute = Callable[[Batch], Awaitable[None]]


class DrivenBatcher(ModelBatcher):
    def __init__(
        self, name: str, batching: BatchingSpec, execute: Execute, clock: Clock, **kw: Any
    ) -> None:
        super().__init__(name, batching, clock, **kw)
        self._execute = execute
        self._driver: asyncio.Task[None] | None = None
        self._runs: set[asyncio.Task[None]] = set()

    def submit(self, request: QueuedRequest, *, counted: bool = True) -> None:
        super().submit(request, counted=counted)
        if self._driver is None:
            self._driver = asyncio.get_running_loop().create_task(self._drive())

    async def stop(self) -> None:
        """Stop forming batches, fail what waits, and wait for the running ones."""
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
            self._driver = None
        self.close()
        if self._runs:
            await asyncio.gather(*self._runs, return_exceptions=True)

    async def _drive(self) -> None:
        while True:
            batch = await self.next_batch()
            run = asyncio.get_running_loop().create_task(self._run(batch))
            self._runs.add(run)
            run.add_done_callback(self._runs.discard)

    async def _run(self, batch: Batch) -> None:
        try:
            await self._execute(batch)
        finally:
            self.finished(batch)
