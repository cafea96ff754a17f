"""A step's loads as the bench reports them (``runner.swap_figures``): the
last load of each model that loaded that way in the step, not of every
model that ever did (a step after an overloaded one would report its loads)."""

from __future__ import annotations

from typing import Any

from harness.deploy import Deployment
from harness.runner import swap_figures


def model(name: str, loads: int, host_loads: int, files_s: float, host_s: float) -> dict[str, Any]:
    return {
        "name": name,
        "loads": loads,
        "host_loads": host_loads,
        "files_load_s": files_s,
        "host_load_s": host_s,
    }


def server(used: int, *models: dict[str, Any]) -> dict[str, Any]:
    return {
        "loads_total": sum(m["loads"] for m in models),
        "host_loads_total": sum(m["host_loads"] for m in models),
        "host_used_bytes": used,
        "models": list(models),
    }


def test_a_steps_loads_are_those_of_the_models_that_loaded_in_it() -> None:
    deployment = Deployment("tessera-20", "tessera", [], {}, None)  # type: ignore[arg-type]
    before = {"a": server(0, model("m1", 3, 2, 0.9, 0.5), model("m2", 1, 0, 0.8, 0.0))}
    after = {
        "a": server(
            7,
            model("m1", 4, 3, 0.9, 0.002),  # back from the host tier in the step
            model("m2", 2, 0, 0.03, 0.0),  # from its files in the step
            model("m3", 1, 0, 0.12, 0.0),  # its first load
        )
    }
    figures = swap_figures(deployment, before, after, 0)
    assert figures["loads"] == 3
    assert figures["host_loads"] == 1
    assert figures["host_used_bytes"] == 7
    assert figures["from_host_last"]["p50_ms"] == 2.0
    assert figures["from_files_last"]["p50_ms"] in (30.0, 120.0)  # of m2 and m3, not m1's 0.9 s
    assert figures["from_files_last"]["p99_ms"] == 120.0
