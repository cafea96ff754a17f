"""A vision-language OCR model's instructions by task (text, fields by names or
by a JSON schema, translate), the JSON read back from its answer, and the work
units of its items: the image's tokens, the prompt's and the new tokens allowed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tessera.errors import InvalidInputError
from tessera.tasks.prompts import DEFAULT_PROMPTS, ocr_prompt, parse_fields
from tessera.tasks.types import (
    ChatInput,
    ChatMessage,
    InputLimits,
    OcrInput,
    VisionLimits,
    work_units,
)

VISION = VisionLimits(patch_size=16, merge_size=2, min_pixels=64 * 64, max_pixels=512 * 512)
LIMITS = InputLimits(vision=VISION, max_tokens_default=100)


def page(height: int, width: int) -> np.ndarray:
    return np.zeros((height, width, 3), dtype=np.uint8)


def schema_in(prompt: str) -> object:
    return json.loads(prompt[prompt.index("{") :])


def test_text_is_the_default_instruction_or_the_cards_own() -> None:
    assert ocr_prompt(None, "text") == DEFAULT_PROMPTS["text"]
    assert ocr_prompt({"text": "Read the page."}, "text") == "Read the page."


def test_fields_by_names_become_a_schema_of_required_strings() -> None:
    prompt = ocr_prompt(None, "fields", fields=["total", "date"])
    assert schema_in(prompt) == {
        "type": "object",
        "properties": {"total": {"type": "string"}, "date": {"type": "string"}},
        "required": ["total", "date"],
    }


def test_a_json_schema_is_passed_as_it_is_in_the_cards_wording() -> None:
    schema = {"type": "object", "properties": {"total": {"type": "number"}}}
    prompt = ocr_prompt({"fields": "Fill {fields} now."}, "fields", fields=schema)
    assert prompt == f"Fill {json.dumps(schema)} now."
    with pytest.raises(InvalidInputError, match="needs 'fields'"):
        ocr_prompt(None, "fields")


def test_translate_names_its_language() -> None:
    assert ocr_prompt(None, "translate", language=" French ").endswith("into French.")
    assert ocr_prompt({"translate": "To {language}:"}, "translate", language="pt") == "To pt:"
    with pytest.raises(InvalidInputError, match="needs 'language'"):
        ocr_prompt(None, "translate", language="  ")


@pytest.mark.parametrize(
    ("text", "fields"),
    [
        ('{"total": "9.99"}', {"total": "9.99"}),
        ('```json\n{"total": "9.99"}\n```', {"total": "9.99"}),
        ("the total is 9.99", None),
    ],
)
def test_the_fields_are_the_json_the_model_wrote(text: str, fields: object) -> None:
    assert parse_fields(text) == fields


def test_a_page_costs_its_image_tokens_its_prompt_and_its_new_tokens() -> None:
    tokens = VISION.image_tokens(320, 640)
    assert tokens == 10 * (20 + 1) + 2  # 10 x 20 merged patches, a token a row, two around
    assert work_units(OcrInput(page(320, 640), prompt="Read it."), LIMITS) == tokens + 2 + 100
    asked = OcrInput(page(320, 640), prompt="Read it.", max_tokens=7)
    assert work_units(asked, LIMITS) == tokens + 2 + 7


def test_a_chat_with_images_costs_every_images_tokens_its_text_and_max_tokens() -> None:
    message = ChatMessage("user", "Read both.", images=(page(320, 640), page(64, 64)))
    chat = ChatInput((message,), max_tokens=30)
    images = VISION.image_tokens(320, 640) + VISION.image_tokens(64, 64)
    assert work_units(chat, LIMITS) == images + 3 + 30
    # Without vision options the same chat is its text alone.
    assert work_units(chat, InputLimits()) == 3 + 30
