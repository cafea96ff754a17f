"""Weight-only int8 ONNX graphs served with int8 weights (runtimes.onnx_quant),
on tiny graphs built here with onnx.helper in the pattern of the packaged int8
MiniLM: int8 initializers -> Cast -> Mul by a scale, feeding MatMul (directly
or through a Transpose) and an embedding Gather. The real model's answers are
checked in test_text_encoders.py.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from tessera.runtimes.memory import measure_rss  # noqa: E402
from tessera.runtimes.onnx_quant import (  # noqa: E402
    has_weight_only_int8,
    rewrite_weight_only_int8,
    served_graph,
)

VOCAB, DIM, HIDDEN = 64, 2048, 2048


def _dequant(nodes: list[Any], inits: list[Any], name: str, q: Any, scale: Any) -> str:
    """Add ``name = Cast(q) * scale`` (q and scale as initializers); return ``name``."""
    inits += [numpy_helper.from_array(q, f"{name}_q"), numpy_helper.from_array(scale, f"{name}_s")]
    nodes.append(helper.make_node("Cast", [f"{name}_q"], [f"{name}_f"], to=TensorProto.FLOAT))
    nodes.append(helper.make_node("Mul", [f"{name}_f", f"{name}_s"], [name]))
    return name


def tiny_int8_graph(seed: int = 0) -> Any:
    """ids [B, S] -> embeddings (int8 table, per-row scales) -> MatMul by an
    int8 weight with per-column scales -> MatMul by a transposed int8 weight ->
    MatMul by a uint8 weight with one scale -> MatMul by an int8 weight with
    per-row scales (not rewritable: left as it is)."""
    rng = np.random.default_rng(seed)

    def int8(*shape: int) -> Any:
        return rng.integers(-127, 128, shape, dtype=np.int8)

    def scales(*shape: int) -> Any:
        return rng.uniform(1e-3, 4e-3, shape).astype(np.float32)

    nodes: list[Any] = []
    inits: list[Any] = []
    table = _dequant(nodes, inits, "table", int8(VOCAB, DIM), scales(VOCAB, 1))
    nodes.append(helper.make_node("Gather", [table, "ids"], ["emb"], axis=0))
    w1 = _dequant(nodes, inits, "w1", int8(DIM, HIDDEN), scales(1, HIDDEN))
    nodes.append(helper.make_node("MatMul", ["emb", w1], ["h1"]))
    w2 = _dequant(nodes, inits, "w2", int8(HIDDEN, HIDDEN), scales(HIDDEN, 1))  # stored [N, K]
    nodes.append(helper.make_node("Transpose", [w2], ["w2_t"], perm=[1, 0]))
    nodes.append(helper.make_node("MatMul", ["h1", "w2_t"], ["h2"]))
    w3 = _dequant(nodes, inits, "w3", rng.integers(0, 256, (HIDDEN, 48), dtype=np.uint8), scales(1))
    nodes.append(helper.make_node("MatMul", ["h2", w3], ["h3"]))
    w4 = _dequant(nodes, inits, "w4", int8(48, 16), scales(48, 1))  # per-row: not per-column
    nodes.append(helper.make_node("MatMul", ["h3", w4], ["out"]))
    graph = helper.make_graph(
        nodes,
        "tiny-int8",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "S"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["B", "S", 16])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def session(model: str | bytes) -> Any:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


IDS = np.random.default_rng(1).integers(0, VOCAB, (3, 5), dtype=np.int64)


def run(sess: Any) -> Any:
    (out,) = sess.run(["out"], {"ids": IDS})
    return out


def test_rewrite_gives_the_original_outputs_with_int8_weights() -> None:
    original = tiny_int8_graph()
    rewritten = rewrite_weight_only_int8(tiny_int8_graph())

    assert (rewritten.matmuls, rewritten.gathers) == (3, 1)
    ops = [n.op_type for n in rewritten.model.graph.node]
    assert ops.count("MatMulNBits") == 3
    assert ops.count("MatMul") == 1  # the per-row-scaled one, left as it was
    assert "Transpose" not in ops
    kinds = {t.name: t.data_type for t in rewritten.model.graph.initializer}
    assert kinds["table_q"] == TensorProto.INT8  # the table is gathered as int8
    big = [t for t in rewritten.model.graph.initializer if np.prod(t.dims) >= DIM * HIDDEN]
    assert big
    assert all(t.data_type in (TensorProto.INT8, TensorProto.UINT8) for t in big)

    want = run(session(original.SerializeToString()))
    got = run(session(rewritten.model.SerializeToString()))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_the_rewritten_session_holds_fewer_bytes() -> None:
    session(tiny_int8_graph(seed=2).SerializeToString())  # onnxruntime's own first-use pages
    original = tiny_int8_graph().SerializeToString()
    rewritten = rewrite_weight_only_int8(tiny_int8_graph()).model.SerializeToString()

    def loaded(model: bytes) -> Any:
        sess = session(model)
        run(sess)
        return sess

    # Both stay alive, so that neither reuses the other's freed pages.
    small = measure_rss(lambda: loaded(rewritten))
    large = measure_rss(lambda: loaded(original))

    int8_bytes = (DIM * HIDDEN + HIDDEN * HIDDEN) * 1  # the two big weights, as int8
    assert large.rss_delta_bytes > 3 * int8_bytes  # folded to fp32
    assert small.rss_delta_bytes < large.rss_delta_bytes / 2
    assert small.rss_delta_bytes < 2 * int8_bytes


def test_a_graph_without_the_pattern_is_left_alone(tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    w = numpy_helper.from_array(np.ones((4, 2), dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "plain",
        [x],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "plain.onnx"
    onnx.save(model, str(path))

    assert rewrite_weight_only_int8(model).model is None
    assert not has_weight_only_int8(path)
    cache = tmp_path / "cache"
    assert served_graph(path, cache).model == str(path)
    # The next load learns it from the cache without reading the graph again.
    assert list((cache / "onnx-int8").glob("*.none"))
    assert served_graph(path, cache).model == str(path)


def test_the_rewrite_is_cached_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    onnx.save(tiny_int8_graph(), str(path))
    cache = tmp_path / "cache"
    assert has_weight_only_int8(path)

    first = served_graph(path, cache, "tiny")
    assert isinstance(first.model, bytes)
    assert first.how == "int8 rewrite"
    (entry,) = (cache / "onnx-int8").glob("*.onnx")
    second = served_graph(path, cache, "tiny")
    assert second.model == str(entry)
    assert second.how == "int8 rewrite (cached)"
    np.testing.assert_array_equal(run(session(second.model)), run(session(first.model)))

    # Another accuracy level is another entry; a changed source is another key.
    assert served_graph(path, cache, "tiny", accuracy_level=4).how == "int8 rewrite"
    onnx.save(tiny_int8_graph(seed=3), str(path))
    assert served_graph(path, cache, "tiny").how == "int8 rewrite"
    assert len(list((cache / "onnx-int8").glob("*.onnx"))) == 3

    # Without a cache folder the rewrite is made in memory, each time.
    assert isinstance(served_graph(path, None).model, bytes)


def test_a_graph_that_cannot_be_read_is_served_as_it_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "broken.onnx"
    path.write_bytes(b"not a protobuf at all")
    with caplog.at_level(logging.WARNING, logger="tessera.runtimes.onnx_quant"):
        served = served_graph(path, tmp_path / "cache", "broken")
    assert served.model == str(path)
    assert served.how == "original graph (rewrite failed)"
    assert "serving the original graph" in caplog.text
    assert not has_weight_only_int8(path)
