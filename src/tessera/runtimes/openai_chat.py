"""One chat completion streamed from an OpenAI-compatible engine process.

What the external runtime (``runtimes/external.py``) sends each item as and
reads back: ``POST /v1/chat/completions`` with ``stream: true`` (an item of a
raw ``prompt``: ``POST /v1/completions``, whose chunks carry ``text`` where a
chat's carry a ``delta``), read as server-sent events until ``[DONE]``.
Streaming serves ``on_text``, tells a crash mid-answer (the connection
resets, or the stream ends before its last chunk) apart from a slow answer,
and bounds a hung engine: the connection's timeout is the longest wait for
the next chunk. An item whose caller has gone
(its stop flag) stops at the next chunk: the connection is closed, which ends
the generation in llama.cpp's and vLLM's servers alike. A message's images
go as ``image_url`` parts with ``data:`` URLs (for an engine that takes them).
"""

from __future__ import annotations

import http.client
import json
import logging
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from tessera.errors import InferenceError, InvalidInputError
from tessera.request import StopFlag
from tessera.tasks.image import png_data_url
from tessera.tasks.types import ChatInput, ChatMessage, ChatOutput

logger = logging.getLogger(__name__)


class EngineGone(Exception):
    """The engine closed a connection or stopped answering (the runtime's own)."""


class EngineNotReady(InferenceError):
    """The engine answered 503: it listens, but its model is not ready (loading)."""


def complete(
    address: str,
    api_key: str,
    body: Mapping[str, Any],
    item: ChatInput,
    stop: StopFlag,
    timeout_s: float,
) -> ChatOutput:
    """One chat completion of ``body`` (``request_body``'s), streamed, until
    ``stop`` is set; raises ``EngineGone`` if the engine is."""
    host, _, port = address.removeprefix("http://").partition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    response: http.client.HTTPResponse | None = None
    try:
        connection.request(
            "POST",
            "/v1/chat/completions" if item.prompt is None else "/v1/completions",
            body=json.dumps(body),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"},
        )
        response = connection.getresponse()
        if response.status != 200:
            raise http_error(str(body.get("model")), response.status, response.read())
        return _read_stream(response, item, stop)
    except (OSError, http.client.HTTPException) as e:  # reset, refused, timed out
        raise EngineGone(f"{type(e).__name__}: {e}") from e
    finally:
        if response is not None:  # its socket too (a read that timed out keeps it)
            response.close()
        connection.close()


def request_body(model: str, item: ChatInput, extras: Mapping[str, Any]) -> dict[str, Any]:
    """The OpenAI chat (or, for a raw prompt, completion) request of ``item``,
    with the engine's own ``extras``."""
    text: dict[str, Any] = (
        {"prompt": item.prompt}
        if item.prompt is not None
        else {"messages": [{"role": m.role, "content": _content(m)} for m in item.messages]}
    )
    body: dict[str, Any] = {
        "model": model,
        **text,
        "max_tokens": item.max_tokens,
        "temperature": item.temperature,
        "top_p": item.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extras,
    }
    if item.stop:
        body["stop"] = list(item.stop)
    if item.response_format is not None:  # llama.cpp and vLLM both constrain to it
        body["response_format"] = json.loads(item.response_format)
    if item.logprobs is not None:  # each chunk then carries its tokens' logprobs
        body["logprobs"] = True
        # llama.cpp gives none at all for 0 alternatives: ask one, and drop it.
        body["top_logprobs"] = max(1, item.logprobs)
    if item.seed is not None:
        body["seed"] = item.seed
    # OpenAI's fields, which both engines take (llama.cpp counts the penalties
    # over the last 64 tokens it has seen, vLLM over the answer so far).
    if item.presence_penalty:
        body["presence_penalty"] = item.presence_penalty
    if item.frequency_penalty:
        body["frequency_penalty"] = item.frequency_penalty
    if item.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in item.logit_bias}
    return body


def _content(message: ChatMessage) -> str | list[dict[str, Any]]:
    """A message's content: its text, or (with images) OpenAI's parts, its
    images first as ``image_url`` parts with PNG ``data:`` URLs (lossless: the
    pixels this server decoded), then its text, in the order the in-process
    adapter gives them to the model's chat template."""
    if not message.images:
        return message.content
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": png_data_url(image)}} for image in message.images
    ]
    parts.append({"type": "text", "text": message.content})
    return parts


def http_error(name: str, status: int, raw: bytes) -> Exception:
    try:
        error = json.loads(raw).get("error", {})
        message = str(error.get("message", raw[:200]) if isinstance(error, dict) else error)
    except (ValueError, AttributeError):
        message = raw[:200].decode(errors="replace")
    if 400 <= status < 500:
        return InvalidInputError(f"model {name!r} refused the chat: {message}")
    if status == 503:
        return EngineNotReady(f"model {name!r}: its engine answered 503: {message}")
    return InferenceError(f"model {name!r}: its engine answered {status}: {message}")


def _sse_events(response: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    """The JSON events of a server-sent-events stream, up to ``[DONE]``."""
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[len(b"data:") :].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


def _ran_so_far(
    timings: Mapping[str, Any], usage: Mapping[str, Any] | None, num_pieces: int
) -> tuple[int, int]:
    """Prompt and completion tokens of an answer cut short: llama.cpp's per-chunk
    ``timings``, else vLLM's per-chunk ``usage`` (continuous usage stats), else
    a token a piece."""
    if timings:
        prompt = int(timings.get("cache_n", 0)) + int(timings.get("prompt_n", 0))
        return prompt, int(timings.get("predicted_n", num_pieces))
    if usage:
        return int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    return 0, num_pieces


def _read_stream(response: http.client.HTTPResponse, item: ChatInput, stop: StopFlag) -> ChatOutput:
    pieces: list[str] = []
    on_text = item.on_text
    finish: str | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] = {}
    logprobs: list[dict[str, Any]] = []
    for event in _sse_events(response):
        if "error" in event:
            raise InferenceError(f"the engine failed the chat: {event['error']}")
        usage = event.get("usage") or usage
        timings = event.get("timings") or timings
        if stop.is_set():  # the caller has gone: what ran so far, nothing more
            prompt, completion = _ran_so_far(timings, usage, len(pieces))
            return ChatOutput(
                text="".join(pieces),
                prompt_tokens=prompt,
                completion_tokens=completion,
                finish_reason="stop",
            )
        for choice in event.get("choices") or ():
            piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            finish = choice.get("finish_reason") or finish
            logprobs.extend(_token_logprobs(choice.get("logprobs"), item.logprobs or 0))
            if not piece:
                continue
            pieces.append(piece)
            if on_text is not None:
                try:
                    on_text(piece)
                except Exception:  # a failing listener must not fail the other items
                    logger.exception("on_text raised; streaming to it stops")
                    on_text = None
    if finish is None or usage is None:
        raise EngineGone("the stream ended before its last chunk")
    reason: Literal["stop", "length"] = "length" if finish == "length" else "stop"
    return ChatOutput(
        text="".join(pieces),
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        finish_reason=reason,
        logprobs=tuple(logprobs) if item.logprobs is not None else None,
    )


def _token_logprobs(found: Any, alternatives: int) -> list[dict[str, Any]]:
    """A chunk's ``logprobs.content`` items in OpenAI's fields (llama.cpp adds
    token ids, which OpenAI's answer has not), with ``alternatives`` of each
    token's likeliest at most."""
    if not isinstance(found, dict):
        return []
    fields = ("token", "logprob", "bytes")
    items = []
    for entry in found.get("content") or ():
        item = {key: entry.get(key) for key in fields}
        tops = list(entry.get("top_logprobs") or ())[:alternatives]
        item["top_logprobs"] = [{key: top.get(key) for key in fields} for top in tops]
        items.append(item)
    return items
