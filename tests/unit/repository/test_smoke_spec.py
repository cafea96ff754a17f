"""``smoke`` on a model card: the checks a new version must answer, and the
items they become."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tessera.errors import ConfigError
from tessera.repository.spec import SmokeCheck, parse_spec
from tessera.tasks.samples import answer_text, smoke_item
from tessera.tasks.types import (
    ChatInput,
    ChatOutput,
    ClassifyOutput,
    LabelScore,
    OcrLine,
    OcrOutput,
    RerankInput,
    Task,
    TextInput,
)


def card(task: str, smoke: Any) -> dict[str, Any]:
    return {"name": "m", "task": task, "runtime": "torch", "adapter": "fake", "smoke": smoke}


def test_checks_are_read_one_or_many_and_become_the_tasks_items(tmp_path: Path) -> None:
    assert parse_spec({**card("embedding", None)}, tmp_path).smoke == ()
    one = parse_spec(card("classify", {"input": "refund please", "expect": "billing"}), tmp_path)
    assert one.smoke == (SmokeCheck("refund please", "billing"),)
    rerank = parse_spec(card("rerank", [{"input": {"query": "q", "document": "d"}}]), tmp_path)
    assert smoke_item(Task.RERANK, rerank.smoke[0].input, tmp_path) == RerankInput("q", "d")
    assert smoke_item(Task.EMBEDDING, "hi", tmp_path) == TextInput("hi")
    chat = smoke_item(Task.GENERATE, "Say hi.", tmp_path)
    assert isinstance(chat, ChatInput)
    assert chat.messages[0].content == "Say hi."
    Image.new("RGB", (40, 20), "white").save(tmp_path / "page.png")
    ocr = parse_spec(card("ocr", {"input": "page.png", "expect": "Total"}), tmp_path)
    page = smoke_item(Task.OCR, ocr.smoke[0].input, tmp_path)
    assert page.image.shape == (20, 40, 3)


@pytest.mark.parametrize(
    ("task", "smoke", "message"),
    [
        ("embedding", [], "at least one check"),
        ("embedding", {"text": "x"}, "mapping of input"),
        ("embedding", {"input": "x", "extra": 1}, "mapping of input"),
        ("embedding", {"input": ""}, "must be a text"),
        ("embedding", {"input": "x", "expect": "y"}, "tasks that answer with text"),
        ("classify", {"input": "x", "expect": 3}, "expect is a text"),
        ("rerank", {"input": "x"}, "{query, document}"),
        ("rerank", {"input": {"query": "q", "document": 1}}, "texts"),
        ("ocr", {"input": "missing.png"}, "no image file"),
    ],
)
def test_a_bad_check_is_refused(tmp_path: Path, task: str, smoke: Any, message: str) -> None:
    with pytest.raises(ConfigError, match="smoke"):
        parse_spec(card(task, smoke), tmp_path)
    with pytest.raises(ConfigError, match=message.replace("{", r"\{").replace("}", r"\}")):
        parse_spec(card(task, smoke), tmp_path)


def test_the_text_an_expect_is_matched_against() -> None:
    assert answer_text("olá") == "olá"
    assert answer_text(ChatOutput("hello", 3, 1, "stop")) == "hello"
    top = ClassifyOutput((LabelScore("billing", 0.8), LabelScore("other", 0.2)))
    assert answer_text(top) == "billing"
    read = OcrOutput((OcrLine("Total", 0.9, ((0, 0),)), OcrLine("12.50", 0.9, ((0, 0),))))
    assert answer_text(read) == "Total\n12.50"
    assert answer_text(np.zeros(3)) is None
