"""Scenario files: parsing, checks, steps, and the shipped scenarios."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

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
