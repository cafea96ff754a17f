"""``n`` choices of one prompt with a ``seed``: each choice samples from the
next seed after the one before's, so that the request is reproducible and
its choices are not all alike (each had the request's seed: one answer n times)."""

from __future__ import annotations

from tessera.gateway.openai_chat import ChatRequest, chat_inputs
from tessera.gateway.openai_completions import CompletionRequest, completion_inputs


def test_each_choice_of_a_chat_has_a_seed_of_its_own() -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = ChatRequest.model_validate({"model": "m", "messages": messages, "n": 3, "seed": 7})
    assert [item.seed for item in chat_inputs(body)] == [7, 8, 9]
    body = ChatRequest.model_validate({"model": "m", "messages": messages, "n": 2})
    assert [item.seed for item in chat_inputs(body)] == [None, None]


def test_each_prompts_choices_count_their_seeds_from_the_requests() -> None:
    body = CompletionRequest.model_validate(
        {"model": "m", "prompt": ["a", "b"], "n": 2, "seed": 5, "max_tokens": 4}
    )
    items = completion_inputs(body)
    assert [(item.prompt, item.seed) for item in items] == [("a", 5), ("a", 6), ("b", 5), ("b", 6)]
