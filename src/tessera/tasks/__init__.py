"""What each task means: its inputs, outputs and work unit."""

from tessera.tasks.types import (
    ChatInput,
    ChatMessage,
    ChatOutput,
    ClassifyOutput,
    EmbedInput,
    LabelScore,
    OcrInput,
    OcrLine,
    OcrOutput,
    RerankInput,
    SpeechInput,
    SpeechOutput,
    Task,
    TextInput,
    TranslateInput,
    work_units,
)

__all__ = [
    "ChatInput",
    "ChatMessage",
    "ChatOutput",
    "ClassifyOutput",
    "EmbedInput",
    "LabelScore",
    "OcrInput",
    "OcrLine",
    "OcrOutput",
    "RerankInput",
    "SpeechInput",
    "SpeechOutput",
    "Task",
    "TextInput",
    "TranslateInput",
    "work_units",
]
