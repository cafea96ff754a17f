"""Work units count what the model will actually run: text to its window, OCR
pages after rapidocr's own resizes; a card's limits refuse what it would not run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tessera.errors import ConfigError, InvalidInputError, PayloadTooLargeError
from tessera.repository.spec import parse_spec
from tessera.tasks.types import (
    DECODE_PIXELS_PER_UNIT,
    MAX_CHARS_PER_TOKEN,
    ChatInput,
    ChatMessage,
    InputLimits,
    OcrInput,
    RerankInput,
    SpeechInput,
    TextInput,
    TranslateInput,
    cut_to_window,
    request_units,
    work_units,
)


def image(height: int, width: int) -> np.ndarray:
    return np.zeros((height, width, 3), dtype=np.uint8)


def test_a_small_page_costs_one_detection_page() -> None:
    assert work_units(OcrInput(image(192, 192))) == pytest.approx(1.0)
    assert work_units(OcrInput(image(736, 736))) == pytest.approx(1.0)


def test_a_tall_receipt_costs_its_aspect_and_a_large_scan_its_bounded_copy() -> None:
    assert work_units(OcrInput(image(1200, 400))) == pytest.approx(3.0)
    assert work_units(OcrInput(image(1472, 1472))) == pytest.approx(4.0)
    # A 9-megapixel scan is brought down to 2,000 pixels on its long side first:
    # 7.27 pages, not the 16.6 its own pixels would make; the pixels that resize
    # throws away are still decoded and held: 0.42 more.
    assert work_units(OcrInput(image(3000, 3000))) == pytest.approx(
        1984 * 1984 / 736**2 + (3000 * 3000 - 1984 * 1984) / DECODE_PIXELS_PER_UNIT
    )  # 2,000 rounds to 1,984 (x32)


def test_a_line_crop_costs_its_own_pixels_within_the_bound() -> None:
    assert work_units(OcrInput(image(32, 368), mode="line")) == pytest.approx(32 * 368 / 736**2)
    assert work_units(OcrInput(image(100, 4000), mode="line")) == pytest.approx(
        64 * 1984 / 736**2  # long side to 2,000, each side rounded to 32
        + (100 * 4000 - 64 * 1984) / DECODE_PIXELS_PER_UNIT
    )


@pytest.mark.parametrize(
    ("height", "width"),
    [(192, 192), (1200, 400), (3000, 3000), (3508, 2480), (100, 2000), (2000, 100), (20, 500)],
)
def test_ocr_pages_are_those_rapidocr_detects(height: int, width: int) -> None:
    """The same shape as rapidocr 3.10's pre-processing, vertical padding and
    detection resize make of the page (its own functions, no model)."""
    pytest.importorskip("rapidocr")
    from rapidocr.ch_ppocr_det.utils import DetPreProcess
    from rapidocr.utils.process_img import apply_vertical_padding, resize_image_within_bounds

    bounded, _, _ = resize_image_within_bounds(image(height, width), 30, 2000)
    padded, _ = apply_vertical_padding(bounded, {}, 8, 30)
    detected = DetPreProcess(736, "min").resize(padded)
    assert detected is not None
    pages = detected.shape[0] * detected.shape[1] / 736**2
    thrown_away = max(0, height * width - bounded.shape[0] * bounded.shape[1])
    decode = thrown_away / DECODE_PIXELS_PER_UNIT
    assert work_units(OcrInput(image(height, width))) == pytest.approx(pages + decode)


def test_text_counts_at_most_its_window() -> None:
    chunk = "word " * 1600  # a 1,600-word RAG chunk: 2,000 approximate tokens
    assert work_units(TextInput(chunk)) == 2000
    assert work_units(TextInput(chunk), InputLimits(text_window=256)) == 256
    assert work_units(TextInput("four"), InputLimits(text_window=256)) == 1
    pair = RerankInput("q" * 40, chunk)  # each side cut to the window
    assert work_units(pair, InputLimits(text_window=256)) == 10 + 256


def test_texts_over_a_truncating_window_are_cut_before_the_tokenizer_sees_them() -> None:
    limits = InputLimits(text_window=256)
    most = 256 * MAX_CHARS_PER_TOKEN
    short = [TextInput("word " * 100), RerankInput("q", "d")]
    assert cut_to_window(short, limits) is short  # nothing to cut: the same items
    huge = "word " * 3_000_000  # 15 MB of text, for 256 tokens
    cut = cut_to_window([TextInput(huge), RerankInput(huge, "d"), TextInput("x")], limits)
    assert cut == [TextInput(huge[:most]), RerankInput(huge[:most], "d"), TextInput("x")]
    assert work_units(cut[0], limits) == work_units(TextInput(huge), limits) == 256
    # Where the card refuses over-window texts, or knows no window, none is cut.
    for kept in (InputLimits(text_window=256, truncate=False), InputLimits()):
        items = [TextInput(huge)]
        assert cut_to_window(items, kept) is items


def test_truncate_false_refuses_an_over_window_text_with_the_limit() -> None:
    limits = InputLimits(text_window=256, truncate=False)
    assert request_units([TextInput("x" * 1024)], limits) == 256  # exactly the window
    with pytest.raises(PayloadTooLargeError, match=r"input\[1\] is about 257 tokens") as info:
        request_units([TextInput("x"), TextInput("x" * 1025)], limits)
    assert "window of 256 tokens" in str(info.value)
    with pytest.raises(PayloadTooLargeError):
        request_units([RerankInput("q", "x" * 1025)], limits)


def test_truncate_false_counts_with_the_models_tokenizer_where_given() -> None:
    limits = InputLimits(text_window=256, truncate=False)
    words = len  # a tokenizer of one token a character
    assert request_units([TextInput("x" * 256)], limits, words) == 64  # units stay estimated
    with pytest.raises(PayloadTooLargeError) as info:
        request_units([RerankInput("q", "x" * 257)], limits, words)
    assert str(info.value).startswith("input[0] is 257 tokens, over the model's window of 256")
    lenient = InputLimits(text_window=256)
    assert request_units([TextInput("x" * 2048)], lenient, words) == 256  # truncated, not counted


def test_chat_over_the_cards_token_limit_is_refused() -> None:
    limits = InputLimits(max_new_tokens=64)
    messages = (ChatMessage("user", "hi"),)
    assert request_units([ChatInput(messages, max_tokens=64)], limits) == 65
    with pytest.raises(InvalidInputError, match="limit of 64"):
        request_units([ChatInput(messages, max_tokens=65)], limits)


@pytest.mark.parametrize(
    "item",
    [
        TextInput("a\ud800"),
        RerankInput("q", "\udfffd"),
        TranslateInput("\ud83d"),
        SpeechInput("\udc00"),
        ChatInput((ChatMessage("user", "hi"),), stop=("\ud800",)),
        OcrInput(image(8, 8), prompt="\ud800"),
    ],
)
def test_a_text_with_a_lone_surrogate_is_refused(item: object) -> None:
    with pytest.raises(InvalidInputError, match=r"input\[1\] holds a lone surrogate"):
        request_units([TextInput("ok é"), item], InputLimits())


def test_text_with_surrogate_pairs_made_whole_is_served() -> None:
    assert request_units([TextInput("\U0001f30d é")], InputLimits()) > 0


def test_an_image_rapidocr_would_resize_to_no_rows_is_refused() -> None:
    # rapidocr brings the long side to 2,000 pixels, then rounds each side to
    # a multiple of 32: a short side of 16 pixels or fewer becomes 0.
    with pytest.raises(InvalidInputError, match="4000 x 33 pixels is too thin"):
        request_units([OcrInput(image(33, 4000))], InputLimits())
    with pytest.raises(InvalidInputError, match="too thin"):
        request_units([OcrInput(image(5000, 1), mode="line")], InputLimits())
    assert request_units([OcrInput(image(34, 4000))], InputLimits()) > 0  # 17 rows
    assert request_units([OcrInput(image(1, 2000))], InputLimits()) > 0  # not brought down


def card(task: str, **options: object) -> dict[str, object]:
    return {"task": task, "runtime": "torch", "adapter": "fake", "options": options}


def test_the_card_gives_the_limits(tmp_path: Path) -> None:
    assert parse_spec(card("embedding", max_length=256), tmp_path).inputs == InputLimits(256)
    assert parse_spec(card("rerank"), tmp_path).inputs.text_window == 512  # the default
    assert parse_spec(card("translate"), tmp_path).inputs.text_window is None
    strict = parse_spec(card("classify", truncate=False), tmp_path).inputs
    assert (strict.text_window, strict.truncate) == (512, False)
    chat = parse_spec(card("generate", max_tokens_limit=2048), tmp_path).inputs
    assert chat.max_new_tokens == 2048
    ocr = parse_spec(
        card("ocr", rapidocr_params={"Global.max_side_len": 1000, "Det.limit_side_len": 960}),
        tmp_path,
    ).inputs
    assert (ocr.ocr_max_side, ocr.ocr_min_side, ocr.ocr_detection_side) == (1000, 30, 960)
    with pytest.raises(ConfigError, match="truncate"):
        parse_spec(card("embedding", truncate="no"), tmp_path)
    with pytest.raises(ConfigError, match="max_length"):
        parse_spec(card("embedding", max_length=0), tmp_path)


def test_a_speech_text_with_a_nul_is_refused_and_other_tasks_take_one() -> None:
    with pytest.raises(
        InvalidInputError, match=r"input\[0\] holds a NUL character \(at character 1\)"
    ):
        request_units([SpeechInput("a\x00b")], InputLimits())
    assert request_units([TranslateInput("a\x00b")], InputLimits()) == 3
    assert request_units([TextInput("a\x00b")], InputLimits()) > 0
