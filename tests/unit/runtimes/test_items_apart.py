"""What a runtime that runs items apart says of their peak (``ItemsApart``):
piper speaks a text a sentence at a time, so its longest sentence is its
peak, not its length; OCR pages run whole, one after another."""

from __future__ import annotations

from builders import make_spec
from harness.fake_models import FakeLoader
from tessera.runtimes.piper import PiperLoader
from tessera.tasks.types import SpeechInput, Task, TextInput


def test_a_spoken_texts_peak_is_its_longest_sentence() -> None:
    spec = make_spec("voice", task=Task.TTS)
    loader = PiperLoader()
    text = "A short one. A longer sentence, with a comma! Last?\nAnd a new line."
    assert loader.alone_units(spec, SpeechInput(text)) == len("A longer sentence, with a comma!")
    unpunctuated = "word " * 300  # one sentence: all of it at once
    assert loader.alone_units(spec, SpeechInput(unpunctuated)) == len(unpunctuated)
    assert loader.alone_units(spec, SpeechInput("")) == 1
    assert loader.alone_units(spec, TextInput("not speech")) is None


def test_a_fake_model_says_its_items_run_alone_where_its_card_does() -> None:
    loader = FakeLoader()
    assert loader.alone_units(make_spec("m"), TextInput("abcd")) is None
    apart = make_spec("m", items_alone=True)
    assert loader.alone_units(apart, TextInput("abcd")) == 1.0  # a text: one unit
