"""Typed inputs and outputs of every task, and each task's work unit.

A request carries a list of *items* (one sentence, one image, one pair); a
batch is a list of items from one or more requests, and a loaded model maps
items to outputs one for one, in order. Items are plain frozen dataclasses so
they cross thread boundaries safely; images are decoded numpy arrays.

Work units (the cost used for batching limits and fairness):
text tasks count approximate tokens (``ceil(chars / 4)``, at least 1) so that
they can be counted before the tokenizer is resident; OCR counts pages of
the detection pass (which scales the short side up to 736 pixels, so a small
page costs as much as a 736 x 736 one and a tall receipt more), a line crop
its own pixels in such pages; speech and translation count characters; chat
counts prompt plus maximum generated tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt


class Task(StrEnum):
    EMBEDDING = "embedding"
    RERANK = "rerank"
    CLASSIFY = "classify"
    OCR = "ocr"
    TRANSLATE = "translate"
    TTS = "tts"
    GENERATE = "generate"


@dataclass(frozen=True, slots=True)
class TextInput:
    """One text, for embedding or classification."""

    text: str


EmbedInput = TextInput


@dataclass(frozen=True, slots=True)
class RerankInput:
    """One (query, document) pair; the output is a relevance score (float)."""

    query: str
    document: str


@dataclass(frozen=True, slots=True)
class TranslateInput:
    """One text to translate; the output is the translation (str)."""

    text: str


@dataclass(frozen=True, slots=True)
class LabelScore:
    label: str
    score: float


@dataclass(frozen=True, slots=True)
class ClassifyOutput:
    """Labels sorted by score, best first (at most the model's top-k)."""

    labels: tuple[LabelScore, ...]


@dataclass(frozen=True, slots=True)
class OcrInput:
    """A decoded image (height x width x 3, uint8, BGR) and whether it is a page or a line crop."""

    image: npt.NDArray[np.uint8]
    mode: Literal["page", "line"] = "page"


@dataclass(frozen=True, slots=True)
class OcrLine:
    text: str
    score: float
    box: tuple[tuple[float, float], ...]  # polygon corners, pixels


@dataclass(frozen=True, slots=True)
class OcrOutput:
    lines: tuple[OcrLine, ...]


@dataclass(frozen=True, slots=True)
class SpeechInput:
    text: str
    speed: float = 1.0


@dataclass(frozen=True, slots=True)
class SpeechOutput:
    """Mono 16-bit PCM samples."""

    samples: npt.NDArray[np.int16]
    sample_rate: int


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class ChatInput:
    """A chat conversation to continue.

    ``on_text`` (if set) is called from the worker thread with each new piece
    of generated text, for streaming; it must be thread-safe and must not block.
    """

    messages: tuple[ChatMessage, ...]
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    on_text: Callable[[str], None] | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class ChatOutput:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: Literal["stop", "length"]


def _approx_tokens(text: str) -> int:
    return max(1, math.ceil(len(text) / 4))


# rapidocr's detection resizes an image so that its short side is at least this.
OCR_DETECTION_SIDE = 736


def _detection_pages(height: int, width: int) -> float:
    """The detection pass's pixels, in 736 x 736 pages: what its activations scale with."""
    scale = max(1.0, OCR_DETECTION_SIDE / max(1, min(height, width)))
    return (height * scale) * (width * scale) / OCR_DETECTION_SIDE**2


def work_units(item: object) -> float:
    """The cost of one item in its task's own unit."""
    match item:
        case TextInput(text=text):
            return _approx_tokens(text)
        case RerankInput(query=query, document=document):
            return _approx_tokens(query) + _approx_tokens(document)
        case TranslateInput(text=text) | SpeechInput(text=text):
            return max(1, len(text))
        case OcrInput(image=image, mode="line"):  # recognition alone: its pixels
            return max(1e-3, float(image.shape[0] * image.shape[1]) / OCR_DETECTION_SIDE**2)
        case OcrInput(image=image):
            return _detection_pages(int(image.shape[0]), int(image.shape[1]))
        case ChatInput(messages=messages, max_tokens=max_tokens):
            return sum(_approx_tokens(m.content) for m in messages) + max_tokens
    raise TypeError(f"not a task item: {type(item).__name__}")
