"""OpenAI-compatible endpoints: embeddings, chat completions, the legacy
completions, speech, models.

Chat messages may carry images as ``image_url`` parts with ``data:`` URLs, for
a vision-language OCR model (the server fetches no remote URL). A legacy
completion continues its prompt as it is, without the model's chat template.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypedDict, TypeVar

import numpy as np
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tessera.engine import ServingEngine
from tessera.errors import InvalidInputError, ModelNotFoundError, TesseraError
from tessera.gateway.common import (
    engine_of,
    run_task,
    started_task,
    unless_disconnected,
    visible_models,
)
from tessera.gateway.errors import OPENAI, error_body, status_of
from tessera.tasks.audio import AudioFormat, check_format, encoded
from tessera.tasks.image import decode_base64, read_image
from tessera.tasks.types import (
    ChatInput,
    ChatMessage,
    ChatOutput,
    InputLimits,
    SpeechInput,
    Task,
    TextInput,
    ToolCall,
    work_units,
)

router = APIRouter()
T = TypeVar("T")
# The most choices (``n``) one request may ask for: each is an item of its own.
MAX_CHOICES = 16


def texts_of(value: str | list[str], field: str = "input") -> list[str]:
    """A string or a list of strings, none empty."""
    texts = [value] if isinstance(value, str) else list(value)
    if not texts:
        raise InvalidInputError(f"{field} must not be empty")
    for i, text in enumerate(texts):
        if not text.strip():
            raise InvalidInputError(f"{field}[{i}] must not be an empty string")
    return texts


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _not_token_ids(cls, value: object) -> object:
        return _text_not_token_ids(
            value,
            "each model counts its own tokens;"
            " LangChain's OpenAIEmbeddings: check_embedding_ctx_length=False",
        )


def _text_not_token_ids(value: object, advice: str) -> object:
    """OpenAI's API also takes token ids (tiktoken's, which some clients send
    by default); each model here has a tokenizer of its own."""
    if isinstance(value, list) and value and all(_token_ids(v) for v in value):
        raise ValueError(f"token ids are not taken as input: send the text ({advice})")
    return value


def _token_ids(value: object) -> bool:
    """An int, or a non-empty list of ints: a token id, or a text as token ids."""
    if isinstance(value, list):
        return bool(value) and all(_token_ids(v) and not isinstance(v, list) for v in value)
    return isinstance(value, int) and not isinstance(value, bool)


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    items = [TextInput(t) for t in texts_of(body.input)]
    vectors = await run_task(request, body.model, Task.EMBEDDING, items)
    limits = engine_of(request).spec(body.model).inputs
    # orjson writes float32 arrays directly: about 15x faster than json on 384 floats.
    return Response(
        orjson.dumps(
            embeddings_body(body, items, vectors, limits), option=orjson.OPT_SERIALIZE_NUMPY
        ),
        media_type="application/json",
    )


def shortened(matrix: np.ndarray[Any, Any], dimensions: int) -> np.ndarray[Any, Any]:
    """The first ``dimensions`` of each row (OpenAI's ``dimensions``); rows of
    unit length are scaled to unit length again, as OpenAI's shortened
    embeddings are. 400 for more dimensions than the model gives."""
    if dimensions > matrix.shape[1]:
        raise InvalidInputError(
            f"dimensions is {dimensions}; this model's embeddings have {matrix.shape[1]}"
        )
    unit = np.abs(np.linalg.norm(matrix, axis=1) - 1.0) < 1e-3
    rows = matrix[:, :dimensions]
    return unit_rows(rows) if dimensions < matrix.shape[1] and unit.all() else rows


def unit_rows(matrix: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Each row scaled to unit length (a zero row stays zero)."""
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    rows: np.ndarray[Any, Any] = matrix / np.maximum(norms, np.finfo(np.float32).tiny)
    return rows


def embedding_matrix(vectors: list[Any], dimensions: int | None) -> np.ndarray[Any, Any]:
    """A model's vectors as float32 rows, ``shortened`` to ``dimensions`` if given."""
    matrix = np.stack([np.asarray(v, dtype=np.float32) for v in vectors])
    return matrix if dimensions is None else shortened(matrix, dimensions)


def embeddings_body(
    body: EmbeddingRequest, items: list[TextInput], vectors: list[Any], limits: InputLimits
) -> dict[str, Any]:
    """The answer (its float vectors numpy rows, for orjson)."""
    matrix = embedding_matrix(vectors, body.dimensions)
    data: list[dict[str, Any]] = []
    for index, row in enumerate(matrix):
        embedding: Any = (
            base64.b64encode(row.astype("<f4").tobytes()).decode()
            if body.encoding_format == "base64"
            else row
        )
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    tokens = int(sum(work_units(i, limits) for i in items))  # as charged: to the window
    return {
        "object": "list",
        "data": data,
        "model": body.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


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


def usage_of(*outputs: ChatOutput, choices: int = 1) -> dict[str, int]:
    """The tokens of one answer, or of several together: ``choices`` in turn
    answer one prompt, counted once (as OpenAI and vLLM count it for ``n``)."""
    prompt = sum(o.prompt_tokens for o in outputs[:: max(1, choices)])
    completion = sum(o.completion_tokens for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatRequest, request: Request) -> Response:
    completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    task = chat_task(engine_of(request), body.model)
    if body.stream:
        pieces: Pieces = asyncio.Queue()
        items = chat_inputs(body, pieces)
        events = _chat_events(body, completion_id, created)
        return await _streamed(request, body.model, task, items, pieces, events)
    outputs = await run_task(request, body.model, task, chat_inputs(body))
    return JSONResponse(completion_body(body.model, outputs, completion_id, created))


@dataclass(frozen=True, slots=True)
class Piece:
    """A streamed piece of choice ``index``'s text, and its tokens' logprobs
    (where they are asked for and the runtime gives them as it goes)."""

    index: int
    text: str
    logprobs: tuple[dict[str, Any], ...] = ()


Pieces = asyncio.Queue[Piece]


class StreamFields(TypedDict, total=False):
    """A ``ChatInput``'s stream listeners."""

    on_text: Callable[[str], None]
    on_logprobs: Callable[[tuple[dict[str, Any], ...]], None]


def listeners(pieces: Pieces | None, count: int) -> list[StreamFields]:
    """``count`` items' stream listeners (none without ``pieces``), called
    from worker threads, or in order on the loop in a gateway process: each
    piece goes on ``pieces`` in the running loop, with the logprobs its item
    was told just before it."""
    if pieces is None:
        return [{} for _ in range(count)]
    loop = asyncio.get_running_loop()

    def listener(index: int) -> StreamFields:
        told: list[dict[str, Any]] = []  # the next piece's tokens' logprobs

        def on_logprobs(tokens: tuple[dict[str, Any], ...]) -> None:
            told.extend(tokens)

        def on_text(text: str) -> None:
            piece = Piece(index, text, tuple(told))
            told.clear()
            loop.call_soon_threadsafe(pieces.put_nowait, piece)

        return {"on_text": on_text, "on_logprobs": on_logprobs}

    return [listener(i) for i in range(count)]


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


def _event(
    kind: str,
    completion_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage: dict[str, int] | None = None,
) -> str:
    """One server-sent event of a stream of ``kind`` (its ``object``)."""
    payload: dict[str, Any] = {
        "id": completion_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        payload["usage"] = usage
    return f"data: {json.dumps(payload)}\n\n"


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
    return _event("chat.completion.chunk", completion_id, created, model, choices, usage)


async def pieces_of(
    work: asyncio.Future[list[Any]], pieces: asyncio.Queue[T]
) -> AsyncGenerator[T, None]:
    """Each streamed piece as it comes, until ``work`` is done and all are read."""
    while not work.done() or not pieces.empty():
        getter = asyncio.ensure_future(pieces.get())
        waiting: set[asyncio.Future[Any]] = {getter, work}
        try:
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also where the stream closed meanwhile (its caller left)
            if not getter.done():
                getter.cancel()  # no getter left pending
        if getter.done():
            yield getter.result()


async def first_pieces(
    request: Request, work: asyncio.Future[list[Any]], pieces: asyncio.Queue[T]
) -> AsyncIterator[T]:
    """``pieces_of`` once its first piece has come, or its work has ended: a
    work that failed before its first piece (a prompt over the model's
    context, a schema its engine would not compile) raises here, so that the
    caller answers an HTTP status, as OpenAI's and vLLM's servers do, where
    a stream of 200 would end in an error event that clients do not take for
    a refused request. Its caller leaving meanwhile cancels the work."""
    stream = pieces_of(work, pieces)
    try:
        first = await unless_disconnected(request, anext(stream, _NO_PIECE))
    except BaseException:
        await stream.aclose()
        work.cancel()
        raise
    if first is _NO_PIECE:
        error = None if work.cancelled() else work.exception()
        if isinstance(error, TesseraError):
            raise error
    return _after(first, stream)


_NO_PIECE: Any = object()


async def _after(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    if first is not _NO_PIECE:
        yield first
    async for piece in rest:
        yield piece


def _error_event(error: TesseraError) -> str:
    status, kind = status_of(error, OPENAI)
    return f"data: {json.dumps(error_body(status, str(error), kind))}\n\n"


@dataclass(frozen=True)
class _StreamEvents:
    """How one API writes its stream's server-sent events."""

    opening: list[str]  # before any piece
    piece: Callable[[Piece], str]  # a choice's new text (and its tokens' logprobs)
    # A choice's index and its output, with the logprobs not streamed yet (if any).
    end: Callable[[int, ChatOutput], str]
    usage: Callable[[dict[str, int]], str] | None  # the usage, where asked for
    choices: int  # a prompt's (``n``): its tokens are counted once


def _wants_usage(options: StreamOptions | None) -> bool:
    return options is not None and options.include_usage


async def _streamed(
    request: Request,
    model: str,
    task: Task,
    items: list[ChatInput],
    pieces: Pieces,
    events: _StreamEvents,
) -> StreamingResponse:
    """A streamed answer of ``items``, whose listeners put their pieces on
    ``pieces`` (``started_task``: a refusal is an HTTP status, not a stream event)."""
    work = await started_task(request, model, task, items)
    return StreamingResponse(
        _stream(work, await first_pieces(request, work, pieces), events),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


async def _stream(
    work: asyncio.Future[list[Any]], pieces: AsyncIterator[Piece], events: _StreamEvents
) -> AsyncIterator[str]:
    """The opening events, each piece as it comes (with its tokens' logprobs),
    each choice's end (with those not streamed), the usage where asked for,
    then ``[DONE]``; an error as an event of its own."""
    told: dict[int, int] = {}  # a choice's tokens whose logprobs are streamed
    try:
        for event in events.opening:
            yield event
        async for piece in pieces:
            told[piece.index] = told.get(piece.index, 0) + len(piece.logprobs)
            yield events.piece(piece)
        try:
            outputs = work.result()
        except TesseraError as e:
            yield _error_event(e)
            return
        for index, output in enumerate(outputs):
            yield events.end(index, _not_told(output, told.get(index, 0)))
        if events.usage is not None:
            yield events.usage(usage_of(*outputs, choices=events.choices))
        yield "data: [DONE]\n\n"
    finally:
        if not work.done():
            work.cancel()


def _not_told(output: ChatOutput, told: int) -> ChatOutput:
    """``output`` with the logprobs of its tokens after the first ``told``:
    None where every one was streamed."""
    if output.logprobs is None or not told:
        return output
    rest = output.logprobs[told:]
    return dataclasses.replace(output, logprobs=rest or None)


def _chat_events(body: ChatRequest, completion_id: str, created: int) -> _StreamEvents:
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
    return _StreamEvents(
        opening=[chunk(role, index=index) for index in range(body.n)],
        piece=lambda piece: chunk(
            {"content": piece.text},
            index=piece.index,
            logprobs={"content": list(piece.logprobs)} if piece.logprobs else None,
        ),
        end=end,
        usage=(lambda tokens: chunk(None, tokens)) if _wants_usage(body.stream_options) else None,
        choices=body.n,
    )


class CompletionRequest(Sampling):
    """OpenAI's legacy completions: ``n`` choices a prompt; ``logprobs`` (0 to
    5) gives each generated token's log probability and that many likeliest
    alternatives, in the legacy form (``tokens``, ``token_logprobs``,
    ``top_logprobs``, ``text_offset``)."""

    model: str
    prompt: str | Annotated[list[str], Field(min_length=1)]
    max_tokens: int = Field(default=16, ge=1, le=4096)  # OpenAI's default here is 16
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    best_of: int | None = Field(default=None, ge=1, le=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)  # OpenAI's bounds
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _not_token_ids(cls, value: object) -> object:
        return _text_not_token_ids(value, "each model has a tokenizer of its own")

    @field_validator("suffix")
    @classmethod
    def _not_served(cls, value: object) -> object:
        if value is not None:
            raise ValueError("is not served here (text after the completion)")
        return value

    @model_validator(mode="after")
    def _no_prompt_logprobs(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise ValueError("logprobs with echo: the prompt's tokens' logprobs are not served")
        return self

    def choice_prompts(self) -> list[str]:
        """Each choice's prompt, in the order of their indices: ``n`` of each
        prompt (prompt i's are choices i*n to i*n + n - 1)."""
        prompts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise InvalidInputError(f"prompt[{i}] must not be empty")
        return [prompt for prompt in prompts for _ in range(self.n)]


def completion_inputs(body: CompletionRequest, pieces: Pieces | None = None) -> list[ChatInput]:
    """A raw-prompt item a choice; with ``pieces``, each streams its text there."""
    prompts = body.choice_prompts()
    return [
        ChatInput(
            messages=(),
            prompt=prompt,
            max_tokens=body.max_tokens,
            **body.sampling(index % body.n),
            **stream,
            logprobs=body.logprobs,
        )
        for index, (prompt, stream) in enumerate(
            zip(prompts, listeners(pieces, len(prompts)), strict=True)
        )
    ]


def _text_choice(
    index: int,
    text: str,
    finish_reason: str | None,
    logprobs: Sequence[dict[str, Any]] | None = None,
    at: int = 0,
) -> dict[str, Any]:
    """A legacy completion's choice (its ``logprobs`` from ``ChatOutput``'s,
    the first token's at ``at`` in the completion's text)."""
    legacy = None if logprobs is None else _legacy_logprobs(logprobs, at)
    return {"text": text, "index": index, "logprobs": legacy, "finish_reason": finish_reason}


def _legacy_logprobs(tokens: Sequence[dict[str, Any]], at: int = 0) -> dict[str, Any]:
    """Token logprobs in the legacy completions' form: each token, its
    logprob, its alternatives as token: logprob, and where it starts in the
    completion's text (the first at ``at``)."""
    offsets = []
    for token in tokens:
        offsets.append(at)
        at += len(token["token"])
    return {
        "tokens": [token["token"] for token in tokens],
        "token_logprobs": [token["logprob"] for token in tokens],
        "top_logprobs": [
            {top["token"]: top["logprob"] for top in token["top_logprobs"]} for token in tokens
        ],
        "text_offset": offsets,
    }


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Response:
    completion_id = f"cmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    if body.stream:
        pieces: Pieces = asyncio.Queue()
        items = completion_inputs(body, pieces)
        events = _completion_events(body, completion_id, created)
        return await _streamed(request, body.model, Task.GENERATE, items, pieces, events)
    outputs = await run_task(request, body.model, Task.GENERATE, completion_inputs(body))
    return JSONResponse(text_completion_body(body, outputs, completion_id, created))


def text_completion_body(
    body: CompletionRequest, outputs: list[ChatOutput], completion_id: str, created: int
) -> dict[str, Any]:
    """A legacy completion's answer: a choice an output (after its prompt, for ``echo``)."""
    prompts = body.choice_prompts()
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": body.model,
        "choices": [
            _text_choice(
                i,
                (prompt if body.echo else "") + output.text,
                output.finish_reason,
                output.logprobs,
            )
            for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True))
        ],
        "usage": usage_of(*outputs, choices=body.n),
    }


def _completion_events(body: CompletionRequest, completion_id: str, created: int) -> _StreamEvents:
    """A legacy completion's events: each choice's prompt first, for ``echo``;
    its text as it comes (with its tokens' logprobs, where they come with it),
    its finish reason (and the logprobs not sent yet) last; with
    ``stream_options.include_usage``, a last event of no choices with the usage."""

    def event(choices: list[dict[str, Any]], tokens: dict[str, int] | None = None) -> str:
        return _event("text_completion", completion_id, created, body.model, choices, tokens)

    at: dict[int, int] = {}  # where a choice's next token starts in its text

    def piece(piece: Piece) -> str:
        start = at.get(piece.index, 0)
        at[piece.index] = start + sum(len(token["token"]) for token in piece.logprobs)
        logprobs = piece.logprobs or None
        return event([_text_choice(piece.index, piece.text, None, logprobs, start)])

    def end(index: int, output: ChatOutput) -> str:
        choice = _text_choice(index, "", output.finish_reason, output.logprobs, at.get(index, 0))
        return event([choice])

    echoed = body.choice_prompts() if body.echo else []
    return _StreamEvents(
        opening=[event([_text_choice(i, prompt, None)]) for i, prompt in enumerate(echoed)],
        piece=piece,
        end=end,
        usage=(lambda tokens: event([], tokens)) if _wants_usage(body.stream_options) else None,
        choices=body.n,
    )


class SpeechRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: Annotated[str, Field(min_length=1, max_length=4096)]
    voice: str | None = None
    response_format: AudioFormat = "wav"
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = "audio"

    @field_validator("response_format")
    @classmethod
    def _written(cls, value: str) -> str:
        return check_format(value)


@router.post("/v1/audio/speech", response_model=None)
async def speech(body: SpeechRequest, request: Request) -> Response:
    if not body.input.strip():
        raise InvalidInputError("input must not be blank")
    (output,) = await run_task(request, body.model, Task.TTS, [SpeechInput(body.input, body.speed)])
    # mp3, flac and opus take milliseconds a second of speech: off the event loop.
    audio = await asyncio.to_thread(encoded, output, body.response_format)
    headers = {"x-sample-rate": str(audio.sample_rate)} if body.response_format == "pcm" else {}
    if body.stream_format == "sse":
        events = _speech_events(audio.data, max(1, len(body.input)))
        headers["Cache-Control"] = "no-cache"
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    return Response(audio.data, media_type=audio.media_type, headers=headers)


# Bytes of encoded audio a ``speech.audio.delta`` event carries (an even count:
# pcm's 16-bit samples are never split).
SPEECH_EVENT_BYTES = 32 * 1024


def _speech_events(audio: bytes, characters: int) -> Iterator[str]:
    """``stream_format: "sse"``, as OpenAI's: the clip (in ``response_format``)
    in ``speech.audio.delta`` events of base64 pieces, then
    ``speech.audio.done`` with the usage. The clip is made whole first (a
    voice speaks each item in one batch), so the events come at once; the
    usage's input is what the request was charged, its characters (tessera
    meters speech by them), and it counts no output tokens."""
    for start in range(0, len(audio), SPEECH_EVENT_BYTES):
        piece = base64.b64encode(audio[start : start + SPEECH_EVENT_BYTES]).decode("ascii")
        yield f"data: {json.dumps({'type': 'speech.audio.delta', 'audio': piece})}\n\n"
    usage = {"input_tokens": characters, "output_tokens": 0, "total_tokens": characters}
    yield f"data: {json.dumps({'type': 'speech.audio.done', 'usage': usage})}\n\n"


def _model_objects(request: Request) -> list[dict[str, Any]]:
    """The models the caller may use, as OpenAI's model objects."""
    allowed = set(visible_models(request))
    return [
        {
            "id": model.name,
            "object": "model",
            "created": 0,
            "owned_by": "tessera",
            "task": model.task,
            "state": model.state,
        }
        for model in engine_of(request).snapshot().models
        if model.name in allowed
    ]


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": _model_objects(request)})


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> JSONResponse:
    """One model (the OpenAI client's ``models.retrieve``); 404 for a model
    the caller may not use, as for one that does not exist."""
    for found in _model_objects(request):
        if found["id"] == model:
            return JSONResponse(found)
    raise ModelNotFoundError(model)


__all__ = ["error_body", "router", "texts_of", "usage_of"]
