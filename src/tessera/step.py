"""Step boundaries: where long work lets short work run first.

A runtime whose batch is long and made of steps (a generation's decode steps,
OCR's detection, classification and recognition chunks) calls
``step_boundary()`` between two steps. The compute executor runs each batch
with a hook in view of this call (``stepping``); at a boundary the hook may
give the batch's compute slot up to short batches that took one beside it,
and wait until a slot is free again (see ``scheduling/slot.py``), so short
work shares the device with a long batch for at most one of its steps.

The call is cheap (a context variable read; the hook decides under one lock)
and a no-op outside the executor: a warm-up, a test calling a model directly,
a model in a worker process of its own. Pausing between steps changes nothing
that is computed, so a stepwise answer is the answer of one run.

A batch paused at a boundary still holds whatever locks it took. A batch
that then waits for one of those locks while holding its slot could keep
the paused one from ever getting a slot back, so a runtime takes a lock that
it holds across boundaries with ``holding(lock)``: while the lock is taken
by another batch, the waiting batch gives its slot up (``StepHook.blocked``).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Protocol


class StepHook(Protocol):
    """What the executor does at a batch's boundaries (one hook per batch)."""

    def boundary(self) -> None:
        """Between two steps: may wait while short batches run."""
        ...

    def blocked(self) -> AbstractContextManager[None]:
        """The enclosed block waits for another batch rather than computing:
        the batch's slot is given up meanwhile and waited for again after."""
        ...


# The hook of the batch the current thread runs; None outside the executor.
_HOOK: contextvars.ContextVar[StepHook | None] = contextvars.ContextVar(
    "tessera_step_hook", default=None
)


def step_boundary() -> None:
    """Called by a runtime between two steps of a batch: the batch may step
    aside here while short batches run, before its next step."""
    hook = _HOOK.get()
    if hook is not None:
        hook.boundary()


@contextlib.contextmanager
def holding(lock: threading.Lock) -> Iterator[None]:
    """Hold ``lock`` for the block; while another batch holds it, wait without
    holding a compute slot (that batch may be paused, waiting for one)."""
    if not lock.acquire(blocking=False):
        hook = _HOOK.get()
        with hook.blocked() if hook is not None else contextlib.nullcontext():
            lock.acquire()
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def stepping(hook: StepHook) -> Iterator[None]:
    """Use ``hook`` at each ``step_boundary`` in this thread while the block runs."""
    token = _HOOK.set(hook)
    try:
        yield
    finally:
        _HOOK.reset(token)
