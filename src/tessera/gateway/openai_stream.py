"""Streamed answers of OpenAI's chat and legacy completions: the pieces an
item's listeners put on a queue, and the server-sent events they become."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypedDict, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from tessera.errors import TesseraError
from tessera.gateway.common import (
    started_task,
    unless_disconnected,
)
from tessera.gateway.errors import OPENAI, error_body, status_of
from tessera.tasks.types import (
    ChatInput,
    ChatOutput,
    Task,
)

T = TypeVar("T")


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


def sse_event(
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
class StreamEvents:
    """How one API writes its stream's server-sent events."""

    opening: list[str]  # before any piece
    piece: Callable[[Piece], str]  # a choice's new text (and its tokens' logprobs)
    # A choice's index and its output, with the logprobs not streamed yet (if any).
    end: Callable[[int, ChatOutput], str]
    usage: Callable[[dict[str, int]], str] | None  # the usage, where asked for
    choices: int  # a prompt's (``n``): its tokens are counted once


async def streamed(
    request: Request,
    model: str,
    task: Task,
    items: list[ChatInput],
    pieces: Pieces,
    events: StreamEvents,
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
    work: asyncio.Future[list[Any]], pieces: AsyncIterator[Piece], events: StreamEvents
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
