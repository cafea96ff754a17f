"""Scenario files: parsing, checks, steps, and the shipped scenarios."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness.figures import within_capacity
from harness.scenario import (
    ScenarioError,
    load_scenario,
    parse_scenario,
)
from tessera.repository import default_repository_path, read_spec

SCENARIOS = Path(__file__).resolve().parents[3] / "benchmarks" / "scenarios"


def minimal(**extra: Any) -> dict[str, Any]:
    return {
        "name": "s",
        "models": ["all-minilm-l6-v2"],
        "tenants": [{"name": "a", "concurrency": 2}],
        "configurations": ["tessera"],
        **extra,
    }


def test_minimal_scenario_takes_defaults() -> None:
    scenario = parse_scenario(minimal())
    assert scenario.configurations[0].kind == "tessera"
    assert scenario.tenants[0].mode == "closed"
    assert scenario.steps() == (None,)
    assert scenario.zipf is None


def test_sweep_sets_closed_loop_concurrency_but_not_open_loop() -> None:
    raw = minimal(
        sweep=[1, 8],
        tenants=[{"name": "a", "concurrency": 2}, {"name": "b", "rate": 5}],
    )
    scenario = parse_scenario(raw)
    tenants = scenario.tenants_for(scenario.configurations[0], 8)
    assert [(t.name, t.concurrency, t.rate) for t in tenants] == [("a", 8, None), ("b", None, 5.0)]


def test_configuration_picks_tenants_and_overrides_tiers() -> None:
    raw = minimal(
        tenants=[{"name": "a", "rate": 1}, {"name": "b", "concurrency": 1, "background": True}],
        configurations=[{"name": "x", "kind": "fifo", "tenants": ["a"], "tiers": {"a": "vip"}}],
    )
    scenario = parse_scenario(raw)
    tenants = scenario.tenants_for(scenario.configurations[0], None)
    assert [(t.name, t.tier) for t in tenants] == [("a", "vip")]


def test_peer_configuration_is_named_by_its_peer() -> None:
    scenario = parse_scenario(minimal(configurations=[{"name": "pytriton", "kind": "peer"}]))
    assert scenario.configurations[0].peer == "pytriton"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (minimal(tenants=[{"name": "a"}]), "exactly one of rate and concurrency"),
        (minimal(tenants=[{"name": "a", "rate": 1, "concurrency": 2}]), "exactly one"),
        (minimal(configurations=["nope"]), "kind 'nope'"),
        (minimal(configurations=["tessera", "tessera"]), "repeat"),
        (minimal(colour="blue"), "unknown keys ['colour']"),
        (minimal(tenants=[{"name": "a", "rate": 1, "speed": 2}]), "unknown keys ['speed']"),
        (minimal(configurations=[{"name": "t", "kind": "tessera", "tenants": ["z"]}]), "{'z'}"),
        (minimal(tenants=[{"name": "a", "rate": 1, "background": True}]), "background"),
        (minimal(models=[]), "needs models"),
        ([1, 2], "a mapping with a name"),
    ],
)
def test_bad_scenarios_are_refused_with_the_reason(raw: Any, message: str) -> None:
    with pytest.raises(ScenarioError, match=message.replace("[", r"\[").replace("(", r"\(")):
        parse_scenario(raw)


def test_unreadable_file_is_a_scenario_error(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("name: [unclosed\n")
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path / "bad.yaml")
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path / "missing.yaml")


def test_shortened_scales_every_bound() -> None:
    scenario = parse_scenario(minimal(requests=1000, duration_s=40, warmup_requests=100))
    short = scenario.shortened(0.25)
    assert (short.requests, short.duration_s, short.warmup_requests) == (250, 10.0, 25)


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_scenarios_parse_and_name_served_models(path: Path) -> None:
    scenario = load_scenario(path)
    assert scenario.name == path.stem
    if scenario.generated is not None:  # made from a default model, with their own target
        read_spec(default_repository_path() / scenario.generated.base)
        assert scenario.generated.latency_target_ms is not None
        return
    for model in scenario.models:
        spec = read_spec(default_repository_path() / scenario.base_model(model))
        assert spec.latency_target_ms is not None


def test_the_issue_scenarios_are_shipped() -> None:
    names = {p.stem for p in SCENARIOS.glob("*.yaml")}
    assert {"embed-saturation", "mixed-zipf", "noisy-neighbor", "shared-vs-dedicated"} <= names


def test_a_tenant_entry_with_a_count_is_that_many_tenants_of_one_group() -> None:
    raw = minimal(
        tenants=[
            {"name": "user", "count": 3, "rate": 0.5, "requests": 4},
            {"name": "flood", "concurrency": 2, "background": True},
        ],
        configurations=[
            {"name": "alone", "kind": "tessera", "tenants": ["user"]},
            {"name": "vip", "kind": "tessera", "tiers": {"user": "vip", "user-2": "standard"}},
        ],
    )
    scenario = parse_scenario(raw)
    users = [t for t in scenario.tenants if t.group == "user"]
    assert [t.name for t in users] == ["user-1", "user-2", "user-3"]
    assert all((t.rate, t.requests) == (0.5, 4) for t in users)
    alone, vip = scenario.configurations
    assert [t.name for t in scenario.tenants_for(alone, None)] == ["user-1", "user-2", "user-3"]
    tiers = {t.name: t.tier for t in scenario.tenants_for(vip, None)}
    assert tiers == {"user-1": "vip", "user-2": "standard", "user-3": "vip", "flood": "standard"}


@pytest.mark.parametrize("count", [0, -1, 1.5, True, "3"])
def test_a_count_is_a_whole_number_of_one_or_more(count: object) -> None:
    with pytest.raises(ScenarioError, match="count"):
        parse_scenario(minimal(tenants=[{"name": "a", "concurrency": 1, "count": count}]))


def test_a_tenants_request_shape_reaches_its_requests() -> None:
    """``words`` makes long texts, ``inputs`` several OCR pages (over KServe v2,
    which takes them in one request), ``max_tokens`` a chat's length."""
    from harness.deploy import TesseraProtocol
    from harness.scenario import RequestShape

    scenario = parse_scenario(
        minimal(tenants=[{"name": "a", "concurrency": 2, "inputs": 3, "words": 100}])
    )
    (load,) = scenario.tenants
    assert load.shape == RequestShape(3, 100, None)
    tasks = {"e": "embedding", "o": "ocr", "c": "generate"}
    protocol = TesseraProtocol(tasks)
    path, body = protocol.call("e", 0, RequestShape(3, 100))
    assert path == "/v1/embeddings"
    assert len(body["input"]) == 3
    assert all(100 <= len(text.split()) < 130 for text in body["input"])
    path, body = protocol.call("o", 0, RequestShape(4))
    assert path == "/v2/models/o/infer"
    assert body["inputs"][0]["shape"] == [4]
    assert protocol.call("o", 0, RequestShape())[0] == "/v1/ocr"
    assert protocol.call("c", 0, RequestShape(max_tokens=64))[1]["max_tokens"] == 64
    assert protocol.call("c", 0, RequestShape())[1]["max_tokens"] == 8


def test_hundred_models_serves_generated_models_at_rates_under_each_popularity() -> None:
    from harness.deploy import card_folder
    from harness.perturbed import bench_models_dir

    scenario = load_scenario(SCENARIOS / "hundred-models.yaml")
    assert scenario.generated is not None
    assert (scenario.generated.base, scenario.generated.count) == ("all-minilm-l6-v2", 100)
    assert scenario.generated.latency_target_ms == 500
    assert scenario.models[0] == "minilm-000"
    assert scenario.models[-1] == "minilm-099"
    plan = scenario.plan()
    assert [(s.rate, s.popularity) for s in plan[:6]] == [
        (5, "uniform"), (10, "uniform"), (15, "uniform"), (25, "uniform"), (40, "uniform"),
        (5, "zipf 1.1"),
    ]  # fmt: skip
    assert len([t for t in scenario.tenants if t.rate]) == 4
    by_name = {c.name: c for c in scenario.configurations}
    assert by_name["tessera-20"].memory_budget == by_name["tessera-20-no-host-tier"].memory_budget
    assert by_name["tessera-20-no-host-tier"].config == {"host_memory_budget": 0}
    assert {c.peer for c in scenario.configurations if c.kind == "peer"} == {"rayserve"}
    assert by_name["ray-2x10"].args == ("--replicas", "2", "--models-per-replica", "10")
    root = scenario.generated.folder(bench_models_dir())
    assert card_folder(scenario, "minilm-042") == root / "minilm-042"


def test_a_rate_step_splits_its_rate_among_open_loop_tenants_as_written() -> None:
    raw = minimal(
        rates=[5, 20],
        tenants=[
            {"name": "a", "rate": 3},
            {"name": "b", "rate": 1},
            {"name": "c", "concurrency": 2},
        ],
    )
    scenario = parse_scenario(raw)
    assert [s.rate for s in scenario.plan()] == [5, 20]
    tenants = scenario.tenants_for(scenario.configurations[0], None, 20)
    assert [(t.name, t.rate, t.concurrency) for t in tenants] == [
        ("a", 15.0, None), ("b", 5.0, None), ("c", None, 2)
    ]  # fmt: skip
    as_written = scenario.tenants_for(scenario.configurations[0], None)
    assert [t.rate for t in as_written] == [3.0, 1.0, None]


def test_popularity_as_a_list_runs_every_step_under_each() -> None:
    scenario = parse_scenario(minimal(sweep=[1, 4], popularity=["uniform", {"zipf": 1.1}]))
    assert [(s.concurrency, s.zipf) for s in scenario.plan()] == [
        (1, None), (4, None), (1, 1.1), (4, 1.1)
    ]  # fmt: skip
    assert scenario.zipf is None  # the first, for what reads one
    assert parse_scenario(minimal(popularity={"zipf": 1.2})).plan()[0].zipf == 1.2


def test_a_configuration_may_set_its_own_budget() -> None:
    raw = minimal(memory_budget="1GiB", configurations=[{"name": "t", "kind": "tessera",
                                                         "memory_budget": "2GiB"}])  # fmt: skip
    assert parse_scenario(raw).configurations[0].memory_budget == "2GiB"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"rates": [5], "sweep": [1]}, "not both"),
        ({"rates": [5]}, "open-loop tenant"),
        ({"rates": [0], "tenants": [{"name": "a", "rate": 1}]}, "positive"),
        ({"popularity": ["pareto"]}, "uniform or"),
        ({"generated_models": {"from": "all-minilm-l6-v2", "count": 3}}, "not both"),
        ({"generated_models": {"from": "x"}, "models": []}, "from and count"),
        ({"generated_models": {"from": "x", "count": 0}, "models": []}, "count"),
        ({"generated_models": {"from": "x", "count": 2, "seed": 1}, "models": []}, "seed"),
        ({"latency_target_ms": 500}, "generated_models' cards"),
    ],
)
def test_bad_rates_popularities_and_generated_models_are_refused(
    extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(minimal(**extra))


def test_generated_models_take_the_place_of_models() -> None:
    raw = minimal(models=[], generated_models={"from": "all-minilm-l6-v2", "count": 2})
    scenario = parse_scenario(raw)
    assert scenario.models == ("model-000", "model-001")
    assert scenario.generated is not None
    assert scenario.generated.noise == 1e-3


def test_a_written_repository_finds_packaged_and_generated_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A packaged card's source stays its package's; a generated card's folder
    source points at the generated folder, wherever the copy is written."""
    from harness.deploy import _write_repository

    monkeypatch.setenv("TESSERA_BENCH_MODELS", str(tmp_path / "models"))
    packaged = parse_scenario(minimal())
    repo = _write_repository(tmp_path / "a", packaged, list(packaged.models))
    spec = read_spec(repo / "all-minilm-l6-v2")
    assert (
        spec.resolve_source()
        == read_spec(default_repository_path() / "all-minilm-l6-v2").resolve_source()
    )
    raw = minimal(models=[], generated_models={"from": "all-minilm-l6-v2", "count": 1})
    generated = parse_scenario(raw)
    assert generated.generated is not None
    card = generated.generated.folder(tmp_path / "models") / "model-000"
    card.mkdir(parents=True)
    (card / "model.yaml").write_text(
        "name: model-000\ntask: embedding\nruntime: torch\nadapter: hf-encoder\n"
        "source: {path: .}\nlatency_target_ms: 500\n"
    )
    repo = _write_repository(tmp_path / "b", generated, ["model-000"])
    assert read_spec(repo / "model-000").resolve_source() == card


def test_capacity_share_sets_the_share_within_target_a_rate_must_hold() -> None:
    strict = parse_scenario(minimal(capacity_share=0.99))
    assert parse_scenario(minimal()).capacity_share == 0.95
    step = {"failed": 0, "within_target_share": 0.97}
    assert within_capacity(step, parse_scenario(minimal()).capacity_share)
    assert not within_capacity(step, strict.capacity_share)
    assert not within_capacity({"failed": 1, "within_target_share": 1.0}, strict.capacity_share)
    with pytest.raises(ScenarioError, match="capacity_share"):
        parse_scenario(minimal(capacity_share=1.5))
