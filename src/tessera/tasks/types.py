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
32), in 736 x 736 pages, so a small page costs as much as a 736 x 736 one and
a tall receipt more; a line crop its own pixels (after the same bound) in such
pages; speech and translation count characters; chat counts prompt plus
maximum generated tokens.

An OCR image larger than rapidocr's bound also costs what its resize throws
away: it is decoded whole and held whole while it runs, which the detection
pass does not see (a 6,300-pixel square: 113 MiB of pixels, 1.3 s to decode,
beside the pass over its 2,000-pixel copy). Its pixels beyond the bounded copy's
add a unit each ``DECODE_PIXELS_PER_UNIT``, counted from the image's header
(``EncodedImage.shape``) before it is decoded, as every unit is.

A vision-language model (its card gives ``InputLimits.vision``) reads an
image as the tokens its processor makes of it (``VisionLimits.image_tokens``:
the image resized to its pixel bounds in whole merged patches, one token a
merged patch, one more a row, two around the image, as HunyuanOCR's
processor does), so its items, an OCR page with a prompt or a chat whose
messages carry images, cost those tokens plus the prompt's plus the
maximum new tokens, as a chat does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal

from tessera.errors import InvalidInputError, PayloadTooLargeError, TaskMismatchError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from tessera.tasks.image import EncodedImage

    # An image as an item carries it: decoded (H x W x 3 uint8 BGR), or its
    # file with the header read, decoded when its batch runs.
    ItemImage = npt.NDArray[np.uint8] | EncodedImage


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
    """An image (decoded: height x width x 3, uint8, BGR; or an ``EncodedImage``,
    decoded when it runs) and whether it is a page or a line crop.

    For a vision-language OCR model, ``prompt`` is the instruction (None: the
    model's plain-text prompt) and ``max_tokens`` the most tokens it may
    write (None: the card's ``max_tokens_default``); its answer is a
    ``ChatOutput``. Other OCR models take neither.
    """

    image: ItemImage
    mode: Literal["page", "line"] = "page"
    prompt: str | None = None
    max_tokens: int | None = None


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
class ToolCall:
    """One call of a tool (OpenAI's ``function`` tool call): its id, the
    tool's name and its arguments as JSON text."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, Any]:
        """The call as OpenAI's ``tool_calls`` items write it."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One turn; ``images`` (decoded as ``OcrInput``'s, for a vision-language
    model) come before its text. An assistant's turn may hold the tools it
    called (``tool_calls``); a ``tool`` turn answers the call ``tool_call_id``."""

    role: str
    content: str
    images: tuple[ItemImage, ...] = field(default=(), compare=False)
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


@dataclass(frozen=True, slots=True)
class ChatInput:
    """A chat conversation to continue, or (``prompt`` set, ``messages``
    empty) a text to continue as it is, without the model's chat template:
    OpenAI's legacy completions.

    ``response_format`` (OpenAI's object of that name, as JSON text: type
    ``json_object`` or ``json_schema``) holds the answer to JSON; a runtime
    that cannot refuses the item. None: free text. ``logprobs`` (k, 0 to 20)
    asks for each generated token's log probability and its k likeliest
    alternatives; a runtime that cannot give them refuses the item.

    ``tools`` (OpenAI's list of function tools, as JSON text) may be called
    as ``tool_choice`` says: ``auto`` (or an answer in text), ``required`` (at
    least one call), or a tool's name (that one); None: no tools. A runtime
    that cannot call tools refuses the item.

    ``presence_penalty`` and ``frequency_penalty`` (OpenAI's, -2 to 2) lower
    the logit of each token already generated by the item, once and once per
    time it was generated; ``logit_bias`` adds (token id, bias) to the logits
    of those tokens at every step, before temperature and top-p.

    ``on_text`` (if set) is called from the worker thread with each new piece
    of generated text, for streaming; it must be thread-safe and must not block.
    Where ``logprobs`` are asked for and the runtime gives them as it goes,
    ``on_logprobs`` (if set) is called the same way, just before ``on_text``,
    with the piece's tokens' logprobs (as ``ChatOutput.logprobs`` has them);
    any not told so come in the output alone.
    """

    messages: tuple[ChatMessage, ...]
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    on_text: Callable[[str], None] | None = field(default=None, compare=False)
    on_logprobs: Callable[[tuple[dict[str, Any], ...]], None] | None = field(
        default=None, compare=False
    )
    prompt: str | None = None
    response_format: str | None = None
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    tools: str | None = None
    tool_choice: str | None = None
    parallel_tool_calls: bool = True


@dataclass(frozen=True, slots=True)
class ChatOutput:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: Literal["stop", "length", "tool_calls"]
    # With ChatInput.logprobs: a token each, as OpenAI's ``logprobs.content``
    # items (``token``, ``logprob``, ``bytes``, ``top_logprobs``).
    logprobs: tuple[dict[str, Any], ...] | None = None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True, slots=True)
class VisionLimits:
    """How a vision-language model's processor turns an image into tokens (the
    card's ``vision`` options): resized, aspect kept, to sides in whole
    ``patch_size * merge_size`` blocks and between ``min_pixels`` and
    ``max_pixels``; one token per merged patch, one more per row, two around."""

    patch_size: int = 16
    merge_size: int = 2
    min_pixels: int = 512 * 512
    max_pixels: int = 2048 * 2048
    max_aspect_ratio: float = 200.0

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """The processor's ``smart_resize`` (Qwen2-VL's, which HunyuanVL's copies)."""
        factor = self.patch_size * self.merge_size
        h_bar = max(factor, round(height / factor) * factor)
        w_bar = max(factor, round(width / factor) * factor)
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def image_tokens(self, height: int, width: int) -> int:
        h_bar, w_bar = self.resized(max(1, height), max(1, width))
        factor = self.patch_size * self.merge_size
        rows, columns = h_bar // factor, w_bar // factor
        return rows * (columns + 1) + 2


@dataclass(frozen=True, slots=True)
class InputLimits:
    """What a model runs of an item, from its card (``ModelSpec.inputs``).

    ``text_window``: tokens of each text the model reads; a longer text is
    truncated to it (counted as the window), or refused with 413 when
    ``truncate`` is false. ``ocr_*``: rapidocr's resizes before detection
    (3.10's defaults: ``Global.max_side_len``, ``Global.min_side_len``,
    ``Det.limit_side_len`` with ``limit_type: min``). ``max_new_tokens``: the
    most tokens a chat item may ask to generate; ``max_tokens_default``
    what an OCR page on a vision-language model may generate when it does
    not say. ``vision``: set for a vision-language model (see ``VisionLimits``).
    """

    text_window: int | None = None
    truncate: bool = True
    ocr_max_side: int = 2000
    ocr_min_side: int = 30
    ocr_detection_side: int = 736
    max_new_tokens: int | None = None
    max_tokens_default: int = 1024
    vision: VisionLimits | None = None


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


# Pixels of an OCR image beyond its bounded copy's that cost one work unit
# (``_decode_units``): decoding and holding them cost about what a unit of the
# detection pass does, by time and by memory (``benchmarks/big_pages.py``).
DECODE_PIXELS_PER_UNIT = 12_000_000


def _decode_units(height: int, width: int, bounded_pixels: int) -> float:
    """The units of an image's pixels that rapidocr's resize throws away:
    decoded and held whole, unseen by the pass over its bounded copy."""
    return max(0, height * width - bounded_pixels) / DECODE_PIXELS_PER_UNIT


def _image_tokens(image: ItemImage, vision: VisionLimits) -> int:
    return vision.image_tokens(int(image.shape[0]), int(image.shape[1]))


def ocr_max_tokens(item: OcrInput, limits: InputLimits) -> int:
    """The most tokens a vision-language model may write for an OCR page."""
    return item.max_tokens if item.max_tokens is not None else limits.max_tokens_default


def work_units(item: object, limits: InputLimits = NO_LIMITS) -> float:
    """The cost of one item in its task's own unit, for a model of ``limits``."""
    vision = limits.vision
    if vision is not None:  # a vision-language model: tokens, images included
        match item:
            case OcrInput(image=image, prompt=prompt):
                prompt_tokens = _image_tokens(image, vision) + _approx_tokens(prompt or "")
                return prompt_tokens + ocr_max_tokens(item, limits)
            case ChatInput(messages=messages, max_tokens=max_tokens):
                images = sum(_image_tokens(i, vision) for m in messages for i in m.images)
                return images + _chat_tokens(item) + max_tokens
    match item:
        case TextInput(text=text):
            return _text_units(text, limits)
        case RerankInput(query=query, document=document):
            return _text_units(query, limits) + _text_units(document, limits)
        case TranslateInput(text=text) | SpeechInput(text=text):
            return max(1, len(text))
        case OcrInput(image=image, mode="line"):  # recognition alone: its pixels
            height, width = int(image.shape[0]), int(image.shape[1])
            bounded = math.prod(_bounded(height, width, limits))
            run = max(1e-3, bounded / OCR_DETECTION_SIDE**2)
            return run + _decode_units(height, width, bounded)
        case OcrInput(image=image):
            height, width = int(image.shape[0]), int(image.shape[1])
            run = _detection_pages(height, width, limits)
            return run + _decode_units(height, width, math.prod(_bounded(height, width, limits)))
        case ChatInput(max_tokens=max_tokens):
            return _chat_tokens(item) + max_tokens
    raise TypeError(f"not a task item: {type(item).__name__}")


def _chat_tokens(item: ChatInput) -> int:
    """A chat's text tokens, its messages' or its raw prompt's (characters / 4)."""
    raw = _approx_tokens(item.prompt) if item.prompt is not None else 0
    return sum(_approx_tokens(m.content) for m in item.messages) + raw


def refuse_engine_only(item: ChatInput, runtime: str) -> None:
    """Refuse an item that asks for what only the external engines give: tool
    calls, an answer held to JSON, or log probabilities."""
    engines = "a model served by llama.cpp or vLLM (runtime: external) can"
    if item.tools is not None or any(m.tool_calls for m in item.messages):
        raise InvalidInputError(f"tools: {runtime} cannot call tools; {engines}")
    if item.response_format is not None:
        raise InvalidInputError(
            f"response_format: {runtime} cannot hold an answer to JSON; {engines}"
        )
    if item.logprobs is not None:
        raise InvalidInputError(f"logprobs: {runtime} does not give them; {engines}")


def _check_item(
    index: int, item: object, limits: InputLimits, count_tokens: Callable[[str], int] | None
) -> None:
    """Refuse an item the model would not run whole: a text over its window
    when the card says ``truncate: false`` (counted by ``count_tokens``, the
    model's tokenizer, where given; else characters / 4), a chat over its
    token limit, an image or a prompt for a model that reads neither, a text
    that is not Unicode."""
    _check_unicode(index, item)
    _check_vision(item, limits)
    match item:
        case TextInput(text=text):
            texts = [text]
        case RerankInput(query=query, document=document):
            texts = [query, document]
        case ChatInput(max_tokens=max_tokens):
            _check_max_tokens(max_tokens, limits)
            return
        case OcrInput() if limits.vision is not None:
            _check_max_tokens(ocr_max_tokens(item, limits), limits)
            return
        case OcrInput(image=image):
            _check_ocr_sides(int(image.shape[0]), int(image.shape[1]), limits)
            return
        case SpeechInput(text=text) if "\x00" in text:
            # espeak-ng reads a C string: a NUL failed the voice (a 500).
            raise InvalidInputError(
                f"input[{index}] holds a NUL character (at character {text.index(chr(0))}):"
                " speech reads text without one"
            )
        case _:
            return
    window = limits.text_window
    if limits.truncate or window is None:
        return
    for text in texts:
        tokens = count_tokens(text) if count_tokens else _approx_tokens(text)
        if tokens > window:
            estimated = f"about {tokens:,} tokens (characters / 4)"
            size = f"{tokens:,} tokens" if count_tokens else estimated
            raise PayloadTooLargeError(
                f"input[{index}] is {size},"
                f" over the model's window of {window:,} tokens; its card says truncate: false"
            )


def _check_ocr_sides(height: int, width: int, limits: InputLimits) -> None:
    """Refuse an image whose short side rapidocr's first resize makes 0 pixels
    (its long side brought to ``ocr_max_side``, each side then rounded to a
    multiple of 32): rapidocr raises on it (ResizeImgError, a 500)."""
    long_side, short_side = max(height, width), min(height, width)
    if long_side <= limits.ocr_max_side:
        return
    ratio = limits.ocr_max_side / long_side
    if round(int(short_side * ratio) / 32) == 0:
        raise InvalidInputError(
            f"an image of {width} x {height} pixels is too thin to read: with its long side"
            f" brought to {limits.ocr_max_side:,} pixels its short side is under 17"
        )


def _texts_of(item: object) -> list[str]:
    match item:
        case TextInput(text=text) | TranslateInput(text=text) | SpeechInput(text=text):
            return [text]
        case RerankInput(query=query, document=document):
            return [query, document]
        case ChatInput(messages=messages, stop=stop, prompt=prompt):
            prompts = [] if prompt is None else [prompt]
            return [m.content for m in messages] + list(stop) + prompts
        case OcrInput(prompt=str(prompt)):
            return [prompt]
        case _:
            return []


def _check_unicode(index: int, item: object) -> None:
    """Refuse a text with a lone surrogate: JSON's escapes (``"\\ud800"``) make
    one, Python's str holds it, and UTF-8, which every tokenizer reads, cannot
    encode it (they failed on it, a 500)."""
    for text in _texts_of(item):
        if text.isascii():
            continue
        try:
            text.encode()
        except UnicodeEncodeError as e:
            raise InvalidInputError(
                f"input[{index}] holds a lone surrogate (U+{ord(text[e.start]):04X}"
                f" at character {e.start}): not Unicode text"
            ) from None


def _check_max_tokens(max_tokens: int, limits: InputLimits) -> None:
    if max_tokens < 1:
        raise InvalidInputError(f"max_tokens must be at least 1, got {max_tokens}")
    if limits.max_new_tokens is not None and max_tokens > limits.max_new_tokens:
        raise InvalidInputError(
            f"max_tokens {max_tokens} is over this model's limit of {limits.max_new_tokens}"
        )


def _check_vision(item: object, limits: InputLimits) -> None:
    """Images and prompts go to vision-language models only, in shapes their
    processor takes."""
    match item:
        case OcrInput(image=image, prompt=prompt, max_tokens=max_tokens):
            images = [image]
            if limits.vision is None and (prompt is not None or max_tokens is not None):
                raise TaskMismatchError("prompt and max_tokens need a vision-language OCR model")
        case ChatInput(messages=messages):
            images = [i for m in messages for i in m.images]
            if limits.vision is None and images:
                raise TaskMismatchError("this model does not take images")
        case _:
            return
    if limits.vision is None:
        return
    ratio = limits.vision.max_aspect_ratio
    for image in images:
        height, width = max(1, int(image.shape[0])), max(1, int(image.shape[1]))
        if max(height, width) / min(height, width) > ratio:
            raise InvalidInputError(
                f"an image of {width} x {height} pixels is over the aspect ratio of {ratio:g}"
            )


# Characters of a text a truncating model's window of N tokens is read from,
# at most N times this: its tokenizer makes every token of a text before it
# cuts to the window (15 MiB of text held 1.3 GB for seconds, for 256 tokens),
# and a WordPiece token spans at most 100 characters of a word (a longer word is
# one unknown token). Only a text whose first N x 100 characters make fewer
# than N tokens (runs of whitespace, words over 100 characters) reads
# otherwise than whole.
MAX_CHARS_PER_TOKEN = 100


def cut_to_window(items: Sequence[Any], limits: InputLimits) -> Sequence[Any]:
    """``items`` with each text over a truncating window's characters cut to
    them (``MAX_CHARS_PER_TOKEN``); the same ``items`` where none is."""
    if not limits.truncate or limits.text_window is None:
        return items
    most = limits.text_window * MAX_CHARS_PER_TOKEN

    def cut(item: Any) -> Any:
        match item:
            case TextInput(text=text) if len(text) > most:
                return TextInput(text[:most])
            case RerankInput(query=query, document=document) if (
                max(len(query), len(document)) > most
            ):
                return RerankInput(query[:most], document[:most])
        return item

    cut_items = [cut(item) for item in items]
    return items if all(a is b for a, b in zip(cut_items, items, strict=True)) else cut_items


def request_units(
    items: Sequence[object],
    limits: InputLimits,
    count_tokens: Callable[[str], int] | None = None,
) -> float:
    """A request's work units, once each item is checked against ``limits``
    (texts of a ``truncate: false`` card counted by ``count_tokens`` where given)."""
    for index, item in enumerate(items):
        _check_item(index, item, limits, count_tokens)
    return sum(work_units(item, limits) for item in items)


def item_images(items: Sequence[object]) -> list[ItemImage]:
    """The images ``items`` carry: OCR pages and crops, chat messages' images."""
    images: list[ItemImage] = []
    for item in items:
        match item:
            case OcrInput(image=image):
                images.append(image)
            case ChatInput(messages=messages):
                images.extend(i for m in messages for i in m.images)
    return images
