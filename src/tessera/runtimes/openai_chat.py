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
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, TypeVar

from tessera.errors import InferenceError, InvalidInputError
from tessera.request import StopFlag
from tessera.runtimes.tool_calls import (
    call_id,
    generic_messages,
    generic_schema,
    native_fields,
    native_message,
    read_generic,
)
from tessera.tasks.image import png_data_url
from tessera.tasks.types import ChatInput, ChatMessage, ChatOutput, ToolCall

T = TypeVar("T")
logger = logging.getLogger(__name__)


class EngineGone(Exception):
    """The engine closed a connection or stopped answering (the runtime's own)."""


class EngineNotReady(InferenceError):
    """The engine answered 503: it listens, but its model is not ready (loading)."""


def complete(
    address: str,
    api_key: str,
    model: str,
    item: ChatInput,
    extras: Mapping[str, Any],
    stop: StopFlag,
    timeout_s: float,
    *,
    native_tools: bool,
) -> ChatOutput:
    """One chat completion of ``item`` (its request: ``request_body``'s),
    streamed, until ``stop`` is set; raises ``EngineGone`` if the engine is."""
    body = request_body(model, item, extras, native_tools=native_tools)
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
            raise http_error(model, response.status, response.read())
        return _read_stream(response, item, stop, generic_tools=not native_tools)
    except (OSError, http.client.HTTPException) as e:  # reset, refused, timed out
        raise EngineGone(f"{type(e).__name__}: {e}") from e
    finally:
        if response is not None:  # its socket too (a read that timed out keeps it)
            response.close()
        connection.close()


def request_body(
    model: str, item: ChatInput, extras: Mapping[str, Any], *, native_tools: bool
) -> dict[str, Any]:
    """The OpenAI chat (or, for a raw prompt, completion) request of ``item``,
    with the engine's own ``extras``; its tools as OpenAI's fields for an
    engine that calls tools itself (``native_tools``), else in the generic
    format (``runtimes/tool_calls.py``)."""
    text: dict[str, Any]
    if item.prompt is not None:
        text = {"prompt": item.prompt}
    elif native_tools:
        messages = [native_message(m, _content(m)) for m in item.messages]
        text = {"messages": messages, **native_fields(item)}
    else:
        text = {"messages": generic_messages(item, _content)}
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
    if item.tools is not None and not native_tools:
        schema = {"name": "tool_calls", "schema": generic_schema(item)}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    # Each chunk then carries its tokens' logprobs. llama.cpp gives none at
    # all for 0 alternatives: ask one, and drop it. A completion's
    # ``logprobs`` is the number of alternatives (OpenAI's legacy field).
    if item.logprobs is not None and item.prompt is not None:
        body["logprobs"] = max(1, item.logprobs)
    elif item.logprobs is not None:
        body["logprobs"] = True
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


def _read_stream(
    response: http.client.HTTPResponse, item: ChatInput, stop: StopFlag, *, generic_tools: bool
) -> ChatOutput:
    """The answer of a stream. A generic tool answer is JSON (not streamed
    as it comes: its text, if it is one, goes to ``on_text`` at the end); an
    engine's own tool calls come as ``delta.tool_calls`` fragments by index."""
    generic = generic_tools and item.tools is not None
    pieces: list[str] = []
    on_text = None if generic else item.on_text
    finish: str | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] = {}
    logprobs: list[dict[str, Any]] = []
    calls: dict[int, dict[str, str]] = {}
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
            delta = choice.get("delta") or {}
            piece = choice.get("text") or delta.get("content") or ""
            finish = choice.get("finish_reason") or finish
            tokens = _token_logprobs(choice.get("logprobs"), item.logprobs or 0)
            logprobs.extend(tokens)
            _add_call_fragments(calls, delta.get("tool_calls"))
            if not piece:
                continue
            pieces.append(piece)
            if on_text is None:
                continue
            if tokens and item.on_logprobs is not None and item.logprobs is not None:
                _tell(item.on_logprobs, tuple(tokens))
            if not _tell(on_text, piece):
                on_text = None
    if finish is None or usage is None:
        raise EngineGone("the stream ended before its last chunk")
    text = "".join(pieces)
    tool_calls = tuple(
        ToolCall(c["id"] or call_id(), c["name"], c["arguments"]) for _, c in sorted(calls.items())
    )
    if generic:
        text, tool_calls = read_generic(text)
        if text and item.on_text is not None:
            _tell(item.on_text, text)
    reason: Literal["stop", "length", "tool_calls"] = (
        "length" if finish == "length" else "tool_calls" if tool_calls else "stop"
    )
    return ChatOutput(
        text=text,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        finish_reason=reason,
        logprobs=tuple(logprobs) if item.logprobs is not None else None,
        tool_calls=tool_calls,
    )


def _tell(listener: Callable[[T], None], piece: T) -> bool:
    """Give a listener a piece (or its logprobs); False if it raised (it is told no more)."""
    try:
        listener(piece)
    except Exception:  # a failing listener must not fail the other items
        logger.exception("a stream listener raised; streaming to it stops")
        return False
    return True


def _add_call_fragments(calls: dict[int, dict[str, str]], fragments: Any) -> None:
    """A chunk's ``delta.tool_calls``: a call's id and name come once, its
    arguments in pieces, each fragment under its call's index."""
    for fragment in fragments or ():
        call = calls.setdefault(
            int(fragment.get("index", 0)), {"id": "", "name": "", "arguments": ""}
        )
        function = fragment.get("function") or {}
        call["id"] = fragment.get("id") or call["id"]
        call["name"] = function.get("name") or call["name"]
        call["arguments"] += function.get("arguments") or ""


def _token_logprobs(found: Any, alternatives: int) -> list[dict[str, Any]]:
    """A chunk's ``logprobs.content`` items in OpenAI's fields (llama.cpp adds
    token ids, which OpenAI's answer has not), with ``alternatives`` of each
    token's likeliest at most; or a completion's in the legacy form (vLLM's)."""
    if not isinstance(found, dict):
        return []
    if "tokens" in found:
        return _legacy_token_logprobs(found, alternatives)
    fields = ("token", "logprob", "bytes")
    items = []
    for entry in found.get("content") or ():
        item = {key: entry.get(key) for key in fields}
        tops = list(entry.get("top_logprobs") or ())[:alternatives]
        item["top_logprobs"] = [{key: top.get(key) for key in fields} for top in tops]
        items.append(item)
    return items


def _legacy_token_logprobs(found: dict[str, Any], alternatives: int) -> list[dict[str, Any]]:
    """The legacy form (``tokens``, ``token_logprobs``, ``top_logprobs`` as
    token: logprob) in ``content``'s fields, the alternatives likeliest first."""
    tops = found.get("top_logprobs") or []
    items = []
    for i, (token, logprob) in enumerate(
        zip(found.get("tokens") or (), found.get("token_logprobs") or (), strict=False)
    ):
        ranked = sorted(dict(tops[i] or {}).items() if i < len(tops) else (), key=lambda t: -t[1])
        items.append(
            {
                "token": token,
                "logprob": logprob,
                "bytes": list(token.encode()),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode())}
                    for t, lp in ranked[:alternatives]
                ],
            }
        )
    return items
