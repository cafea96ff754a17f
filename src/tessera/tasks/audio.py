"""Speech as the bytes of OpenAI's ``response_format``s.

``wav`` and ``pcm`` (16-bit little-endian mono, no header) are written here
with the standard library. ``mp3``, ``flac`` and ``opus`` (in an Ogg
container) are written by libsndfile through the ``soundfile`` package (in
the ``tts`` extra, beside the voices; without it they are refused as an
invalid request that says so). Opus takes 8, 12, 16, 24 or 48 kHz only: other rates are resampled
(linearly) to the next of those up. ``aac`` is not written: libsndfile has no
AAC encoder.
"""

from __future__ import annotations

import io
import wave
from dataclasses import dataclass
from typing import Literal

import numpy as np

from tessera.errors import InvalidInputError
from tessera.tasks.types import SpeechOutput

AudioFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
WRITTEN = ("mp3", "opus", "flac", "wav", "pcm")
_MEDIA_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)


@dataclass(frozen=True, slots=True)
class EncodedAudio:
    data: bytes
    media_type: str
    sample_rate: int


def check_format(value: str) -> str:
    """``value`` if it is a format written here, else why not (a ValueError)."""
    if value not in WRITTEN:
        raise ValueError(f"{value} is not written here; ask for one of {', '.join(WRITTEN)}")
    return value


def encoded(output: SpeechOutput, audio_format: str) -> EncodedAudio:
    """``output``'s samples as ``audio_format``'s bytes."""
    samples = np.asarray(output.samples, dtype="<i2")
    rate = output.sample_rate
    media_type = _MEDIA_TYPES[check_format(audio_format)]
    if audio_format == "pcm":
        return EncodedAudio(samples.tobytes(), media_type, rate)
    if audio_format == "wav":
        return EncodedAudio(_wav(samples, rate), media_type, rate)
    try:
        import soundfile
    except ImportError as e:
        raise InvalidInputError(
            f"{audio_format} needs the soundfile package (pip install 'tessera[tts]');"
            " wav and pcm need nothing"
        ) from e
    if samples.size == 0:
        # libsndfile writes no bytes for no samples (mp3, flac) or an Ogg
        # stream it cannot read back (opus): one silent sample makes a file.
        samples = np.zeros(1, dtype="<i2")
    container, subtype = audio_format.upper(), None
    if audio_format == "opus":
        container, subtype = "OGG", "OPUS"
        target = next((r for r in _OPUS_RATES if r >= rate), _OPUS_RATES[-1])
        samples, rate = _resampled(samples, rate, target), target
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=container, subtype=subtype)
    return EncodedAudio(buffer.getvalue(), media_type, rate)


def _wav(samples: np.ndarray[tuple[int], np.dtype[np.int16]], rate: int) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(samples.tobytes())
    return buffer.getvalue()


def _resampled(
    samples: np.ndarray[tuple[int], np.dtype[np.int16]], rate: int, target: int
) -> np.ndarray[tuple[int], np.dtype[np.int16]]:
    """``samples`` at ``target`` Hz, by linear interpolation."""
    if rate == target or samples.size == 0:
        return samples
    count = max(1, round(samples.size * target / rate))
    times = np.arange(count) * (rate / target)
    values = np.interp(times, np.arange(samples.size), samples.astype(np.float32))
    resampled: np.ndarray[tuple[int], np.dtype[np.int16]]
    resampled = np.clip(np.rint(values), -32768, 32767).astype(np.int16)
    return resampled
