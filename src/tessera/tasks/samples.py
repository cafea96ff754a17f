"""Representative items per task, for warm-up batches (their activation peaks
seed the reservation statistics) and for the benchmarks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tessera.tasks.types import (
    ChatInput,
    ChatMessage,
    ChatOutput,
    ClassifyOutput,
    OcrInput,
    OcrOutput,
    RerankInput,
    SpeechInput,
    Task,
    TextInput,
    TranslateInput,
)

SENTENCE = "The quick brown fox jumps over the lazy dog near the quiet river bank today."


def sample_page(height: int = 480, width: int = 640) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A white page with a few lines of dark text, BGR uint8."""
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=28)
    for i, line in enumerate(("Total 12.50 EUR", "Thank you for shopping", "Receipt 0042")):
        draw.text((24, 40 + i * 60), line, fill="black", font=font)
    rgb = np.asarray(image, dtype=np.uint8)
    return np.ascontiguousarray(rgb[:, :, ::-1])


def smoke_item(task: Task, value: Any, folder: Path) -> Any:
    """The item of a model card's smoke check (``repository.spec.SmokeCheck``)."""
    match task:
        case Task.EMBEDDING | Task.CLASSIFY:
            return TextInput(value)
        case Task.RERANK:
            return RerankInput(value["query"], value["document"])
        case Task.TRANSLATE:
            return TranslateInput(value)
        case Task.TTS:
            return SpeechInput(value)
        case Task.OCR:
            from tessera.tasks.image import decode_image

            return OcrInput(decode_image((folder / value).read_bytes()), "page")
        case Task.GENERATE:
            return ChatInput((ChatMessage("user", value),), max_tokens=32)


def answer_text(output: Any) -> str | None:
    """The text of an answer, for a smoke check's ``expect`` (None: no text)."""
    if isinstance(output, str):
        return output
    if isinstance(output, ChatOutput):
        return output.text
    if isinstance(output, ClassifyOutput):
        return " ".join(label.label for label in output.labels[:1])
    if isinstance(output, OcrOutput):
        return "\n".join(line.text for line in output.lines)
    return None


def warmup_items(task: Task, num_items: int) -> list[Any]:
    """``num_items`` typical items of ``task``."""
    match task:
        case Task.EMBEDDING | Task.CLASSIFY:
            return [TextInput(SENTENCE) for _ in range(num_items)]
        case Task.RERANK:
            return [RerankInput("Where does the fox jump?", SENTENCE) for _ in range(num_items)]
        case Task.TRANSLATE:
            return [TranslateInput("The weather is nice today.") for _ in range(num_items)]
        case Task.TTS:
            return [SpeechInput("Hello from tessera.") for _ in range(num_items)]
        case Task.OCR:
            page = sample_page()
            return [OcrInput(page, "page") for _ in range(num_items)]
        case Task.GENERATE:
            messages = (ChatMessage("user", "Say hello."),)
            return [ChatInput(messages, max_tokens=4) for _ in range(num_items)]
