"""Watching model repository folders for new models and versions (opt-in).

With ``watch_repository: true`` the server polls the folders given with
``--model-repository`` (never the default models shipped inside tessera)
every ``watch_interval_s``. A model folder whose shape changed since the
server last acted on it (a model folder or a version folder appeared or went,
a ``model.yaml`` changed) is handed to the engine's ``add_model``, which rolls
out the versions its policy now serves and retires those it no longer does:
the same path as ``POST /admin/models``.

A folder is acted on only once two polls in a row saw it the same: a version
folder still being copied in is left alone until the copy is done (Triton's
poll mode has the same caveat, and leaves it to the operator). A model folder
that disappears is not retired: ``DELETE /admin/models/{name}`` does that.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

# Each entry: a path under the model folder and its modification time (ns).
Signature = tuple[tuple[str, int], ...]


def signature(model_dir: Path) -> Signature:
    """What a model folder serves from: its ``model.yaml`` and each version
    folder with its own ``model.yaml``, with their modification times."""
    entries: list[tuple[str, int]] = []
    card = model_dir / "model.yaml"
    if card.is_file():
        entries.append(("model.yaml", card.stat().st_mtime_ns))
    for child in sorted(model_dir.iterdir()):
        if child.is_dir() and child.name.isdecimal():
            entries.append((child.name, child.stat().st_mtime_ns))
            own = child / "model.yaml"
            if own.is_file():
                entries.append((f"{child.name}/model.yaml", own.stat().st_mtime_ns))
    return tuple(entries)


class RepositoryWatcher:
    """Polls repository folders; ``poll`` returns the model folders to act on.

    The state at construction is taken as served (the server read it at start)."""

    def __init__(self, roots: Iterable[Path]) -> None:
        self._roots = tuple(roots)
        self._served = self._scan()
        self._pending: dict[Path, Signature] = {}

    def _scan(self) -> dict[Path, Signature]:
        found = {}
        for root in self._roots:
            if not root.is_dir():
                continue
            for model_dir in sorted(root.iterdir()):
                if (model_dir / "model.yaml").is_file():
                    found[model_dir] = signature(model_dir)
        return found

    def poll(self) -> list[Path]:
        """The model folders that changed since they were last served and have
        stayed the same since the previous poll; they count as served now."""
        ready = []
        current = self._scan()
        for folder, seen in current.items():
            if self._served.get(folder) == seen:
                self._pending.pop(folder, None)
            elif self._pending.get(folder) == seen:
                del self._pending[folder]
                self._served[folder] = seen
                ready.append(folder)
            else:
                self._pending[folder] = seen
        for folder in set(self._pending) - set(current):
            del self._pending[folder]
        return ready
