"""The OpenAI request tessera sends to an external engine (llama.cpp, vLLM)."""

from __future__ import annotations

from tessera.runtimes.openai_chat import request_body
from tessera.tasks.types import ChatInput, ChatMessage


def test_penalties_and_logit_bias_are_sent_as_openai_writes_them() -> None:
    item = ChatInput(
        messages=(ChatMessage("user", "hi"),),
        presence_penalty=0.5,
        frequency_penalty=-1.0,
        logit_bias=((7, -100.0), (12, 2.5)),
    )
    body = request_body("m", item, {}, native_tools=True)
    assert body["presence_penalty"] == 0.5
    assert body["frequency_penalty"] == -1.0
    assert body["logit_bias"] == {"7": -100.0, "12": 2.5}


def test_nothing_is_sent_for_the_defaults() -> None:
    body = request_body(
        "m", ChatInput(messages=(ChatMessage("user", "hi"),)), {}, native_tools=True
    )
    assert not {"presence_penalty", "frequency_penalty", "logit_bias"} & body.keys()
