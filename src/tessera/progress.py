"""Progress of model loading at start: a rich bar in a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn


class PreloadReporter:
    """Implements ``engine.PreloadProgress`` for the ``serve`` command."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stdout
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._started = 0.0
        self._total = 0

    def start(self, names: list[str]) -> None:
        self._started, self._total = time.perf_counter(), len(names)
        if not names:
            return
        if self._stream.isatty():
            self._progress = Progress(
                TextColumn("loading models"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total} {task.description}"),
                TimeElapsedColumn(),
            )
            self._task = self._progress.add_task("", total=len(names))
            self._progress.start()
        else:
            print(f"loading {len(names)} models: {', '.join(names)}", file=self._stream, flush=True)

    def loaded(self, name: str, error: BaseException | None) -> None:
        seconds = time.perf_counter() - self._started
        outcome = "loaded" if error is None else f"FAILED ({error})"
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, advance=1, description=f"{name} {outcome}")
        else:
            print(f"{name} {outcome} after {seconds:.1f} s", file=self._stream, flush=True)

    def finish(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._total:
            seconds = time.perf_counter() - self._started
            print(f"models ready after {seconds:.1f} s", file=self._stream, flush=True)
