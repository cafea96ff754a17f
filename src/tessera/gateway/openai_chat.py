"""OpenAI's chat completions: the request (messages, tools, sampling,
response formats), its items, and its answer, whole or streamed.

Chat messages may carry images as ``image_url`` parts with ``data:`` URLs, for
a vision-language OCR model (the server fetches no remote URL).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tessera.engine import ServingEngine
from tessera.errors import InvalidInputError
from tessera.gateway.common import (
    JsonBodyRoute,
    engine_of,
    run_task,
)
from tessera.gateway.openai_stream import (
    Pieces,
    StreamEvents,
    listeners,
    sse_event,
    streamed,
    usage_of,
)
from tessera.tasks.image import decode_base64, read_image
from tessera.tasks.types import (
    ChatInput,
    ChatMessage,
    ChatOutput,
    Task,
    ToolCall,
)

# Bodies are JSON whatever their content type (``JsonBodyRoute``).
router = APIRouter(route_class=JsonBodyRoute)

# The most choices (``n``) one request may ask for: each is an item of its own.
MAX_CHOICES = 16


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str


class ToolCallIn(BaseModel):
    """A call an assistant made, in an earlier turn of the chat."""

    model_config = ConfigDict(extra="allow")

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


MAX_TOOLS = 128  # OpenAI's limit too


# A JSON schema's bounds (OpenAI's for structured outputs: 5,000 properties
# and 1,000 enum values in all; its 10 levels of objects are about 20 of JSON
# containers, and a few more of ``items``/``anyOf``). A schema becomes a
# grammar the model's engine compiles before its first token, holding the
# model meanwhile: 5,000 enum values held SmolLM2 in llama.cpp 25 s for every
# tenant, and 130 levels of objects failed as the schema was written out (a 500).
MAX_SCHEMA_DEPTH = 64
MAX_SCHEMA_PROPERTIES = 5000
MAX_SCHEMA_ENUM_VALUES = 1000


def check_json_schema(schema: object) -> None:
    """Refuse (``ValueError``: the request's 400) a schema past the bounds above."""
    properties = enums = 0
    stack: list[tuple[object, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(node, dict):
            named = node.get("properties")
            if isinstance(named, dict):
                properties += len(named)
            listed = node.get("enum")
            if isinstance(listed, list):
                enums += len(listed)
            children: Iterable[object] = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if properties > MAX_SCHEMA_PROPERTIES:
            raise ValueError(f"the JSON schema has over {MAX_SCHEMA_PROPERTIES} properties")
        if enums > MAX_SCHEMA_ENUM_VALUES:
            raise ValueError(f"the JSON schema has over {MAX_SCHEMA_ENUM_VALUES} enum values")
        stack.extend((child, depth + 1) for child in children)


class FunctionIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _bounded(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        check_json_schema(value)
        return value


class ToolIn(BaseModel):
    """A tool the model may call: a function, its parameters a JSON schema."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionIn


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: NamedFunction


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: free ``text``, any ``json_object``, or JSON
    of the schema in ``json_schema.schema``."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema":
            schema = (self.json_schema or {}).get("schema")
            if not isinstance(schema, dict):
                raise ValueError("type json_schema needs a json_schema object with a schema")
            check_json_schema(schema)
        return self

    def constraint(self) -> str | None:
        """The format as the runtimes take it (``ChatInput.response_format``):
        None for free text."""
        return None if self.type == "text" else self.model_dump_json(exclude_none=True)


MAX_LOGIT_BIAS = 300  # tokens a request may bias


class Sampling(BaseModel):
    """How chat and legacy completions choose their tokens (OpenAI's fields)."""

    model_config = ConfigDict(extra="allow")

    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: (
        Annotated[
            dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
            Field(max_length=MAX_LOGIT_BIAS),
        ]
        | None
    ) = None

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isascii() or not key.isdigit():
                raise ValueError(f'keys are token ids ("50256"), got {key!r}')
        return value

    def sampling(self, choice: int = 0) -> dict[str, Any]:
        """These fields as ``ChatInput`` takes them, for the ``choice``-th
        answer to a prompt: its seed is the next after the one before's (the
        request is reproducible, and its ``n`` choices are not all alike)."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stop": (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            "seed": None if self.seed is None else self.seed + choice,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": tuple(
                sorted((int(token), bias) for token, bias in (self.logit_bias or {}).items())
            ),
        }


class ChatRequest(Sampling):
    model: str
    messages: Annotated[list[ChatMessageIn], Field(min_length=1)]
    max_tokens: int | None = Field(default=None, ge=1, le=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=4096)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: Annotated[list[ToolIn], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _top_with_logprobs(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _no_legacy_functions(self) -> ChatRequest:
        """OpenAI's deprecated ``functions`` and ``function_call``: refused,
        not ignored (``tools`` and ``tool_choice`` say the same)."""
        extra = self.model_extra or {}
        if extra.get("functions") is not None or extra.get("function_call") is not None:
            raise ValueError(
                "functions and function_call are not served: give them as tools and tool_choice"
            )
        return self

    @model_validator(mode="after")
    def _tools_agree(self) -> ChatRequest:
        format_ = self.response_format
        check_tools(
            [tool.function.name for tool in self.tools or ()],
            *self._choice(),
            constrained=format_ is not None and format_.type != "text",
            format_field="response_format",
        )
        return self

    def _choice(self) -> tuple[str | None, str | None]:
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return None, choice.function.name
        return choice, None

    def tool_setup(self) -> dict[str, Any]:
        """The tools as ``ChatInput`` takes them; none where ``tool_choice`` is none."""
        tools = [tool.model_dump(exclude_none=True) for tool in self.tools or ()]
        return tool_fields(tools, *self._choice(), self.parallel_tool_calls)


def check_tools(
    names: list[str],
    mode: str | None,
    named: str | None,
    *,
    constrained: bool,
    format_field: str,
) -> None:
    """What chat and the Responses API ask of their tools (``names``): a name
    each; a ``tool_choice`` (a ``mode``, or a tool ``named``) only with tools,
    and a named one offered; no JSON constraint (``format_field``) beside them."""
    if len(set(names)) < len(names):
        raise ValueError("tools: each tool needs a name of its own")
    if (named is not None or mode not in (None, "none")) and not names:
        raise ValueError("tool_choice needs tools")
    if named is not None and named not in names:
        raise ValueError(f"tool_choice names {named!r}, which is not in tools")
    if names and mode != "none" and constrained:
        raise ValueError(f"{format_field} and tools do not go together here")


def tool_fields(
    tools: list[dict[str, Any]], mode: str | None, named: str | None, parallel: bool
) -> dict[str, Any]:
    """The tools (chat's form) as ``ChatInput`` takes them: ``tool_choice`` a
    tool's name or a mode (``auto`` unless given); none where it is none."""
    if not tools or mode == "none":
        return {}
    return {
        "tools": json.dumps(tools),
        "tool_choice": named or mode or "auto",
        "parallel_tool_calls": parallel,
    }


def _message(message: ChatMessageIn) -> ChatMessage:
    """A message's text and images (text parts joined, ``image_url`` parts
    decoded from their ``data:`` URLs: the server fetches nothing, a remote URL
    is refused), and the tool calls it made or the call it answers."""
    texts: list[str] = []
    images: list[Any] = []
    if isinstance(message.content, str):
        texts.append(message.content)
    for part in message.content if isinstance(message.content, list) else ():
        kind = part.get("type")
        if kind == "text":
            texts.append(str(part.get("text", "")))
        elif kind == "image_url":
            images.append(image_of(part.get("image_url")))
        else:
            raise InvalidInputError(f"content part type {kind!r} is not supported")
    return ChatMessage(
        message.role,
        "".join(texts),
        images=tuple(images),
        tool_calls=tuple(
            ToolCall(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or ()
        ),
        tool_call_id=message.tool_call_id,
    )


def image_of(image_url: Any) -> Any:
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str) or not url:
        raise InvalidInputError("an image_url part needs a url")
    if not url.startswith("data:"):
        raise InvalidInputError(
            "image_url must be a data: URL (data:image/png;base64,...): the server fetches nothing"
        )
    return read_image(decode_base64(url))


def chat_inputs(body: ChatRequest, pieces: Pieces | None = None) -> list[ChatInput]:
    """An item a choice (``n``); with ``pieces``, each streams its text there."""
    response_format = body.response_format
    messages = tuple(_message(m) for m in body.messages)
    return [
        ChatInput(
            messages=messages,
            max_tokens=body.max_completion_tokens or body.max_tokens or 128,
            **body.sampling(choice),
            **body.tool_setup(),
            **stream,
            response_format=None if response_format is None else response_format.constraint(),
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        )
        for choice, stream in enumerate(listeners(pieces, body.n))
    ]


def chat_task(engine: ServingEngine, model: str) -> Task:
    """A vision-language OCR model answers chats too (its task is ``ocr``);
    any other model is asked to generate, and refuses if it does not."""
    spec = engine.spec(model)
    return spec.task if spec.inputs.vision is not None else Task.GENERATE


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatRequest, request: Request) -> Response:
    completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    task = chat_task(engine_of(request), body.model)
    if body.stream:
        pieces: Pieces = asyncio.Queue()
        items = chat_inputs(body, pieces)
        events = _chat_events(body, completion_id, created)
        return await streamed(request, body.model, task, items, pieces, events)
    outputs = await run_task(request, body.model, task, chat_inputs(body))
    return JSONResponse(completion_body(body.model, outputs, completion_id, created))


def completion_body(
    model: str, outputs: list[ChatOutput], completion_id: str, created: int
) -> dict[str, Any]:
    """A chat's answer: a choice an output."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "message": _assistant_message(output),
                "logprobs": _logprobs_of(output),
                "finish_reason": output.finish_reason,
            }
            for index, output in enumerate(outputs)
        ],
        "usage": usage_of(*outputs, choices=len(outputs)),
    }


def _assistant_message(output: ChatOutput) -> dict[str, Any]:
    """A choice's message: its text, or its tool calls (and text where it has
    any beside them: null where it has none, as OpenAI answers)."""
    if not output.tool_calls:
        return {"role": "assistant", "content": output.text}
    return {
        "role": "assistant",
        "content": output.text or None,
        "tool_calls": [call.openai() for call in output.tool_calls],
    }


def _logprobs_of(output: ChatOutput) -> dict[str, Any] | None:
    """A choice's ``logprobs``: its tokens', where they were asked for."""
    return None if output.logprobs is None else {"content": list(output.logprobs)}


def _chunk(
    completion_id: str,
    created: int,
    model: str,
    delta: dict[str, Any] | None,
    usage: dict[str, int] | None = None,
    *,
    index: int = 0,
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
) -> str:
    """One chat chunk: choice ``index``'s ``delta`` (and ``logprobs``), or
    (``delta`` None) no choice, with ``usage``."""
    choices: list[dict[str, Any]] = []
    if delta is not None:
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason}
        if logprobs is not None:
            choice["logprobs"] = logprobs
        choices.append(choice)
    return sse_event("chat.completion.chunk", completion_id, created, model, choices, usage)


def wants_usage(options: StreamOptions | None) -> bool:
    return options is not None and options.include_usage


def _chat_events(body: ChatRequest, completion_id: str, created: int) -> StreamEvents:
    """A chat's chunks: a role chunk a choice first, its content as it comes
    (with its tokens' logprobs, where they come with it), its finish reason
    (and the logprobs not sent yet) last; with
    ``stream_options.include_usage``, a last chunk of no choices with the
    usage, as OpenAI sends it."""

    def chunk(
        delta: dict[str, Any] | None, usage: dict[str, int] | None = None, **choice: Any
    ) -> str:
        return _chunk(completion_id, created, body.model, delta, usage, **choice)

    def end(index: int, output: ChatOutput) -> str:
        """Its tool calls (whole, in one delta), then its finish reason."""
        calls = [{"index": i, **call.openai()} for i, call in enumerate(output.tool_calls)]
        logprobs = _logprobs_of(output)
        finish = chunk({}, index=index, finish_reason=output.finish_reason, logprobs=logprobs)
        return (chunk({"tool_calls": calls}, index=index) if calls else "") + finish

    role = {"role": "assistant", "content": ""}
    return StreamEvents(
        opening=[chunk(role, index=index) for index in range(body.n)],
        piece=lambda piece: chunk(
            {"content": piece.text},
            index=piece.index,
            logprobs={"content": list(piece.logprobs)} if piece.logprobs else None,
        ),
        end=end,
        usage=(lambda tokens: chunk(None, tokens)) if wants_usage(body.stream_options) else None,
        choices=body.n,
    )
