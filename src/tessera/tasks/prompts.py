"""The instructions a vision-language OCR model is given, by OCR task.

``/v1/ocr`` takes a ``task``: ``text`` (read the page), ``fields`` (the named
fields, or those of a JSON schema, as JSON) or ``translate`` (into a
``language``), or a ``prompt`` of the caller's own. A model's card may give
its own wording (``options.prompts``: ``text``, ``fields`` with ``{fields}``,
``translate`` with ``{language}``), as models are trained on their own.
``page_chat`` is the chat a page becomes, for the in-process adapter and the
external vLLM engine alike.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from tessera.errors import InvalidInputError
from tessera.tasks.types import ChatInput, ChatMessage, InputLimits, OcrInput, ocr_max_tokens

OcrTask = Literal["text", "fields", "translate"]

DEFAULT_PROMPTS: dict[str, str] = {
    "text": "Extract all the text in the image, in reading order.",
    "fields": (
        "Extract these fields from the image and answer with JSON only, "
        "as this JSON schema describes: {fields}"
    ),
    "translate": "Extract the text in the image and translate it into {language}.",
}


def ocr_prompt(
    prompts: Any,
    task: OcrTask,
    *,
    fields: list[str] | dict[str, Any] | None = None,
    language: str | None = None,
) -> str:
    """The instruction for ``task``, in the card's wording (``prompts``) or ours."""
    custom = prompts.get(task) if isinstance(prompts, dict) else None
    template = custom if isinstance(custom, str) else DEFAULT_PROMPTS[task]
    if task == "fields":
        if not fields:
            raise InvalidInputError("task 'fields' needs 'fields': names or a JSON schema")
        schema = fields if isinstance(fields, dict) else _schema_of(fields)
        return template.replace("{fields}", json.dumps(schema, ensure_ascii=False))
    if task == "translate":
        if not language or not language.strip():
            raise InvalidInputError("task 'translate' needs 'language'")
        return template.replace("{language}", language.strip())
    return template


def page_chat(item: OcrInput, prompts: Any, limits: InputLimits) -> ChatInput:
    """The chat a vision-language model is asked for an OCR page: the page, then
    its prompt (the card's plain-text prompt, ``prompts``, when it has none),
    writing at most its ``max_tokens`` (the card's default when it does not
    say). In process (``hf-vision-ocr``) and out (the external vLLM engine) alike."""
    prompt = item.prompt or ocr_prompt(prompts, "text")
    message = ChatMessage("user", prompt, images=(item.image,))
    return ChatInput((message,), max_tokens=ocr_max_tokens(item, limits))


def _schema_of(names: list[str]) -> dict[str, Any]:
    """A JSON schema of string fields, from their names."""
    return {
        "type": "object",
        "properties": {name: {"type": "string"} for name in names},
        "required": list(names),
    }


def parse_fields(text: str) -> Any:
    """The JSON a model wrote (inside a Markdown code fence or not), or None."""
    body = text.strip()
    if body.startswith("```"):
        body = body.strip("`")
        body = body.removeprefix("json").strip()
    try:
        return json.loads(body)
    except ValueError:
        return None
