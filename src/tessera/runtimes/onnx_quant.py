"""Weight-only int8 ONNX graphs served with int8 weights in memory.

A weight-only int8 export stores each weight as an int8 (or uint8)
initializer dequantised in the graph: ``q -> Cast(to float) -> Mul(scale)``,
feeding a ``MatMul`` (as its B input, possibly through a ``Transpose``) or
an embedding ``Gather``. onnxruntime's constant folding computes those
dequantised weights once when it creates the session and keeps them as fp32
initializers: the int8 file holds four times its size resident.

``rewrite_weight_only_int8`` rewrites each such pattern so that nothing is
left to fold and the weights stay int8:

- ``MatMul(x, dequant(q))`` becomes onnxruntime's contrib op ``MatMulNBits``
  (domain ``com.microsoft``, ``bits=8``): the weights transposed to
  ``[N, K]`` and stored as ``q + 128`` (uint8) with zero point 128, and each
  column's scale repeated over its blocks of K, so the weights it dequantises
  are bit-identical to the original's. Scalar and per-column scales only;
  a per-row scale cannot be written as per-column blocks and is left as it was.
- ``Gather(dequant(q), ids)`` becomes ``Gather(q, ids) -> Cast -> Mul`` by the
  scale (gathered by the same ids for a per-row scale): the table stays int8
  and only the rows looked up are dequantised, to the same values.

``served_graph`` returns what the session should load: the rewritten graph,
written once under ``<cache_dir>/onnx-int8/<key>.onnx`` (the key hashes the
source's path, size, modification time and this rewrite's version) and read
from there by later loads, or the original file where no pattern is found,
the ``onnx`` package is missing or the rewrite fails (each with a log line).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tessera.runtimes.cache import INT8_REWRITES, private_dirs, used
from tessera.runtimes.digest import source_key

if TYPE_CHECKING:
    import numpy.typing as npt

log = logging.getLogger(__name__)

# Bumped when the rewrite changes, so that older cached graphs are not read.
REWRITE_VERSION = 1
_MS_DOMAIN = "com.microsoft"
# MatMulNBits' block length along K: the largest of these dividing K (fewer
# scales to hold); K divisible by none of them is left as it was.
_BLOCK_SIZES = (128, 64, 32, 16)
_ZERO_POINT = 128

# onnx.TensorProto's data types, spelt out so that this module imports without onnx.
_FLOAT = 1
_UINT8 = 2
_INT8 = 3


@dataclass(frozen=True)
class Rewritten:
    """The outcome of a rewrite: the rewritten model (None: nothing to rewrite)
    and how many matmuls and gathers were rewritten."""

    model: Any
    matmuls: int
    gathers: int


def _block_size(k: int) -> int | None:
    for size in _BLOCK_SIZES:
        if k % size == 0:
            return size
    return None


class _Graph:
    """Index of a graph's nodes, initializers and consumers."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self.inits: dict[str, Any] = {t.name: t for t in graph.initializer}
        self.producer: dict[str, Any] = {o: n for n in graph.node for o in n.output}
        self.consumers: dict[str, list[Any]] = {}
        for node in graph.node:
            # A name an If's or Loop's subgraph reads counts as read by that node.
            for name in _names_read([node]):
                self.consumers.setdefault(name, []).append(node)
        self.outputs = {o.name for o in graph.output}

    def only_consumers(self, name: str) -> list[Any]:
        """The nodes reading ``name``; empty where a graph output is one of them."""
        return [] if name in self.outputs else self.consumers.get(name, [])

    def dequant(self, mul: Any) -> tuple[str, str, Any] | None:
        """(int8 initializer, scale initializer, Cast node) where ``mul``
        multiplies a Cast-to-float of an int8/uint8 initializer by a float one."""
        if mul.op_type != "Mul" or len(mul.input) != 2:
            return None
        for i in (0, 1):
            cast = self.producer.get(mul.input[i])
            scale = self.inits.get(mul.input[1 - i])
            if cast is None or scale is None or cast.op_type != "Cast":
                continue
            to = next((a.i for a in cast.attribute if a.name == "to"), None)
            q = self.inits.get(cast.input[0])
            if to != _FLOAT or q is None or q.data_type not in (_INT8, _UINT8):
                continue
            if scale.data_type != _FLOAT or len(self.consumers.get(cast.output[0], [])) != 1:
                continue
            return q.name, scale.name, cast
        return None


def _column_scales(scale: npt.NDArray[np.float32], n: int) -> npt.NDArray[np.float32] | None:
    """A [K, N] weight's scale as one per column, or None where it is not
    scalar or per-column (a [K, 1] or [K, N] scale)."""
    if scale.size == 1:
        return np.full(n, scale.reshape(()), dtype=np.float32)
    if scale.ndim >= 1 and scale.shape[-1] == n and scale.size == n:
        return scale.reshape(n).astype(np.float32, copy=False)
    return None


def rewrite_weight_only_int8(model: Any, accuracy_level: int = 0) -> Rewritten:
    """Rewrite ``model`` (an ``onnx.ModelProto``, changed in place) as the
    module notes say; ``Rewritten.model`` is None where nothing was rewritten.
    ``accuracy_level`` is MatMulNBits': 0 computes in fp32 (the same answers),
    4 quantises the activations to int8 too (faster, not the same answers)."""
    from onnx import helper, numpy_helper

    g = _Graph(model.graph)
    new_inits: list[Any] = []
    removed_nodes: set[int] = set()
    replacements: dict[int, list[Any]] = {}
    matmuls = gathers = 0

    for mul in list(model.graph.node):
        found = g.dequant(mul)
        if found is None:
            continue
        q_name, scale_name, cast = found
        consumers = g.only_consumers(mul.output[0])
        if len(consumers) != 1:
            continue
        (user,) = consumers
        q = numpy_helper.to_array(g.inits[q_name])
        scale = numpy_helper.to_array(g.inits[scale_name]).astype(np.float32, copy=False)
        prefix = f"{q_name}_tessera{matmuls + gathers}"

        if user.op_type == "Gather" and user.input[0] == mul.output[0]:
            axis = next((a.i for a in user.attribute if a.name == "axis"), 0)
            if axis != 0 or q.ndim != 2:
                continue
            ids = user.input[1]
            nodes = [helper.make_node("Gather", [q_name, ids], [f"{prefix}_rows"], axis=0)]
            nodes.append(
                helper.make_node("Cast", [f"{prefix}_rows"], [f"{prefix}_rows_f"], to=_FLOAT)
            )
            if scale.size == 1 or scale.shape == (1, q.shape[1]) or scale.shape == (q.shape[1],):
                scale_input = scale_name
            elif scale.shape == (q.shape[0], 1):
                nodes.append(
                    helper.make_node("Gather", [scale_name, ids], [f"{prefix}_scales"], axis=0)
                )
                scale_input = f"{prefix}_scales"
            else:
                continue
            nodes.append(
                helper.make_node("Mul", [f"{prefix}_rows_f", scale_input], list(user.output))
            )
            replacements[id(user)] = nodes
            removed_nodes.update({id(cast), id(mul)})
            gathers += 1
            continue

        transpose = None
        if user.op_type == "Transpose":
            perm = next((list(a.ints) for a in user.attribute if a.name == "perm"), None)
            following = g.only_consumers(user.output[0])
            if q.ndim != 2 or perm not in (None, [1, 0]) or len(following) != 1:
                continue
            transpose, user = user, following[0]
            q = q.T
            scale = scale.T if scale.ndim == 2 else scale
        if user.op_type != "MatMul" or q.ndim != 2:
            continue
        b_input = transpose.output[0] if transpose is not None else mul.output[0]
        if user.input[1] != b_input or user.input[0] == b_input:
            continue
        k, n = q.shape
        block = _block_size(k)
        columns = _column_scales(scale, n)
        if block is None or columns is None:
            continue
        blocks = k // block
        if q.dtype == np.int8:  # stored as q + 128 with zero point 128: the same values
            stored, zero = (q.astype(np.int16) + _ZERO_POINT).astype(np.uint8), _ZERO_POINT
        else:  # a uint8's Cast is its value: zero point 0
            stored, zero = q, 0
        weights = np.ascontiguousarray(stored.T.reshape(n, blocks, block))
        scales = np.repeat(columns, blocks).astype(np.float32)
        zeros = np.full(n * blocks, zero, dtype=np.uint8)
        new_inits += [
            numpy_helper.from_array(weights, f"{prefix}_B"),
            numpy_helper.from_array(scales, f"{prefix}_scales"),
            numpy_helper.from_array(zeros, f"{prefix}_zero_points"),
        ]
        node = helper.make_node(
            "MatMulNBits",
            [user.input[0], f"{prefix}_B", f"{prefix}_scales", f"{prefix}_zero_points"],
            list(user.output),
            name=f"{user.name or prefix}_nbits",
            domain=_MS_DOMAIN,
            K=k,
            N=n,
            bits=8,
            block_size=block,
            accuracy_level=accuracy_level,
        )
        replacements[id(user)] = [node]
        removed_nodes.update({id(cast), id(mul)})
        if transpose is not None:
            removed_nodes.add(id(transpose))
        matmuls += 1

    if not replacements:
        return Rewritten(None, 0, 0)
    order: list[Any] = []
    for node in model.graph.node:
        if id(node) in removed_nodes:
            continue
        order.extend(replacements.get(id(node), [node]))
    del model.graph.node[:]
    model.graph.node.extend(order)
    # Drop the initializers nothing reads any more (the int8 ones of matmuls,
    # now stored transposed and shifted), then add the new ones.
    used = _names_read(order)
    kept = [t for t in model.graph.initializer if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept + new_inits)
    if matmuls and not any(o.domain == _MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(_MS_DOMAIN, 1))
    return Rewritten(model, matmuls, gathers)


def _names_read(nodes: list[Any]) -> set[str]:
    """The names ``nodes`` read, those of their subgraphs (If, Loop...) included."""
    names: set[str] = set()
    for node in nodes:
        names.update(node.input)
        for attribute in node.attribute:
            graphs = [attribute.g] if attribute.HasField("g") else []
            for graph in graphs + list(attribute.graphs):
                names |= _names_read(list(graph.node))
    return names


@dataclass(frozen=True)
class ServedGraph:
    """What a session loads: a file path or serialised bytes, and a word on which."""

    model: str | bytes
    how: str


def served_graph(
    source: Path, cache_dir: Path | None, name: str = "", accuracy_level: int = 0
) -> ServedGraph:
    """The graph to load for ``source``: its int8-preserving rewrite (from
    the cache, or made now and cached), or ``source`` itself."""
    entry = None
    if cache_dir is not None:
        key = source_key(source, accuracy_level=accuracy_level, version=REWRITE_VERSION)
        entry = cache_dir / INT8_REWRITES / f"{key}.onnx"
        if entry.is_file():
            used(entry)
            return ServedGraph(str(entry), "int8 rewrite (cached)")
        marker = entry.with_suffix(".none")
        if marker.is_file():  # an earlier load found nothing to rewrite
            used(marker)
            return ServedGraph(str(source), "original graph")
    try:
        import onnx
    except ImportError:
        log.info("%s: the onnx package is missing; serving the graph as it is", name or source)
        return ServedGraph(str(source), "original graph (no onnx package)")
    try:
        model = onnx.load(str(source))
        rewritten = rewrite_weight_only_int8(model, accuracy_level)
    except Exception as e:  # a malformed or unusual graph: serve it as it is
        log.warning("%s: cannot rewrite its int8 weights (%s); serving the original graph", name, e)
        return ServedGraph(str(source), "original graph (rewrite failed)")
    if rewritten.model is None:
        log.info("%s: no weight-only int8 pattern found; serving the original graph", name)
        if entry is not None:
            _write_atomic(entry.with_suffix(".none"), b"")
        return ServedGraph(str(source), "original graph")
    data: bytes = rewritten.model.SerializeToString()
    log.info(
        "%s: %d matmuls and %d gathers rewritten to keep their int8 weights",
        name,
        rewritten.matmuls,
        rewritten.gathers,
    )
    if entry is not None:
        _write_atomic(entry, data)
    return ServedGraph(data, "int8 rewrite")


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all (a crash leaves no half graph to read)."""
    try:
        private_dirs(path.parent)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("cannot cache %s: %s", path, e)


_patterns: dict[tuple[str, int, int], bool] = {}
_patterns_lock = threading.Lock()


def has_weight_only_int8(source: Path) -> bool:
    """Whether ``source`` dequantises int8 initializers in the graph (the
    pattern the rewrite looks for); False without the onnx package. Cached by
    path, size and modification time: the engine asks before every load."""
    try:
        stat = source.stat()
        import onnx
    except (OSError, ImportError):
        return False
    key = (str(source.resolve()), stat.st_size, stat.st_mtime_ns)
    with _patterns_lock:
        found = _patterns.get(key)
    if found is None:
        try:
            g = _Graph(onnx.load(str(source), load_external_data=False).graph)
            found = any(g.dequant(node) is not None for node in g.graph.node)
        except Exception:  # a graph onnx cannot read: onnxruntime will say why at load
            found = False
        with _patterns_lock:
            _patterns[key] = found
    return found
