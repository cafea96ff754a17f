"""Progress of a benchmark's requests, for a person watching a terminal or a log."""

from __future__ import annotations

import time
from typing import Any, TextIO

PLAIN_PROGRESS_EVERY_S = 2.0


class BenchProgress:
    """A rich bar on a terminal, a plain line every few seconds otherwise."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self._total, self._stream, self._done = total, stream, 0
        self._last_line = time.perf_counter()
        self._bar: Any = None
        if stream.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

            self._bar = Progress("bench", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            self._task = self._bar.add_task("", total=total)
            self._bar.start()

    def advance(self) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.update(self._task, completed=self._done)
        elif time.perf_counter() - self._last_line >= PLAIN_PROGRESS_EVERY_S:
            self._last_line = time.perf_counter()
            print(f"bench: {self._done}/{self._total} requests", file=self._stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
        print(f"bench: {self._done}/{self._total} requests done", file=self._stream, flush=True)
