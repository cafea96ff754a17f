"""No unit test waits in real time: time goes through a ``Clock`` (a
``FakeClock`` in tests), so the unit suite neither sleeps nor races the machine.

This walks the syntax tree of every file under ``tests/unit`` and fails on a
call of ``time.sleep``, of ``asyncio.sleep`` with anything but a literal zero
(``sleep(0)`` only yields to the loop), and of ``asyncio.wait_for``,
``asyncio.timeout`` or ``asyncio.timeout_at`` (bounds in real seconds: use
``clock.wait_for`` or ``clock.timeout``). Imports under other names count too.
A file that must wait in real time goes in ``ALLOWED`` with the reason.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parent

BANNED = {
    "time.sleep": "a real sleep",
    "asyncio.wait_for": "a bound in real seconds: use clock.wait_for",
    "asyncio.timeout": "a bound in real seconds: use clock.timeout",
    "asyncio.timeout_at": "a bound in real seconds: use clock.timeout",
}

# (path under tests/unit, call) -> why that file may wait in real time. An
# entry whose file no longer waits fails the check, so the list cannot rot;
# one whose file is gone is skipped.
ALLOWED: dict[tuple[str, str], str] = {}


@dataclass(frozen=True, slots=True)
class RealWait:
    line: int
    call: str
    why: str


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local names bound to ``time``/``asyncio`` or to a function of theirs."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in ("time", "asyncio"):
                    names[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module in ("time", "asyncio"):
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(func: ast.expr, aliases: dict[str, str]) -> str | None:
    if isinstance(func, ast.Name):
        return aliases.get(func.id)
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        module = aliases.get(func.value.id)
        return f"{module}.{func.attr}" if module is not None else None
    return None


def _is_zero(node: ast.expr | None) -> bool:
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
        and node.value == 0
    )


def real_waits(source: str) -> list[RealWait]:
    """The calls in ``source`` that wait in real time."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    found: list[RealWait] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        call = _dotted(node.func, aliases)
        if call in BANNED:
            found.append(RealWait(node.lineno, call, BANNED[call]))
        elif call == "asyncio.sleep":
            delay = node.args[0] if node.args else None
            for keyword in node.keywords:
                if keyword.arg == "delay":
                    delay = keyword.value
            if not _is_zero(delay):
                found.append(RealWait(node.lineno, call, "a real sleep: use clock.sleep"))
    return sorted(found, key=lambda wait: wait.line)


def test_no_unit_test_waits_in_real_time() -> None:
    offences: list[str] = []
    used: set[tuple[str, str]] = set()
    for path in sorted(UNIT.rglob("*.py")):
        rel = path.relative_to(UNIT).as_posix()
        for wait in real_waits(path.read_text(encoding="utf-8")):
            if (rel, wait.call) in ALLOWED:
                used.add((rel, wait.call))
            else:
                offences.append(f"tests/unit/{rel}:{wait.line}: {wait.call} ({wait.why})")
    assert not offences, "unit tests wait in real time:\n" + "\n".join(offences)
    stale = sorted(key for key in set(ALLOWED) - used if (UNIT / key[0]).exists())
    assert not stale, f"allowed real waits that no longer occur, drop them: {stale}"


@pytest.mark.parametrize(
    "source",
    [
        "import time\ntime.sleep(SECONDS)",
        "import time as t\nt.sleep(0)",
        "from time import sleep\nsleep(1)",
        "import asyncio\nasyncio.sleep(-1 + 1.01)",
        "import asyncio\nasyncio.sleep(DELAY)",
        "import asyncio\nasyncio.sleep(delay=1)",
        "from asyncio import sleep as nap\nnap(2)",
        "import asyncio\nasyncio.wait_for(f, 1.0)",
        "from asyncio import wait_for\nwait_for(f, None)",
        "import asyncio\nasyncio.timeout(1)",
        "import asyncio\nasyncio.timeout_at(5)",
    ],
)
def test_real_waits_are_found(source: str) -> None:
    assert len(real_waits(source)) == 1


@pytest.mark.parametrize(
    "source",
    [
        "import asyncio\nasyncio.sleep(0)",
        "import asyncio\nasyncio.sleep(0.0, 'result')",
        "clock.sleep(5.0)",
        "clock.wait_for(f, 1.0)",
        "event.wait(10.0)",
        "def sleep(s): ...\nsleep(3)",
    ],
)
def test_waits_on_the_clock_or_zero_pass(source: str) -> None:
    assert real_waits(source) == []
