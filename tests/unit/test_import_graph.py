"""The import graph of ``src/tessera`` has no cycles.

The graph is read from each module's AST, not by importing it, so a module
that needs torch is walked like any other. Every ``import x`` and
``from x import y`` that names a ``tessera`` module is an arrow, wherever it
stands: at module level, in a class body, or inside a function (a deferred
import is still a dependency, and deferring is the usual way a cycle hides).

Imports under ``if TYPE_CHECKING:`` count too. They never run, so they cannot
break an import, but they are arrows of the design all the same: a package
that names another's types depends on it. A module that needs a type from a
package above it moves the type down instead (to a low module both import).

Two rules, each failing with the cycle printed:

- between packages (``tessera.X`` for ``src/tessera/X/`` or
  ``src/tessera/X.py``): no cycle;
- between the modules of one package: no cycle (a package's ``__init__`` is
  the node ``tessera.X`` itself, so a submodule that imports from its own
  package's ``__init__`` while that ``__init__`` imports it is a cycle).

``ALLOWED_CYCLES`` names cycles that are known and owned by other work, each
with its reason; an entry that no longer matches a cycle fails the test, so it
is removed when the work lands.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
ROOT = "tessera"

# Known cycles owned by work in progress: the nodes of the cycle (all of its
# strongly connected component) -> why it is still allowed and who removes it,
# e.g. ``frozenset({"tessera.bench", "tessera.benchmark"}): "the harness moves
# to benchmarks/"``. Empty: the tree has no cycle.
ALLOWED_CYCLES: Mapping[frozenset[str], str] = {}


@dataclass(frozen=True, slots=True)
class Arrow:
    """One import: ``source`` imports ``target`` at ``line``."""

    source: str
    target: str
    line: int
    where: str  # "module", "function" or "TYPE_CHECKING"


def module_names(src: Path = SRC) -> dict[str, Path]:
    """Every module under ``src/tessera``, by dotted name (a package by its own name)."""
    names: dict[str, Path] = {}
    for path in sorted((src / ROOT).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    node: ast.AST, where: str = "module"
) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement, in functions, classes and TYPE_CHECKING blocks too,
    with where it stands."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node, where
        return
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        where = "function"
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        for statement in node.body:
            yield from _imports(statement, "TYPE_CHECKING")
        for statement in node.orelse:
            yield from _imports(statement, where)
        return
    for child in ast.iter_child_nodes(node):
        yield from _imports(child, where)


def _resolve_from(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def arrows(modules: Mapping[str, Path]) -> list[Arrow]:
    """The arrows between ``tessera`` modules, each to the module it names.

    ``from a.b import c`` points to ``a.b.c`` where that is a module, else to
    ``a.b``; ``import a.b.c`` points to ``a.b.c``.
    """
    found: list[Arrow] = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node, where in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve_from(node, name, is_package)
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            for target in targets:
                if target in modules and target != name:
                    found.append(Arrow(name, target, node.lineno, where))
    return found


def package_of(module: str) -> str:
    """``tessera.X`` for any module under ``tessera.X`` (``tessera`` for itself)."""
    return ".".join(module.split(".")[:2])


def _components(edges: Mapping[str, Mapping[str, Arrow]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(edges.get(node, {})):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component: list[str] = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return components


def _shortest_cycle(edges: Mapping[str, Mapping[str, Arrow]], component: list[str]) -> list[str]:
    """A shortest closed path through the first node of a component (breadth first)."""
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for succ in sorted(edges.get(node, {})):
                if succ == start:
                    return [*paths[node], start]
                if succ in component and succ not in paths:
                    paths[succ] = [*paths[node], succ]
                    following.append(succ)
        frontier = following
    raise AssertionError(f"{component} is not a cycle")


@dataclass(frozen=True, slots=True)
class Cycle:
    """Nodes that reach each other through imports, and one closed path among them."""

    nodes: frozenset[str]
    path: tuple[str, ...]
    arrows: tuple[Arrow, ...]

    def __str__(self) -> str:
        lines = [" -> ".join(self.path)]
        lines += [f"    {a.source}:{a.line} imports {a.target} ({a.where})" for a in self.arrows]
        if len(self.nodes) > len(self.path) - 1:
            lines.append(f"    (and through {', '.join(sorted(self.nodes - set(self.path)))})")
        return "\n".join(lines)


def find_cycles(found: list[Arrow], node_of: Callable[[str], str] = str) -> list[Cycle]:
    """The cycles of the graph whose nodes are ``node_of(module)``."""
    edges: dict[str, dict[str, Arrow]] = {}
    for arrow in found:
        a, b = node_of(arrow.source), node_of(arrow.target)
        if a != b:
            edges.setdefault(a, {}).setdefault(b, arrow)
    cycles = []
    for component in _components(edges):
        path = _shortest_cycle(edges, component)
        steps = tuple(edges[a][b] for a, b in itertools.pairwise(path))
        cycles.append(Cycle(frozenset(component), tuple(path), steps))
    return cycles


def package_cycles(found: list[Arrow]) -> list[Cycle]:
    """Cycles between ``tessera.X`` packages (and top-level modules)."""
    return find_cycles(found, package_of)


def module_cycles(found: list[Arrow]) -> list[Cycle]:
    """Cycles between the modules of one package."""
    return find_cycles([a for a in found if package_of(a.source) == package_of(a.target)])


@pytest.fixture(scope="module")
def found() -> list[Arrow]:
    return arrows(module_names())


def _fail_on(cycles: list[Cycle], what: str) -> None:
    left = [str(c) for c in cycles if c.nodes not in ALLOWED_CYCLES]
    assert not left, f"import cycles {what}:\n" + "\n".join(left)


def test_no_cycle_between_packages(found: list[Arrow]) -> None:
    _fail_on(package_cycles(found), "between packages")


def test_no_cycle_between_modules_of_a_package(found: list[Arrow]) -> None:
    _fail_on(module_cycles(found), "inside a package")


def test_allowed_cycles_still_exist(found: list[Arrow]) -> None:
    present = {c.nodes for c in [*package_cycles(found), *module_cycles(found)]}
    stale = [sorted(nodes) for nodes in ALLOWED_CYCLES if nodes not in present]
    assert not stale, f"these cycles are gone (or changed): update ALLOWED_CYCLES: {stale}"


def test_the_walk_covers_the_tree(found: list[Arrow]) -> None:
    sources = {a.source for a in found}
    assert {"tessera.residency.manager", "tessera.engine.engine", "tessera.cli"} <= sources
    pairs = {(a.source, a.target) for a in found}
    assert ("tessera.residency.table", "tessera.footprint") in pairs


def test_the_walk_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The walker finds imports in functions and under TYPE_CHECKING, and relative ones."""
    pkg = tmp_path / ROOT
    (pkg / "a").mkdir(parents=True)
    (pkg / "b").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "b" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tessera.b import y\n"
    )
    (pkg / "a" / "z.py").write_text("from . import x\n")
    (pkg / "b" / "y.py").write_text("def f():\n    import tessera.a.z\n")
    found = arrows(module_names(tmp_path))
    assert {(a.source, a.target, a.where) for a in found} == {
        ("tessera.a.x", "tessera.b.y", "TYPE_CHECKING"),
        ("tessera.a.z", "tessera.a.x", "module"),
        ("tessera.b.y", "tessera.a.z", "function"),
    }
    assert [c.nodes for c in package_cycles(found)] == [frozenset({"tessera.a", "tessera.b"})]
