"""The engine's start: the preload models loaded, then the idle budget filled.

Invariant: the engine is ``ready`` only after this returns; a preload that
fails is that model's state (logged, retried on demand), never the server's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from tessera.clock import Clock
from tessera.residency import ResidencyManager
from tessera.runtimes.cache import prune
from tessera.runtimes.memory import freeze_heap

from .lifecycle import ServedModel, served_spec
from .types import EngineConfig, PreloadProgress

log = logging.getLogger(__name__)


def preload_names(config: EngineConfig, served: Mapping[str, ServedModel]) -> list[str]:
    """The models to load at start: the config's, else those marked preload."""
    if config.preload is not None:
        return list(config.preload)
    return [s.current_spec.key for s in served.values() if s.current_spec.preload]


async def start_models(
    config: EngineConfig,
    residency: ResidencyManager,
    served: Mapping[str, ServedModel],
    clock: Clock,
    demand: Mapping[str, int],
    progress: PreloadProgress | None,
) -> None:
    """Load and warm the preload models, then (``config.fills``) fill the idle
    budget, the most asked-for (``demand``) first."""
    names = preload_names(config, served)
    if progress is not None:
        progress.start(names)
    if config.cache_dir is not None:  # before any load reads it
        await asyncio.to_thread(
            prune,
            config.cache_dir,
            max_age_s=config.cache_max_age_s,
            max_bytes=config.cache_max_bytes,
        )

    async def load(name: str) -> None:
        error: BaseException | None = None
        try:
            await residency.ensure_loaded(served_spec(served, name))
        except Exception as e:
            error = e
            raise
        finally:
            if progress is not None:
                progress.loaded(name, error)

    results = await asyncio.gather(*(load(n) for n in names), return_exceptions=True)
    if progress is not None:
        progress.finish()
    for name, result in zip(names, results, strict=True):
        if isinstance(result, BaseException):
            log.error("preload failed: %s", f"{name}: {result}")
    if config.fills:
        await _fill(residency, served, clock, demand)
    # What started the server (its modules, its preloaded models) lives as
    # long as it does: out of the collector's way (``memory.freeze_heap``).
    freeze_heap()


async def _fill(
    residency: ResidencyManager,
    served: Mapping[str, ServedModel],
    clock: Clock,
    demand: Mapping[str, int],
) -> None:
    """Fill the idle budget with what fits (``ResidencyManager.fill``), as
    Triton loads its whole repository at start: the first requests for those
    models find them ready rather than wait behind loads."""
    specs = [s.current_spec for s in served.values()]
    started = clock.now()
    loaded = await residency.fill(specs, dict(demand))
    if loaded:
        log.info(
            "filled the budget at start in %.1f s: %s (%d MiB of %d MiB in use)",
            clock.now() - started,
            ", ".join(loaded),
            residency.table.used_bytes() >> 20,
            residency.table.budget_bytes >> 20,
        )
