"""Head sets (``harness.heads``): distinct, reproducible heads over the
packaged encoder, reused while intact; and the scenario that serves them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from harness.heads import RECIPE, SET_FILE, HeadSet, ensure_heads, head_labels
from harness.scenario import load_scenario
from tessera.repository import read_spec
from tessera.runtimes.heads import HEAD_FILE, LABELS_FILE

SCENARIOS = Path(__file__).resolve().parents[3] / "benchmarks" / "scenarios"


def make(tmp_path: Path, count: int = 3, made: list[tuple[str, bool]] | None = None) -> Path:
    heads = HeadSet("all-minilm-l6-v2", count, prefix="h", latency_target_ms=300)
    on_head = None if made is None else lambda name, wrote: made.append((name, wrote))
    return ensure_heads(heads, tmp_path / "root", on_head)


def test_every_head_is_a_distinct_card_over_the_packaged_encoder(tmp_path: Path) -> None:
    folder = make(tmp_path)

    described = json.loads((folder / SET_FILE).read_text())
    assert (Path(described["encoder"]) / "config.json").is_file()
    weights = []
    for index, name in enumerate(["h-000", "h-001", "h-002"]):
        spec = read_spec(folder / name)
        assert (spec.name, spec.adapter, spec.task.value) == (name, "encoder-head", "classify")
        assert spec.latency_target_ms == 300
        assert spec.option_path("encoder") == Path(described["encoder"])
        tensors = load_file(str(folder / name / HEAD_FILE))
        labels = json.loads((folder / name / LABELS_FILE).read_text())
        assert len(labels) == 2 + index
        assert tensors["weight"].shape == (len(labels), described["dims"])
        assert tensors["bias"].shape == (len(labels),)
        assert all(label.startswith(f"{name}-") for label in labels)
        assert len(set(labels)) == len(labels)
        weights.append(tensors["weight"][0])
    assert not np.allclose(weights[0], weights[1])


def test_heads_are_the_same_bytes_each_time_and_reused_while_intact(tmp_path: Path) -> None:
    first: list[tuple[str, bool]] = []
    folder = make(tmp_path, made=first)
    again = make(tmp_path.parent / (tmp_path.name + "-again"), count=2)
    assert [wrote for _, wrote in first] == [True, True, True]
    for name in ("h-000", "h-001"):
        ours, theirs = (f / name / HEAD_FILE for f in (folder, again))
        assert ours.read_bytes() == theirs.read_bytes()

    second: list[tuple[str, bool]] = []
    make(tmp_path, made=second)
    assert [wrote for _, wrote in second] == [False, False, False]

    (folder / "h-001" / HEAD_FILE).write_bytes(b"damaged")
    (folder / "h-002" / RECIPE).unlink()
    third: list[tuple[str, bool]] = []
    make(tmp_path, made=third)
    assert third == [("h-000", False), ("h-001", True), ("h-002", True)]


def test_a_head_s_labels_depend_on_its_index_alone() -> None:
    assert head_labels("x", 5) == head_labels("x", 5)
    assert len(head_labels("x", 6)) == 8
    assert len(head_labels("x", 7)) == 2


def test_thousand_heads_spreads_traffic_over_a_thousand_heads_or_sends_it_to_one() -> None:
    scenario = load_scenario(SCENARIOS / "thousand-heads.yaml")

    assert isinstance(scenario.generated, HeadSet)
    assert (scenario.generated.count, scenario.models[0], scenario.models[-1]) == (
        1000,
        "head-000",
        "head-999",
    )
    by_name = {c.name: c for c in scenario.configurations}
    assert by_name["tessera-per-model"].config == {"encoder_batching": False}
    assert by_name["tessera-across-models"].config == {}
    spread = scenario.tenants_for(by_name["tessera-across-models"], None, rate=100)
    single = scenario.tenants_for(by_name["tessera-one-head"], None, rate=100)
    assert sum(t.rate or 0 for t in spread) == sum(t.rate or 0 for t in single) == 100
    assert all(t.models is None for t in spread)
    assert all(t.models == ("head-000",) for t in single)
    peers = {c.name: c for c in scenario.configurations if c.kind == "peer"}
    assert {c.peer for c in peers.values()} == {"rayserve-heads"}
    assert peers["ray-whole-models"].args[:2] == ("--mode", "whole")
    assert peers["ray-expert"].args == ("--mode", "expert")


@pytest.mark.parametrize(
    ("raw", "message"),
    [({"heads": "yes"}, "heads must be true or false"), ({"noise": 0.1}, "no noise")],
)
def test_bad_head_sets_are_refused(raw: dict[str, object], message: str) -> None:
    from harness.scenario import ScenarioError, parse_scenario

    generated = {"from": "all-minilm-l6-v2", "count": 3, "heads": True, **raw}
    scenario = {
        "name": "s",
        "generated_models": generated,
        "tenants": [{"name": "t", "rate": 1}],
        "configurations": ["tessera"],
    }
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(scenario)
