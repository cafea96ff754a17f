"""Backoff of failed loads: when a model whose load failed may be tried again.

Invariants:

- The n-th failure in a row of a model's load makes it wait
  ``retry_s * 2 ** (n - 1)`` seconds, at most ``max_retry_s``, from the
  failure. Reason: a load that keeps failing (missing weights, a broken
  file) must not take the device's time from the models that load.
- A successful load ends the row: the next failure waits ``retry_s`` again.
- Callers are told the public reason only: the cause may name the server's
  files (it is in the log and the table's ``error``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.clock import Clock
from tessera.errors import ModelUnavailableError

# What callers are told of a failed load: its cause may name the server's files.
LOAD_FAILED = "its load failed (the cause is in the server log)"


@dataclass(frozen=True, slots=True)
class _Retry:
    at: float  # when the load may be tried again
    reason: str  # what callers may be told


class LoadBackoff:
    """Each failed model's failures in a row, retry time and public reason."""

    def __init__(self, clock: Clock, retry_s: float, max_retry_s: float) -> None:
        self._clock = clock
        self._retry_s = retry_s
        self._max_retry_s = max_retry_s
        self._failures: dict[str, int] = {}
        self._retries: dict[str, _Retry] = {}

    def fail(self, name: str, public_reason: str) -> float:
        """One more failure of ``name``'s load; the seconds until it is tried again."""
        failures = self._failures[name] = self._failures.get(name, 0) + 1
        retry_s = min(self._max_retry_s, self._retry_s * 2.0 ** (failures - 1))
        self._retries[name] = _Retry(self._clock.now() + retry_s, public_reason)
        return retry_s

    def succeeded(self, name: str) -> None:
        """``name`` loaded (or is forgotten): its row of failures ends."""
        self._failures.pop(name, None)
        self._retries.pop(name, None)

    def raise_if_waiting(self, name: str) -> None:
        """``ModelUnavailableError``, with Retry-After, until ``name``'s retry time."""
        retry = self._retries.get(name)
        if retry is None:
            return
        wait_s = retry.at - self._clock.now()
        if wait_s > 0:
            raise ModelUnavailableError(
                name, f"{retry.reason}; retried in {wait_s:.3g}s", retry_after_s=wait_s
            )
