"""The engine's side of residency: estimate, load (with a measured warm-up) and
unload models, off the event loop.

A model that can sleep (``runtimes.base.SleepingModel``: vLLM's sleep mode) is
evicted by putting it to sleep: its device bytes leave the budget as an
unloaded model's do, but the host keeps it, and its next load wakes it. A model
that cannot (or fails to) sleep is unloaded; a sleeping one that fails to wake
is unloaded and loaded afresh. Unloading for any other cause (by hand, retired,
the server stopping) ends it.

A model that can wait in the host tier (``runtimes.base.OffloadingModel``) is
offloaded when residency keeps it there (``offload``): its weights move to host
memory and the host keeps the model; ``restore`` brings it back, ``drop`` ends
it. Both run off the event loop, as loads do, but on threads of their own (a
swap does not wait behind loads from files), and count as loads for the
measurement of batches (``executor.loading``)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tessera.device import Device
from tessera.errors import ModelUnavailableError, TesseraError
from tessera.footprint import Footprint
from tessera.metrics import NullSink, StatsSink
from tessera.repository.spec import ModelSpec
from tessera.residency import ActivationBook
from tessera.runtimes.base import (
    ItemsApart,
    LoadContext,
    LoadedModel,
    ModelLoader,
    OffloadingModel,
    SharedComponents,
    SleepingModel,
    offloads,
)
from tessera.runtimes.hostcopy import PINNED_POOL
from tessera.runtimes.isolated import IsolatedLoader
from tessera.runtimes.memory import Measured, collect_all, freeze_heap, freezes
from tessera.runtimes.registry import NOT_STAGED, get_loader
from tessera.runtimes.stacking import stacked_totals
from tessera.tasks.finiteness import check_finite
from tessera.tasks.samples import warmup_items
from tessera.tasks.types import Task, work_units

from .executor import ComputeExecutor

log = logging.getLogger(__name__)

MAX_WARMUP_ITEMS = 8
# Tasks whose items are heavy (a page, a sentence of speech, a generation)
# warm up on one item: enough to measure a peak per unit, cheap on a cold load.
ONE_ITEM_WARMUP = frozenset({Task.OCR, Task.TTS, Task.GENERATE})
# Runtimes whose models hold nothing here (a cluster gateway's, which run on
# engine actors): loaded without a measurement or a warm-up.
UNMEASURED_RUNTIMES = frozenset({"cluster"})
# Unloads run an ordinary collection (for the cycles an ended model leaves)
# at most this often.
ORDINARY_COLLECTION_S = 1.0


@dataclasses.dataclass(frozen=True)
class RuntimeTotals:
    """Counts the runtimes keep for the whole process, as the snapshot reports them."""

    stacked_rounds: int  # rounds of two or more models' batches run together
    stacked_batches: int  # the batches in those rounds
    host_copies_out: int  # evictions to page-locked memory that copied the weights out
    host_copies_kept: int  # those whose kept buffer still held them


def runtime_totals() -> RuntimeTotals:
    """The runtimes' process-wide counts: the engine reads the runtimes'
    module state through this call only."""
    stacked_rounds, stacked_batches = stacked_totals()
    copies_out, copies_kept = PINNED_POOL.copies()
    return RuntimeTotals(stacked_rounds, stacked_batches, copies_out, copies_kept)


# Runtimes whose models' bytes are the growth of this process's resident set
# around their load (onnxruntime's and native libraries' allocations are
# invisible otherwise). An adapter's first load grows it by its libraries'
# one-time memory too (imports, static tables, thread pools: OCR 87 MiB where
# its model holds 37), which an unload does not give back: that load is
# primed by an unmeasured one first (``_prime``).
PROCESS_MEASURED_RUNTIMES = frozenset({"onnx", "native"})


class EngineHost:
    """Implements ``residency.ModelHost`` with real loaders and the compute executor."""

    def __init__(
        self,
        device: Device,
        executor: ComputeExecutor,
        activations: ActivationBook,
        stats: StatsSink | None = None,
        max_concurrent_loads: int = 2,
        cache_dir: Path | None = None,
        loaders: Mapping[str, ModelLoader] | None = None,
        adapters: Mapping[str, str] | None = None,
        trusted_pickle_dirs: tuple[Path, ...] = (),
    ):
        self.device = device
        self.executor = executor
        self.stats: StatsSink = stats or NullSink()
        self.shared = SharedComponents()
        # The warm-up after a first load seeds the model's activation peaks.
        self.activations = activations
        self._adapters: Mapping[str, str] = adapters or {}  # beyond the registry's
        self._loaders: dict[tuple[str, str], ModelLoader] = {
            (adapter, "inline"): loader for adapter, loader in (loaders or {}).items()
        }
        # Each loader as an ``ItemsApart`` where it is one (a protocol's
        # isinstance takes microseconds: asked once, not per request).
        self._apart: dict[tuple[str, str], ItemsApart | None] = {}
        self._load_pool = ThreadPoolExecutor(
            max_concurrent_loads, thread_name_prefix="tessera-load"
        )
        # The host tier's copies on threads of their own, a pool each way: a
        # swap takes milliseconds, and behind loads from files it waited for
        # them (seconds). With one pool for both ways a round of evictions
        # (the line's head evicts for itself and the loads behind it) can fill
        # every thread, each waiting for its copy on the stream out, and the
        # returns queue behind them. On CUDA two each way (a copy queued on
        # the stream while another runs).
        per_way = 2 if device.kind == "cuda" else 1
        self._copy_out_pool = ThreadPoolExecutor(per_way, thread_name_prefix="tessera-copy-out")
        self._copy_back_pool = ThreadPoolExecutor(per_way, thread_name_prefix="tessera-copy-back")
        self._ctx = LoadContext(
            device=device,
            threads=executor.threads_per_worker,
            shared=self.shared,
            measure=executor.measure_exclusive,
            cache_dir=cache_dir,
            trusted_pickle_dirs=trusted_pickle_dirs,
        )
        # Reloads are not measured again (the residency manager keeps the first
        # load's figures), so a reload never holds running batches back, nor
        # warmed up. Priming (``_prime``) warms up unmeasured.
        self._prime_ctx = dataclasses.replace(self._ctx, measure=_unmeasured)
        self._reload_ctx = dataclasses.replace(self._prime_ctx, warm_up=False)
        self._loaded_before: set[str] = set()
        # transformers' lazy imports are not thread-safe: the first load of each
        # adapter (which imports its libraries) runs one at a time.
        self._first_load_lock = threading.Lock()
        self._adapters_seen: set[str] = set()
        self._torch_configured = False
        # Set as the engine closes (``begin_close``): a load still running then
        # (its caller cancelled, as preload is when the server stops) unloads
        # what it loaded at its end.
        self._closing = False
        # Loaded models by key, and evicted ones that sleep (their process kept).
        self._live: dict[str, LoadedModel] = {}
        self._asleep: dict[str, LoadedModel] = {}
        self._asleep_lock = threading.Lock()
        # Evicted models waiting in the host tier (residency decides which).
        self._kept: dict[str, OffloadingModel] = {}
        # ``memory.freezes()`` as each model (by id) began to load: one loaded
        # before a later freeze has its objects frozen (``_unload_sync``).
        self._born: dict[int, int] = {}
        self.monotonic = time.monotonic  # when collections ran (tests set their own)
        self._collected_at = -math.inf

    def loader(self, spec: ModelSpec) -> ModelLoader:
        key = (spec.adapter, spec.isolation)
        if key not in self._loaders:
            isolated = spec.isolation == "process"
            adapters = self._adapters
            if isolated:
                loader: ModelLoader = IsolatedLoader(spec.adapter, adapters)
            else:
                loader = get_loader(spec.adapter, adapters)
            self._loaders[key] = loader
        return self._loaders[key]

    def items_apart(self, spec: ModelSpec) -> ItemsApart | None:
        """``spec``'s loader, where it runs some items alone."""
        key = (spec.adapter, spec.isolation)
        if key not in self._apart:
            loader = self.loader(spec)
            self._apart[key] = loader if isinstance(loader, ItemsApart) else None
        return self._apart[key]

    def estimate(self, spec: ModelSpec) -> Footprint:
        loader = self.loader(spec)
        total = loader.estimate_bytes(spec)
        shared = {key: self.shared.bytes_of(key) for key in loader.shared_keys(spec)}
        known = {key: num for key, num in shared.items() if num > 0}
        # Shared components not resident yet are counted as the model's own.
        return Footprint(max(0, total - sum(known.values())), known)

    def configure_threads(self) -> None:
        """Give torch the per-worker thread share, once, before its first model."""
        if self._torch_configured:
            return
        import torch

        torch.set_num_threads(self.executor.threads_per_worker)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # already set, or parallel work already ran
            log.debug("torch inter-op threads already fixed")
        self._torch_configured = True

    async def load(self, spec: ModelSpec) -> LoadedModel:
        loop = asyncio.get_running_loop()
        if spec.runtime == "torch" and spec.isolation == "inline":
            self.configure_threads()
        start = time.perf_counter()
        try:
            model = await loop.run_in_executor(self._load_pool, self._load_sync, spec)
        except BaseException:
            self.stats.on_load(spec.key, time.perf_counter() - start, ok=False)
            raise
        seconds = time.perf_counter() - start
        self.stats.on_load(spec.key, seconds, ok=True)
        log.info("loaded %s in %.2f s", spec.key, seconds)
        return model

    def _load_sync(self, spec: ModelSpec) -> LoadedModel:
        born = freezes()
        model = self._wake(spec)
        if model is None:
            # Blocks that evictions left in torch's cache go back to the card:
            # a load may be measured by the card's free bytes, or allocate
            # outside torch (onnxruntime, a native engine).
            self._empty_device_cache()
            with self.executor.loading():
                model = self._load_once(spec)
            self._born[id(model)] = born  # a woken model keeps its first load's
        if self._closing:
            self._unload_sync(model)
            raise ModelUnavailableError(spec.key, "the server is shutting down")
        self._live[spec.key] = model
        return model

    def _wake(self, spec: ModelSpec) -> LoadedModel | None:
        """The model put to sleep when it was evicted, awake; None if there is none
        (or it did not wake, and was ended)."""
        with self._asleep_lock:
            model = self._asleep.pop(spec.key, None)
        if model is None:
            return None
        assert isinstance(model, SleepingModel)  # only those are kept asleep
        try:
            model.wake()
        except Exception as e:
            log.warning("%s did not wake (%s); loading it afresh", spec.key, e)
            self._unload_sync(model)
            return None
        log.info("woke %s", spec.key)
        return model

    def _load_once(self, spec: ModelSpec) -> LoadedModel:
        if spec.runtime in UNMEASURED_RUNTIMES:
            return self._load_with(spec, self._reload_ctx)
        if spec.adapter not in self._adapters_seen:
            with self._first_load_lock:
                if spec.runtime in PROCESS_MEASURED_RUNTIMES and spec.isolation == "inline":
                    self._prime(spec)
                model = self._load_measured(spec)
                self._adapters_seen.add(spec.adapter)
                # The libraries its load imported live as long as the server
                # does: out of the collector's way (``memory.freeze_heap``).
                freeze_heap()
                return model
        if spec.key in self._loaded_before:
            return self._load_with(spec, self._reload_ctx)
        return self._load_measured(spec)

    def _load_with(self, spec: ModelSpec, ctx: LoadContext) -> LoadedModel:
        """Load ``spec`` with ``ctx``, its runtime's threads as its card says
        (``threads``: a number, or all of the server's; else one worker's share)."""
        if spec.threads is not None:
            total = self.executor.num_threads
            threads = total if spec.threads == "all" else min(spec.threads, total)
            ctx = dataclasses.replace(ctx, threads=threads)
        return self.loader(spec).load(spec, ctx)

    def _prime(self, spec: ModelSpec) -> None:
        """Load and unload a model unmeasured (its warm-up included), so that its
        adapter's libraries hold their one-time memory before the measured load:
        they keep it when the model goes, so it is the process's, not the model's."""
        model = self._load_with(spec, self._prime_ctx)
        self._unload_sync(model)
        log.info("%s: primed %s's libraries before measuring", spec.key, spec.adapter)

    def _load_measured(self, spec: ModelSpec) -> LoadedModel:
        """A first load: measured alone, then warmed up to measure a batch's peak."""
        model = self._load_with(spec, self._ctx)
        num_items = min(MAX_WARMUP_ITEMS, spec.batching.max_batch_size)
        items = warmup_items(spec.task, 1 if spec.task in ONE_ITEM_WARMUP else num_items)
        try:
            measured = self.executor.measure_exclusive(lambda: model.run(items))
            # Weights that load but answer NaN fail here, as a load that raised:
            # the model is failed (``failed_models``), never served.
            check_finite(spec.key, measured.value)
        except BaseException:
            model.unload()
            raise
        # Counted as the model's requests are (a vision model's page in tokens).
        units = sum(work_units(i, spec.inputs) for i in items)
        self.activations.observe(spec.key, measured.peak_delta_bytes, units, provisional=True)
        self._loaded_before.add(spec.key)
        return model

    async def offload(self, spec: ModelSpec, model: LoadedModel) -> Footprint | None:
        """Move an evicted model's weights to the host tier and keep it; None
        where it cannot go (nothing moved: the caller unloads it)."""
        if not offloads(model) or self._closing:
            return None
        self._live.pop(spec.key, None)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._copy_out_pool, self._offload_sync, spec, model)

    def _offload_sync(self, spec: ModelSpec, model: OffloadingModel) -> Footprint | None:
        start = time.perf_counter()
        try:
            with self.executor.loading():
                held = model.offload()
        except Exception as e:
            log.warning("%s could not move to the host tier: %s: %s", spec.key, type(e).__name__, e)
            return None
        if held is None:
            return None
        # The freed blocks stay in torch's cache: a restore of a model of the
        # same shapes takes them back without asking the driver (a free there
        # waits for the whole device). Loads from files empty it first.
        with self._asleep_lock:
            self._kept[spec.key] = model
        # A swap's two lines are DEBUG: under pressure on a GPU there are
        # hundreds a second, beside the eviction's own INFO line;
        # tessera_model_evictions and tessera_model_host_tier_loads count them.
        log.debug(
            "%s waits in the host tier: %d bytes (%s), moved in %.3f s",
            spec.key,
            held.total_bytes,
            held.method,
            time.perf_counter() - start,
        )
        return held

    async def restore(self, spec: ModelSpec) -> LoadedModel | None:
        """The model kept in the host tier, back on the device; None if it could
        not come back (it is then ended)."""
        with self._asleep_lock:
            model = self._kept.pop(spec.key, None)
        if model is None:
            return None
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        restored = await loop.run_in_executor(self._copy_back_pool, self._restore_sync, spec, model)
        seconds = time.perf_counter() - start
        self.stats.on_load(spec.key, seconds, ok=restored)
        if not restored:
            return None
        log.debug("%s came back from the host tier in %.3f s", spec.key, seconds)
        self._live[spec.key] = model
        return model

    def _restore_sync(self, spec: ModelSpec, model: OffloadingModel) -> bool:
        try:
            with self.executor.loading():
                model.restore()
        except Exception as e:
            cause = f"{type(e).__name__}: {e}"
            log.warning("%s did not come back from the host tier: %s", spec.key, cause)
            self._unload_sync(model)
            return False
        if self._closing:
            self._unload_sync(model)
            return False
        return True

    async def drop(self, spec: ModelSpec) -> None:
        """End the model kept in the host tier (off the event loop)."""
        with self._asleep_lock:
            model = self._kept.pop(spec.key, None)
        if model is not None:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._load_pool, self._unload_sync, model)

    def forget(self, key: str) -> None:
        """A retired model: a later model of that key is measured afresh."""
        self._loaded_before.discard(key)
        with self._asleep_lock:
            model = self._asleep.pop(key, None)
        if model is not None:  # asleep: ended off the event loop
            self._load_pool.submit(self._unload_sync, model)

    def engine_metrics(self, key: str) -> dict[str, float]:
        """The engine process's own metrics of a model served by one (else empty)."""
        model = self._live.get(key) or self._asleep.get(key)
        read = getattr(model, "engine_metrics", None)
        return dict(read()) if callable(read) else {}

    async def unload(self, spec: ModelSpec, model: LoadedModel, *, eviction: bool = False) -> None:
        loop = asyncio.get_running_loop()
        self._live.pop(spec.key, None)
        if eviction and isinstance(model, SleepingModel) and not self._closing:
            asleep = await loop.run_in_executor(self._load_pool, model.sleep)
            if asleep:
                with self._asleep_lock:
                    self._asleep[spec.key] = model
                log.info("%s sleeps (evicted)", spec.key)
                return
        await loop.run_in_executor(self._load_pool, self._unload_sync, model)

    def _unload_sync(self, model: LoadedModel) -> None:
        """End ``model`` and collect the cycles it leaves: an ordinary collection
        (milliseconds) where it loaded after the heap's last freeze, a full one
        (hundreds of milliseconds, every other thread held) where its objects
        may be frozen: it loaded before a freeze, or is not known. The
        ordinary one at most once a second (``ORDINARY_COLLECTION_S``: with
        a hundred models taking turns, eight unloads a second, each took
        20 ms); a model whose objects hold no cycle (a Hugging Face encoder's
        do not) is freed as its last reference goes, collected or not."""
        born = self._born.pop(id(model), None)
        model.unload()
        if self._closing:  # at a close, once for all (``shutdown``)
            return
        now = self.monotonic()
        if born is None or born < freezes():
            collect_all()
            self._collected_at = now
        elif now - self._collected_at >= ORDINARY_COLLECTION_S:
            gc.collect()
            self._collected_at = now
        self._empty_device_cache()

    def _empty_device_cache(self) -> None:
        if self.device.kind == "cuda":
            import torch

            torch.cuda.empty_cache()

    def begin_close(self) -> None:
        """The server is stopping: from now on an evicted model neither waits in
        the host tier nor sleeps, a load that ends unloads what it loaded, and
        an unload leaves the full collection and the device cache's emptying to
        ``shutdown``, once for all: a stop costs one collection, not one per
        model."""
        self._closing = True

    def shutdown(self) -> None:
        self.begin_close()
        self._copy_out_pool.shutdown(wait=True, cancel_futures=True)
        self._copy_back_pool.shutdown(wait=True, cancel_futures=True)
        self._load_pool.shutdown(wait=True, cancel_futures=True)
        with self._asleep_lock:
            held = [*self._asleep.values(), *self._kept.values()]
            self._asleep, self._kept = {}, {}
        for model in held:
            self._unload_sync(model)
        PINNED_POOL.clear()
        collect_all()
        self._empty_device_cache()


def stage_key(host: EngineHost, spec: ModelSpec) -> str | None:
    """The stage key of ``spec``'s model where its loader says one before
    it loads (a head model's, ``runtimes/heads.py``): encoder batching's
    group (``engine/groups.py``). None for any other model, one isolated in
    a process of its own, and one whose files are not there (its load says
    why). Only the loaders of built-in adapters that make head models and
    those of the config's own adapters are asked: asking imports them."""
    if spec.isolation != "inline" or spec.adapter in NOT_STAGED:
        return None
    try:
        staged = getattr(host.loader(spec), "stage_key", None)
        key = staged(spec, host.device) if callable(staged) else None
    except (TesseraError, OSError, ValueError) as e:
        log.info("%s batches its encoder on its own: %s", spec.key, e)
        return None
    return key if isinstance(key, str) else None


def _unmeasured(fn: Callable[[], Any]) -> Measured:
    """Run ``fn`` without measuring it (a reload: its figures are known)."""
    return Measured(fn(), 0, 0)
