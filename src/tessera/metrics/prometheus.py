"""The ``tessera_*`` Prometheus families: events from the sink, gauges at scrape time.

``PrometheusMetrics`` is a ``StatsSink`` with a registry of its own (never the
process-global one, so two engines in one process do not collide). Request,
batch and load events feed counters and histograms; memory, residency, queue
depths and the device are read from the engine's snapshot (``EngineStats``) by
``EngineCollector`` when Prometheus scrapes, so they are never stale and cost
nothing between scrapes.

Label cardinality is bounded: ``model`` is a repository name (else "unknown"),
``tier`` a configured tier (or "none" when auth is off), ``status`` an HTTP
code, ``reason`` one of six; ``tenant`` only with ``per_tenant_labels`` (and
always on the ``tessera_tenant_*`` cost counters), and at most
``max_tenant_labels`` distinct values (later ones become "other").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Container, Iterable, Mapping

import psutil
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tessera.metrics.rolling import NONE_LABEL, REJECT_REASONS, model_label
from tessera.metrics.stats import EngineStats, RequestEvent

Snapshot = Callable[[], EngineStats]

log = logging.getLogger(__name__)

# 5 ms .. 60 s, with bounds at the usual latency targets (200/300 ms, 2/3/10 s)
# so histogram_quantile is exact where the SLO alerts compare.
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0,
)  # fmt: skip
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BATCH_DURATION_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
LOAD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
MODEL_STATES = ("unloaded", "loading", "ready", "unloading", "failed")
RESIDENT_STATES = frozenset({"loading", "ready", "unloading"})
OTHER_TENANT = "other"
UNATTRIBUTED_LABEL = "unattributed"  # memory held with no use in the window
# An engine process's figures (ModelStats.engine_metrics) -> tessera's families:
# (name, help, counter?). vLLM's are read from its /metrics (runtimes/vllm.py).
ENGINE_FAMILIES = {
    "requests_running": (
        "tessera_engine_requests_running",
        "Requests a model's engine process runs now (vllm:num_requests_running).",
        False,
    ),
    "requests_waiting": (
        "tessera_engine_requests_waiting",
        "Requests waiting inside a model's engine process (vllm:num_requests_waiting).",
        False,
    ),
    "kv_cache_usage_ratio": (
        "tessera_engine_kv_cache_usage_ratio",
        "Share of a model's engine KV cache in use, 0..1 (vllm:gpu_cache_usage_perc).",
        False,
    ),
    "prompt_tokens": (
        "tessera_engine_prompt_tokens",
        "Prompt tokens a model's engine process has read (vllm:prompt_tokens_total).",
        True,
    ),
    "generation_tokens": (
        "tessera_engine_generation_tokens",
        "Tokens a model's engine process has generated (vllm:generation_tokens_total).",
        True,
    ),
    "restarts": (
        "tessera_engine_restarts",
        "Starts of a model's engine process after a crash or a hang.",
        True,
    ),
    "sleeping": (
        "tessera_engine_sleeping",
        "1 while a model's engine process sleeps (evicted, its process kept).",
        False,
    ),
}
DEFAULT_MAX_TENANT_LABELS = 50


class PrometheusMetrics:
    """A ``StatsSink`` that keeps the ``tessera_*`` families in ``registry``."""

    def __init__(
        self,
        snapshot: Snapshot,
        models: Container[str],
        targets_s: Mapping[str, float],
        *,
        per_tenant_labels: bool = False,
        max_tenant_labels: int = DEFAULT_MAX_TENANT_LABELS,
    ) -> None:
        """``snapshot`` is read at each scrape; ``models`` are the names a label
        may take; ``targets_s`` the models' latency targets in seconds."""
        self.models = models
        self.registry = CollectorRegistry(auto_describe=False)
        self.per_tenant_labels = per_tenant_labels
        self.max_tenant_labels = max_tenant_labels
        self._tenants: set[str] = set()
        self._tenant_lock = threading.Lock()
        self.targets_s = dict(targets_s)
        self._make_families()
        self.registry.register(EngineCollector(snapshot, self.targets_s, self._tenant_label))

    def _make_families(self) -> None:
        r = self.registry
        request_labels = ["model", "task", "tier", "status"]
        if self.per_tenant_labels:
            request_labels.append("tenant")
        self.requests = Counter(
            "tessera_requests", "Inference requests, answered or refused, by HTTP status.",
            request_labels, registry=r,
        )  # fmt: skip
        self.request_duration = Histogram(
            "tessera_request_duration_seconds", "Time to answer a request (status < 400).",
            ["model", "tier"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_duration = Histogram(
            "tessera_queue_duration_seconds", "Time an answered request waited in its queue.",
            ["model", "tier"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_size = Histogram(
            "tessera_batch_size", "Items per batch run.",
            ["model"], buckets=BATCH_SIZE_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_duration = Histogram(
            "tessera_batch_duration_seconds", "Time to run one batch on the device.",
            ["model"], buckets=BATCH_DURATION_BUCKETS, registry=r,
        )  # fmt: skip
        self.load_duration = Histogram(
            "tessera_model_load_seconds", "Time to load and warm a model (successful loads).",
            ["model"], buckets=LOAD_BUCKETS, registry=r,
        )  # fmt: skip
        self.load_failures = Counter(
            "tessera_model_load_failures", "Loads that failed.", ["model"], registry=r
        )
        self.rejected = Counter(
            "tessera_rejected_requests", "Requests refused, by reason.", ["reason"], registry=r
        )
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)  # present at 0 before the first refusal
        self.slo_requests = Counter(
            "tessera_slo_requests",
            "Answered requests of a model with a latency target, by whether within it.",
            ["model", "within"], registry=r,
        )  # fmt: skip

    # -- StatsSink -----------------------------------------------------------

    def on_request(self, event: RequestEvent) -> None:
        model = model_label(event.model, self.models)
        tier = event.tier or NONE_LABEL
        labels = [model, event.task or NONE_LABEL, tier, str(event.status)]
        if self.per_tenant_labels:
            labels.append(self._tenant_label(event.tenant))
        self.requests.labels(*labels).inc()
        if event.reason in REJECT_REASONS:
            self.rejected.labels(event.reason).inc()
        if event.status >= 400:
            return
        self.request_duration.labels(model, tier).observe(event.total_s)
        self.queue_duration.labels(model, tier).observe(event.queue_s)
        target_s = self.targets_s.get(model)
        if target_s is not None:
            within = "true" if event.total_s <= target_s else "false"
            self.slo_requests.labels(model, within).inc()

    def on_batch(self, model: str, size: int, run_s: float) -> None:
        self.batch_size.labels(model).observe(size)
        self.batch_duration.labels(model).observe(run_s)

    def on_load(self, model: str, seconds: float, ok: bool) -> None:
        if ok:
            self.load_duration.labels(model).observe(seconds)
        else:
            self.load_failures.labels(model).inc()

    # -- exposition ------------------------------------------------------------

    def exposition(self, accept: str = "") -> tuple[bytes, str]:
        """The registry in the format ``accept`` asks for, and its content type."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type

    def family_names(self) -> set[str]:
        """Every family name as a query sees it (counters with ``_total``)."""
        names = set()
        for family in self.registry.collect():
            names.add(family.name + "_total" if family.type == "counter" else family.name)
        return names

    def _tenant_label(self, tenant: str | None) -> str:
        if tenant is None:
            return NONE_LABEL
        with self._tenant_lock:
            if tenant in self._tenants:
                return tenant
            if len(self._tenants) < self.max_tenant_labels:
                self._tenants.add(tenant)
                return tenant
        return OTHER_TENANT


class EngineCollector(Collector):
    """Gauges read from one engine snapshot at scrape time (on the event loop)."""

    def __init__(
        self,
        snapshot: Snapshot,
        targets_s: Mapping[str, float],
        tenant_label: Callable[[str | None], str] = lambda tenant: tenant or NONE_LABEL,
    ) -> None:
        """``tenant_label``: a cost counter's tenant label (``PrometheusMetrics``
        bounds them; by default every tenant by name)."""
        self.snapshot = snapshot
        self.targets_s = targets_s
        self.tenant_label = tenant_label
        self._process = psutil.Process()

    def describe(self) -> Iterable[Metric]:
        return []  # names are only known at collect; registering must not scrape

    def collect(self) -> Iterable[Metric]:
        stats = self.snapshot()
        yield from self._residency(stats)
        yield from self._queues_and_slo(stats)
        yield from self._device(stats)
        yield from self._engines(stats)
        yield from self._costs(stats)
        yield from self._process_metrics()

    def _costs(self, stats: EngineStats) -> Iterable[Metric]:
        """Per tenant and model (``tessera.costs``); tenants past
        ``max_tenant_labels`` are summed as "other", memory held with no use
        is tenant "unattributed"."""
        device = CounterMetricFamily(
            "tessera_tenant_device_seconds",
            "A tenant's share of the device time of the batches its requests ran in.",
            labels=["tenant", "model"],
        )
        memory = CounterMetricFamily(
            "tessera_tenant_memory_byte_seconds",
            "Byte-seconds of a model's memory attributed to a tenant by its use in a"
            " sliding window (unattributed: held with no use).",
            labels=["tenant", "model"],
        )
        sums: dict[tuple[str, str], tuple[float, float]] = {}
        for cost in stats.tenant_costs:
            tenant = self.tenant_label(cost.tenant) if cost.tenant else UNATTRIBUTED_LABEL
            device_s, byte_s = sums.get((tenant, cost.model), (0.0, 0.0))
            sums[tenant, cost.model] = (device_s + cost.device_s, byte_s + cost.byte_s)
        for labels, (device_s, byte_s) in sorted(sums.items()):
            device.add_metric(list(labels), device_s)
            memory.add_metric(list(labels), byte_s)
        yield from (device, memory)

    def _residency(self, stats: EngineStats) -> Iterable[Metric]:
        yield GaugeMetricFamily(
            "tessera_memory_budget_bytes", "The byte budget models share.", stats.budget_bytes
        )
        yield GaugeMetricFamily(
            "tessera_memory_used_bytes", "Bytes of the budget in use.", stats.used_bytes
        )
        yield GaugeMetricFamily(
            "tessera_memory_peak_used_bytes", "Most bytes ever in use.", stats.peak_used_bytes
        )
        resident = GaugeMetricFamily(
            "tessera_model_resident_bytes", "Bytes a model holds (0 unless resident).",
            labels=["model"],
        )  # fmt: skip
        state = GaugeMetricFamily(
            "tessera_model_state", "1 for the model's current state.", labels=["model", "state"]
        )
        loads = CounterMetricFamily("tessera_model_loads", "Model loads.", labels=["model"])
        evictions = CounterMetricFamily(
            "tessera_model_evictions", "Models evicted to make room.", labels=["model"]
        )
        host_bytes = GaugeMetricFamily(
            "tessera_model_host_tier_bytes",
            "Bytes a model evicted to the host tier holds there (0 unless it waits there).",
            labels=["model"],
        )
        host_loads = CounterMetricFamily(
            "tessera_model_host_tier_loads",
            "Loads of a model from the host tier (a copy; the rest read its files).",
            labels=["model"],
        )
        for model in stats.models:
            held = model.bytes if model.state in RESIDENT_STATES else 0
            resident.add_metric([model.name], held)
            for s in MODEL_STATES:
                state.add_metric([model.name, s], 1.0 if s == model.state else 0.0)
            loads.add_metric([model.name], model.loads)
            evictions.add_metric([model.name], model.evictions)
            host_bytes.add_metric([model.name], model.host_bytes)
            host_loads.add_metric([model.name], model.host_loads)
        rollouts = CounterMetricFamily(
            "tessera_model_rollouts",
            "Rollouts of a model version, by outcome: done, or rolled_back (it failed to"
            " load or answer, and the version before it kept serving).",
            labels=["model", "outcome"],
        )
        for count in stats.rollouts_total:
            rollouts.add_metric([count.model, count.outcome], count.num)
        yield from (resident, state, loads, evictions, rollouts, host_bytes, host_loads)
        yield from self._host_tier(stats)
        yield CounterMetricFamily(
            "tessera_stacked_rounds",
            "Rounds of two or more models' batches run in one forward (stack: N cards).",
            stats.stacked_rounds_total,
        )
        yield CounterMetricFamily(
            "tessera_stacked_batches",
            "Batches run in those rounds (the rest ran alone).",
            stats.stacked_batches_total,
        )
        yield CounterMetricFamily(
            "tessera_encoder_batches",
            "Batches of head models' requests run through their shared encoder together"
            " (encoder batching; each model's batch_size counts its own rows of them).",
            stats.encoder_batches_total,
        )
        yield CounterMetricFamily(
            "tessera_encoder_rows",
            "Items of those batches, every model's.",
            stats.encoder_rows_total,
        )

    def _host_tier(self, stats: EngineStats) -> Iterable[Metric]:
        yield GaugeMetricFamily(
            "tessera_host_tier_budget_bytes",
            "The host tier's budget (evicted models kept in host memory); 0: no tier.",
            stats.host_budget_bytes,
        )
        yield GaugeMetricFamily(
            "tessera_host_tier_used_bytes",
            "Bytes the models in the host tier hold (shared components once).",
            stats.host_used_bytes,
        )
        yield CounterMetricFamily(
            "tessera_host_tier_drops",
            "Copies dropped from the host tier to make room for others.",
            stats.host_drops_total,
        )
        yield CounterMetricFamily(
            "tessera_host_tier_copies_out",
            "Evictions to page-locked memory that copied the weights out (CUDA).",
            stats.host_copies_out_total,
        )
        yield CounterMetricFamily(
            "tessera_host_tier_copies_kept",
            "Evictions to page-locked memory that copied nothing: a buffer kept from"
            " the model's restore still held its weights (CUDA).",
            stats.host_copies_kept_total,
        )

    def _queues_and_slo(self, stats: EngineStats) -> Iterable[Metric]:
        depth = GaugeMetricFamily(
            "tessera_queue_depth", "Requests waiting for a model.", labels=["model"]
        )
        for model in stats.models:
            depth.add_metric([model.name], model.queue_depth)
        yield depth
        target = GaugeMetricFamily(
            "tessera_slo_target_seconds", "A model's latency target (model.yaml).",
            labels=["model"],
        )  # fmt: skip
        for name, seconds in sorted(self.targets_s.items()):
            target.add_metric([name], seconds)
        yield target

    def _engines(self, stats: EngineStats) -> Iterable[Metric]:
        """The figures of models served by engine processes (none: no families)."""
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for model in stats.models:
            for key, value in sorted(model.engine_metrics.items()):
                if key not in ENGINE_FAMILIES:
                    continue
                name, help_text, counter = ENGINE_FAMILIES[key]
                if key not in families:
                    kind = CounterMetricFamily if counter else GaugeMetricFamily
                    families[key] = kind(name, help_text, labels=["model"])
                families[key].add_metric([model.name], value)
        yield from families.values()

    def _device(self, stats: EngineStats) -> Iterable[Metric]:
        device = stats.device
        if device is None:  # a failing NVML must not fail the whole scrape
            return
        yield GaugeMetricFamily(
            "tessera_device_memory_used_bytes",
            "Memory in use on the device (process RSS on CPU).",
            device.used_bytes,
        )
        yield GaugeMetricFamily(
            "tessera_device_memory_total_bytes", "The device's memory.", device.total_bytes
        )
        if device.utilization is not None:
            yield GaugeMetricFamily(
                "tessera_device_utilization_ratio", "Device busy share, 0..1.", device.utilization
            )
        if device.temperature_c is not None:
            yield GaugeMetricFamily(
                "tessera_device_temperature_celsius", "Device temperature.", device.temperature_c
            )

    def _process_metrics(self) -> Iterable[Metric]:
        try:
            rss = self._process.memory_info().rss
            times = self._process.cpu_times()
        except psutil.Error:
            log.warning("process stats failed", exc_info=True)
            return
        yield GaugeMetricFamily(
            "tessera_process_resident_bytes", "Resident memory of the tessera process.", rss
        )
        yield CounterMetricFamily(
            "tessera_process_cpu_seconds",
            "CPU time of the tessera process (user + system).",
            times.user + times.system,
        )
