"""The ``hf-vision-ocr`` adapter on a tiny random HunYuanVL (HunyuanOCR's
architecture) built here: pages with prompts, chats with images, streaming,
stop flags, and the card's image-token count against the processor's."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest
import yaml

from builders import make_queued, write_tiny_vl_card
from tessera.errors import ModelUnavailableError
from tessera.repository import read_spec
from tessera.request import with_stops
from tessera.runtimes.base import LoadedModel, OffloadingModel, standalone_context
from tessera.runtimes.registry import get_loader
from tessera.tasks.types import ChatInput, ChatMessage, ChatOutput, OcrInput, work_units

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def card(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_vl_card(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def model(card: Path) -> LoadedModel:
    spec = read_spec(card)
    return get_loader(spec.adapter).load(spec, standalone_context())


def page(height: int, width: int) -> np.ndarray:
    return np.full((height, width, 3), 255, dtype=np.uint8)


def test_a_page_with_a_prompt_is_answered_with_its_image_tokens_counted(
    card: Path, model: LoadedModel
) -> None:
    spec = read_spec(card)
    small, tall = OcrInput(page(200, 300), prompt="Read it."), OcrInput(page(640, 64))
    outputs = model.run([small, tall])
    assert all(isinstance(o, ChatOutput) for o in outputs)
    assert [o.completion_tokens for o in outputs] == [8, 8]  # max_tokens_default
    vision = spec.inputs.vision
    assert vision is not None
    # The difference of the prompts is the images' (the tall page's prompt is the default).
    tokens = [vision.image_tokens(200, 300), vision.image_tokens(640, 64)]
    assert tokens == [17, 26]  # the processor's grids: 6 x 8 and 24 x 2 patches
    # Units are image tokens, about the prompt's, and the new tokens allowed.
    assert work_units(small, spec.inputs) == 17 + 2 + 8
    alone = model.run([OcrInput(page(640, 64), prompt="Read it.")])
    assert alone[0].prompt_tokens - outputs[0].prompt_tokens == tokens[1] - tokens[0]


def test_a_chat_with_an_image_streams(model: LoadedModel) -> None:
    pieces: list[str] = []
    message = ChatMessage("user", "What does it say?", images=(page(100, 100),))
    (output,) = model.run([ChatInput((message,), max_tokens=6, on_text=pieces.append)])
    assert output.completion_tokens == 6
    assert "".join(pieces) == output.text


async def test_a_page_whose_caller_left_stops_at_the_next_step(model: LoadedModel) -> None:
    loop = asyncio.get_running_loop()
    gone, kept = make_queued(loop, "gone"), make_queued(loop, "kept")

    def leave(piece: str) -> None:
        gone.stop.set()  # the caller hangs up once its first piece is out

    message = ChatMessage("user", "Read it.", images=(page(100, 100),))
    items = [
        ChatInput((message,), max_tokens=40, on_text=leave),
        OcrInput(page(100, 100), max_tokens=40),
    ]
    left, full = with_stops(model.run, [gone, kept])(items)
    assert full.completion_tokens == 40  # the other row of the batch runs on
    assert 1 <= left.completion_tokens <= 3


def test_a_card_whose_vision_options_are_not_the_processors_is_refused(
    card: Path, tmp_path: Path
) -> None:
    raw = yaml.safe_load((card / "model.yaml").read_text())
    raw["options"]["vision"]["max_pixels"] = 256 * 256
    raw["source"] = {"path": str(card / "weights")}
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(raw))
    spec = read_spec(tmp_path)
    with pytest.raises(ModelUnavailableError, match="disagree"):
        get_loader(spec.adapter).load(spec, standalone_context())


def test_the_model_waits_in_the_host_tier_and_comes_back_with_the_same_answer(
    card: Path,
) -> None:
    spec = read_spec(card)
    model = get_loader(spec.adapter).load(spec, standalone_context())
    try:
        assert isinstance(model, OffloadingModel)
        before = model.run([OcrInput(page(200, 300), prompt="Read it.")])
        held = model.offload()
        assert held is not None  # on the CPU: its safetensors' mappings let go
        assert "mapped weight files" in held.method
        with pytest.raises(ModelUnavailableError, match="host tier"):
            model.run([OcrInput(page(200, 300))])
        model.restore()
        assert model.run([OcrInput(page(200, 300), prompt="Read it.")]) == before
    finally:
        model.unload()
