"""The policy packages and the config import no heavy library.

Admission, scheduling, batching and residency decide in plain Python:
importing one of them in a fresh interpreter loads no
torch, numpy, onnxruntime, transformers, ray, and nothing of the HTTP side
(FastAPI, Starlette, uvicorn, Prometheus). Reading the config loads nothing
of the HTTP side or of the tenant store (SQLite) either. The drivers of shared
tenant state (psycopg, redis) load only where a gateway is configured to use
them. A failure names the chain of imports that loaded the library (from
``python -X importtime``).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

POLICY_PACKAGES = (
    "tessera.admission",
    "tessera.scheduling",
    "tessera.batching",
    "tessera.residency",
)
HTTP = frozenset({"fastapi", "starlette", "uvicorn", "prometheus_client"})
HEAVY = HTTP | {"torch", "numpy", "onnxruntime", "transformers", "ray", "psycopg", "redis"}


def fresh_import(module: str) -> tuple[set[str], list[tuple[int, str]]]:
    """The modules loaded by importing ``module`` in a new interpreter, and the
    import tree (depth, name) that ``-X importtime`` reports, children first."""
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    errors = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert done.returncode == 0, "\n".join(errors)
    tree = []
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1]
            tree.append((len(name) - len(name.lstrip()), name.strip()))
    return set(done.stdout.split()), tree


def import_chain(tree: list[tuple[int, str]], target: str) -> list[str]:
    """Who imported ``target`` first: its name, then each importer up to the root."""
    for i, (depth, name) in enumerate(tree):
        if name == target or name.startswith(target + "."):
            chain = [name]
            for later_depth, later in tree[i + 1 :]:
                if later_depth < depth:
                    chain.append(later)
                    depth = later_depth
            return chain
    return [target]


def loaded(modules: set[str], forbidden: frozenset[str]) -> list[str]:
    return sorted({m.split(".")[0] for m in modules} & forbidden)


def _check(module: str, forbidden: frozenset[str]) -> None:
    modules, tree = fresh_import(module)
    found = loaded(modules, forbidden)
    chains = [" <- ".join(import_chain(tree, name)) for name in found]
    assert not found, f"importing {module} loaded {found}:\n" + "\n".join(chains)


@pytest.mark.parametrize("package", POLICY_PACKAGES)
def test_policy_package_imports_no_heavy_library(package: str) -> None:
    _check(package, HEAVY)


def test_config_imports_nothing_of_the_http_side() -> None:
    _check("tessera.config", HTTP | {"sqlite3", "psycopg", "redis"})


def test_import_chain_names_who_loaded_a_module() -> None:
    tree = [(3, "numpy.core"), (2, "numpy"), (1, "tessera.runtimes.onnx"), (0, "tessera.x")]
    assert import_chain(tree, "numpy") == [
        "numpy.core",
        "numpy",
        "tessera.runtimes.onnx",
        "tessera.x",
    ]


def test_the_tenant_store_imports_its_postgresql_driver_only_when_configured() -> None:
    _check("tessera.tenants", frozenset({"psycopg", "redis"}))
