"""The deployment files start the server with flags it has, and probe routes it serves."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import typer
import yaml

from tessera import cli
from tessera.gateway.health import router as health_router

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def _serve_flags() -> set[str]:
    group: Any = typer.main.get_command(cli.app)
    command: Any = group.commands["serve"]
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}


def _check_command(argv: list[str]) -> None:
    assert argv[:2] == ["tessera", "serve"] or argv[0].endswith("/tessera"), argv
    flags = _serve_flags()
    for word in argv:
        if word.startswith("--"):
            assert word.split("=", 1)[0] in flags, f"tessera serve has no {word}"


def _manifests() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]
    return docs


def _container() -> dict[str, Any]:
    (workload,) = [d for d in _manifests() if d["kind"] in ("StatefulSet", "Deployment")]
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    assert isinstance(container, dict)
    return container


def test_the_kubernetes_command_uses_only_flags_tessera_serve_has() -> None:
    container = _container()
    _check_command([str(word) for word in container["command"]])


def test_the_kubernetes_probes_are_the_servers_probe_routes() -> None:
    container = _container()
    routes = {getattr(route, "path", None) for route in health_router.routes}
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["path"] in routes


def test_the_kubernetes_pod_asks_for_a_gpu_a_data_volume_and_a_scrape() -> None:
    (workload,) = [d for d in _manifests() if d["kind"] in ("StatefulSet", "Deployment")]
    template = workload["spec"]["template"]
    container = _container()
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    data_dir = container["command"][container["command"].index("--data-dir") + 1]
    assert data_dir in {m["mountPath"] for m in container["volumeMounts"]}
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) in {
        p["containerPort"] for p in container["ports"]
    }


def test_the_systemd_unit_uses_only_flags_tessera_serve_has() -> None:
    unit = (DEPLOY / "systemd" / "tessera.service").read_text(encoding="utf-8")
    (line,) = [x for x in unit.splitlines() if x.startswith("ExecStart=")]
    argv = shlex.split(line.removeprefix("ExecStart="))
    assert argv[1] == "serve"
    _check_command(argv)
