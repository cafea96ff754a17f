"""OpenAI's Responses API (``POST /v1/responses``) for the clients that use it
(the openai SDK's ``responses.create``, ``.stream`` and ``.parse``, the OpenAI
Agents SDK): a chat by another name, served by the chat's runtimes.

- ``input``: a text, or a list of items: messages (``role``; ``content`` a
  text or ``input_text`` / ``output_text`` / ``input_image`` parts, an image
  as a ``data:`` URL, for a vision-language model), and an earlier answer's
  ``function_call`` items with their ``function_call_output``;
  ``instructions`` comes first, as a system message;
- ``max_output_tokens`` (128 unless given), ``temperature`` (greedy unless
  given, as chat here), ``top_p``; ``text.format`` (``text``,
  ``json_object``, ``json_schema``); function ``tools``, ``tool_choice``,
  ``parallel_tool_calls``; ``include: ["message.output_text.logprobs"]`` (or
  ``top_logprobs``) for each token's log probability;
- answered whole, or streamed as the Responses API streams
  (``response.created``, the output items and their text as it comes,
  ``response.completed``, or ``response.incomplete`` where
  ``max_output_tokens`` cut it, ``response.failed`` where it failed).

Answers are kept only where the server keeps them (``store_responses``:
``tenants/responses.py``): then an answer to a request with ``store`` (the
API's default) says ``store: true``, a later request continues it by
``previous_response_id`` (its conversation, output included, comes before
the new ``input``; its ``instructions`` do not carry over, as OpenAI's), and
``GET`` / ``DELETE /v1/responses/{id}`` and ``GET
/v1/responses/{id}/input_items`` (its conversation before its output, by
pages) find it. Elsewhere answers say
``store: false`` and ``previous_response_id`` is a 400 (send the whole
conversation in ``input``). ``conversation`` and ``background`` are refused,
as are tools other than functions (web search, files, code).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tessera.errors import InvalidInputError, ResponseNotFoundError, TenantError, TesseraError
from tessera.gateway.common import JsonBodyRoute, engine_of, principal_of, run_task, started_task
from tessera.gateway.errors import OPENAI, status_of
from tessera.gateway.openai_chat import (
    MAX_TOOLS,
    FunctionIn,
    NamedFunction,
    ResponseFormat,
    Sampling,
    chat_task,
    check_json_schema,
    check_tools,
    image_of,
    tool_fields,
)
from tessera.gateway.openai_stream import Piece, Pieces, first_pieces, listeners
from tessera.tasks.types import ChatInput, ChatMessage, ChatOutput, ToolCall
from tessera.tenants.responses import ResponseStore, StoredResponse

log = logging.getLogger(__name__)
# Bodies are JSON whatever their content type (``JsonBodyRoute``).
router = APIRouter(route_class=JsonBodyRoute)
LOGPROBS = "message.output_text.logprobs"  # the ``include`` that asks for them


class Part(BaseModel):
    """A part of a message's content: its text, or an image."""

    model_config = ConfigDict(extra="allow")

    type: Literal["input_text", "output_text", "input_image"]
    text: str | None = None
    image_url: str | None = None


class Item(BaseModel):
    """An item of ``input``: a message (its ``type`` may be left out), a call
    an earlier answer made, or that call's output."""

    model_config = ConfigDict(extra="allow")

    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[Part] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[Part] | None = None

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> Item:
        needed = {
            "message": ("role", "content"),
            "function_call": ("call_id", "name", "arguments"),
            "function_call_output": ("call_id", "output"),
        }[self.type]
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise ValueError(f"a {self.type} item needs {' and '.join(missing)}")
        return self


class FunctionTool(FunctionIn):
    """A function the model may call (the Responses API's flat form)."""

    type: Literal["function"]

    def chat(self) -> dict[str, Any]:
        """The tool in chat's form (``{"type": "function", "function": ...}``)."""
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class NamedChoice(NamedFunction):
    """A ``tool_choice`` that names the function to call."""

    type: Literal["function"]


class TextFormat(BaseModel):
    """``text.format``: free ``text``, any ``json_object``, or JSON of ``schema``."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a schema")
        check_json_schema(self.json_schema)
        return self

    def constraint(self) -> str | None:
        """The format as the runtimes take it (chat's ``response_format``)."""
        schema = None
        if self.json_schema is not None:
            schema = {"name": self.name or "format", "schema": self.json_schema}
        return ResponseFormat(type=self.type, json_schema=schema).constraint()


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(Sampling):
    model: str
    input: str | Annotated[list[Item], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=4096)
    stream: bool = False
    text: TextConfig = Field(default_factory=TextConfig)
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool = True
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    store: bool = True
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _served(self) -> ResponsesRequest:
        if self.conversation is not None:
            raise ValueError(
                "conversations are not served: send the whole conversation in input,"
                " or continue a kept response by previous_response_id"
            )
        if self.background:
            raise ValueError("background responses are not served")
        check_tools(
            [tool.name for tool in self.tools or ()],
            *self._choice(),
            constrained=self.text.format.type != "text",
            format_field="text.format",
        )
        return self

    def _choice(self) -> tuple[str | None, str | None]:
        choice = self.tool_choice
        if isinstance(choice, NamedChoice):
            return None, choice.name
        return choice, None

    def wants_logprobs(self) -> bool:
        return LOGPROBS in (self.include or ()) or self.top_logprobs is not None

    def input_items(self) -> list[Item]:
        """``input`` as items (a text is a user's message)."""
        if not isinstance(self.input, str):
            return list(self.input)
        if not self.input.strip():
            raise InvalidInputError("input must not be empty")
        return [Item(type="message", role="user", content=self.input)]

    def item(self, conversation: list[Item], pieces: Pieces | None = None) -> ChatInput:
        """The chat item of ``conversation`` (``input_items``, after the turns
        it continues); with ``pieces``, it streams its text there."""
        tools = [tool.chat() for tool in self.tools or ()]
        (stream,) = listeners(pieces, 1)
        return ChatInput(
            messages=self._messages(conversation),
            max_tokens=self.max_output_tokens or 128,
            **self.sampling(),
            **tool_fields(tools, *self._choice(), self.parallel_tool_calls),
            **stream,
            response_format=self.text.format.constraint(),
            logprobs=(self.top_logprobs or 0) if self.wants_logprobs() else None,
        )

    def _messages(self, conversation: list[Item]) -> tuple[ChatMessage, ...]:
        messages = [ChatMessage("system", self.instructions)] if self.instructions else []
        for item in conversation:
            if item.type == "function_call":
                _call(messages, ToolCall(str(item.call_id), str(item.name), str(item.arguments)))
            elif item.type == "function_call_output":
                text, _ = _content(item.output)
                messages.append(ChatMessage("tool", text, tool_call_id=item.call_id))
            else:
                text, images = _content(item.content)
                messages.append(ChatMessage(str(item.role), text, images=images))
        return tuple(messages)

    def echoed(self, stored: bool) -> dict[str, Any]:
        """What an answer says of the request (and whether it is kept)."""
        choice = self.tool_choice
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "model": self.model,
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": stored,
            "temperature": self.temperature,
            "text": {"format": self.text.format.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": choice.model_dump()
            if isinstance(choice, NamedChoice)
            else choice or "auto",
            "tools": [tool.model_dump() for tool in self.tools or ()],
            "top_logprobs": self.top_logprobs,
            "top_p": self.top_p,
            "truncation": "disabled",
            "user": self.user,
            "metadata": self.metadata or {},
        }


def _call(messages: list[ChatMessage], call: ToolCall) -> None:
    """An earlier answer's call, joined to the assistant's turn it follows
    (its text, or its other calls), or a turn of its own."""
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant":
        messages[-1] = dataclasses.replace(last, tool_calls=(*last.tool_calls, call))
    else:
        messages.append(ChatMessage("assistant", "", tool_calls=(call,)))


def _content(content: str | list[Part] | None) -> tuple[str, tuple[Any, ...]]:
    """A content's text (its text parts joined) and images."""
    if isinstance(content, str):
        return content, ()
    texts: list[str] = []
    images: list[Any] = []
    for part in content or ():
        if part.type == "input_image":
            if part.image_url is None:
                raise InvalidInputError(
                    "an input_image part needs an image_url (a data: URL; file ids are not served)"
                )
            images.append(image_of(part.image_url))
        else:
            texts.append(part.text or "")
    return "".join(texts), tuple(images)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass
class _Answer:
    """One response's ids, and its output items as its output makes them;
    where it is kept (``store``), and the conversation it answers."""

    body: ResponsesRequest
    conversation: list[Item]
    store: ResponseStore | None
    tenant: str
    id: str = dataclasses.field(default_factory=lambda: _new_id("resp"))
    message_id: str = dataclasses.field(default_factory=lambda: _new_id("msg"))
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        answer: ChatOutput | None = None,
        error: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """The response object: ``in_progress`` (no output yet), ``completed``,
        ``incomplete`` (cut at ``max_output_tokens``) or ``failed``."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        usage = None
        if answer is not None:
            usage = {
                "input_tokens": answer.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": answer.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": answer.prompt_tokens + answer.completion_tokens,
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "completed_at": int(time.time()) if status == "completed" else None,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "output": output,
            "usage": usage,
            **self.body.echoed(self.store is not None),
        }

    def message(self, answer: ChatOutput | None, text: str) -> dict[str, Any]:
        """The answer's message item: ``in_progress`` with no part until
        ``answer`` comes."""
        if answer is None:
            return {
                "type": "message",
                "id": self.message_id,
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
        return {
            "type": "message",
            "id": self.message_id,
            "status": self.status(answer),
            "role": "assistant",
            "content": [self.part(answer, text)],
        }

    def part(self, answer: ChatOutput | None, text: str) -> dict[str, Any]:
        logprobs = [] if answer is None else list(answer.logprobs or ())
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def output(self, answer: ChatOutput, *, message: bool) -> list[dict[str, Any]]:
        """The output items: the message (where ``message``, or where there
        is text or no call) and each call."""
        items = []
        if message or answer.text or not answer.tool_calls:
            items.append(self.message(answer, answer.text))
        return items + [_call_item(call) for call in answer.tool_calls]

    def status(self, answer: ChatOutput) -> str:
        return "incomplete" if answer.finish_reason == "length" else "completed"

    async def keep(self, response: dict[str, Any]) -> None:
        """Keep the answer with its conversation (its output as input items
        after it), where it is kept; a store that fails is logged, and the
        answer goes out all the same."""
        if self.store is None:
            return
        turns = [
            _listed(item.model_dump(mode="json", exclude_none=True)) for item in self.conversation
        ]
        try:
            await asyncio.to_thread(
                self.store.put, self.tenant, response, [*turns, *response["output"]]
            )
        except TenantError as e:
            log.error("response %s was not kept: %s", self.id, e)


_ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def _listed(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as kept and listed: an id of its own (kept from an
    earlier turn), a message's text as a part."""
    kept = dict(item)
    if kept["type"] == "message" and isinstance(kept.get("content"), str):
        part = "output_text" if kept.get("role") == "assistant" else "input_text"
        kept["content"] = [{"type": part, "text": kept["content"]}]
    kept.setdefault("id", _new_id(_ITEM_ID_PREFIXES[kept["type"]]))
    return kept


def _call_item(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{call.id.removeprefix('call_')}",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": "completed",
    }


def _store(request: Request) -> ResponseStore | None:
    store: ResponseStore | None = getattr(request.app.state, "response_store", None)
    return store


def _tenant(request: Request) -> str:
    """Whose kept responses these are ("" with auth off)."""
    principal = principal_of(request)
    return "" if principal is None else principal.tenant.name


async def _found(request: Request, response_id: str) -> StoredResponse:
    store = _store(request)
    found = None
    if store is not None:
        found = await asyncio.to_thread(store.get, _tenant(request), response_id)
    if found is None:
        raise ResponseNotFoundError(response_id)
    return found


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    task = chat_task(engine_of(request), body.model)
    store = _store(request)
    earlier: list[Item] = []
    if body.previous_response_id is not None:
        if store is None:
            raise InvalidInputError(
                "previous_response_id: this server keeps no responses (store_responses"
                " is off); send the whole conversation in input"
            )
        found = await _found(request, body.previous_response_id)
        earlier = [Item.model_validate(item) for item in found.conversation]
    conversation = [*earlier, *body.input_items()]
    kept = store if body.store else None
    answer = _Answer(body, conversation, kept, _tenant(request))
    if not body.stream:
        (output,) = await run_task(request, body.model, task, [body.item(conversation)])
        items = answer.output(output, message=False)
        response = answer.response(answer.status(output), items, output)
        await answer.keep(response)
        return JSONResponse(response)
    pieces: Pieces = asyncio.Queue()
    work = await started_task(request, body.model, task, [body.item(conversation, pieces)])
    return StreamingResponse(
        _events(answer, work, await first_pieces(request, work, pieces)),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


@router.get("/v1/responses/{response_id}", response_model=None)
async def get_response(response_id: str, request: Request) -> JSONResponse:
    """A kept response (``store_responses``), as it was answered."""
    return JSONResponse((await _found(request, response_id)).response)


@router.get("/v1/responses/{response_id}/input_items", response_model=None)
async def list_input_items(
    response_id: str,
    request: Request,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> JSONResponse:
    """A kept response's input items (its conversation before its output),
    newest first unless ``order`` is ``asc``, ``limit`` a page, the next
    page ``after`` the last item's id."""
    found = await _found(request, response_id)
    items = found.conversation[: len(found.conversation) - len(found.response["output"])]
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise InvalidInputError(f"after: response {response_id!r} has no input item {after!r}")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0].get("id") if page else None,
            "last_id": page[-1].get("id") if page else None,
            "has_more": len(items) > limit,
        }
    )


@router.delete("/v1/responses/{response_id}", response_model=None)
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    store = _store(request)
    deleted = False
    if store is not None:
        deleted = await asyncio.to_thread(store.delete, _tenant(request), response_id)
    if not deleted:
        raise ResponseNotFoundError(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


class _Sequence:
    """Server-sent events numbered in order, as the Responses API numbers them."""

    def __init__(self) -> None:
        self.number = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"


async def _events(
    answer: _Answer, work: asyncio.Future[list[Any]], pieces: AsyncIterator[Piece]
) -> AsyncIterator[str]:
    """The response in progress, its message's text as it comes (the message
    opened at its first piece), then the rest of its items whole, and the
    response as it ended."""
    event = _Sequence()
    at = {"item_id": answer.message_id, "output_index": 0, "content_index": 0}

    def opening() -> list[str]:
        return [
            event("response.output_item.added", output_index=0, item=answer.message(None, "")),
            event("response.content_part.added", **at, part=answer.part(None, "")),
        ]

    try:
        for kind in ("response.created", "response.in_progress"):
            yield event(kind, response=answer.response("in_progress", []))
        streamed = ""
        async for piece in pieces:
            for opened in opening() if not streamed else ():
                yield opened
            streamed += piece.text
            told = list(piece.logprobs)
            yield event("response.output_text.delta", **at, delta=piece.text, logprobs=told)
        try:
            (output,) = work.result()
        except TesseraError as e:
            error = {"code": status_of(e, OPENAI)[1], "message": str(e)}
            yield event("response.failed", response=answer.response("failed", [], error=error))
            return
        items = answer.output(output, message=bool(streamed))
        if items[0]["type"] == "message":
            for opened in opening() if not streamed else ():
                yield opened
            if output.text.startswith(streamed) and len(output.text) > len(streamed):
                rest = output.text[len(streamed) :]
                yield event("response.output_text.delta", **at, delta=rest, logprobs=[])
            part = items[0]["content"][0]
            yield event(
                "response.output_text.done", **at, text=output.text, logprobs=part["logprobs"]
            )
            yield event("response.content_part.done", **at, part=part)
            yield event("response.output_item.done", output_index=0, item=items[0])
        for index, item in enumerate(items):
            if item["type"] != "function_call":
                continue
            where = {"item_id": item["id"], "output_index": index}
            added = {**item, "arguments": "", "status": "in_progress"}
            yield event("response.output_item.added", output_index=index, item=added)
            yield event("response.function_call_arguments.delta", **where, delta=item["arguments"])
            yield event(
                "response.function_call_arguments.done",
                **where,
                name=item["name"],
                arguments=item["arguments"],
            )
            yield event("response.output_item.done", output_index=index, item=item)
        status = answer.status(output)
        response = answer.response(status, items, output)
        await answer.keep(response)
        yield event(f"response.{status}", response=response)
    finally:
        if not work.done():
            work.cancel()
