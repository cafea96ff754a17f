"""Tool calls (OpenAI's ``tools`` and ``tool_choice``) on the external engines.

vLLM calls tools itself (its chat templates render them, its parsers read the
calls back) and takes OpenAI's fields as they are (``native``). llama.cpp as
built here does not: xllamacpp's server renders no tools into the prompt and
constrains nothing for them (measured: a chat with tools and ``tool_choice:
required`` got the same prompt tokens and free text as one without). For such
an engine the tools go the way llama.cpp's own "generic" format takes them
(``generic_messages``, ``generic_schema``): they are described in a system
message, and the answer is held, by the engine's JSON-schema constraint, to
``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`` (a listed tool,
its ``parameters`` the schema of its arguments) or, where the choice is
``auto``, ``{"response": "..."}``; ``read_generic`` reads that back into
OpenAI's tool calls (each an id of its own) or text. Earlier turns go back
the same way: an assistant's calls as that JSON, a tool's result as a
``tool`` turn.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

from tessera.tasks.types import ChatInput, ChatMessage, ToolCall


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def native_fields(item: ChatInput) -> dict[str, Any]:
    """OpenAI's tool fields of a request, for an engine that calls tools itself."""
    if item.tools is None or item.tool_choice is None:
        return {}
    choice: Any = item.tool_choice
    if choice not in ("auto", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    fields: dict[str, Any] = {"tools": json.loads(item.tools), "tool_choice": choice}
    if not item.parallel_tool_calls:
        fields["parallel_tool_calls"] = False
    return fields


def _offered(item: ChatInput) -> list[dict[str, Any]]:
    """The functions this item may call: every tool, or the one named."""
    functions = [tool["function"] for tool in json.loads(item.tools or "[]")]
    if item.tool_choice in (None, "auto", "required"):
        return functions
    return [f for f in functions if f["name"] == item.tool_choice]


def generic_schema(item: ChatInput) -> dict[str, Any]:
    """The JSON schema that holds the answer to calls of the offered tools
    (or, with ``auto``, to a text answer instead)."""
    calls = {
        "type": "array",
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": f["name"]},
                        "arguments": f.get("parameters") or {"type": "object"},
                    },
                    "required": ["name", "arguments"],
                }
                for f in _offered(item)
            ]
        },
        "minItems": 1,
    }
    if not item.parallel_tool_calls:
        calls["maxItems"] = 1
    call = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"]}
    if item.tool_choice != "auto":
        return call
    text = {
        "type": "object",
        "properties": {"response": {"type": "string"}},
        "required": ["response"],
    }
    return {"anyOf": [call, text]}


def _instructions(item: ChatInput) -> str:
    described = [
        {key: f[key] for key in ("name", "description", "parameters") if key in f}
        for f in _offered(item)
    ]
    text = (
        "You can call these tools (each with arguments that follow its JSON schema "
        f"of parameters):\n{json.dumps(described, ensure_ascii=False)}\n\n"
        'To call tools, answer with JSON only: {"tool_calls": [{"name": "<a tool\'s name>", '
        '"arguments": {<its arguments>}}]}.'
    )
    if item.tool_choice == "auto":
        text += ' To answer without a tool, answer with JSON only: {"response": "<your answer>"}.'
    return text


def generic_messages(
    item: ChatInput, content: Callable[[ChatMessage], Any]
) -> list[dict[str, Any]]:
    """The chat as OpenAI messages for an engine that calls no tools itself:
    the tools' description in the system message, earlier calls as the JSON
    the answer is held to; ``content`` gives a message's content."""
    messages: list[dict[str, Any]] = []
    for m in item.messages:
        if m.tool_calls:
            calls = [{"name": c.name, "arguments": _arguments(c)} for c in m.tool_calls]
            messages.append({"role": m.role, "content": json.dumps({"tool_calls": calls})})
        else:
            messages.append({"role": m.role, "content": content(m)})
    if item.tools is None or item.tool_choice is None:
        return messages
    instructions = _instructions(item)
    if messages and messages[0]["role"] == "system" and isinstance(messages[0]["content"], str):
        system = {"role": "system", "content": f"{messages[0]['content']}\n\n{instructions}"}
        return [system, *messages[1:]]
    return [{"role": "system", "content": instructions}, *messages]


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.arguments)
    except ValueError:
        return call.arguments


def read_generic(text: str) -> tuple[str, tuple[ToolCall, ...]]:
    """An answer held to ``generic_schema``: its text, and its calls. One cut
    short at ``max_tokens`` is not whole JSON: a text answer's text so far is
    its text, a call cut short is none (the held JSON's scaffold is never
    shown as the answer: it was, ``{"tool_calls":`` with finish_reason length)."""
    try:
        answer = json.loads(text)
    except ValueError:
        return _cut_short(text), ()
    if not isinstance(answer, dict):
        return text, ()
    if isinstance(answer.get("response"), str):
        return answer["response"], ()
    calls = answer.get("tool_calls")
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        return text, ()
    return "", tuple(
        ToolCall(
            call_id(),
            str(c.get("name", "")),
            json.dumps(c.get("arguments", {}), ensure_ascii=False),
        )
        for c in calls
    )


_RESPONSE_START = re.compile(r'\s*\{\s*"response"\s*:\s*"')
# The longest tail a JSON string cut short may end in that does not decode:
# a backslash and part of a \uXXXX escape.
_CUT_ESCAPE = 6


def _cut_short(text: str) -> str:
    """The text so far of a ``{"response": "..."}`` answer cut short; "" for
    any other JSON cut short (a call's)."""
    start = _RESPONSE_START.match(text)
    if start is None:
        return ""
    rest = text[start.end() :]
    for end in range(len(rest), max(-1, len(rest) - _CUT_ESCAPE - 1), -1):
        try:
            decoded = json.loads(f'"{rest[:end]}"')
        except ValueError:
            continue
        return decoded if isinstance(decoded, str) else ""
    return ""


def native_message(m: ChatMessage, content: Any) -> dict[str, Any]:
    """One message as OpenAI writes it, its tool calls and tool call id with it."""
    # OpenAI's content of an assistant's turn that only called tools is null.
    message: dict[str, Any] = {
        "role": m.role,
        "content": content or None if m.tool_calls else content,
    }
    if m.tool_calls:
        message["tool_calls"] = [c.openai() for c in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    return message
