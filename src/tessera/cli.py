"""The ``tessera`` command: ``serve`` and ``models list``."""

from __future__ import annotations

import ipaddress
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tessera.config import ServerConfig, build_config, gateway_processes, read_config_file
from tessera.errors import ConfigError
from tessera.logs import configure_logging
from tessera.tenants.cli import register as register_tenant_commands

if TYPE_CHECKING:
    from tessera.admission.shared import RedisAdmissionController
    from tessera.cluster.client import RayEngines
    from tessera.engine import Engine
    from tessera.repository import ModelRepository
    from tessera.tenants import AuditLog, TenantStore

app = typer.Typer(help="Serve many small AI models, for many tenants, from one device.")
models_app = typer.Typer(help="The model repository.")
app.add_typer(models_app, name="models")
register_tenant_commands(app)

# How far back the audit log's requests per model order the fill at start.
DEMAND_MEMORY_S = 86_400.0

ConfigOpt = Annotated[Path | None, typer.Option("--config", help="YAML config file.")]
HostBudgetOpt = Annotated[
    str | None,
    typer.Option(
        help="The host tier, where evicted models wait ready to copy back: bytes or a size"
        " (4GiB), 0 for none. Default: a quarter of the RAM."
    ),
]
AdapterOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--adapter",
        help="An adapter beyond the built-in ones: NAME=module:Class, a ModelLoader"
        " importable by the server (repeatable).",
    ),
]
RepoOpt = Annotated[
    list[Path] | None,
    typer.Option("--model-repository", help="Extra model repository folder (repeatable)."),
]


def _offline() -> None:
    # Models come from installed packages and local folders only; never a hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _config(config: Path | None, **overrides: object) -> ServerConfig:
    try:
        return build_config(read_config_file(config), overrides)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e


def _adapters(given: list[str] | None) -> dict[str, str] | None:
    """``--adapter NAME=module:Class`` options as the config's ``adapters``."""
    if not given:
        return None
    return {name: target for name, _, target in (a.partition("=") for a in given)}


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Address to bind.")] = None,
    port: Annotated[int | None, typer.Option(help="Port to bind.")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="Where state is kept.")] = None,
    memory_budget: Annotated[
        str | None, typer.Option(help="Bytes or a size (700MiB). Default: the device's share.")
    ] = None,
    host_memory_budget: HostBudgetOpt = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu, cuda or cuda:N.")] = None,
    threads: Annotated[int | None, typer.Option(help="Thread budget (default: all cores).")] = None,
    workers: Annotated[int | None, typer.Option(help="Batches run at once.")] = None,
    preload: Annotated[
        list[str] | None, typer.Option(help="Model to load at start (repeatable).")
    ] = None,
    fill: Annotated[
        bool | None,
        typer.Option(
            "--fill/--no-fill",
            help="After the preloads, load what else fits the budget before ready"
            " (default: unless --preload names the models).",
        ),
    ] = None,
    model_repository: RepoOpt = None,
    adapter: AdapterOpt = None,
    scheduling: Annotated[str | None, typer.Option(help="fair (across tenants) or fifo.")] = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="Also serve /metrics on this port, without a key.")
    ] = None,
    grpc_port: Annotated[
        int | None,
        typer.Option(help="Also serve KServe v2 over gRPC on this port (tessera[grpc])."),
    ] = None,
    no_auth: Annotated[
        bool, typer.Option("--no-auth", help="Serve without API keys (trusted networks only).")
    ] = False,
    shutdown_grace: Annotated[
        float | None,
        typer.Option(min=0, help="On SIGTERM, seconds accepted requests may still run (30)."),
    ] = None,
    header_timeout: Annotated[
        float | None, typer.Option(min=0.001, help="Seconds for a request's headers (10).")
    ] = None,
    body_timeout: Annotated[
        float | None, typer.Option(min=0.001, help="Seconds for a request's body (60).")
    ] = None,
    cluster_address: Annotated[
        str | None,
        typer.Option(
            "--cluster",
            help="Route to the engines of this Ray cluster (auto, or its address)"
            " instead of serving models here.",
        ),
    ] = None,
    gateways: Annotated[
        str | None,
        typer.Option(
            help="HTTP gateway processes in front of the engine's process: a number"
            " (0: one process) or auto (0 on a CPU, 2-4 on a GPU).",
        ),
    ] = None,
    config: ConfigOpt = None,
    log_level: Annotated[str, typer.Option(help="Logging level.")] = "info",
    log_format: Annotated[
        str | None, typer.Option(help="text, or json: one object a line with the request id.")
    ] = None,
) -> None:
    """Start the server."""
    _offline()
    settings = _config(
        config,
        host=host,
        port=port,
        data_dir=str(data_dir) if data_dir else None,
        memory_budget=memory_budget,
        host_memory_budget=host_memory_budget,
        device=device,
        num_threads=threads,
        num_workers=workers,
        preload=preload,
        fill=fill,
        model_repositories=model_repository,
        adapters=_adapters(adapter),
        scheduling=scheduling,
        auth=False if no_auth else None,
        log_format=log_format,
        metrics_port=metrics_port,
        grpc_port=grpc_port,
        shutdown_grace_s=shutdown_grace,
        header_timeout_s=header_timeout,
        body_timeout_s=body_timeout,
        cluster=cluster_address,
        gateways=int(gateways) if gateways is not None and gateways.isdigit() else gateways,
    )
    _serve(settings, log_level, start_engines=False)


@app.command()
def cluster(
    address: Annotated[
        str,
        typer.Option(
            help="The Ray cluster: auto (the one this machine joined with ray start),"
            " local (start one here), or its address."
        ),
    ] = "local",
    host: Annotated[str | None, typer.Option(help="Address to bind.")] = None,
    port: Annotated[int | None, typer.Option(help="Port to bind.")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="Where state is kept.")] = None,
    memory_budget: Annotated[
        str | None, typer.Option(help="Each engine's budget. Default: its device's share.")
    ] = None,
    host_memory_budget: HostBudgetOpt = None,
    device: Annotated[str | None, typer.Option(help="Each engine's: auto, cpu, cuda.")] = None,
    threads: Annotated[int | None, typer.Option(help="Each engine's thread budget.")] = None,
    cpu_share: Annotated[
        float | None, typer.Option(help="CPUs an engine takes on a node without GPUs (1).")
    ] = None,
    model_repository: RepoOpt = None,
    adapter: AdapterOpt = None,
    no_auth: Annotated[
        bool, typer.Option("--no-auth", help="Serve without API keys (trusted networks only).")
    ] = False,
    config: ConfigOpt = None,
    log_level: Annotated[str, typer.Option(help="Logging level.")] = "info",
) -> None:
    """Start one engine per device of a Ray cluster (a Ray actor each), and a
    gateway routing to them. More gateways: ``tessera serve --cluster ADDRESS``."""
    _offline()
    settings = _config(
        config,
        host=host,
        port=port,
        data_dir=str(data_dir) if data_dir else None,
        memory_budget=memory_budget,
        host_memory_budget=host_memory_budget,
        device=device,
        num_threads=threads,
        model_repositories=model_repository,
        adapters=_adapters(adapter),
        auth=False if no_auth else None,
        cluster=address,
        cluster_cpu_share=cpu_share,
    )
    _serve(settings, log_level, start_engines=True)


def _serve(settings: ServerConfig, log_level: str, *, start_engines: bool) -> None:
    """Run a gateway: over its own engine, or over the engines of
    ``settings.cluster`` (started first when ``start_engines``)."""
    try:
        configure_logging(log_level, settings.log_format)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    from tessera.engine import Engine
    from tessera.gateway import create_app
    from tessera.gateway.server import GatewayServer, http_config
    from tessera.progress import PreloadReporter
    from tessera.repository.watch import RepositoryWatcher

    if not settings.auth:
        if not _loopback(settings.host):
            typer.echo(
                f"error: --no-auth (auth: false) serves on loopback only, not {settings.host}",
                err=True,
            )
            raise typer.Exit(2)
        logging.getLogger("tessera.cli").warning(
            "serving without API keys (--no-auth) on %s: anyone on this machine may call it;"
            " admin changes (models, tenants, keys) are refused",
            settings.host,
        )
    try:
        repository = settings.repository()
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    if not _can_listen(settings.host, settings.port):  # before a key is made and printed
        typer.echo(f"error: cannot listen on {settings.host}:{settings.port}: in use", err=True)
        raise typer.Exit(3)
    try:
        settings.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # the owner's alone
    except OSError as e:
        typer.echo(f"error: data folder {settings.data_dir}: {e.strerror or e}", err=True)
        raise typer.Exit(2) from e
    ray_engines: RayEngines | None = None
    if settings.cluster is not None:
        engine, ray_engines = _cluster_engine(settings, repository, start_engines)
    else:
        engine = Engine(repository, settings.engine, admission=_shared_admission(settings))
        stats = engine.snapshot()
        typer.echo(
            f"tessera on {stats.device_name}: {len(repository)} models,"
            f" budget {stats.budget_bytes} bytes, host tier {stats.host_budget_bytes},"
            f" {stats.num_workers} workers x {stats.threads_per_worker} threads"
        )
    try:
        store, audit_log = _tenancy(settings, engine) if settings.auth else (None, None)
        if audit_log is None:  # no keys: still a row for each admin change refused
            audit_log = _audit_log(settings)
    except ConfigError as e:  # a data folder's database it cannot read
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    app_ = create_app(
        engine,
        max_body_bytes=settings.max_body_bytes,
        image_limits=settings.image_limits,
        header_timeout_s=settings.header_timeout_s,
        tenant_store=store,
        audit_log=audit_log,
        response_store=settings.response_store(),
        tiers=settings.tiers,
        preload_progress=PreloadReporter(),
        per_tenant_labels=settings.per_tenant_labels,
        metrics_public=settings.metrics_public,
        # The folders given with --model-repository, never the default models.
        watcher=RepositoryWatcher(settings.model_repositories)
        if settings.watch_repository
        else None,
        watch_interval_s=settings.watch_interval_s,
        cluster=ray_engines,
        model_roots=settings.model_roots(),
        admin_changes=settings.auth,
    )
    if settings.metrics_port is not None:
        # A scrape-only listener (prometheus_client's own thread): no key, no other routes.
        from prometheus_client import start_http_server

        start_http_server(
            settings.metrics_port, addr=settings.host, registry=app_.state.metrics.registry
        )
        typer.echo(f"metrics on http://{settings.host}:{settings.metrics_port}/metrics")
    num_gateways = 0
    if ray_engines is None:
        num_gateways = gateway_processes(settings.gateways, engine.device_kind, os.cpu_count() or 1)
    if settings.grpc_port is not None:
        typer.echo(f"KServe v2 gRPC on {settings.host}:{settings.grpc_port}")
    if num_gateways:  # the gateway processes serve gRPC, as they serve HTTP
        from tessera.gateway.split import serve_split

        typer.echo(f"{num_gateways} gateway processes on {settings.host}:{settings.port}")
        serve_split(settings, app_, engine, num_gateways, log_level)
        return
    if settings.grpc_port is not None:
        app_.state.grpc_address = (settings.host, settings.grpc_port)
    server = GatewayServer(
        http_config(app_, settings, log_level, host=settings.host, port=settings.port),
        engine,
        settings.shutdown_grace_s,
    )
    server.run()


def _cluster_engine(
    settings: ServerConfig, repository: ModelRepository, start_engines: bool
) -> tuple[Engine, RayEngines]:
    """The gateway's engine over the engine actors of ``settings.cluster``."""
    from tessera.cluster import Router
    from tessera.cluster.actor import find_engines
    from tessera.cluster.actor import start_engines as start_actors
    from tessera.cluster.client import RayEngines, cluster_address, connect
    from tessera.cluster.gateway import (
        CLUSTER_RUNTIME,
        ClusterLoader,
        gateway_config,
        gateway_repository,
    )
    from tessera.engine import Engine

    address = settings.cluster
    connect(None if address == "local" else address)
    if start_engines:
        actors = start_actors(repository, settings.engine, cpu_share=settings.cluster_cpu_share)
        typer.echo(
            f"Ray cluster at {cluster_address()}: more gateways join it with"
            f" tessera serve --cluster {cluster_address()} (or --cluster auto on this machine)"
        )
    else:
        actors = find_engines()
        if not actors:
            typer.echo(
                "error: no tessera engines in that Ray cluster (start them with tessera cluster)",
                err=True,
            )
            raise typer.Exit(2)
    typer.echo(f"tessera gateway over {len(actors)} engines: {', '.join(sorted(actors))}")
    ray_engines = RayEngines(actors, Router(settings.cluster_routing))
    engine = Engine(
        gateway_repository(repository),
        gateway_config(settings.engine, settings.cluster_window),
        admission=_shared_admission(settings),
        loaders={CLUSTER_RUNTIME: ClusterLoader(ray_engines)},
    )
    return engine, ray_engines


def _can_listen(host: str, port: int) -> bool:
    """Whether ``host:port`` can be listened on now (port 0: any free one)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _tenancy(settings: ServerConfig, engine: Engine) -> tuple[TenantStore, AuditLog]:
    """Open the tenant store and audit log; on first start make tenant ``default``
    and an admin key, printed once; seed today's quota use from the audit log."""
    from tessera.tenants.audit import start_of_day_utc

    store, audit_log = settings.tenancy()
    bootstrap = store.ensure_bootstrap()
    if bootstrap is not None:
        typer.echo(f"created tenant {bootstrap.tenant.name!r} (tier {bootstrap.tenant.tier})")
        typer.echo(f"admin API key (shown once, keep it): {bootstrap.key}")
    day_start = start_of_day_utc(time.time())
    for tenant in store.list_tenants():
        engine.seed_usage(tenant.name, audit_log.units_since(tenant.name, day_start))
    engine.seed_demand(audit_log.requests_by_model(time.time() - DEMAND_MEMORY_S))
    return store, audit_log


def _loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _audit_log(settings: ServerConfig) -> AuditLog:
    from tessera.tenants import AuditLog

    return AuditLog(
        settings.data_dir,
        url=settings.tenant_store,
        retention_days=settings.audit_retention_days,
    )


def _shared_admission(settings: ServerConfig) -> RedisAdmissionController | None:
    """Admission counters in Redis when ``admission_store`` names one, else None
    (the engine's own). Its lease renewer is a daemon thread that ends with the
    process, when every request has been answered."""
    if settings.admission_store is None:
        return None
    from tessera.admission.shared import RedisAdmissionController

    return RedisAdmissionController.from_url(
        settings.admission_store,
        prefix=settings.admission_prefix,
        lease_s=settings.admission_lease_s,
    )


@models_app.command("list")
def models_list(model_repository: RepoOpt = None, config: ConfigOpt = None) -> None:
    """Print the model repository."""
    from rich.console import Console
    from rich.table import Table

    settings = _config(config, model_repositories=model_repository)
    try:
        repository = settings.repository()
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    table = Table("name", "task", "runtime", "adapter", "preload", "source", "licence")
    for spec in repository:
        source = spec.source.package or spec.source.path or str(spec.folder)
        table.add_row(
            spec.name,
            spec.task.value,
            spec.runtime,
            spec.adapter,
            "yes" if spec.preload else "",
            source,
            spec.licence,
        )
    Console(width=200).print(table)


UrlOpt = Annotated[str, typer.Option("--url", help="The running server.", envvar="TESSERA_URL")]
AdminKeyOpt = Annotated[
    str | None,
    typer.Option("--key", help="An admin API key.", envvar="TESSERA_ADMIN_KEY"),
]


def _admin_call(method: str, url: str, key: str | None, body: object = None) -> None:
    """One call to a running server's admin API; prints its JSON answer, exits 1
    with its error on a refusal, 2 when the server cannot be reached."""
    import json
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        # A rollout loads and checks the model: allow it time.
        with urllib.request.urlopen(request, timeout=600) as response:
            typer.echo(response.read().decode())
    except urllib.error.HTTPError as e:
        typer.echo(e.read().decode(), err=True)
        raise typer.Exit(1) from e
    except OSError as e:
        typer.echo(f"error: {url}: {e}", err=True)
        raise typer.Exit(2) from e


@models_app.command("add")
def models_add(
    folder: Annotated[
        Path,
        typer.Argument(help="The model folder (model.yaml, versions), or with --weights a card."),
    ],
    url: UrlOpt = "http://127.0.0.1:8000",
    key: AdminKeyOpt = None,
    weights: Annotated[
        Path | None,
        typer.Option(help="FOLDER is then a model.yaml file, sent; this is its weights' path."),
    ] = None,
) -> None:
    """Register a model on a running server, or roll out its new versions."""
    body = {"path": str(folder.resolve())}
    if weights is not None:
        try:
            body = {"model_yaml": folder.read_text(encoding="utf-8")}
        except OSError as e:
            typer.echo(f"error: {folder}: {e}", err=True)
            raise typer.Exit(2) from e
        body["weights"] = str(weights.resolve())
    _admin_call("POST", f"{url.rstrip('/')}/admin/models", key, body)


@models_app.command("remove")
def models_remove(
    name: Annotated[str, typer.Argument(help="The model to retire.")],
    url: UrlOpt = "http://127.0.0.1:8000",
    key: AdminKeyOpt = None,
) -> None:
    """Retire a model on a running server: drained, unloaded, forgotten."""
    _admin_call("DELETE", f"{url.rstrip('/')}/admin/models/{name}", key)


@app.command()
def bench(
    model: Annotated[str | None, typer.Option(help="The model to send requests to.")] = None,
    scenario: Annotated[
        list[Path] | None,
        typer.Option(help="Run a scenario file instead: it starts its own servers (repeatable)."),
    ] = None,
    only: Annotated[
        list[str] | None, typer.Option(help="With --scenario: only this configuration.")
    ] = None,
    quick: Annotated[bool, typer.Option(help="With --scenario: a quarter of its bounds.")] = False,
    out_dir: Annotated[Path, typer.Option(help="With --scenario: where results go.")] = Path(
        "benchmarks/results"
    ),
    work_dir: Annotated[
        Path | None,
        typer.Option(help="With --scenario: keep the servers' data and logs under this folder."),
    ] = None,
    url: Annotated[str, typer.Option(help="A running tessera.")] = "http://127.0.0.1:8000",
    key: Annotated[
        str | None, typer.Option(envvar="TESSERA_KEY", help="API key (or TESSERA_KEY).")
    ] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="Closed-loop callers.")] = 8,
    rate: Annotated[
        float | None, typer.Option(min=0.001, help="Open loop: requests a second (Poisson).")
    ] = None,
    requests: Annotated[int, typer.Option(min=1, help="At most this many requests.")] = 200,
    duration: Annotated[float, typer.Option(min=0.1, help="At most this many seconds.")] = 30.0,
    out: Annotated[Path | None, typer.Option(help="Write the result as JSON here.")] = None,
) -> None:
    """Drive a running tessera with a bounded load; report throughput and latency.

    With --scenario, serve a scenario's workload with each of its configurations
    (tessera, baselines, peer servers) and write JSON, Markdown and plots.
    """
    import asyncio

    import httpx

    _import_bench_harness()
    from harness.live import BenchPlan, report, run_bench

    if scenario:
        _bench_scenarios(scenario, out_dir, set(only) if only else None, quick, work_dir)
        return
    if model is None:
        typer.echo("error: give --model (a running tessera) or --scenario FILE", err=True)
        raise typer.Exit(2)

    plan = BenchPlan(url, model, key, concurrency, rate, requests, duration)
    try:
        result = asyncio.run(run_bench(plan))
    except (ValueError, OSError, httpx.HTTPError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    report(result, out)


def _bench_scenarios(
    paths: list[Path], out_dir: Path, only: set[str] | None, quick: bool, work_dir: Path | None
) -> None:
    from harness.scenario import ScenarioError
    from harness.suite import bench_scenario

    _offline()
    for path in paths:
        try:
            bench_scenario(path, out_dir, only, quick, work_dir)
        except ScenarioError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from e


def _import_bench_harness() -> None:
    """Make the benchmark harness (``benchmarks/harness/``) importable.

    The harness, the peer servers' definitions among it, lives with the
    benchmarks in the source checkout rather than in the installed package,
    so ``tessera bench`` needs a checkout installed in place (``make venv``).
    """
    import sys

    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    if not (benchmarks / "harness" / "__init__.py").is_file():
        typer.echo(
            "error: tessera bench runs the harness in a source checkout's benchmarks/; "
            "install tessera from its checkout in place (make venv, or pip install -e .)",
            err=True,
        )
        raise typer.Exit(2)
    if str(benchmarks) not in sys.path:
        sys.path.insert(0, str(benchmarks))


def main() -> None:
    app()
