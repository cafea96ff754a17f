"""The engine's public types: its config, who calls it, what a submit returns.

Both faces of the engine use them: ``Engine`` in its own process and
``RemoteEngine`` in a gateway's; the gateway's routes and the audit read them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tessera.admission import Admission, TenantLimits
from tessera.repository.trust import DEFAULT_ENGINE_COMMANDS
from tessera.request import Charge, QueuedRequest, RequestResult
from tessera.residency import PATIENCE_SHARE

from .executor import ACROSS_MODELS_THREADS


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings, parsed once at start and passed down."""

    memory_budget_bytes: int | None = None  # None: the device's default share
    # The host tier's budget: evicted models kept ready in host memory, so that
    # a reload is a copy. None: a quarter of the machine's RAM; 0: no host tier.
    host_memory_budget_bytes: int | None = None
    device: str = "auto"
    num_threads: int | None = None  # None: every core
    num_workers: int | None = None  # None: one per thread
    eviction_policy: str = "cost"
    # The share of its latency target a caller short of room waits for busy
    # models cheaper to evict than idle ones (``residency/patience.py``'s
    # ``PATIENCE_SHARE``); 0: it evicts idle ones at once.
    eviction_patience: float = PATIENCE_SHARE
    # Requests waiting per model, at most: a bound on memory; before it, a
    # request whose predicted wait passes its deadline is refused (batcher.py).
    max_queue: int = 1000
    default_timeout_s: float = 60.0
    residency_wait_s: float = 30.0
    # Loads from the host tier in flight at once (``residency/transfer.py``'s
    # ``MAX_HOST_LOADS``); None: that on CUDA, whose copies back run one at a
    # time on a copy stream, no bound on the CPU; 0: no bound.
    max_host_loads: int | None = None
    preload: tuple[str, ...] | None = None  # None: the models marked preload
    # After the preloads, load more models while they fit the budget without
    # an eviction, before the server is ready; None: when ``preload`` is None
    # (``fills``).
    fill: bool | None = None
    scheduling: str = "fair"  # fair | fifo
    # While two or more tenants use a model, cap a batch's predicted run time
    # here (the fair queue's quantum); None: full batches whatever the mix.
    fair_quantum_s: float | None = 0.025
    # Fairness at the grain of work: a request of more work than one quantum
    # is queued as parts of about a quantum each (from the model's measured
    # run time per unit), run as long work; a tenant with nothing running
    # starts a batch beyond the model's busy slots. False: a request runs
    # whole (up to ``max_batch_size`` items a part), as one batch.
    fair_parts: bool = True
    # Encoder batching (``engine/groups.py``): requests of head models over
    # one shared encoder (one stage key) batch together through it, each row
    # then through its own model's head. False: every model batches alone.
    encoder_batching: bool = True
    # Batches predicted to run this long (a page of OCR, a chat generation) are
    # long work; None: every batch is short, in one lane.
    long_batch_s: float | None = 0.5
    # How long work shares the workers (executor.py): "steps", compute slots that
    # short batches never wait for, long ones stepping aside at their next step
    # boundary; "lane", threads of their own beside the short ones' workers.
    long_work: str = "steps"
    # Where loaders keep converted weights (a GGUF model's) between loads and
    # restarts; None: no cache. At start, entries unused for longer than
    # cache_max_age_s are removed, then the least recently used over
    # cache_max_bytes (runtimes/cache.py); None: no bound of that kind.
    cache_dir: Path | None = None
    cache_max_age_s: float | None = 30 * 86400.0
    cache_max_bytes: int | None = None
    # The engine process's interpreter switch interval (``sys.setswitchinterval``):
    # how long a thread that wants the interpreter lock waits before it asks the
    # holder to drop it. None: Python's own (5 ms).
    gil_switch_interval_s: float | None = None
    # Threads for batches that may run in one forward with other models'
    # (executor.py, ``ACROSS_MODELS_THREADS``); a knob for a device to settle.
    across_models_threads: int = ACROSS_MODELS_THREADS
    # The command lines a card's options.command may name, per engine, and the
    # folders pickle files may load from (``repository/trust.py``).
    engine_commands: Mapping[str, tuple[tuple[str, ...], ...]] = field(
        default_factory=lambda: dict(DEFAULT_ENGINE_COMMANDS)
    )
    trusted_pickle_dirs: tuple[Path, ...] = ()
    # Adapters beyond the built-in ones: name -> "module:Class", a ModelLoader
    # imported when a card names it (``runtimes/registry.py``).
    adapters: Mapping[str, str] = field(default_factory=dict)

    @property
    def fills(self) -> bool:
        """Whether the budget is filled at start: ``fill``, or by default unless
        ``preload`` names the models."""
        return self.fill if self.fill is not None else self.preload is None


class PreloadProgress(Protocol):
    """Told as preload models finish loading (the CLI draws a progress bar)."""

    def start(self, names: list[str]) -> None: ...

    def loaded(self, name: str, error: BaseException | None) -> None: ...

    def finish(self) -> None: ...


@dataclass(frozen=True)
class Caller:
    """Who sends a request: the tenant's limits, its tier's weight and latency target."""

    limits: TenantLimits
    tier: str = "standard"
    weight: float = 1.0
    latency_target_s: float | None = None

    @property
    def tenant(self) -> str:
        return self.limits.name


@dataclass
class RequestTrace:
    """Filled in by ``Engine.infer`` for the audit log and the metrics."""

    units: float = 0.0
    queued_s: float = 0.0
    run_s: float = 0.0
    batch_size: int = 0
    # The request's final charge, settled when its work ends (which may be
    # after ``wait`` returns: a generation stops at its next step).
    charge: Charge | None = None

    def record(self, request: QueuedRequest, result: RequestResult | None) -> None:
        """What a wait on ``request`` ended with (``result``: None if unanswered)."""
        self.charge = request.charge
        self.units = request.charge.units if request.charge.units is not None else 0.0
        if result is not None:
            self.queued_s = result.queued_s
            self.run_s = result.run_s
            self.batch_size = result.batch_size


@dataclass(frozen=True)
class Submission:
    """A queued request, and the admission to release once it is answered;
    ``model`` is the version it was queued on (its key), ``version`` that
    version's label: the one that answers it."""

    model: str
    request: QueuedRequest
    admission: Admission | None
    version: str = "1"
    # A request of more items than a batch holds is queued as these parts,
    # a batch's worth each; ``request`` is their whole (``_joined``).
    parts: tuple[QueuedRequest, ...] = ()

    @property
    def started(self) -> bool:
        """Whether any of its work began to run."""
        return self.request.charge.started or any(p.charge.started for p in self.parts)
