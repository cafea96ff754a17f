"""The engine process's event loop (the process split's, ``engine_loop``).

Its loop shares the interpreter lock with the compute workers that launch
the batches, and asyncio's loop lets go of that lock at every turn: each
turn starts with a poll of its sockets (``select``), with a timeout of zero
while callbacks are ready, and a poll is a system call made without the
lock. A worker waiting for the lock takes it then, and the loop waits for
it back before the turn's callbacks run. A request took the engine's loop
6-8 turns (docs/benchmarks.md), so at a thousand requests a second the loop
handed the lock over several thousand times a second.

``patient`` (the default): asyncio's loop over a ``PatientSelector``, which
polls again at most every ``POLL_S`` while callbacks are ready; a turn with
callbacks ready within that time skips the poll, keeps the lock and runs
them. What a socket brings meanwhile waits at most ``POLL_S`` (0.2 ms). A
turn with nothing ready polls as asyncio does (its timeout is the next
timer's, or none). ``asyncio``: asyncio's own loop. ``uvloop``: uvloop's
(uvicorn's choice where it is installed, and the gateways' loop, whose work
is HTTP: there uvloop took 7-15% less CPU a request).

Measured side by side in one run (``engine_ceiling_bench.py --engine-loops``,
the core form over a modelled GPU: docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Callable

ENGINE_LOOPS = ("patient", "asyncio", "uvloop")
DEFAULT_ENGINE_LOOP = "patient"
# How long a poll's answer stands while callbacks are ready (seconds).
POLL_S = 0.0002


class PatientSelector(selectors.DefaultSelector):
    """The platform's selector, polling with a timeout of zero at most every
    ``every_s`` (module notes); a poll that may wait always polls."""

    def __init__(self, every_s: float = POLL_S) -> None:
        super().__init__()
        self.every_s = every_s
        self._polled = float("-inf")
        self.polls = 0
        self.skipped = 0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        waits = timeout is None or timeout > 0
        if not waits and time.monotonic() - self._polled < self.every_s:
            self.skipped += 1
            return []
        ready: list[tuple[selectors.SelectorKey, int]] = super().select(timeout)
        self._polled = time.monotonic()
        self.polls += 1
        return ready


def patient_loop() -> asyncio.AbstractEventLoop:
    """asyncio's loop over a ``PatientSelector``."""
    return asyncio.SelectorEventLoop(PatientSelector())


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """The loop ``name`` (one of ``ENGINE_LOOPS``) as a factory, for
    ``asyncio.Runner``."""
    if name == "patient":
        return patient_loop
    if name == "asyncio":
        return asyncio.SelectorEventLoop
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    raise ValueError(f"engine_loop must be one of {', '.join(ENGINE_LOOPS)}, not {name!r}")


def uvicorn_loop(name: str) -> str:
    """The loop ``name`` as uvicorn's ``loop`` setting."""
    if name == "patient":
        return f"{__name__}:patient_loop"
    loop_factory(name)  # a name it does not know is refused here
    return name
