"""Write docs/configuration.md: every server configuration key, from the code.

The keys are the ones ``tessera.config.build_config`` accepts; each key's type
and default come from the config dataclasses as ``build_config({}, {})``
fills them, its flag from the ``tessera serve`` and ``tessera cluster``
parsers (each flag is given alone and the key it sets is read back), and
its description from the commented example at the top of
``src/tessera/config.py``. A key without a description there is an error,
so that the page cannot silently fall behind the code.

    python scripts/config_reference.py          # rewrite docs/configuration.md
    python scripts/config_reference.py --check  # exit 1 if it is out of date
"""

from __future__ import annotations

import dataclasses
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

import typer

from tessera import cli, config
from tessera.cluster.routing import RoutingConfig
from tessera.tenants import cli as tenants_cli
from tessera.tenants import store

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"
# The one key the server also reads from the environment (store.load_secret).
ENVIRONMENT = {"key_secret_file": f"`{store.SECRET_ENV}` (the secret itself, hex; wins)"}


class ReferenceError(Exception):
    """The code and its documentation disagree."""


def config_keys() -> list[str]:
    """Every top-level key a config file may hold."""
    return sorted(config._SERVER_KEYS | config._ENGINE_KEYS)


def described_keys() -> dict[str, str]:
    """Each key's comment in config.py's example, by key (``cluster_routing.*``
    for the router's), continuation lines joined."""
    doc = config.__doc__ or ""
    found: dict[str, str] = {}
    current: str | None = None
    parent: str | None = None
    for line in doc.splitlines():
        entry = re.match(r"^( {4,})([a-z0-9_]+):(.*)$", line)
        if entry:
            indent, key, rest = len(entry.group(1)), entry.group(2), entry.group(3)
            if indent == 4:
                parent, current = key, key
            elif parent == "cluster_routing":
                current = f"cluster_routing.{key}"
            else:
                current = None  # an example entry inside a mapping (tiers, engine_commands)
                continue
            comment = rest.split("#", 1)[1].strip() if "#" in rest else ""
            found[current] = comment
            continue
        more = re.match(r"^ {8,}# ?(.*)$", line)
        if more and current is not None:
            found[current] = f"{found[current]} {more.group(1).strip()}".strip()
    return found


def _field(obj: Any, name: str) -> tuple[str, Any] | None:
    """The annotation and value of ``name`` on a config dataclass, if it has one."""
    hints = typing.get_type_hints(type(obj), vars(sys.modules[type(obj).__module__]))
    if name in hints:
        return _type_name(hints[name]), getattr(obj, name)
    return None


def _type_name(hint: Any) -> str:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return " | ".join(_type_name(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    origin = typing.get_origin(hint)
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(hint) if a is not Ellipsis)
        return f"{origin.__name__}[{args}]"
    return str(getattr(hint, "__name__", hint))


def type_and_default(key: str, defaults: config.ServerConfig) -> tuple[str, str]:
    """A key's type and its default, read from where build_config puts it."""
    holders = (defaults, defaults.engine, defaults.image_limits)
    for holder in holders:
        found = _field(holder, key)
        if found is not None:
            return found[0], _shown(found[1])
    for suffix, source, scale, unit in (
        ("_ms", "_s", 1000.0, "ms"),
        ("_days", "_s", 1 / 86400, "days"),
        ("", "_bytes", 1.0, "bytes or a size (700MiB)"),
    ):
        if not key.endswith(suffix):
            continue
        name = key[: len(key) - len(suffix)] + source if suffix else key + source
        for holder in holders:
            found = _field(holder, name)
            if found is not None:
                value = found[1]
                kind = found[0].replace("float", unit).replace("int", unit)
                return kind, _shown(value * scale if isinstance(value, int | float) else value)
    raise ReferenceError(f"no config field holds {key!r}: teach scripts/config_reference.py")


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    if isinstance(value, dict):
        return f"{len(value)} entries"
    return str(value)


def _sample(param: Any) -> list[str]:
    # "3" parses as every option type here: a number, a string, a path.
    return [param.opts[0]] if param.is_flag else [param.opts[0], "3"]


def flags(command_name: str) -> dict[str, str]:
    """The config key each option of ``tessera COMMAND`` sets, by giving each alone."""
    # typer's own click: read by duck type, not by class.
    group: Any = typer.main.get_command(cli.app)
    command: Any = group.commands[command_name]
    seen: dict[str, Any] = {}

    def capture(path: Path | None, **overrides: object) -> config.ServerConfig:
        seen.update(overrides)
        return config.ServerConfig()

    found: dict[str, str] = {}
    real_config, real_serve = cli._config, cli._serve
    cli._config = capture  # type: ignore[assignment]
    cli._serve = lambda *a, **k: None
    try:
        for param in command.params:
            if param.param_type_name != "option" or param.name in ("config", "log_level"):
                continue
            seen.clear()
            command.main([], standalone_mode=False)
            baseline = dict(seen)
            seen.clear()
            command.main(_sample(param), standalone_mode=False)
            changed = [k for k, v in seen.items() if v is not None and baseline.get(k) != v]
            for key in changed:
                found[key] = param.opts[0]
    finally:
        cli._config, cli._serve = real_config, real_serve
    return found


def render() -> str:
    descriptions = described_keys()
    defaults = config.build_config({}, {})
    serve_flags = flags("serve")
    cluster_flags = flags("cluster")
    keys = config_keys()
    missing = [k for k in keys if not descriptions.get(k)]
    stale = [k for k in descriptions if "." not in k and k not in keys]
    if missing or stale:
        raise ReferenceError(
            f"src/tessera/config.py's example: keys not described {missing},"
            f" described but not accepted {stale}"
        )
    for key in set(serve_flags) | set(cluster_flags):
        if key not in keys:
            raise ReferenceError(f"a flag sets {key!r}, which is not a config key")
    rows = []
    for key in keys:
        if key == "cluster_routing":
            kind, default = "mapping", "see below"
        else:
            kind, default = type_and_default(key, defaults)
        cli_flags = []
        if key in serve_flags:
            cli_flags.append(f"`serve {serve_flags[key]}`")
        if key in cluster_flags:
            cli_flags.append(f"`cluster {cluster_flags[key]}`")
        rows.append(
            f"| `{key}` | {_cell(kind)} | `{default}` | {'<br>'.join(cli_flags) or '-'}"
            f" | {ENVIRONMENT.get(key, '-')} | {_cell(descriptions[key])} |"
        )
    routing_rows = []
    for field in dataclasses.fields(RoutingConfig):
        name = f"cluster_routing.{field.name}"
        if name not in descriptions:
            raise ReferenceError(f"src/tessera/config.py's example does not show {name}")
        kind = _cell(_type_name(field.type))
        routing_rows.append(f"| `{name}` | {kind} | `{_shown(field.default)}` |")
    return TEMPLATE.format(
        count=len(keys),
        store_env=tenants_cli.STORE_ENV,
        secret_file_env=tenants_cli.SECRET_FILE_ENV,
        rows="\n".join(rows),
        routing="\n".join(routing_rows),
    )


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;") or "-"


TEMPLATE = """\
# Configuration

<!-- Written by scripts/config_reference.py from the code; do not edit by hand. -->

`tessera serve` (and `tessera cluster`) read an optional YAML file, `--config
FILE`, then the command line: a flag wins over the file. An unknown key is an
error at start. The server reads no other environment variable than the one
named below; the `tessera tenants`, `keys` and `audit` commands also read
`{store_env}` and `{secret_file_env}` (see
[Tenants and limits](tenants.md)).

```sh
tessera serve --config tessera.yaml --port 9000
```

Sizes take bytes or a unit (`700MiB`, `4GiB`); `null` means "not set", and the
description says what that does. Defaults are the values the server runs with
when a key is absent.

## Every key ({count})

| key | type | default | flag | environment | what it does |
|---|---|---|---|---|---|
{rows}

## `cluster_routing`

The router's targets on a Ray cluster ([Scale-out](scale-out.md)), each a number above 0:

| key | type | default |
|---|---|---|
{routing}

## Command-line only

`--config FILE` (the YAML file), `--log-level LEVEL` (`info`), and
`tessera cluster --address` (`local`, `auto` or a Ray address; the `cluster`
key) exist only as flags.
"""


def main() -> int:
    try:
        page = render()
    except ReferenceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if "--check" in sys.argv[1:]:
        if not PAGE.is_file() or PAGE.read_text(encoding="utf-8") != page:
            print(f"{PAGE} is out of date: run scripts/config_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
