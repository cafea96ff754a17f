"""Speech as the bytes of OpenAI's response formats (``tasks/audio.py``), each
read back: wav and flac losslessly, mp3 and opus by length and loudness."""

from __future__ import annotations

import io
import sys
import wave

import numpy as np
import pytest

from tessera.errors import InvalidInputError
from tessera.tasks.audio import check_format, encoded
from tessera.tasks.types import SpeechOutput

RATE = 22050


def tone(seconds: float = 1.0) -> SpeechOutput:
    t = np.arange(int(RATE * seconds)) / RATE
    samples = (np.sin(2 * np.pi * 220 * t) * 12000).astype(np.int16)
    return SpeechOutput(samples=samples, sample_rate=RATE)


def test_pcm_and_wav_carry_the_samples_as_they_are() -> None:
    speech = tone()
    pcm = encoded(speech, "pcm")
    assert (pcm.media_type, pcm.sample_rate) == ("audio/pcm", RATE)
    np.testing.assert_array_equal(np.frombuffer(pcm.data, dtype="<i2"), speech.samples)
    wav = encoded(speech, "wav")
    assert wav.media_type == "audio/wav"
    with wave.open(io.BytesIO(wav.data)) as read:
        assert (read.getframerate(), read.getnchannels(), read.getsampwidth()) == (RATE, 1, 2)
        frames = np.frombuffer(read.readframes(read.getnframes()), dtype="<i2")
    np.testing.assert_array_equal(frames, speech.samples)


def test_flac_is_lossless() -> None:
    soundfile = pytest.importorskip("soundfile")
    speech = tone()
    flac = encoded(speech, "flac")
    assert (flac.media_type, flac.sample_rate) == ("audio/flac", RATE)
    samples, rate = soundfile.read(io.BytesIO(flac.data), dtype="int16")
    assert rate == RATE
    np.testing.assert_array_equal(samples, speech.samples)


@pytest.mark.parametrize(
    ("audio_format", "media_type", "rate"),
    [("mp3", "audio/mpeg", RATE), ("opus", "audio/ogg", 24000)],
)
def test_lossy_formats_keep_the_length_and_the_loudness(
    audio_format: str, media_type: str, rate: int
) -> None:
    soundfile = pytest.importorskip("soundfile")
    speech = tone(2.0)
    audio = encoded(speech, audio_format)
    assert (audio.media_type, audio.sample_rate) == (media_type, rate)
    assert len(audio.data) < speech.samples.nbytes / 4  # compressed
    samples, read_rate = soundfile.read(io.BytesIO(audio.data), dtype="int16")
    assert read_rate == rate
    assert abs(len(samples) / rate - 2.0) < 0.1
    rms = float(np.sqrt(np.mean(samples.astype(np.float64) ** 2)))
    expected = float(np.sqrt(np.mean(speech.samples.astype(np.float64) ** 2)))
    assert abs(rms - expected) / expected < 0.1


def test_opus_takes_a_rate_of_its_own_and_silence_encodes() -> None:
    pytest.importorskip("soundfile")
    quiet = SpeechOutput(samples=np.zeros(0, dtype=np.int16), sample_rate=16000)
    assert encoded(quiet, "opus").sample_rate == 16000
    assert encoded(quiet, "wav").data


@pytest.mark.parametrize("audio_format", ["mp3", "flac", "opus", "wav"])
def test_no_samples_still_make_a_file_that_reads_back(audio_format: str) -> None:
    # A text with nothing to speak ("...") gives no samples: libsndfile wrote
    # no bytes at all for mp3 and flac, which no player opens.
    soundfile = pytest.importorskip("soundfile")
    quiet = SpeechOutput(samples=np.zeros(0, dtype=np.int16), sample_rate=RATE)
    audio = encoded(quiet, audio_format)
    samples, _ = soundfile.read(io.BytesIO(audio.data), dtype="int16")
    assert not np.any(samples)


def test_aac_and_unknown_formats_say_what_is_written() -> None:
    for value in ("aac", "ogg"):
        with pytest.raises(ValueError, match="mp3, opus, flac, wav, pcm"):
            check_format(value)


def test_without_soundfile_mp3_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "soundfile", None)  # makes `import soundfile` fail
    with pytest.raises(InvalidInputError, match=r"tessera\[tts\]"):
        encoded(tone(0.1), "mp3")
    assert encoded(tone(0.1), "wav").data
