"""OpenAI's Responses API over a fake chat model, through the openai client
in process: whole and streamed (the client's own stream helper checks the
events' order), what is refused and why; input items as chat turns."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from fastapi import FastAPI

from tessera.engine import Engine
from tessera.gateway import create_app
from tessera.gateway.responses_api import ResponsesRequest
from tessera.tasks.types import ChatMessage, ToolCall
from tessera.tenants.responses import ResponseStore


@contextlib.asynccontextmanager
async def openai_client(app: FastAPI) -> AsyncIterator[openai.AsyncOpenAI]:
    """The openai client of ``app``, in process."""
    transport = httpx.ASGITransport(app=app)
    async with (
        httpx.AsyncClient(transport=transport, base_url="http://tessera") as http,
        openai.AsyncOpenAI(
            base_url="http://tessera/v1", api_key="none", http_client=http, max_retries=0
        ) as client,
    ):
        yield client


# One app for the module: without a response store a request leaves nothing behind.
@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def oai(shared_engine: Engine) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai_client(create_app(shared_engine)) as client:
        yield client


async def test_a_text_answered_whole(oai: openai.AsyncOpenAI) -> None:
    response = await oai.responses.create(
        model="chat", input="one two three", instructions="be brief", metadata={"k": "v"}
    )
    assert response.object == "response"
    assert response.id.startswith("resp_")
    assert (response.status, response.error, response.incomplete_details) == (
        "completed",
        None,
        None,
    )
    assert response.output_text == "one two three "
    (message,) = response.output
    assert message.type == "message"
    assert (message.role, message.status) == ("assistant", "completed")
    assert response.usage is not None
    # The fake counts a token a message: the instructions are one of two.
    assert (response.usage.input_tokens, response.usage.output_tokens) == (2, 3)
    assert response.usage.total_tokens == 5
    assert (response.instructions, response.metadata, response.store) == (
        "be brief",
        {"k": "v"},
        False,
    )


async def test_a_text_streamed_as_the_responses_api_streams(oai: openai.AsyncOpenAI) -> None:
    parts = [{"type": "input_text", "text": "one two"}, {"type": "input_text", "text": " three"}]
    async with oai.responses.stream(
        model="chat", input=[{"role": "user", "content": parts}]
    ) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert deltas == ["one ", "two ", "three "]
    assert final.output_text == "one two three "
    assert final.status == "completed"
    assert final.id == events[0].response.id  # type: ignore[union-attr]


def test_earlier_calls_and_their_outputs_are_turns_of_the_chat() -> None:
    items: list[Any] = [
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {
            "type": "function_call_output",
            "call_id": "call_2",
            "output": [{"type": "input_text", "text": "noon"}],
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "ok"}],
        },
    ]
    body = ResponsesRequest.model_validate({"model": "chat", "input": items, "instructions": "i"})
    assert body.item(body.input_items()).messages == (
        ChatMessage("system", "i"),
        ChatMessage("user", "weather in Paris?"),
        ChatMessage(
            "assistant",
            "",
            tool_calls=(
                ToolCall("call_1", "get_weather", "{}"),
                ToolCall("call_2", "get_time", "{}"),
            ),
        ),
        ChatMessage("tool", "sunny", tool_call_id="call_1"),
        ChatMessage("tool", "noon", tool_call_id="call_2"),
        ChatMessage("assistant", "ok"),
    )


async def test_a_chat_model_refuses_what_it_cannot_do(oai: openai.AsyncOpenAI) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    with pytest.raises(openai.BadRequestError, match="cannot call tools"):
        await oai.responses.create(model="chat", input="x", tools=[tool])  # type: ignore[list-item]


ENUM_1001 = {"enum": list(range(1001))}


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"conversation": "conv_1"}, "conversations are not served"),
        ({"background": True}, "background"),
        ({"input": []}, "at least 1 item"),
        ({"input": ""}, "must not be empty"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "call_id and arguments"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "function_call_output"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input_image"),
        ({"tools": [{"type": "web_search"}]}, "'function'"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "needs a schema"),
        (
            {
                "text": {
                    "format": {"type": "json_schema", "name": "x", "schema": {"enum": [0] * 1001}}
                }
            },
            "over 1000 enum values",
        ),
        ({"max_output_tokens": 0}, "greater than or equal to 1"),
        ({"model": "embed"}, "does embedding, not generate"),
        ({"model": "nope"}, "not found"),
    ],
)
async def test_what_is_not_served_says_why(
    oai: openai.AsyncOpenAI, fields: dict[str, Any], why: str
) -> None:
    with pytest.raises(openai.APIStatusError, match=why) as refused:
        await oai.responses.create(**{"model": "chat", "input": "x", **fields})
    assert refused.value.status_code in (400, 404)


async def test_an_image_must_come_as_a_data_url(oai: openai.AsyncOpenAI) -> None:
    image = {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "auto"}
    with pytest.raises(openai.BadRequestError, match="data: URL"):
        await oai.responses.create(model="chat", input=[{"role": "user", "content": [image]}])
    with pytest.raises(openai.BadRequestError, match="file ids are not served"):
        await oai.responses.create(
            model="chat",
            input=[{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}],
        )


async def test_unless_the_server_keeps_them_no_response_is_kept(
    oai: openai.AsyncOpenAI,
) -> None:
    response = await oai.responses.create(model="chat", input="x")
    assert response.store is False
    with pytest.raises(openai.NotFoundError, match="not found"):
        await oai.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError, match="store_responses is off"):
        await oai.responses.create(model="chat", input="y", previous_response_id=response.id)


@pytest.fixture
async def keeping(engine: Engine, tmp_path: Path) -> AsyncIterator[openai.AsyncOpenAI]:
    """A client of an app that keeps responses (``store_responses``)."""
    store = ResponseStore(tmp_path / "data", None, 3600.0)
    async with openai_client(create_app(engine, response_store=store)) as client:
        yield client
    store.close()


async def test_a_kept_response_is_continued_fetched_and_deleted(
    keeping: openai.AsyncOpenAI,
) -> None:
    first = await keeping.responses.create(model="chat", input="one two", instructions="i")
    assert first.store is True
    # The fake answers the last turn and counts a token a turn: the first
    # request's user turn and answer, then this one's (its instructions not carried).
    second = await keeping.responses.create(
        model="chat", input="three", previous_response_id=first.id
    )
    assert second.output_text == "three "
    assert second.previous_response_id == first.id
    assert second.usage is not None
    assert second.usage.input_tokens == 3
    # Streamed answers are kept too, and continue the chain.
    async with keeping.responses.stream(
        model="chat", input=[{"role": "user", "content": "four"}], previous_response_id=second.id
    ) as stream:
        third = await stream.get_final_response()
    assert third.usage is not None
    assert third.usage.input_tokens == 5
    # Its input items: the conversation before its output, newest first, by pages.
    listed = [item async for item in keeping.responses.input_items.list(third.id, limit=2)]
    assert [(item.type, getattr(item, "role", None)) for item in listed] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert len({item.id for item in listed}) == 5
    oldest = (await keeping.responses.input_items.list(third.id, order="asc", limit=1)).data[0]
    assert oldest.type == "message"
    assert [part.text for part in oldest.content] == ["one two"]  # type: ignore[union-attr]
    assert oldest.id == listed[-1].id  # the same ids on every listing

    fetched = await keeping.responses.retrieve(second.id)
    assert (fetched.id, fetched.output_text) == (second.id, second.output_text)
    await keeping.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        await keeping.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        await keeping.responses.create(model="chat", input="x", previous_response_id=second.id)
    with pytest.raises(openai.NotFoundError):
        await keeping.responses.delete(second.id)
    # store: false keeps nothing.
    unkept = await keeping.responses.create(model="chat", input="x", store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        await keeping.responses.retrieve(unkept.id)
