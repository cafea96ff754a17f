"""Scenario files: the workload a benchmark serves and the configurations it compares.

A scenario is YAML (see ``benchmarks/scenarios/``)::

    name: mixed-zipf
    about: what it measures, in a sentence or two
    models: [all-minilm-l6-v2, minilm-rerank, ...]   # in popularity order
    aliases: {minilm-a: all-minilm-l6-v2}          # extra names for the same weights
    popularity: {zipf: 1.1}                          # or omitted: uniform; or a list
                                                     # of them ([uniform, {zipf: 1.1}]):
                                                     # every step under each in turn
    memory_budget: 700MiB                            # tessera's, for every configuration
    requests: 2000                                   # each tenant's bound, per step
    duration_s: 60                                   # each step's time bound
    warmup_requests: 50                              # per step, not measured
    sweep: [1, 8, 32, 64]                            # closed-loop concurrency steps
    rates: [5, 10, 15, 25]                           # or open-loop steps: the open-loop
                                                     # tenants' rates together (split as
                                                     # written), up to the first rate a
                                                     # configuration misses (capacity)
    capacity_share: 0.99                             # a rate's share within target to hold
                                                     # it (0.95 unless given; 0.99: p99)
    tenants:
      - {name: quiet, tier: standard, rate: 10}          # open loop, Poisson arrivals
      - {name: flood, concurrency: 16, inputs: 8, background: true}  # closed loop
      - {name: bulk, concurrency: 2, inputs: 32, words: 260}  # texts of ~260 words
      - {name: talker, concurrency: 2, max_tokens: 256, models: [smollm2-135m]}
      - {name: user, count: 200, rate: 0.25}         # 200 tenants alike, user-1 ... user-200
    configurations:
      - tessera                                      # a name that is also its kind
      - {name: vip, kind: tessera, tiers: {quiet: vip},
         config: {tiers: {vip: {latency_target_ms: {p99_of: alone, tenant: quiet, times: 3}}}}}
      - {name: pytriton, kind: peer}
      - {name: small, kind: tessera, memory_budget: 1GiB}  # the scenario's, overridden

Generated models stand in for ``models``: ``generated_models: {from:
all-minilm-l6-v2, count: 100, noise: 1.0e-3, prefix: minilm}`` serves
``minilm-000`` to ``minilm-099``, each the packaged model with its weights
perturbed (``harness.perturbed``), with ``latency_target_ms`` on their cards.
With ``heads: true`` they are classifier heads over the packaged model's
encoder instead (``encoder-head`` cards, ``harness.heads``): ``generated_models:
{from: all-minilm-l6-v2, count: 1000, heads: true, prefix: head}``.
``prime: true`` sends one request to each model in turn, least popular first,
before a configuration's first step (what loads them is not measured).

Kinds: ``tessera`` (one shared server), ``fifo`` (fair scheduling off),
``static`` (every model preloaded into fixed slices sized by the dedicated run,
no eviction), ``dedicated`` (one tessera process per model, one thread each),
``raw`` (the model in-process, no server) and ``peer`` (a peer server, named
by ``peer`` or by the configuration's name).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from harness.heads import HeadSet
from harness.perturbed import ModelSet

# A step within a configuration's capacity: this share of its requests within
# their target (a scenario's ``capacity_share``; 0.99: "p99 within target"),
# and none failed (``figures.within_capacity``).
CAPACITY_SHARE = 0.95
KINDS = ("tessera", "fifo", "static", "dedicated", "raw", "peer")
_SCENARIO_KEYS = {
    "name", "about", "models", "aliases", "popularity", "memory_budget", "requests",
    "duration_s", "warmup_requests", "sweep", "tenants", "configurations", "server_args",
    "generated_models", "latency_target_ms", "rates", "prime", "capacity_share",
}  # fmt: skip
_GENERATED_KEYS = {"from", "count", "noise", "prefix", "heads"}
_TENANT_KEYS = {
    "name", "tier", "rate", "concurrency", "inputs", "requests", "models", "background", "count",
    "words", "max_tokens",
}  # fmt: skip
_CONFIG_KEYS = {"name", "kind", "peer", "tenants", "tiers", "config", "args", "memory_budget"}


class ScenarioError(ValueError):
    """A scenario file that cannot be run as written."""


@dataclass(frozen=True)
class RequestShape:
    """What one request of a tenant holds: ``inputs`` texts (of about ``words``
    words each where given) or OCR pages; a chat's ``max_tokens`` where given."""

    inputs: int = 1
    words: int | None = None
    max_tokens: int | None = None


@dataclass(frozen=True)
class TenantLoad:
    """One tenant's share of the workload."""

    name: str
    tier: str = "standard"
    rate: float | None = None  # open loop: requests a second, Poisson arrivals
    concurrency: int | None = None  # closed loop: callers, each waiting for its answer
    inputs: int = 1  # sentences (or OCR pages) per request, for tasks that take several
    words: int | None = None  # each text about this many words (embeddings); else a sentence
    max_tokens: int | None = None  # a chat's tokens to generate; else 8
    requests: int | None = None  # this tenant's bound; else the scenario's
    models: tuple[str, ...] | None = None  # else the scenario's
    background: bool = False  # runs until the other tenants are done, unbounded itself
    group: str | None = None  # the entry it came from, where one (``count``) made many

    @property
    def shape(self) -> RequestShape:
        return RequestShape(self.inputs, self.words, self.max_tokens)

    @property
    def mode(self) -> str:
        return "open" if self.rate is not None else "closed"


@dataclass(frozen=True)
class Configuration:
    """One way to serve the workload."""

    name: str
    kind: str
    peer: str | None = None
    tenants: tuple[str, ...] | None = None  # a subset of the scenario's, else all
    tiers: dict[str, str] = field(default_factory=dict)  # tenant -> tier, overriding
    config: dict[str, Any] = field(default_factory=dict)  # tessera config file contents
    args: tuple[str, ...] = ()  # more `tessera serve` arguments, or a peer script's
    memory_budget: str | None = None  # tessera's, else the scenario's


@dataclass(frozen=True)
class Step:
    """One measured step: closed-loop tenants' concurrency, or the open-loop
    tenants' rate together, where the scenario sweeps one; the popularity
    (``zipf`` exponent, None: uniform)."""

    concurrency: int | None = None
    rate: float | None = None
    zipf: float | None = None

    @property
    def popularity(self) -> str:
        return "uniform" if self.zipf is None else f"zipf {self.zipf:g}"


@dataclass(frozen=True)
class Scenario:
    name: str
    about: str
    models: tuple[str, ...]
    tenants: tuple[TenantLoad, ...]
    configurations: tuple[Configuration, ...]
    aliases: dict[str, str] = field(default_factory=dict)
    zipf: float | None = None
    memory_budget: str | None = None
    requests: int = 1000
    duration_s: float = 30.0
    warmup_requests: int = 0
    sweep: tuple[int, ...] = ()
    server_args: tuple[str, ...] = ()
    path: Path | None = None
    # The models, where made from a packaged one: perturbed copies, or heads over it.
    generated: ModelSet | HeadSet | None = None
    popularities: tuple[float | None, ...] = ()  # each in turn; else (zipf,)
    rates: tuple[float, ...] = ()
    prime: bool = False
    capacity_share: float = CAPACITY_SHARE

    def base_model(self, name: str) -> str:
        """The default model a served name stands for (itself unless an alias)."""
        return self.aliases.get(name, name)

    def steps(self) -> tuple[int | None, ...]:
        """Concurrency of the closed-loop tenants at each step; ``None``: as written."""
        return self.sweep or (None,)

    def plan(self) -> tuple[Step, ...]:
        """Every step, each popularity in turn: the concurrency sweep, or the rates."""
        out = []
        for zipf in self.popularities or (self.zipf,):
            if self.rates:
                out += [Step(rate=rate, zipf=zipf) for rate in self.rates]
            else:
                out += [Step(concurrency=c, zipf=zipf) for c in self.steps()]
        return tuple(out)

    def tenants_for(
        self, configuration: Configuration, step: int | None, rate: float | None = None
    ) -> list[TenantLoad]:
        """The configuration's tenants at a step: closed-loop ones at ``step``'s
        concurrency, open-loop ones at rates that add up to ``rate`` (in the
        proportions written), each where given."""
        chosen = [
            t
            for t in self.tenants
            if configuration.tenants is None
            or t.name in configuration.tenants
            or t.group in configuration.tenants
        ]
        written = sum(t.rate or 0.0 for t in chosen)
        out = []
        for tenant in chosen:
            tier = self.tier_of(configuration, tenant)
            concurrency = step if step is not None and tenant.rate is None else tenant.concurrency
            scaled = tenant.rate
            if rate is not None and tenant.rate is not None and written > 0:
                scaled = rate * tenant.rate / written
            out.append(replace(tenant, tier=tier, concurrency=concurrency, rate=scaled))
        return out

    def tier_of(self, configuration: Configuration, tenant: TenantLoad) -> str:
        """The tenant's tier in ``configuration``: as the configuration names
        it (or its group), else as the scenario does."""
        tiers = configuration.tiers
        return tiers.get(tenant.name, tiers.get(tenant.group or tenant.name, tenant.tier))

    def shortened(self, factor: float) -> Scenario:
        """The same scenario with its bounds scaled by ``factor`` (``--quick``)."""
        tenants = tuple(
            replace(t, requests=None if t.requests is None else max(1, int(t.requests * factor)))
            for t in self.tenants
        )
        return replace(
            self,
            tenants=tenants,
            requests=max(1, int(self.requests * factor)),
            duration_s=max(3.0, self.duration_s * factor),
            warmup_requests=int(self.warmup_requests * factor),
        )


def _unknown(kind: str, raw: dict[str, Any], known: set[str]) -> None:
    extra = sorted(set(raw) - known)
    if extra:
        raise ScenarioError(f"{kind}: unknown keys {extra} (known: {sorted(known)})")


def _tenants(raw: Any) -> list[TenantLoad]:
    """A tenant entry's tenants: itself, or with ``count: N`` N tenants alike
    (``NAME-1`` to ``NAME-N``, each at the entry's rate or concurrency and
    with its ``requests`` bound), reported together as group ``NAME``."""
    tenant = _tenant(raw)
    count = raw.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ScenarioError(f"tenant {tenant.name}: count must be a whole number, 1 or more")
    if count == 1:
        return [tenant]
    name = tenant.name
    return [replace(tenant, name=f"{name}-{i}", group=name) for i in range(1, count + 1)]


def _tenant(raw: Any) -> TenantLoad:
    if not isinstance(raw, dict) or "name" not in raw:
        raise ScenarioError(f"a tenant needs a mapping with a name, not {raw!r}")
    _unknown(f"tenant {raw['name']}", raw, _TENANT_KEYS)
    if (raw.get("rate") is None) == (raw.get("concurrency") is None):
        raise ScenarioError(f"tenant {raw['name']}: give exactly one of rate and concurrency")
    models = raw.get("models")
    return TenantLoad(
        name=str(raw["name"]),
        tier=str(raw.get("tier", "standard")),
        rate=None if raw.get("rate") is None else float(raw["rate"]),
        concurrency=None if raw.get("concurrency") is None else int(raw["concurrency"]),
        inputs=int(raw.get("inputs", 1)),
        words=None if raw.get("words") is None else int(raw["words"]),
        max_tokens=None if raw.get("max_tokens") is None else int(raw["max_tokens"]),
        requests=None if raw.get("requests") is None else int(raw["requests"]),
        models=None if models is None else tuple(str(m) for m in models),
        background=bool(raw.get("background", False)),
    )


def _configuration(raw: Any) -> Configuration:
    if isinstance(raw, str):
        raw = {"name": raw}
    if not isinstance(raw, dict) or "name" not in raw:
        raise ScenarioError(f"a configuration is a name or a mapping with one, not {raw!r}")
    _unknown(f"configuration {raw['name']}", raw, _CONFIG_KEYS)
    name = str(raw["name"])
    kind = str(raw.get("kind", name))
    if kind not in KINDS:
        raise ScenarioError(f"configuration {name}: kind {kind!r} is not one of {KINDS}")
    tenants = raw.get("tenants")
    return Configuration(
        name=name,
        kind=kind,
        peer=str(raw.get("peer", name)) if kind == "peer" else None,
        tenants=None if tenants is None else tuple(str(t) for t in tenants),
        tiers={str(k): str(v) for k, v in (raw.get("tiers") or {}).items()},
        config=dict(raw.get("config") or {}),
        args=tuple(str(a) for a in raw.get("args", ())),
        memory_budget=None if raw.get("memory_budget") is None else str(raw["memory_budget"]),
    )


def _zipf(raw: Any) -> float | None:
    """One popularity: ``uniform`` (or nothing), or ``{zipf: S}``."""
    if not raw or raw == "uniform":
        return None
    if isinstance(raw, dict) and set(raw) == {"zipf"}:
        return float(raw["zipf"])
    raise ScenarioError(f"a popularity is uniform or {{zipf: S}}, not {raw!r}")


def _generated(raw: Any, target: Any) -> ModelSet | HeadSet | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or "from" not in raw or "count" not in raw:
        raise ScenarioError("generated_models needs a mapping with from and count")
    _unknown("generated_models", raw, _GENERATED_KEYS)
    count = raw["count"]
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ScenarioError("generated_models: count must be a whole number, 1 or more")
    latency_target_ms = None if target is None else float(target)
    if raw.get("heads", False) not in (True, False):
        raise ScenarioError("generated_models: heads must be true or false")
    if raw.get("heads"):
        if "noise" in raw:
            raise ScenarioError("generated_models: heads are drawn, not perturbed (no noise)")
        prefix = str(raw.get("prefix", "head"))
        return HeadSet(str(raw["from"]), count, prefix, latency_target_ms)
    return ModelSet(
        base=str(raw["from"]),
        count=count,
        noise=float(raw.get("noise", 1e-3)),
        prefix=str(raw.get("prefix", "model")),
        latency_target_ms=None if target is None else float(target),
    )


def parse_scenario(raw: Any, path: Path | None = None) -> Scenario:
    if not isinstance(raw, dict) or "name" not in raw:
        raise ScenarioError("a scenario is a mapping with a name")
    _unknown(f"scenario {raw['name']}", raw, _SCENARIO_KEYS)
    popularity = raw.get("popularity")
    popularities = tuple(_zipf(p) for p in popularity) if isinstance(popularity, list) else ()
    generated = _generated(raw.get("generated_models"), raw.get("latency_target_ms"))
    if generated is not None and raw.get("models"):
        raise ScenarioError(f"{raw['name']}: give models or generated_models, not both")
    if generated is None and raw.get("latency_target_ms") is not None:
        raise ScenarioError(f"{raw['name']}: latency_target_ms is for generated_models' cards")
    models = generated.names() if generated is not None else raw.get("models", ())
    scenario = Scenario(
        name=str(raw["name"]),
        about=str(raw.get("about", "")).strip(),
        models=tuple(str(m) for m in models),
        aliases={str(k): str(v) for k, v in (raw.get("aliases") or {}).items()},
        zipf=popularities[0] if popularities else _zipf(popularity),
        tenants=tuple(t for entry in raw.get("tenants", ()) for t in _tenants(entry)),
        configurations=tuple(_configuration(c) for c in raw.get("configurations", ())),
        memory_budget=None if raw.get("memory_budget") is None else str(raw["memory_budget"]),
        requests=int(raw.get("requests", 1000)),
        duration_s=float(raw.get("duration_s", 30.0)),
        warmup_requests=int(raw.get("warmup_requests", 0)),
        sweep=tuple(int(c) for c in raw.get("sweep", ())),
        server_args=tuple(str(a) for a in raw.get("server_args", ())),
        path=path,
        generated=generated,
        popularities=popularities,
        rates=tuple(float(r) for r in raw.get("rates", ())),
        prime=bool(raw.get("prime", False)),
        capacity_share=float(raw.get("capacity_share", CAPACITY_SHARE)),
    )
    _check(scenario)
    return scenario


def _check(scenario: Scenario) -> None:
    if not scenario.models or not scenario.tenants or not scenario.configurations:
        raise ScenarioError(f"{scenario.name}: needs models, tenants and configurations")
    names = [c.name for c in scenario.configurations]
    if len(set(names)) != len(names):
        raise ScenarioError(f"{scenario.name}: configuration names repeat: {names}")
    tenant_names = {t.name for t in scenario.tenants}
    tenant_names |= {t.group for t in scenario.tenants if t.group is not None}
    for configuration in scenario.configurations:
        unknown = set(configuration.tenants or ()) | set(configuration.tiers)
        if unknown - tenant_names:
            raise ScenarioError(f"{configuration.name}: unknown tenants {unknown - tenant_names}")
    if not 0 < scenario.capacity_share <= 1:
        raise ScenarioError(f"{scenario.name}: capacity_share is a share in (0, 1]")
    if all(t.background for t in scenario.tenants):
        raise ScenarioError(f"{scenario.name}: every tenant is background; nothing bounds a step")
    if scenario.rates and scenario.sweep:
        raise ScenarioError(f"{scenario.name}: sweep concurrency or rates, not both")
    if scenario.rates and not any(t.rate for t in scenario.tenants):
        raise ScenarioError(f"{scenario.name}: rates need an open-loop tenant (one with a rate)")
    if any(r <= 0 for r in scenario.rates):
        raise ScenarioError(f"{scenario.name}: rates must be positive")


def load_scenario(path: Path) -> Scenario:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise ScenarioError(f"cannot read scenario {path}: {e}") from e
    return parse_scenario(raw, path)
