"""What a model card may make the server do, by where the card came from.

Design notes (the invariants the tests check):

- Cards on disk in the operator's repository folders are the operator's: they
  load as written, except that an engine's command line (``options.command``
  of ``runtime: external``) must be one the server's configuration allows
  (``engine_commands``); any other is refused when the card is read.
- A card registered over the admin API (``POST /admin/models``, a folder or a
  card sent as text) is the caller's: its folder and its weights must lie in a
  model repository root once resolved (symlinks followed), and it may name no
  executable, argument, environment or working folder (``PROCESS_KEYS``): the
  engine's command line is then the configuration's alone. The refusal never
  says whether a path outside the roots exists.
- Pickle files (joblib, ``.pkl``) run code as they load: they load only from
  a folder the configuration marks trusted (``trusted_pickle_dirs``), or from
  an installed Python package (its operator installed it), and never for a
  card registered over the API (``unpickle_allowed``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from tessera.errors import ConfigError, PermissionDeniedError

if TYPE_CHECKING:
    from tessera.repository.spec import ModelSpec

# Keys naming what a process runs: refused in a card registered over the API.
PROCESS_KEYS = ("command", "args", "env", "cwd")
# vLLM's ``options.model`` is an argument too (a hub id or any folder).
_EXTERNAL_KEYS = ("model",)
# The commands a card's options.command may name, per engine, by default:
# the engine's own (``runtimes/vllm.py``'s default).
DEFAULT_ENGINE_COMMANDS: Mapping[str, tuple[tuple[str, ...], ...]] = {
    "vllm": (("vllm", "serve"),),
}
PICKLE_RULE = (
    "pickle files (joblib, .pkl) load only from the folders trusted_pickle_dirs names"
    " in the server's configuration or from an installed package, never for a model"
    " registered over the API"
)


def expand_command(command: Iterable[object]) -> tuple[str, ...]:
    """A command line as it runs: ``{python}`` is this interpreter."""
    return tuple(str(a).replace("{python}", sys.executable) for a in command)


def parse_engine_commands(raw: object) -> dict[str, tuple[tuple[str, ...], ...]]:
    """``engine_commands`` of the config file: per engine, the command lines
    (each a list of strings) a card may name; the defaults when absent."""
    if raw is None:
        return dict(DEFAULT_ENGINE_COMMANDS)
    where = "engine_commands"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must map an engine to a list of commands, not {raw!r}")
    commands: dict[str, tuple[tuple[str, ...], ...]] = {}
    for engine, lines in raw.items():
        if not isinstance(lines, list) or not all(
            isinstance(line, list) and line and all(isinstance(a, str) and a for a in line)
            for line in lines
        ):
            raise ConfigError(f"{where}: {engine} must be a list of commands (lists of strings)")
        commands[str(engine)] = tuple(expand_command(line) for line in lines)
    return commands


def check_engine_command(
    spec: ModelSpec, allowed: Mapping[str, tuple[tuple[str, ...], ...]]
) -> None:
    """``ConfigError`` unless ``spec``'s ``options.command`` (if any) is one of
    the command lines its engine is allowed."""
    command = spec.options.get("command")
    if command is None:
        return
    if not isinstance(command, list | tuple):
        raise ConfigError(f"model {spec.name!r}: options.command must be a list of strings")
    if spec.runtime != "external" or expand_command(command) not in allowed.get(
        spec.engine or "", ()
    ):
        raise ConfigError(
            f"model {spec.name!r}: options.command {list(command)!r} is not among the"
            f" engine_commands the server's configuration allows for engine {spec.engine!r}"
        )


def check_api_card(spec: ModelSpec) -> None:
    """``PermissionDeniedError`` naming the first option of a card registered
    over the API that would choose what a process runs."""
    keys = PROCESS_KEYS + (_EXTERNAL_KEYS if spec.runtime == "external" else ())
    for key in keys:
        if key in spec.options:
            raise PermissionDeniedError(
                f"options.{key} is refused in a card registered over the API: engine"
                " command lines come from the server's configuration (engine_commands)"
            )


def within_roots(path: Path, roots: Iterable[Path]) -> Path | None:
    """``path`` resolved (symlinks followed), if it lies in one of ``roots``
    (resolved too); else None."""
    resolved = path.resolve()
    for root in roots:
        if resolved.is_relative_to(root.resolve()):
            return resolved
    return None


def unpickle_allowed(path: Path, spec: ModelSpec, trusted_dirs: Iterable[Path]) -> bool:
    """Whether the pickle file ``path`` of ``spec`` may be loaded (``PICKLE_RULE``)."""
    if spec.via_api:
        return False
    if spec.source.package is not None:
        from tessera.repository.spec import package_dir

        try:
            if within_roots(path, [package_dir(spec.source.package)]) is not None:
                return True
        except (FileNotFoundError, ModuleNotFoundError, ValueError):
            return False
    return within_roots(path, trusted_dirs) is not None
