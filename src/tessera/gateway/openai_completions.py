"""OpenAI's legacy completions: a prompt continued as it is, without the
model's chat template; ``logprobs`` in the legacy form."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, field_validator, model_validator

from tessera.errors import InvalidInputError
from tessera.gateway.common import (
    JsonBodyRoute,
    run_task,
)
from tessera.gateway.openai_chat import MAX_CHOICES, Sampling, StreamOptions, wants_usage
from tessera.gateway.openai_embeddings import text_not_token_ids
from tessera.gateway.openai_stream import (
    Piece,
    Pieces,
    StreamEvents,
    listeners,
    sse_event,
    streamed,
    usage_of,
)
from tessera.tasks.types import (
    ChatInput,
    ChatOutput,
    Task,
)

# Bodies are JSON whatever their content type (``JsonBodyRoute``).
router = APIRouter(route_class=JsonBodyRoute)


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
        return text_not_token_ids(value, "each model has a tokenizer of its own")

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
        return await streamed(request, body.model, Task.GENERATE, items, pieces, events)
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


def _completion_events(body: CompletionRequest, completion_id: str, created: int) -> StreamEvents:
    """A legacy completion's events: each choice's prompt first, for ``echo``;
    its text as it comes (with its tokens' logprobs, where they come with it),
    its finish reason (and the logprobs not sent yet) last; with
    ``stream_options.include_usage``, a last event of no choices with the usage."""

    def event(choices: list[dict[str, Any]], tokens: dict[str, int] | None = None) -> str:
        return sse_event("text_completion", completion_id, created, body.model, choices, tokens)

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
    return StreamEvents(
        opening=[event([_text_choice(i, prompt, None)]) for i, prompt in enumerate(echoed)],
        piece=piece,
        end=end,
        usage=(lambda tokens: event([], tokens)) if wants_usage(body.stream_options) else None,
        choices=body.n,
    )
