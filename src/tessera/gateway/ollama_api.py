"""Ollama's API (``/api/...``) for Ollama's clients (``ollama.Client(host=...)``,
LangChain's ``OllamaEmbeddings`` and ``ChatOllama``).

- ``POST /api/embed`` (``input``: a text or a list; ``dimensions``): unit
  vectors, as Ollama's; ``POST /api/embeddings`` (``prompt``), the older one;
- ``POST /api/chat`` and ``POST /api/generate`` (``prompt``, with ``system``;
  ``raw`` continues it as it is): streamed as Ollama streams them, one JSON
  object a line, unless ``stream`` is false (Ollama's default is true);
  ``options`` ``temperature``, ``top_p``, ``num_predict``, ``stop``, ``seed``,
  ``presence_penalty`` and ``frequency_penalty`` are taken (others, such as
  ``top_k`` and ``num_ctx``, are the model card's), ``format`` (``json`` or a
  schema) and ``tools`` go where the OpenAI API's would (llama.cpp, vLLM),
  and images (base64) to a vision-language model;
- a chat with no messages, or a generation with no prompt, loads the model
  (``done_reason`` ``load``), as Ollama's clients ask before they use one;
  with ``keep_alive`` 0 it unloads it (``unload``), for an admin key only:
  for a tenant's the server keeps or evicts models for all of them (403);
- ``GET /api/tags`` (the models the caller may use), ``GET /api/ps`` (those
  resident now, their bytes), ``POST /api/show`` (a model's details and
  ``capabilities``: ``completion``, ``tools`` and ``vision`` where its runtime
  gives them, ``embedding``), ``GET /api/version``;
- ``POST /api/pull`` of a model served here answers success at once (whole,
  or Ollama's progress lines: ``pulling manifest``, ``success``), as clients
  pull before they use a model; any other is a 404: nothing is downloaded.

Defaults are tessera's where Ollama's come from a model's Modelfile: a chat
is greedy unless ``temperature`` is given, and at most 128 tokens unless
``num_predict`` is. A model name may carry Ollama's ``:latest`` tag. Keys go
as a bearer token (``ollama.Client(headers=...)``). A body is read as JSON
whatever its content type, as Ollama reads it (``curl -d`` sends it as a
form). Errors read as Ollama's,
``{"error": message}`` (``gateway/errors.py``). Pushing, creating, copying
and deleting models are not served.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from tessera import __version__
from tessera.errors import (
    InvalidInputError,
    ModelNotFoundError,
    PermissionDeniedError,
    TesseraError,
)
from tessera.gateway.common import (
    caller_of,
    engine_of,
    parsed,
    principal_of,
    run_task,
    started_task,
    visible_current,
    visible_models,
)
from tessera.gateway.errors import OLLAMA, status_of
from tessera.gateway.openai_chat import Sampling, chat_task, check_json_schema
from tessera.gateway.openai_embeddings import embedding_matrix, texts_of, unit_rows
from tessera.gateway.openai_stream import Pieces, listeners, pieces_of
from tessera.repository.spec import ModelSpec
from tessera.tasks.image import read_image
from tessera.tasks.types import (
    ChatInput,
    ChatMessage,
    ChatOutput,
    Task,
    TextInput,
    ToolCall,
    work_units,
)

router = APIRouter(prefix="/api")


def _name(model: str) -> str:
    return model.removesuffix(":latest")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class OllamaEmbedRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | Annotated[list[str], Field(min_length=1)]
    truncate: bool = True
    dimensions: int | None = Field(default=None, ge=1)


@router.post("/embed")
async def embed(request: Request) -> JSONResponse:
    body = parsed(OllamaEmbedRequest, await request.body())
    started = time.perf_counter_ns()
    model = _name(body.model)
    items = [TextInput(t) for t in texts_of(body.input)]
    limits = engine_of(request).spec(model).inputs
    vectors = await run_task(request, model, Task.EMBEDDING, items)
    matrix = unit_rows(embedding_matrix(vectors, body.dimensions))
    return JSONResponse(
        {
            "model": body.model,
            "embeddings": matrix.tolist(),
            "total_duration": time.perf_counter_ns() - started,
            "load_duration": 0,
            "prompt_eval_count": int(sum(work_units(i, limits) for i in items)),
        }
    )


class OllamaEmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    prompt: str


@router.post("/embeddings")
async def embeddings(request: Request) -> JSONResponse:
    body = parsed(OllamaEmbeddingsRequest, await request.body())
    (text,) = texts_of(body.prompt, "prompt")
    (vector,) = await run_task(request, _name(body.model), Task.EMBEDDING, [TextInput(text)])
    return JSONResponse({"embedding": np.asarray(vector, dtype=np.float32).tolist()})


class Options(Sampling):
    """Ollama's ``options``: the OpenAI API's sampling fields, and how many
    tokens (``num_predict``; -1 and -2 are Ollama's "no limit")."""

    num_predict: int | None = Field(default=None, ge=-2, le=4096)


class OllamaCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    function: dict[str, Any]


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[OllamaCall] | None = None


class Generation(BaseModel):
    """What chat and generate share."""

    model_config = ConfigDict(extra="allow")

    model: str
    stream: bool = True
    keep_alive: float | str | None = None  # 0 with nothing to answer: unload the model
    format: Literal["json"] | dict[str, Any] | None = None
    options: Options = Field(default_factory=Options)

    @field_validator("format")
    @classmethod
    def _bounded(cls, value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(value, dict):
            check_json_schema(value)
        return value

    def item(self, **fields: Any) -> ChatInput:
        limit = self.options.num_predict
        return ChatInput(
            max_tokens=128 if limit is None or limit < 0 else max(1, limit),
            **self.options.sampling(),
            response_format=self._response_format(),
            **fields,
        )

    def _response_format(self) -> str | None:
        if self.format is None:
            return None
        if self.format == "json":
            return json.dumps({"type": "json_object"})
        schema = {"name": "format", "schema": self.format}
        return json.dumps({"type": "json_schema", "json_schema": schema})


class OllamaChatRequest(Generation):
    messages: list[OllamaMessage] = Field(default_factory=list)  # none: load the model
    tools: list[dict[str, Any]] | None = None


class OllamaGenerateRequest(Generation):
    prompt: str = ""  # none: load the model
    system: str | None = None
    raw: bool = False
    images: list[str] | None = None


def _images(encoded: list[str] | None) -> tuple[Any, ...]:
    images = []
    for i, text in enumerate(encoded or ()):
        try:
            images.append(read_image(base64.b64decode(text, validate=True)))
        except (binascii.Error, ValueError) as e:
            raise InvalidInputError(f"images[{i}] is not base64: {e}") from e
    return tuple(images)


def _message(message: OllamaMessage) -> ChatMessage:
    calls = tuple(
        ToolCall(
            f"call_{i}",
            str(call.function.get("name", "")),
            json.dumps(call.function.get("arguments", {})),
        )
        for i, call in enumerate(message.tool_calls or ())
    )
    return ChatMessage(message.role, message.content, _images(message.images), tool_calls=calls)


@router.post("/chat", response_model=None)
async def chat(request: Request) -> Response:
    body = parsed(OllamaChatRequest, await request.body())
    if not body.messages:
        return await _load_or_unload(request, body, "message")
    tools = {"tools": json.dumps(body.tools), "tool_choice": "auto"} if body.tools else {}
    messages = tuple(_message(m) for m in body.messages)
    return await _answer(request, body, "message", messages=messages, **tools)


@router.post("/generate", response_model=None)
async def generate(request: Request) -> Response:
    body = parsed(OllamaGenerateRequest, await request.body())
    if not body.prompt and not body.images:
        return await _load_or_unload(request, body, "response")
    if body.raw:
        if body.images:
            raise InvalidInputError("images go with the model's template: not with raw")
        return await _answer(request, body, "response", messages=(), prompt=body.prompt)
    system = (ChatMessage("system", body.system),) if body.system else ()
    messages = (*system, ChatMessage("user", body.prompt, _images(body.images)))
    return await _answer(request, body, "response", messages=messages)


async def _load_or_unload(request: Request, body: Generation, field: str) -> JSONResponse:
    """Ollama's load (a chat or generation of nothing), or its unload
    (``keep_alive`` 0): the model resident now, or evicted (an admin key's)."""
    model = _name(body.model)
    caller_of(request, model)  # 404 where the key may not use it, as for no such model
    engine = engine_of(request)
    engine.spec_for(model, chat_task(engine, model))  # 404: no such model; 400: no chat
    if _zero(body.keep_alive):
        principal = principal_of(request)
        if principal is not None and not principal.admin:
            raise PermissionDeniedError(
                "unloading a model takes an admin key: the server keeps or evicts"
                " models for every tenant"
            )
        await engine.unload(model)
        reason = "unload"
    else:
        await engine.load(model)
        reason = "load"
    empty: Any = {"role": "assistant", "content": ""} if field == "message" else ""
    answer = {"model": body.model, "created_at": _now(), field: empty, "done": True}
    return JSONResponse({**answer, "done_reason": reason})


def _zero(keep_alive: Any) -> bool:
    """Whether Ollama's ``keep_alive`` (seconds, or a duration such as "0s") is 0."""
    if isinstance(keep_alive, int | float) and not isinstance(keep_alive, bool):
        return keep_alive == 0
    return isinstance(keep_alive, str) and keep_alive.strip() in ("0", "0s", "0m", "0h")


async def _answer(request: Request, body: Generation, field: str, **fields: Any) -> Response:
    """One chat (``field`` message) or generation (``field`` response), whole
    or streamed a line a piece."""
    model = _name(body.model)
    task = chat_task(engine_of(request), model)
    started = time.perf_counter_ns()
    if not body.stream:
        (output,) = await run_task(request, model, task, [body.item(**fields)])
        return JSONResponse(_last(body.model, field, output, started, whole=True))
    pieces: Pieces = asyncio.Queue()
    (stream,) = listeners(pieces, 1)
    work = await started_task(request, model, task, [body.item(**stream, **fields)])
    lines = _lines(body.model, field, work, pieces, started)
    return StreamingResponse(lines, media_type="application/x-ndjson")


async def _lines(
    model: str,
    field: str,
    work: asyncio.Future[list[Any]],
    pieces: Pieces,
    started: int,
) -> AsyncIterator[str]:
    try:
        async for told in pieces_of(work, pieces):
            text = told.text
            piece = {"role": "assistant", "content": text} if field == "message" else text
            yield json.dumps({"model": model, "created_at": _now(), field: piece, "done": False})
            yield "\n"
        try:
            (output,) = work.result()
        except TesseraError as e:
            yield json.dumps({"error": str(e), "status": status_of(e, OLLAMA)[0]}) + "\n"
            return
        yield json.dumps(_last(model, field, output, started, whole=False)) + "\n"
    finally:
        if not work.done():
            work.cancel()


def _last(
    model: str, field: str, output: ChatOutput, started: int, *, whole: bool
) -> dict[str, Any]:
    """The answer (``whole``) or a stream's last line: its text where whole,
    its calls, why it ended and its counts."""
    text = output.text if whole else ""
    content: Any = text
    if field == "message":
        content = {"role": "assistant", "content": text}
        if output.tool_calls:
            content["tool_calls"] = [
                {"function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                for c in output.tool_calls
            ]
    return {
        "model": model,
        "created_at": _now(),
        field: content,
        "done": True,
        "done_reason": "length" if output.finish_reason == "length" else "stop",
        "total_duration": time.perf_counter_ns() - started,
        "load_duration": 0,
        "prompt_eval_count": output.prompt_tokens,
        "eval_count": output.completion_tokens,
    }


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _details(task: str) -> dict[str, Any]:
    return {
        "format": "",
        "family": task,
        "families": [task],
        "parameter_size": "",
        "quantization_level": "",
    }


@router.get("/tags")
async def tags(request: Request) -> JSONResponse:
    """The models the caller may use; a size is its bytes as last measured
    (0 until it has loaded once)."""
    models = [
        {
            "name": m.model,
            "model": m.model,
            "modified_at": _now(),
            "size": m.measured_bytes or 0,
            "digest": "",
            "details": _details(m.task),
        }
        for m in visible_current(request)
    ]
    return JSONResponse({"models": models})


@router.get("/ps")
async def ps(request: Request) -> JSONResponse:
    visible = set(visible_models(request))
    resident = [
        {
            "name": m.name,
            "model": m.name,
            "size": m.bytes,
            "size_vram": m.bytes,
            "digest": "",
            "details": _details(m.task),
        }
        for m in engine_of(request).snapshot().models
        if m.state == "ready" and not m.host_tier and m.name.partition("@")[0] in visible
    ]
    return JSONResponse({"models": resident})


class OllamaModelRequest(BaseModel):
    """A request that names a model (show, pull)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    name: str | None = None  # the older field
    stream: bool = True

    def served(self, request: Request) -> str:
        """The model named, if the caller may use it (else a 404)."""
        asked = self.model or self.name
        if not asked:
            raise InvalidInputError("model is required")
        name = _name(asked)
        if name not in visible_models(request):
            raise ModelNotFoundError(name)
        return name


@router.post("/show")
async def show(request: Request) -> JSONResponse:
    """A model's details and what it can do, as Ollama's clients read them to
    decide what to offer (tools, images); no Modelfile, template or parameters."""
    body = parsed(OllamaModelRequest, await request.body())
    spec = engine_of(request).spec(body.served(request))
    return JSONResponse(
        {
            "modelfile": "",
            "parameters": "",
            "template": "",
            "details": _details(spec.task.value),
            "model_info": {"general.architecture": spec.adapter},
            "capabilities": _capabilities(spec),
            "modified_at": _now(),
        }
    )


def _capabilities(spec: ModelSpec) -> list[str]:
    """Ollama's words for what ``spec``'s model does: an embedding, or a chat
    (``completion``) with tool calls where an engine of its own runs it
    (llama.cpp, vLLM) and images where it reads them."""
    if spec.task is Task.EMBEDDING:
        return ["embedding"]
    chats = spec.task is Task.GENERATE or spec.inputs.vision is not None
    if not chats:
        return []
    tools = ["tools"] if spec.runtime == "external" and spec.task is Task.GENERATE else []
    vision = ["vision"] if spec.inputs.vision is not None else []
    return ["completion", *tools, *vision]


@router.post("/pull", response_model=None)
async def pull(request: Request) -> Response:
    """A model served here is there already: success, whole or as progress lines."""
    body = parsed(OllamaModelRequest, await request.body())
    body.served(request)
    if not body.stream:
        return JSONResponse({"status": "success"})
    lines = "".join(json.dumps({"status": s}) + "\n" for s in ("pulling manifest", "success"))
    return Response(lines, media_type="application/x-ndjson")


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})
