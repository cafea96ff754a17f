"""Server configuration: built once at start from the CLI and an optional YAML
file (``--config``), then passed down. Command-line values win over the file.

A config file may hold any of::

    host: 127.0.0.1              # the address to listen on
    port: 8000                   # the HTTP port
    data_dir: ./data             # tenants, keys, the audit and the key secret (0700)
    cache_dir: ./data/cache      # converted weights between loads; default: <data_dir>/cache
    cache_max_age_days: 30       # at start, remove cache entries unused this long (null: keep)
    cache_max_bytes: null        # at start, then the least recently used over this size
    memory_budget: 700MiB        # bytes or a size; default: the device's share
    host_memory_budget: 4GiB     # the host tier (evicted models ready to copy back):
                                 # default a quarter of the RAM; 0: none
    device: auto                 # auto | cpu | cuda | cuda:N
    num_threads: 2               # the process's thread budget; default: all cores
    num_workers: 2               # batches at once; each gets num_threads / num_workers;
                                 # default: one per thread on the CPU, 2 on a GPU
    across_models_threads: 32    # threads for batches of cards saying stack: N (stacked
                                 # rounds across models); a round of N needs N at once
    eviction_policy: cost        # cost (uses x miss s / target s / bytes) | lru | largest | none
    eviction_patience: 0.5       # the share of its latency target a caller short of room
                                 # waits for busy models cheaper to evict than idle ones
    max_queue: 1000              # per model, a bound on memory; before it, a request
                                 # whose batch would start after its deadline gets 503
    default_timeout_s: 60        # a request's deadline when it gives no x-request-timeout
    residency_wait_s: 30          # a load or batch short of room waits this long for it,
                                 # then 503 (Retry-After)
    max_body_bytes: 16MiB        # a request's body (413 over it)
    max_request_pixels: 120000000  # a request's images, width x height summed, read from
                                 # their headers before any is decoded (413 over it)
    max_request_pages: 64        # a request's images (OCR pages, chat images), 413 over it
    model_repositories: [./my-models]  # folders of model cards, besides the default set
    include_default_models: true # serve the packaged default models too
    preload: [all-minilm-l6-v2]  # default: the models whose model.yaml says preload
    fill: null                   # load what else fits before ready: default (null) unless
                                 # preload is given; true or false to say so
    scheduling: fair             # fair (weighted across tenants) | fifo
    fair_quantum_ms: 25          # 2+ tenants on a model: cap a batch's run time (null: off),
                                 # counted beyond the fixed cost every batch of the model pays
    fair_parts: true             # a request of more work than a quantum queues as parts of
                                 # a quantum each, run as long work, and a tenant with nothing
                                 # running steps past a model's busy slots; false: requests
                                 # run whole, one batch each (up to max_batch_size items)
    encoder_batching: true       # requests of head models over one shared encoder batch
                                 # together through it, each row then through its own
                                 # head; false: every model batches alone
    long_batch_ms: 500           # batches predicted this long are long work (null: none is)
    gil_switch_interval_ms: null # the engine process's interpreter switch interval
                                 # (sys.setswitchinterval); null: Python's 5 ms
    long_work: steps             # steps: short batches never wait for long work, which steps
                                 # aside at its next step; lane: threads of its own (the OS shares)
    tiers:                       # weights and latency targets; these are the defaults
      vip: {weight: 4, latency_target_ms: 250}
      standard: {weight: 2}
      batch: {weight: 1}
    auth: true                   # API keys from the tenant store under data_dir
    audit_retention_days: 30     # audit rows older than this are removed (null: kept)
    store_responses: false       # keep Responses API answers (their store: true) for
                                 # previous_response_id and GET /v1/responses/{id}
    responses_retention_hours: 24  # this long (in tenant_store's database, or data_dir)
    metrics_public: false        # true: /metrics needs no key (else an admin key)
    metrics_port: null           # a port: also serve /metrics there, without a key, on host
    grpc_port: null              # a port: also serve KServe v2 over gRPC there (tessera[grpc])
    per_tenant_labels: false     # true: a tenant label on tessera_requests_total (at most 50)
    log_format: text             # text | json (one object a line, with the request id)
    access_log: false            # true: a log line a request too (each has an audit row)
    shutdown_grace_s: 30         # on SIGTERM, how long accepted requests may still run
    header_timeout_s: 10         # a request's head must arrive within this
    body_timeout_s: 60           # its whole body within this of the head
    keep_alive_s: 75             # an idle kept-alive connection is closed after this
    max_url_bytes: 8KiB          # a request's URL (414 over it); each cap below is
                                 # counted as the bytes arrive, and the connection closed
    max_header_bytes: 16KiB      # one header line, name and value (431 over it)
    max_head_bytes: 64KiB        # a request's whole head (431 over it)
    max_num_headers: 100         # headers in one head (431 over it)
    max_num_opening_connections: 32  # per client address, connections open 1 s or more
                                 # without a whole head; one more is closed at once (429);
                                 # trusted_proxies are not bound; null: no bound
    tenant_store: null           # postgresql://host/db: tenants, keys and the audit shared
                                 # by many gateways; default: SQLite files in data_dir
    key_secret_file: null        # the API keys' HMAC secret (default <data_dir>/secret.key;
                                 # TESSERA_KEY_SECRET, hex, wins): the same on every gateway
    admission_store: null        # redis://host:6379/0: rate, concurrency and daily units
                                 # counted across gateways; default: in this process
    admission_prefix: "tessera:" # the Redis keys' prefix
    admission_lease_s: 30        # a dead gateway's requests in flight count this long
    watch_repository: false      # poll model_repositories for new models and versions
    engine_commands:             # per engine, the command lines a card's options.command
      vllm: [[vllm, serve]]      # may name ({python}: this interpreter); these are the
                                 # defaults. A card registered over the admin API names
                                 # none: its engine runs the engine's default command
    trusted_pickle_dirs: []      # folders whose pickle files (joblib, .pkl) may load, for
                                 # cards read from disk; an installed package's folder is
                                 # trusted (its operator installed it); never over the API
    adapters: {}                 # adapters beyond the built-in ones, for a card's adapter:
                                 # name: module:Class (a ModelLoader, imported from the
                                 # server's sys.path when a card names it; --adapter
                                 # NAME=module:Class); a built-in name may not be reused
    watch_interval_s: 5          # how often watch_repository polls (see docs/models.md)
    trusted_proxies: []          # addresses whose X-Forwarded-For names the client
                                 # (rate limits, the auth throttle); default: none
    cluster: null                # a Ray cluster's address (auto: the one this machine
                                 # joined; local: start one): serve from engine actors
                                 # there (tessera cluster; see docs/scale-out.md)
    cluster_window: 32           # batches of each model a gateway has in flight there
    gateways: auto               # HTTP gateway processes in front of the engine process;
                                 # 0: one process; auto: 0 on a CPU, else one per 4 cores (2-4)
    engine_loop: patient         # the engine process's event loop (with gateways): patient
                                 # (asyncio's, polling at most every 0.2 ms while callbacks
                                 # are ready) | asyncio | uvloop (see engine/loop.py)
    cluster_cpu_share: 1         # CPUs an engine actor takes on a node without GPUs
    cluster_routing:             # the router's targets (RoutingConfig); these are defaults
      report_interval_s: 0.25
      target_p99_s: 0.5
      max_queue_per_replica: 8
      target_utilization: 0.6
      scale_up_after_s: 1
      scale_down_after_s: 20
      max_replicas: 8
      placement_ttl_s: 10
      cold_after_s: 60
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from tessera.cluster.routing import RoutingConfig
from tessera.engine import EngineConfig
from tessera.engine.executor import ACROSS_MODELS_THREADS, LONG_WORK_MODES
from tessera.engine.loop import DEFAULT_ENGINE_LOOP, ENGINE_LOOPS
from tessera.errors import ConfigError
from tessera.repository import ModelRepository, default_repository_path
from tessera.repository.trust import check_engine_command, parse_engine_commands
from tessera.runtimes.registry import parse_adapters
from tessera.scheduling import DEFAULT_TIERS, TierSpec, parse_tiers
from tessera.tasks.image import (
    DEFAULT_MAX_REQUEST_PAGES,
    DEFAULT_MAX_REQUEST_PIXELS,
    RequestImageLimits,
)
from tessera.units import parse_bytes

if TYPE_CHECKING:
    from tessera.tenants import AuditLog, TenantStore
    from tessera.tenants.responses import ResponseStore

# The largest request body the gateway reads. Kept here, not in the gateway, so
# that reading the config does not import FastAPI, SQLite and Prometheus.
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_SHUTDOWN_GRACE_S = 30.0  # Kubernetes' terminationGracePeriodSeconds
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0
# Longer than clients and proxies keep an idle connection (httpx 5 s, load
# balancers 60 s): at uvicorn's 5 s a client could send on a connection in the
# moment the server closed it, and get a connection error for a sound request.
DEFAULT_KEEP_ALIVE_S = 75.0
# A request head's caps (gateway/head.py): nginx's 8 KiB request line, h11's
# 16 KiB for a header, room for many such in a head, and 100 headers (as
# Python's http.client reads at most).
DEFAULT_MAX_URL_BYTES = 8 * 1024
DEFAULT_MAX_HEADER_BYTES = 16 * 1024
DEFAULT_MAX_HEAD_BYTES = 64 * 1024
DEFAULT_MAX_NUM_HEADERS = 100
DEFAULT_MAX_NUM_OPENING_CONNECTIONS = 32


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = Path("data")
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    image_limits: RequestImageLimits = field(default_factory=RequestImageLimits)
    model_repositories: tuple[Path, ...] = ()
    include_default_models: bool = True
    tiers: dict[str, TierSpec] = field(default_factory=lambda: dict(DEFAULT_TIERS))
    auth: bool = True
    audit_retention_days: float | None = 30.0
    store_responses: bool = False
    responses_retention_hours: float = 24.0
    metrics_public: bool = False
    metrics_port: int | None = None
    grpc_port: int | None = None
    per_tenant_labels: bool = False
    log_format: str = "text"
    access_log: bool = False
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S
    max_url_bytes: int = DEFAULT_MAX_URL_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES
    max_num_headers: int = DEFAULT_MAX_NUM_HEADERS
    max_num_opening_connections: int | None = DEFAULT_MAX_NUM_OPENING_CONNECTIONS
    tenant_store: str | None = None
    key_secret_file: Path | None = None
    admission_store: str | None = None
    admission_prefix: str = "tessera:"
    admission_lease_s: float = 30.0
    trusted_proxies: tuple[str, ...] = ()
    watch_repository: bool = False
    watch_interval_s: float = 5.0
    cluster: str | None = None
    cluster_window: int = 32
    cluster_cpu_share: float = 1.0
    cluster_routing: RoutingConfig = field(default_factory=RoutingConfig)
    gateways: int | None = None  # None: by the device (``gateway_processes``)
    engine_loop: str = DEFAULT_ENGINE_LOOP  # the engine process's loop (``engine/loop.py``)

    def repository(self) -> ModelRepository:
        repository = ModelRepository.from_folders(self.model_roots())
        for spec in repository:  # cards on disk name only the commands allowed
            for version in repository.versions(spec.name):
                check_engine_command(version, self.engine.engine_commands)
        return repository

    def model_roots(self) -> tuple[Path, ...]:
        """The folders models are read from, and the only ones the admin API
        may register a model or weights from: the packaged default set (when
        included) and ``model_repositories``."""
        folders = (default_repository_path(),) if self.include_default_models else ()
        return (*folders, *self.model_repositories)

    def tenancy(self) -> tuple[TenantStore, AuditLog]:
        """The tenant store and the audit log this config names."""
        from tessera.tenants import open_tenancy

        return open_tenancy(
            self.data_dir, self.tenant_store, self.key_secret_file, self.audit_retention_days
        )

    def response_store(self) -> ResponseStore | None:
        """Where Responses API answers are kept, if ``store_responses``."""
        if not self.store_responses:
            return None
        from tessera.tenants.responses import ResponseStore

        retention_s = self.responses_retention_hours * 3600
        return ResponseStore(self.data_dir, self.tenant_store, retention_s)


_ENGINE_KEYS = {
    "device",
    "num_threads",
    "num_workers",
    "across_models_threads",
    "eviction_policy",
    "eviction_patience",
    "max_queue",
    "default_timeout_s",
    "residency_wait_s",
    "scheduling",
    "long_work",
    "fair_parts",
    "encoder_batching",
    "fill",
    "engine_commands",
    "trusted_pickle_dirs",
    "adapters",
}
# Keys given in one unit in the file and another in EngineConfig.
_MS_KEYS = {
    "fair_quantum_ms": "fair_quantum_s",
    "long_batch_ms": "long_batch_s",
    "gil_switch_interval_ms": "gil_switch_interval_s",
}


_SERVER_KEYS = {
    "host",
    "port",
    "data_dir",
    "cache_dir",
    "cache_max_age_days",
    "cache_max_bytes",
    "memory_budget",
    "host_memory_budget",
    "max_body_bytes",
    "max_request_pixels",
    "max_request_pages",
    "model_repositories",
    "include_default_models",
    "preload",
    "tiers",
    "auth",
    "audit_retention_days",
    "store_responses",
    "responses_retention_hours",
    "metrics_public",
    "metrics_port",
    "grpc_port",
    "per_tenant_labels",
    "log_format",
    "access_log",
    "shutdown_grace_s",
    "header_timeout_s",
    "body_timeout_s",
    "keep_alive_s",
    "max_url_bytes",
    "max_header_bytes",
    "max_head_bytes",
    "max_num_headers",
    "max_num_opening_connections",
    "tenant_store",
    "key_secret_file",
    "admission_store",
    "admission_prefix",
    "admission_lease_s",
    "trusted_proxies",
    "watch_repository",
    "watch_interval_s",
    "cluster",
    "cluster_window",
    "cluster_cpu_share",
    "cluster_routing",
    "gateways",
    "engine_loop",
    *_MS_KEYS,
}


def read_config_file(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"config {path} must be a mapping")
    return raw


def _hours(value: Any) -> float:
    try:
        hours = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"responses_retention_hours must be a number, got {value!r}") from None
    if hours <= 0:
        raise ConfigError("responses_retention_hours must be positive")
    return hours


def _days(value: Any, key: str) -> float:
    """A number of days as seconds."""
    try:
        days = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be a number of days, got {value!r}") from None
    if days < 0:
        raise ConfigError(f"{key} must not be negative")
    return days * 86400


def build_config(file_values: dict[str, Any], overrides: dict[str, Any]) -> ServerConfig:
    """Merge a config file's values with command-line overrides (None = unset)."""
    values = {**file_values, **{k: v for k, v in overrides.items() if v is not None}}
    unknown = set(values) - _ENGINE_KEYS - _SERVER_KEYS
    if unknown:
        raise ConfigError(f"unknown config keys: {sorted(unknown)}")
    engine_values = {k: values[k] for k in _ENGINE_KEYS if k in values}
    if engine_values.get("fill") not in (None, True, False):
        raise ConfigError(f"fill must be true, false or null, got {engine_values['fill']!r}")
    if engine_values.get("fair_parts", True) not in (True, False):
        raise ConfigError(f"fair_parts must be true or false, got {engine_values['fair_parts']!r}")
    if engine_values.get("encoder_batching", True) not in (True, False):
        raise ConfigError(
            f"encoder_batching must be true or false, got {engine_values['encoder_batching']!r}"
        )
    if engine_values.get("long_work", "steps") not in LONG_WORK_MODES:
        raise ConfigError(f"long_work must be one of {', '.join(LONG_WORK_MODES)}")
    for key, field_name in _MS_KEYS.items():
        if key in file_values or key in values:
            raw = values.get(key)
            engine_values[field_name] = float(raw) / 1000 if raw is not None else None
    engine_values["engine_commands"] = parse_engine_commands(values.get("engine_commands"))
    engine_values["trusted_pickle_dirs"] = _paths(values, "trusted_pickle_dirs")
    engine_values["adapters"] = parse_adapters(values.get("adapters"))
    if "across_models_threads" in engine_values:
        engine_values["across_models_threads"] = _positive_int(
            engine_values, "across_models_threads", ACROSS_MODELS_THREADS
        )
    if "eviction_patience" in engine_values:
        patience = engine_values["eviction_patience"]
        if isinstance(patience, bool) or not isinstance(patience, int | float) or patience < 0:
            raise ConfigError("eviction_patience must be a number, 0 or more")
        engine_values["eviction_patience"] = float(patience)
    switch = engine_values.get("gil_switch_interval_s")
    if switch is not None and switch <= 0:
        raise ConfigError("gil_switch_interval_ms must be positive (or null)")
    budget = values.get("memory_budget")
    host_budget = values.get("host_memory_budget")
    preload = values.get("preload")
    data_dir = Path(values.get("data_dir", "data"))
    # Absent: under data_dir; an explicit null in the file: no cache.
    cache_dir = values.get("cache_dir", data_dir / "cache")
    cache_age = values.get("cache_max_age_days", 30)
    cache_bytes = values.get("cache_max_bytes")
    engine = EngineConfig(
        memory_budget_bytes=parse_bytes(budget) if budget is not None else None,
        host_memory_budget_bytes=parse_bytes(host_budget) if host_budget is not None else None,
        preload=tuple(preload) if preload is not None else None,
        cache_dir=Path(cache_dir) if cache_dir is not None else None,
        cache_max_age_s=None if cache_age is None else _days(cache_age, "cache_max_age_days"),
        cache_max_bytes=None if cache_bytes is None else parse_bytes(cache_bytes),
        **engine_values,
    )
    return ServerConfig(
        host=str(values.get("host", "127.0.0.1")),
        port=int(values.get("port", 8000)),
        data_dir=data_dir,
        engine=engine,
        max_body_bytes=parse_bytes(values.get("max_body_bytes", DEFAULT_MAX_BODY_BYTES)),
        image_limits=RequestImageLimits(
            _positive_int(values, "max_request_pixels", DEFAULT_MAX_REQUEST_PIXELS),
            _positive_int(values, "max_request_pages", DEFAULT_MAX_REQUEST_PAGES),
        ),
        model_repositories=tuple(Path(p) for p in values.get("model_repositories", ())),
        include_default_models=bool(values.get("include_default_models", True)),
        tiers=parse_tiers(values.get("tiers")),
        auth=bool(values.get("auth", True)),
        audit_retention_days=values.get("audit_retention_days", 30.0),
        store_responses=bool(values.get("store_responses", False)),
        responses_retention_hours=_hours(values.get("responses_retention_hours", 24.0)),
        metrics_public=bool(values.get("metrics_public", False)),
        metrics_port=int(values["metrics_port"]) if values.get("metrics_port") else None,
        grpc_port=int(values["grpc_port"]) if values.get("grpc_port") else None,
        per_tenant_labels=bool(values.get("per_tenant_labels", False)),
        log_format=str(values.get("log_format", "text")),
        access_log=bool(values.get("access_log", False)),
        shutdown_grace_s=_seconds(values, "shutdown_grace_s", DEFAULT_SHUTDOWN_GRACE_S, 0.0),
        header_timeout_s=_seconds(values, "header_timeout_s", DEFAULT_HEADER_TIMEOUT_S),
        body_timeout_s=_seconds(values, "body_timeout_s", DEFAULT_BODY_TIMEOUT_S),
        keep_alive_s=_seconds(values, "keep_alive_s", DEFAULT_KEEP_ALIVE_S),
        max_url_bytes=_size(values, "max_url_bytes", DEFAULT_MAX_URL_BYTES),
        max_header_bytes=_size(values, "max_header_bytes", DEFAULT_MAX_HEADER_BYTES),
        max_head_bytes=_size(values, "max_head_bytes", DEFAULT_MAX_HEAD_BYTES),
        max_num_headers=_positive_int(values, "max_num_headers", DEFAULT_MAX_NUM_HEADERS),
        max_num_opening_connections=_bound(
            values, "max_num_opening_connections", DEFAULT_MAX_NUM_OPENING_CONNECTIONS
        ),
        tenant_store=_optional_str(values, "tenant_store"),
        key_secret_file=_optional_path(values, "key_secret_file"),
        admission_store=_optional_str(values, "admission_store"),
        admission_prefix=str(values.get("admission_prefix", "tessera:")),
        admission_lease_s=_seconds(values, "admission_lease_s", 30.0),
        trusted_proxies=_addresses(values, "trusted_proxies"),
        watch_repository=bool(values.get("watch_repository", False)),
        watch_interval_s=_seconds(values, "watch_interval_s", 5.0),
        cluster=_optional_str(values, "cluster"),
        cluster_window=_positive_int(values, "cluster_window", 32),
        cluster_cpu_share=_seconds(values, "cluster_cpu_share", 1.0),
        cluster_routing=_routing(values.get("cluster_routing")),
        gateways=_gateways(values.get("gateways", "auto")),
        engine_loop=_engine_loop(values.get("engine_loop", DEFAULT_ENGINE_LOOP)),
    )


def _engine_loop(raw: object) -> str:
    if raw not in ENGINE_LOOPS:
        raise ConfigError(f"engine_loop must be one of {', '.join(ENGINE_LOOPS)}, not {raw!r}")
    return str(raw)


def _gateways(raw: object) -> int | None:
    if raw == "auto" or raw is None:
        return None
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < 0:
        raise ConfigError(f"gateways must be auto or a whole number from 0, not {raw!r}")
    return raw


def gateway_processes(configured: int | None, device_kind: str, cores: int) -> int:
    """How many gateway processes to start (0: the gateway runs in the engine's
    process). On a CPU the engine's batches need every core and a process more
    costs more than it gives (docs/benchmarks.md, the process split); on a GPU
    one per 4 cores, 2 to 4, serve HTTP beside the engine process's loop."""
    if configured is not None:
        return configured
    if device_kind == "cpu":
        return 0
    return max(2, min(4, cores // 4))


def _positive_int(values: dict[str, Any], key: str, default: int) -> int:
    raw = values.get(key, default)
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < 1:
        raise ConfigError(f"{key} must be a whole number above 0, not {raw!r}")
    return raw


def _routing(raw: object) -> RoutingConfig:
    """The router's targets: RoutingConfig's fields, each a number above 0."""
    if raw is None:
        return RoutingConfig()
    if not isinstance(raw, dict):
        raise ConfigError(f"cluster_routing must be a mapping, not {raw!r}")
    known = {f.name: f.default for f in dataclasses.fields(RoutingConfig)}
    unknown = set(raw) - set(known)
    if unknown:
        raise ConfigError(f"unknown cluster_routing keys: {sorted(unknown)}")
    values: dict[str, Any] = {}
    for key, default in known.items():
        if key not in raw:
            continue
        if isinstance(default, int):
            values[key] = _positive_int(raw, key, default)
        else:
            values[key] = _seconds(raw, key, float(str(default)))
    return RoutingConfig(**values)


def _addresses(values: dict[str, Any], key: str) -> tuple[str, ...]:
    raw = values.get(key) or ()
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list | tuple) or not all(isinstance(a, str) and a for a in raw):
        raise ConfigError(f"{key} must be a list of addresses, not {raw!r}")
    return tuple(raw)


def _paths(values: dict[str, Any], key: str) -> tuple[Path, ...]:
    raw = values.get(key) or ()
    if not isinstance(raw, list | tuple) or not all(isinstance(p, str) and p for p in raw):
        raise ConfigError(f"{key} must be a list of folders, not {raw!r}")
    return tuple(Path(p) for p in raw)


def _bound(values: dict[str, Any], key: str, default: int) -> int | None:
    """A whole number above 0, or null (given so) for no bound."""
    if key in values and values[key] is None:
        return None
    return _positive_int(values, key, default)


def _size(values: dict[str, Any], key: str, default: int) -> int:
    """A size in bytes (a number or ``64KiB``), above 0."""
    raw = values.get(key, default)
    try:
        size = parse_bytes(raw)
    except (TypeError, ValueError, ConfigError) as e:
        raise ConfigError(f"{key} must be a size in bytes, not {raw!r}") from e
    if size < 1:
        raise ConfigError(f"{key} must be above 0 bytes, not {raw!r}")
    return size


def _optional_str(values: dict[str, Any], key: str) -> str | None:
    raw = values.get(key)
    if raw is not None and not isinstance(raw, str):
        raise ConfigError(f"{key} must be a string, not {raw!r}")
    return raw or None


def _optional_path(values: dict[str, Any], key: str) -> Path | None:
    raw = _optional_str(values, key)
    return Path(raw) if raw is not None else None


def _seconds(
    values: dict[str, Any], key: str, default: float, minimum: float | None = None
) -> float:
    """A number of seconds: at least ``minimum``, or above 0 when none is given."""
    raw = values.get(key, default)
    try:
        seconds = float(raw)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key} must be a number of seconds, not {raw!r}") from e
    if not (seconds >= minimum if minimum is not None else seconds > 0) or seconds == math.inf:
        bound = f"at least {minimum:g}" if minimum is not None else "above 0"
        raise ConfigError(f"{key} must be {bound} seconds, not {raw!r}")
    return seconds
