"""Parsing of byte sizes (``700MiB``, ``1.5GB``, ``123456``)."""

from __future__ import annotations

import re

from tessera.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: str | int | float) -> int:
    """Return a size in bytes from an int or a string such as ``700MiB``."""
    if isinstance(value, bool):
        raise ConfigError(f"not a size: {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ConfigError(f"size must not be negative: {value!r}")
        return int(value)
    match = _SIZE.match(value)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"not a size: {value!r} (use bytes or e.g. 700MiB, 1.5GB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
