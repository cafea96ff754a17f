"""Vision-language OCR through the external vLLM runtime, against
``tests/fakes/fake_vllm.py`` (a real engine process on loopback, loaded with
the runtime's own loader): OCR pages go as the chats the in-process
``hf-vision-ocr`` adapter runs (the same prompts), images as ``image_url``
parts with ``data:`` URLs; the fake echoes what arrived (its prompt, the
image's bytes and size) as JSON, and its usage. A card asking for images on
an engine that takes none is refused at load."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from fakes import write_fake_vllm_model
from tessera.errors import ModelUnavailableError
from tessera.repository import read_spec
from tessera.runtimes.base import standalone_context
from tessera.runtimes.external import ExternalModel
from tessera.runtimes.registry import get_loader
from tessera.tasks.image import encode_png
from tessera.tasks.prompts import ocr_prompt, page_chat, parse_fields
from tessera.tasks.types import ChatInput, ChatMessage, OcrInput, VisionLimits, work_units

VISION = {"patch_size": 14, "merge_size": 2, "min_pixels": 56 * 56, "max_pixels": 1024 * 1024}
PROMPTS = {"text": "Read every line of the page."}


def page(height: int, width: int, shade: int = 255) -> np.ndarray:
    image = np.full((height, width, 3), shade, dtype=np.uint8)
    image[height // 2, :, 0] = 0  # not uniform: its PNG has some bytes to it
    return image


def arrived(image: np.ndarray) -> dict[str, int]:
    """What the fake reports of an image tessera sent it."""
    return {"bytes": len(encode_png(image)), "width": image.shape[1], "height": image.shape[0]}


def fake_tokens(image: np.ndarray) -> int:
    """The fake's prompt tokens of an image (one per 32 x 32 block)."""
    return max(1, (image.shape[1] // 32) * (image.shape[0] // 32))


@pytest.fixture(scope="module")
def card(tmp_path_factory: pytest.TempPathFactory) -> Path:
    options: dict[str, Any] = {"vision": VISION, "prompts": PROMPTS, "max_tokens_default": 200}
    return write_fake_vllm_model(
        tmp_path_factory.mktemp("models"), "fake-ocr", task="ocr", **options
    )


@pytest.fixture(scope="module")
def model(card: Path) -> Iterator[ExternalModel]:
    spec = read_spec(card)
    model = get_loader(spec.adapter).load(spec, standalone_context(threads=1))
    assert isinstance(model, ExternalModel)
    yield model
    model.unload()


def test_ocr_pages_reach_the_engine_with_their_image_and_the_adapters_prompt(
    card: Path, model: ExternalModel
) -> None:
    spec = read_spec(card)
    fields = ocr_prompt(PROMPTS, "fields", fields=["total", "date"])
    translate = ocr_prompt(PROMPTS, "translate", language="French")
    pages = [page(200, 300), page(640, 64, shade=200), page(100, 120)]
    items = [
        OcrInput(pages[0]),  # the card's own plain-text prompt
        OcrInput(pages[1], prompt=fields),
        OcrInput(pages[2], prompt=translate, max_tokens=150),
    ]
    outputs = model.run(items)
    for item, image, output in zip(items, pages, outputs, strict=True):
        prompt = item.prompt or PROMPTS["text"]
        assert json.loads(output.text) == {"prompt": prompt, "images": [arrived(image)]}
        assert output.finish_reason == "stop"
        assert output.completion_tokens == len(output.text.split(" "))
        # The engine's usage: its count of the prompt, the image's tokens included.
        assert output.prompt_tokens == len(prompt.split()) + 4 + fake_tokens(image)
        # The very chat the in-process adapter would run for the page.
        (message,) = page_chat(item, PROMPTS, spec.inputs).messages
        assert message.content == prompt
    # fields: the answer is read back as the in-process adapter's is.
    assert parse_fields(outputs[1].text)["prompt"] == fields
    assert "French" in json.loads(outputs[2].text)["prompt"]


def test_work_units_count_the_image_tokens_from_the_cards_vision_options(card: Path) -> None:
    spec = read_spec(card)
    vision = VisionLimits(**VISION)
    assert spec.inputs.vision == vision
    item, prompt = OcrInput(page(200, 300)), "Read it."
    tokens = vision.image_tokens(200, 300)
    # The page's units: its image tokens, its prompt's, and the max_tokens it may write.
    assert work_units(item, spec.inputs) == tokens + 1 + 200
    assert work_units(OcrInput(page(200, 300), prompt=prompt, max_tokens=9), spec.inputs) == (
        tokens + 2 + 9
    )
    tall = OcrInput(page(1400, 70))
    assert work_units(tall, spec.inputs) - work_units(item, spec.inputs) == (
        vision.image_tokens(1400, 70) - tokens
    )


def test_a_chat_with_images_streams_them_to_the_engine(model: ExternalModel) -> None:
    images = (page(90, 90), page(64, 128, shade=100))
    message = ChatMessage("user", "What do they say?", images=images)
    pieces: list[str] = []
    full, cut = model.run(
        [
            ChatInput((message,), max_tokens=100, on_text=pieces.append),
            ChatInput((message,), max_tokens=3),
        ]
    )
    expected = {"prompt": "What do they say?", "images": [arrived(i) for i in images]}
    assert json.loads(full.text) == expected
    assert "".join(pieces) == full.text
    assert (full.finish_reason, cut.finish_reason, cut.completion_tokens) == ("stop", "length", 3)
    assert cut.prompt_tokens == full.prompt_tokens == 4 + 4 + sum(fake_tokens(i) for i in images)
    # A text chat to the same engine is still a text chat.
    (text,) = model.run([ChatInput((ChatMessage("user", "Hello"),), max_tokens=2)])
    assert text.text == "w0 w1"


def write_card(folder: Path, **card: Any) -> Path:
    folder.mkdir(parents=True)
    (folder / "model.gguf").write_bytes(b"GGUF" + b"\0" * 64)
    raw = {"name": folder.name, "runtime": "external", "memory": {"max_bytes": "64MiB"}, **card}
    (folder / "model.yaml").write_text(yaml.safe_dump(raw))
    return folder


def test_ocr_on_an_engine_that_takes_no_images_is_refused_at_load(tmp_path: Path) -> None:
    card = write_card(
        tmp_path / "gguf-ocr",
        task="ocr",
        engine="llamacpp",
        source={"path": "model.gguf"},
        options={"vision": VISION},
    )
    spec = read_spec(card)
    loader = get_loader(spec.adapter)
    with pytest.raises(ModelUnavailableError, match=r"llama\.cpp engine .* does not take images"):
        loader.load(spec, standalone_context(threads=1))
    with pytest.raises(ModelUnavailableError, match="does not take images"):
        loader.estimate_bytes(spec)


def test_ocr_on_vllm_without_vision_options_is_refused_at_load(tmp_path: Path) -> None:
    spec = read_spec(write_fake_vllm_model(tmp_path, "fake-blind", task="ocr"))
    with pytest.raises(ModelUnavailableError, match=r"options\.vision"):
        get_loader(spec.adapter).load(spec, standalone_context(threads=1))
