"""Tool calls in the generic format (for engines that call none themselves)
and in OpenAI's own fields."""

from __future__ import annotations

import json

import pytest

from builders import WEATHER_TOOL
from tessera.runtimes.tool_calls import (
    generic_messages,
    generic_schema,
    native_fields,
    native_message,
    read_generic,
)
from tessera.tasks.types import ChatInput, ChatMessage, ToolCall

OTHER = {"type": "function", "function": {"name": "get_time"}}
TOOLS = json.dumps([WEATHER_TOOL, OTHER])


def item(choice: str, *messages: ChatMessage, parallel: bool = True) -> ChatInput:
    turns = messages or (ChatMessage("user", "Weather in Paris?"),)
    return ChatInput(turns, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel)


def test_the_schema_holds_calls_to_the_offered_tools_and_text_only_with_auto() -> None:
    required = generic_schema(item("required"))
    calls = required["properties"]["tool_calls"]
    assert [c["properties"]["name"] for c in calls["items"]["anyOf"]] == [
        {"const": "get_weather"},
        {"const": "get_time"},
    ]
    assert (
        calls["items"]["anyOf"][0]["properties"]["arguments"]
        == (WEATHER_TOOL["function"]["parameters"])
    )
    assert calls["items"]["anyOf"][1]["properties"]["arguments"] == {"type": "object"}
    assert (calls["minItems"], "maxItems" in calls) == (1, False)
    named = generic_schema(item("get_time", parallel=False))["properties"]["tool_calls"]
    assert [c["properties"]["name"] for c in named["items"]["anyOf"]] == [{"const": "get_time"}]
    assert named["maxItems"] == 1
    auto = generic_schema(item("auto"))
    assert auto["anyOf"][0] == required
    assert auto["anyOf"][1]["required"] == ["response"]


def test_the_tools_join_the_system_message_and_earlier_calls_go_back_as_json() -> None:
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    turns = (
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Weather in Paris?"),
        ChatMessage("assistant", "", tool_calls=(call,)),
        ChatMessage("tool", "Sunny", tool_call_id="call_1"),
    )
    messages = generic_messages(item("auto", *turns), lambda m: m.content)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[0]["content"].startswith("Be brief.\n\nYou can call these tools")
    assert '"response"' in messages[0]["content"]  # auto: a text answer is offered
    assert json.loads(messages[2]["content"]) == {
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    }
    assert messages[3] == {"role": "tool", "content": "Sunny"}
    required = generic_messages(item("required"), lambda m: m.content)
    assert required[0]["role"] == "system"
    assert '"response"' not in required[0]["content"]


def test_answers_read_back_as_calls_or_text() -> None:
    answer = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'
    text, calls = read_generic(answer)
    assert text == ""
    ((call_id, name, arguments),) = [(c.id, c.name, c.arguments) for c in calls]
    assert call_id.startswith("call_")
    assert (name, json.loads(arguments)) == ("get_weather", {"city": "Paris"})
    assert read_generic('{"response": "It is sunny."}') == ("It is sunny.", ())
    assert read_generic("[1, 2]") == ("[1, 2]", ())


@pytest.mark.parametrize(
    ("cut", "text"),
    [
        # A call cut short at max_tokens: no call, and not its scaffold as the answer.
        ('{"tool_calls": [{"name": "get_wea', ""),
        ('{\n  "tool_calls":', ""),
        # A text answer cut short: its text so far, escapes decoded.
        ('{"response": "It is sun', "It is sun"),
        ('{ "response" : "Line one\\nLine', "Line one\nLine"),
        ('{"response": "caf\\u00e9 and \\u00', "café and "),
        ('{"response": "ends on a backslash \\', "ends on a backslash "),
        ('{"response": ', ""),
    ],
)
def test_an_answer_cut_short_shows_its_text_so_far_never_its_json(cut: str, text: str) -> None:
    assert read_generic(cut) == (text, ())


def test_openais_own_fields_for_an_engine_that_calls_tools() -> None:
    assert native_fields(item("auto"))["tool_choice"] == "auto"
    named = native_fields(item("get_time", parallel=False))
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_time"}}
    assert named["parallel_tool_calls"] is False
    assert named["tools"] == [WEATHER_TOOL, OTHER]
    assert native_fields(ChatInput((ChatMessage("user", "x"),))) == {}
    call = ToolCall("c1", "get_time", "{}")
    assert native_message(ChatMessage("assistant", "", tool_calls=(call,)), "") == {
        "role": "assistant",
        "content": None,
        "tool_calls": [call.openai()],
    }
    assert native_message(ChatMessage("tool", "9:00", tool_call_id="c1"), "9:00") == {
        "role": "tool",
        "content": "9:00",
        "tool_call_id": "c1",
    }
