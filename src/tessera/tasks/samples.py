"""Representative items per task, for warm-up batches (their activation peaks
seed the reservation statistics) and for the benchmarks."""

from __future__ import annotations

from typing import Any

import numpy as np

from tessera.tasks.types import (
    ChatInput,
    ChatMessage,
    OcrInput,
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
