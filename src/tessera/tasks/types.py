"""Typed inputs and outputs of every task, and each task's work unit.

A request carries a list of *items* (one sentence, one image, one pair); a
batch is a list of items from one or more requests, and a loaded model maps
items to outputs one for one, in order. Items are plain frozen dataclasses so
they cross thread boundaries safely; images are decoded numpy arrays.

Work units (the cost used for batching limits, fairness, the quota and the
activation reservation) count what the model will actually run, as its card
says (``InputLimits``): text tasks count approximate tokens (``ceil(chars /
4)``, at least 1, so that they can be counted before the tokenizer is
resident), capped at the model's window, where the runtime truncates; OCR
counts pages of the detection pass after rapidocr's resizes (the long side
brought down to 2,000 pixels, then the short side up to 736, each rounded to
32), in 736 x 736 pages, so a small page costs as much as a 736 x 736 one, a
tall receipt more and a 9-megapixel scan what its 2,000-pixel copy costs; a
line crop its own pixels (after the same bound) in such pages; speech and
translation count characters; chat counts prompt plus maximum generated tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Literal

from tessera.errors import InvalidInputError, PayloadTooLargeError

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


@dataclass(frozen=True, slots=True)
class InputLimits:
    """What a model runs of an item, from its card (``ModelSpec.inputs``).

    ``text_window``: tokens of each text the model reads; a longer text is
    truncated to it (counted as the window), or refused with 413 when
    ``truncate`` is false. ``ocr_*``: rapidocr's resizes before detection
    (3.10's defaults: ``Global.max_side_len``, ``Global.min_side_len``,
    ``Det.limit_side_len`` with ``limit_type: min``). ``max_new_tokens``: the
    most tokens a chat item may ask to generate.
    """

    text_window: int | None = None
    truncate: bool = True
    ocr_max_side: int = 2000
    ocr_min_side: int = 30
    ocr_detection_side: int = 736
    max_new_tokens: int | None = None


NO_LIMITS = InputLimits()


def _approx_tokens(text: str) -> int:
    return max(1, math.ceil(len(text) / 4))


def _text_units(text: str, limits: InputLimits) -> int:
    tokens = _approx_tokens(text)
    window = limits.text_window
    return tokens if window is None else min(tokens, window)


# The side, in pixels, of one work unit of OCR: a page of the detection pass.
OCR_DETECTION_SIDE = 736
# rapidocr pads a strip wider than 8:1 (or a page at most 30 pixels high) with
# rows above and below before detection (Global.width_height_ratio, min_height).
_OCR_WIDTH_HEIGHT_RATIO = 8
_OCR_MIN_HEIGHT = 30


def _resized(height: int, width: int, scale: float) -> tuple[int, int]:
    """rapidocr's resize: each side scaled, then rounded to a multiple of 32."""
    return (
        max(32, round(int(height * scale) / 32) * 32),
        max(32, round(int(width * scale) / 32) * 32),
    )


def _bounded(height: int, width: int, limits: InputLimits) -> tuple[int, int]:
    """The image rapidocr's pre-processing hands on: long side at most
    ``ocr_max_side``, then short side at least ``ocr_min_side``."""
    height, width = max(1, height), max(1, width)
    if max(height, width) > limits.ocr_max_side:
        height, width = _resized(height, width, limits.ocr_max_side / max(height, width))
    if min(height, width) < limits.ocr_min_side:
        height, width = _resized(height, width, limits.ocr_min_side / min(height, width))
    return height, width


def _detection_pages(height: int, width: int, limits: InputLimits) -> float:
    """The detection pass's pixels, in 736 x 736 pages: what its activations scale with."""
    height, width = _bounded(height, width, limits)
    if width / height > _OCR_WIDTH_HEIGHT_RATIO or height <= _OCR_MIN_HEIGHT:
        padded = max(int(width / _OCR_WIDTH_HEIGHT_RATIO), _OCR_MIN_HEIGHT) * 2
        height += 2 * int(abs(padded - height) / 2)
    side = limits.ocr_detection_side
    if min(height, width) < side:
        height, width = _resized(height, width, side / min(height, width))
    return height * width / OCR_DETECTION_SIDE**2


def work_units(item: object, limits: InputLimits = NO_LIMITS) -> float:
    """The cost of one item in its task's own unit, for a model of ``limits``."""
    match item:
        case TextInput(text=text):
            return _text_units(text, limits)
        case RerankInput(query=query, document=document):
            return _text_units(query, limits) + _text_units(document, limits)
        case TranslateInput(text=text) | SpeechInput(text=text):
            return max(1, len(text))
        case OcrInput(image=image, mode="line"):  # recognition alone: its pixels
            height, width = _bounded(int(image.shape[0]), int(image.shape[1]), limits)
            return max(1e-3, height * width / OCR_DETECTION_SIDE**2)
        case OcrInput(image=image):
            return _detection_pages(int(image.shape[0]), int(image.shape[1]), limits)
        case ChatInput(messages=messages, max_tokens=max_tokens):
            return sum(_approx_tokens(m.content) for m in messages) + max_tokens
    raise TypeError(f"not a task item: {type(item).__name__}")


def _check_item(index: int, item: object, limits: InputLimits) -> None:
    """Refuse an item the model would not run whole: a text over its window
    when the card says ``truncate: false``, a chat over its token limit."""
    match item:
        case TextInput(text=text):
            texts = [text]
        case RerankInput(query=query, document=document):
            texts = [query, document]
        case ChatInput(max_tokens=max_tokens):
            if limits.max_new_tokens is not None and max_tokens > limits.max_new_tokens:
                raise InvalidInputError(
                    f"max_tokens {max_tokens} is over this model's limit of {limits.max_new_tokens}"
                )
            return
        case _:
            return
    window = limits.text_window
    if limits.truncate or window is None:
        return
    for text in texts:
        if _approx_tokens(text) > window:
            raise PayloadTooLargeError(
                f"input[{index}] is about {_approx_tokens(text):,} tokens (characters / 4),"
                f" over the model's window of {window:,} tokens; its card says truncate: false"
            )


def request_units(items: Sequence[object], limits: InputLimits) -> float:
    """A request's work units, once each item is checked against ``limits``."""
    for index, item in enumerate(items):
        _check_item(index, item, limits)
    return sum(work_units(item, limits) for item in items)
