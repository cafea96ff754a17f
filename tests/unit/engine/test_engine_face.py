"""Nothing outside ``engine/`` reaches into the engine's parts: it reads
``Engine.snapshot()`` and calls the engine's few public methods."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# The engine's parts; a reader that needs one of these wants the snapshot.
PARTS = frozenset(
    {
        "residency",
        "host",
        "counters",
        "device",
        "executor",
        "admission",
        "predictors",
        "batchers",
        "loops",
        "intake",
        "lifecycle",
    }
)
SCANNED = ("src/tessera", "benchmarks", "tests")
OWN = ("src/tessera/engine", "tests/unit/engine")


def _names_engine(node: ast.expr) -> bool:
    """Whether ``node`` is an expression that names an engine (``engine``,
    ``self.engine``, ``app.state.engine``, ``tessera_engine``...)."""
    if isinstance(node, ast.Name):
        return "engine" in node.id.lower()
    if isinstance(node, ast.Attribute):
        return "engine" in node.attr.lower()
    return False


def reaches_into_engine(source: str) -> list[tuple[int, str]]:
    """(line, attribute) of every access to an engine part in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not _names_engine(node.value):
            continue
        if node.attr.lstrip("_") in PARTS:
            found.append((node.lineno, node.attr))
    return found


def test_no_module_outside_the_engine_reads_its_parts() -> None:
    offenders = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if relative.startswith(OWN):
                continue
            for line, attr in reaches_into_engine(path.read_text()):
                offenders.append(f"{relative}:{line}: .{attr}")
    assert offenders == [], "read engine.snapshot() instead:\n" + "\n".join(offenders)


def test_the_check_finds_each_way_in() -> None:
    source = (
        "engine.residency.stats()\n"
        "self.engine.counters['m']\n"
        "request.app.state.engine._host\n"
        "engine.snapshot().models\n"
        "spec.device\n"
    )
    assert sorted(reaches_into_engine(source)) == [(1, "residency"), (2, "counters"), (3, "_host")]
