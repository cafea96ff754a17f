"""Speech synthesis with Piper (VITS voices in ONNX, espeak-ng phonemes).

piper-tts is GPL-3.0-or-later, so it is an optional extra (``tessera[tts]``)
imported only inside ``load()``. The loader builds the ``InferenceSession``
itself (``PiperVoice.load`` takes no session options) so that the session
gets the engine's thread share and the device's providers, and hands it to
``PiperVoice``, a plain dataclass of a session and a config. On the CPU the
session loads the voice's optimised graph from the cache
(``runtimes/ort_graphs.py``): a reload takes about half the time.

Items run one by one: piper synthesizes one sentence per ONNX call, and each
item's sentences are joined into one clip. Each sentence is a step
(``step.step_boundary``: short batches may run between two), and an item whose
caller has gone or whose deadline has passed (``request.item_stops``) stops at
its next sentence.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tessera.errors import InvalidInputError, ModelUnavailableError
from tessera.footprint import Footprint
from tessera.request import StopFlag, item_stops
from tessera.runtimes.base import LoadContext
from tessera.runtimes.memory import files_bytes
from tessera.runtimes.ort_graphs import cpu_only, optimized_graph
from tessera.step import step_boundary
from tessera.tasks.types import SpeechInput, SpeechOutput

if TYPE_CHECKING:
    from tessera.repository.spec import ModelSpec

_INSTALL_HINT = "piper-tts is not installed: pip install 'tessera[tts]'"
# Resident bytes per byte of ONNX weights after load and a warm-up sentence,
# as measured on CPU (onnxruntime's optimized graph and its arena).
_ESTIMATE_FACTOR = 2
_METHOD = "rss delta (load + warm-up)"
_MAX_SPEED = 10.0
# Where espeak-ng ends a sentence (piper speaks one an ONNX call): a text is
# cut there to find its longest sentence (a text without one is one sentence).
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def _config_path(spec: ModelSpec, model_path: Path) -> Path:
    path = spec.option_path("config")
    if path is None:
        path = model_path.with_name(model_path.name + ".json")
    if not path.is_file():
        raise ModelUnavailableError(spec.name, f"voice config not found: {path}")
    return path


def _check_item(item: object) -> SpeechInput:
    if not isinstance(item, SpeechInput):
        raise InvalidInputError(f"TTS expects SpeechInput items, got {type(item).__name__}")
    if not math.isfinite(item.speed) or not 0 < item.speed <= _MAX_SPEED:
        raise InvalidInputError(f"speed must be in (0, {_MAX_SPEED}], got {item.speed}")
    return item


@dataclass
class PiperModel:
    """A loaded Piper voice."""

    voice: Any
    sample_rate: int
    own_bytes: int
    method: str

    def run(self, items: Sequence[Any]) -> list[Any]:
        checked = [_check_item(item) for item in items]
        stops = item_stops(len(checked))
        return [self._speak(item, stop) for item, stop in zip(checked, stops, strict=True)]

    def _speak(self, item: SpeechInput, stop: StopFlag) -> SpeechOutput:
        import numpy as np
        from piper import SynthesisConfig

        # speed scales the voice's own phoneme length (1.0 for most voices).
        length_scale = self.voice.config.length_scale / item.speed
        chunks = []
        sentences = self.voice.synthesize(item.text, SynthesisConfig(length_scale=length_scale))
        for chunk in sentences:  # a generator: one ONNX call a sentence, as it is read
            chunks.append(chunk.audio_int16_array)
            if stop.is_set():
                break
            step_boundary()
        samples = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int16)
        return SpeechOutput(
            samples=samples.astype(np.int16, copy=False), sample_rate=self.sample_rate
        )

    def memory(self) -> Footprint:
        return Footprint(own_bytes=self.own_bytes, method=self.method)

    def unload(self) -> None:
        self.voice = None


class PiperLoader:
    """Adapter ``piper``: a Piper voice (``.onnx`` + ``.onnx.json``) on onnxruntime."""

    def estimate_bytes(self, spec: ModelSpec) -> int:
        return _ESTIMATE_FACTOR * files_bytes(spec.resolve_source())

    def shared_keys(self, spec: ModelSpec) -> tuple[str, ...]:
        return ()

    def alone_units(self, spec: ModelSpec, item: object) -> float | None:
        """Every text is spoken on its own, a sentence at a time: its longest
        sentence's characters (its units) are its peak. (Its whole length
        had a 1,500-character text need 13 GB, 9 MB a character from a
        short warm-up, and refused as one that could never run.)"""
        if not isinstance(item, SpeechInput):
            return None
        return float(max(1, max(len(s) for s in _SENTENCE_END.split(item.text))))

    def load(self, spec: ModelSpec, ctx: LoadContext) -> PiperModel:
        # The missing extra first: without it the voice package is missing too.
        try:
            import onnxruntime as ort
            from piper import PiperConfig, PiperVoice
        except ImportError as e:
            raise ModelUnavailableError(spec.name, _INSTALL_HINT) from e
        model_path = spec.resolve_source()
        config_path = _config_path(spec, model_path)
        try:
            config = PiperConfig.from_dict(json.loads(config_path.read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError) as e:
            raise ModelUnavailableError(spec.name, f"bad voice config {config_path}: {e}") from e

        providers = ctx.device.onnx_providers(spec.max_bytes)
        graph = model_path
        if cpu_only(providers):  # made (once) before the measurement
            graph = optimized_graph(model_path, ctx.cache_dir, spec.name)

        def build() -> Any:
            options = ort.SessionOptions()
            options.intra_op_num_threads = max(1, ctx.threads)
            options.inter_op_num_threads = 1
            session = ort.InferenceSession(str(graph), sess_options=options, providers=providers)
            voice = PiperVoice(session=session, config=config)
            if ctx.warm_up:
                for _chunk in voice.synthesize("Ready."):
                    pass
            return voice

        try:
            measured = ctx.measure(build)
        except Exception as e:
            raise ModelUnavailableError(spec.name, f"piper voice failed to load: {e}") from e
        weights = files_bytes(model_path)
        own, method = measured.rss_delta_bytes, _METHOD
        if own < weights:
            own, method = weights, f"{_METHOD}; below the weight file, so its size"
        return PiperModel(
            voice=measured.value, sample_rate=config.sample_rate, own_bytes=own, method=method
        )
