"""What residency needs from the engine: estimates, and loads and unloads off the loop."""

from __future__ import annotations

from typing import Protocol

from tessera.footprint import Footprint
from tessera.repository.spec import ModelSpec
from tessera.runtimes.base import LoadedModel


class ModelHost(Protocol):
    """What residency needs from the engine: estimates, and loads/unloads off the loop."""

    def estimate(self, spec: ModelSpec) -> Footprint: ...

    async def load(self, spec: ModelSpec) -> LoadedModel: ...

    async def unload(
        self,
        spec: ModelSpec,
        model: LoadedModel,
        *,
        eviction: bool = False,  # pragma: no mutate
    ) -> None:
        """Free what ``model`` holds (``eviction``: to make room; a host may then
        keep it in a state cheaper to reload, outside the budget)."""
        ...

    async def offload(self, spec: ModelSpec, model: LoadedModel) -> Footprint | None:
        """Move an evicted model into the host tier and return the host bytes it
        holds there; None where it cannot go (nothing moved: unload it)."""
        ...

    async def restore(self, spec: ModelSpec) -> LoadedModel | None:
        """The model kept in the host tier, back on the device; None if it could
        not come back (the host ended it: load it from its files)."""
        ...

    async def drop(self, spec: ModelSpec) -> None:
        """End the model kept in the host tier."""
        ...
