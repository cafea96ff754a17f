"""Bring up one configuration of a scenario: tessera in one of its forms, or a peer.

Each configuration is a :class:`Deployment`: the servers it started, which
one serves each model, the tenants' keys, and what memory it reserves.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import yaml

from harness.inputs import sentences
from harness.perturbed import bench_models_dir
from harness.probes import Residency
from harness.request import request_for
from harness.scenario import Configuration, RequestShape, Scenario, ScenarioError
from harness.servers import RunningServer, running_tessera
from tessera.repository import default_repository_path, read_spec
from tessera.tenants import TenantStore

if TYPE_CHECKING:
    from harness.peers import Peer

ADMIN_TENANT = "bench-ops"


@dataclass
class TesseraProtocol:
    """tessera's own APIs, with a real input for each model's task."""

    tasks: dict[str, str]  # served model name -> task
    texts: list[str] = field(default_factory=sentences)

    def call(self, model: str, n: int, shape: RequestShape) -> tuple[str, dict[str, Any]]:
        task, inputs = self.tasks[model], shape.inputs
        if task == "embedding":
            chosen = [self._text(n * inputs + i, shape.words) for i in range(inputs)]
            return "/v1/embeddings", {"model": model, "input": chosen[0] if inputs == 1 else chosen}
        return request_for(task, model, n, pages=inputs, max_tokens=shape.max_tokens)

    def _text(self, n: int, words: int | None) -> str:
        """The ``n``-th text: a sentence, or sentences joined to about ``words`` words."""
        if words is None:
            return self.texts[n % len(self.texts)]
        out: list[str] = []
        k = n * words
        while sum(len(s.split()) for s in out) < words:
            out.append(self.texts[k % len(self.texts)])
            k += 1
        return " ".join(out)

    def ok(self, model: str, status: int, body: bytes) -> bool:
        if status != 200:
            return False
        return self.tasks[model] != "embedding" or b'"embedding"' in body


@dataclass
class PeerProtocol:
    peer: Peer
    texts: list[str] = field(default_factory=sentences)

    def call(self, model: str, n: int, shape: RequestShape) -> tuple[str, dict[str, Any]]:
        if shape != RequestShape():
            raise ScenarioError(f"peer {self.peer.name}: one sentence a request only")
        return self.peer.embed_call(model, self.texts[n % len(self.texts)])

    def ok(self, model: str, status: int, body: bytes) -> bool:
        return self.peer.embed_ok(status, body)


@dataclass
class Deployment:
    """A configuration, up and serving."""

    name: str
    kind: str
    servers: list[RunningServer]
    routes: dict[str, RunningServer]  # served model name -> server
    protocol: TesseraProtocol | PeerProtocol
    keys: dict[str, str] = field(default_factory=dict)  # tenant -> API key
    admin_key: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    load_events: Path | None = None  # a peer's JSON line per model load, where it writes one

    # --- the driver's Endpoint -----------------------------------------------------
    def route(self, model: str) -> str:
        return self.routes[model].base_url

    def headers(self, tenant: str) -> dict[str, str]:
        key = self.keys.get(tenant)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def call(self, model: str, n: int, shape: RequestShape) -> tuple[str, dict[str, Any]]:
        return self.protocol.call(model, n, shape)

    def ok(self, model: str, status: int, body: bytes) -> bool:
        return self.protocol.ok(model, status, body)

    def model_headers(self, model: str) -> dict[str, str]:
        """Headers of a request for ``model`` (a header-routed peer's model id)."""
        if isinstance(self.protocol, PeerProtocol):
            return self.protocol.peer.model_headers(model)
        return {}

    # --- what the probes need ------------------------------------------------------
    def processes(self) -> list[psutil.Process]:
        return [p for server in self.servers for p in server.processes()]

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}

    def residencies(self) -> list[Residency]:
        if self.kind == "peer":
            return []
        return [
            Residency(f"{s.base_url}/admin/residency", self.admin_headers) for s in self.servers
        ]


def card_folder(scenario: Scenario, model: str) -> Path:
    """The folder of a served model's card: a generated model's own, else the
    default model's it stands for."""
    if scenario.generated is not None:
        return scenario.generated.folder(bench_models_dir()) / model
    return default_repository_path() / scenario.base_model(model)


def served_tasks(scenario: Scenario) -> dict[str, str]:
    return {m: read_spec(card_folder(scenario, m)).task for m in scenario.models}


def latency_targets_ms(scenario: Scenario) -> dict[str, float | None]:
    out = {}
    for model in scenario.models:
        target = read_spec(card_folder(scenario, model)).latency_target_ms
        out[model] = None if target is None else float(target)
    return out


def bench_cache() -> Path:
    """Where benchmark servers keep converted weights (SmolLM2's dequantized GGUF)
    between runs, as a restarted server keeps its data folder:
    ``$TESSERA_BENCH_CACHE`` or ``~/.cache/tessera/bench-cache``."""
    return Path(os.environ.get("TESSERA_BENCH_CACHE", "~/.cache/tessera/bench-cache")).expanduser()


# Slices are each model's peak in its own process plus this margin: resident-set
# deltas (how ONNX and native models are measured) differ a little between processes.
SLICE_MARGIN = 1.10


def _write_repository(
    folder: Path, scenario: Scenario, names: list[str], caps: dict[str, int] | None = None
) -> Path:
    """A model repository holding ``names``, aliases under their own name, each
    capped at ``caps[name]`` bytes (weights and batches) where given."""
    for name in names:
        card = card_folder(scenario, name)
        raw = yaml.safe_load((card / "model.yaml").read_text(encoding="utf-8"))
        raw["name"] = name
        source = raw.get("source") or {}
        path = source.get("path")
        # A folder source is relative to its card's folder, not to this copy's.
        if source.get("package") is None and path and not Path(path).expanduser().is_absolute():
            raw["source"] = {**source, "path": str(card / path)}
        if caps is not None:
            raw.setdefault("memory", {})["max_bytes"] = caps[name]
        (folder / name).mkdir(parents=True, exist_ok=True)
        (folder / name / "model.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return folder


def _prepare_tenants(data_dir: Path, tiers: dict[str, str]) -> tuple[dict[str, str], str]:
    """Each tenant with its tier and a key, and an admin key."""
    data_dir.mkdir(parents=True, exist_ok=True)
    with TenantStore(data_dir) as store:
        store.add_tenant(ADMIN_TENANT)
        admin = store.create_key(ADMIN_TENANT, admin=True).key
        keys = {}
        for tenant, tier in tiers.items():
            store.add_tenant(tenant, tier=tier)
            keys[tenant] = store.create_key(tenant).key
    return keys, admin


def _serve_args(
    scenario: Scenario, configuration: Configuration, work: Path, label: str | None = None
) -> list[str]:
    """The scenario's and configuration's serve arguments and a config file of
    the configuration's settings (with the benchmark cache) named after ``label``."""
    config = {"cache_dir": str(bench_cache()), **configuration.config}
    path = work / f"config-{label or configuration.name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return [*scenario.server_args, *configuration.args, "--config", str(path)]


@contextlib.contextmanager
def deploy_tessera(
    scenario: Scenario,
    configuration: Configuration,
    work: Path,
    tiers: dict[str, str],
    slices: dict[str, int] | None = None,
) -> Iterator[Deployment]:
    """One tessera serving every model of the scenario (``tessera``, ``fifo``, ``static``)."""
    data_dir = work / f"data-{configuration.name}"
    keys, admin = _prepare_tenants(data_dir, tiers)
    # The scenario's models only, as each peer and dedicated process serves
    # only its own: with the default models included, the fill at start
    # loaded all nine (three-models' peak PSS 1,248 MiB against 607 before
    # the fill; its three names share one encoder). A configuration may
    # still include them (``include_default_models: true``).
    config = {"include_default_models": False, **configuration.config}
    settings: dict[str, Any] = {}
    caps: dict[str, int] | None = None
    extra: list[str] = []
    if configuration.kind == "static":
        if slices is None:
            raise ScenarioError("static needs a dedicated configuration before it (its slices)")
        # Each model preloaded into a fixed slice (its cap), the budget the slices
        # together, and no eviction: a batch that finds no room waits for it.
        caps = {m: int(b * SLICE_MARGIN) for m, b in slices.items()}
        config["eviction_policy"] = "none"
        settings["slices_bytes"] = caps
        extra += ["--memory-budget", str(sum(caps.values()))]
        extra += [a for m in scenario.models for a in ("--preload", m)]
    elif (configuration.memory_budget or scenario.memory_budget) is not None:
        extra += ["--memory-budget", str(configuration.memory_budget or scenario.memory_budget)]
    folder = work / f"repo-{configuration.name}"
    repository = _write_repository(folder, scenario, list(scenario.models), caps)
    extra += ["--model-repository", str(repository)]
    args = [*_serve_args(scenario, replace(configuration, config=config), work), *extra]
    if configuration.kind == "fifo":
        args += ["--scheduling", "fifo"]
    with running_tessera(work, configuration.name, args) as server:
        server.key = admin
        routes = dict.fromkeys(scenario.models, server)
        yield Deployment(
            configuration.name,
            configuration.kind,
            [server],
            routes,
            TesseraProtocol(served_tasks(scenario)),
            keys,
            admin,
            {**settings, "command": server.command, "startup_s": round(server.startup_s, 1)},
        )


@contextlib.contextmanager
def deploy_dedicated(
    scenario: Scenario, configuration: Configuration, work: Path, tiers: dict[str, str]
) -> Iterator[Deployment]:
    """One tessera process per model, each holding only its model, one thread each."""
    template = work / f"data-{configuration.name}-template"
    keys, admin = _prepare_tenants(template, tiers)
    threads = max(1, (os.cpu_count() or 1) // len(scenario.models))
    routes: dict[str, RunningServer] = {}
    with contextlib.ExitStack() as stack:
        for model in scenario.models:
            label = f"{configuration.name}-{model}"
            shutil.copytree(template, work / f"data-{label}")
            repository = _write_repository(work / f"repo-{label}", scenario, [model])
            alone = replace(
                configuration, config={**configuration.config, "include_default_models": False}
            )
            args = _serve_args(scenario, alone, work, label)
            args += ["--model-repository", str(repository)]
            args += ["--preload", model, "--threads", str(threads), "--workers", "1"]
            server = stack.enter_context(running_tessera(work, label, args))
            server.key = admin
            routes[model] = server
        settings = {"processes": len(routes), "threads_per_process": threads}
        yield Deployment(
            configuration.name,
            "dedicated",
            list(routes.values()),
            routes,
            TesseraProtocol(served_tasks(scenario)),
            keys,
            admin,
            settings,
        )


@contextlib.contextmanager
def deploy_peer(
    scenario: Scenario, configuration: Configuration, work: Path
) -> Iterator[Deployment]:
    from harness.peers import PEERS, peers_dir

    under = peers_dir()

    name = configuration.peer or configuration.name
    if name not in PEERS:
        raise ScenarioError(f"unknown peer {name!r}; known: {sorted(PEERS)}")
    peer = PEERS[name]
    if not peer.installed(under):
        raise ScenarioError(f"peer {name} is not installed under {under}: run make bench-peers")
    if scenario.generated is not None:
        model_dir = scenario.generated.folder(bench_models_dir())  # NAME under it, each
    else:
        bases = {scenario.base_model(m) for m in scenario.models}
        if len(bases) != 1:
            raise ScenarioError("peers serve one model's weights (under one or more names)")
        model_dir = read_spec(default_repository_path() / bases.pop()).resolve_source()
    # One torch thread per process where a peer runs a process per worker.
    threads = peer.default_threads(len(scenario.models))
    models = list(scenario.models)
    with peer.serve(under, work, model_dir, models, threads, configuration.args) as server:
        routes = dict.fromkeys(scenario.models, server)
        settings = {**server.extra, "version": peer.version(under)}
        settings["startup_s"] = round(server.startup_s, 1)
        events = server.extra.get("load_events")
        yield Deployment(
            configuration.name,
            "peer",
            [server],
            routes,
            PeerProtocol(peer),
            settings=settings,
            load_events=None if events is None else Path(str(events)),
        )
