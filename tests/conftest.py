"""Shared test setup: models are loaded offline only; a test runs in the event
loop of the fixtures it shares with its module."""

from __future__ import annotations

import inspect
import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that uses an async fixture made for its whole module (declared
    with ``pytest_asyncio.fixture(scope="module", loop_scope="module")``: an
    engine its tests share) runs in that module's event loop, where the
    fixture's objects live. Such a test may not also use an async fixture of
    its own loop (its objects would live in another loop): a usage error."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        shared, own = [], []
        for name, definitions in info.name2fixturedefs.items():
            func = definitions[-1].func
            if not (inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func)):
                continue
            (shared if getattr(func, "_loop_scope", None) == "module" else own).append(name)
        if not shared:
            continue
        if own:
            raise pytest.UsageError(
                f"{item.nodeid}: module-loop fixtures {shared} beside own-loop fixtures {own}"
            )
        item.add_marker(pytest.mark.asyncio(loop_scope="module"), append=False)
