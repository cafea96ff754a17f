"""onnxruntime's optimised graphs, kept between loads of a model on the CPU.

An ``InferenceSession`` optimises its graph each time it is created
(constant folding, node fusions, then layout rewrites for the CPU it runs
on), and a model evicted under the budget pays that again on every reload:
for Piper's VITS voice, about 0.3 s of its 0.45 s session creation on a
2-core CPU. ``optimized_graph`` keeps the graph as onnxruntime optimised it
at the *extended* level (``ORT_ENABLE_EXTENDED``, written with the session
option ``optimized_model_filepath``) under
``<cache_dir>/onnx-optimized/<key>.onnx``, and later sessions load that file
in place of the source: those rewrites are done already. Each session still
runs at the ``all`` level, whose layout rewrites (NCHWc) depend on the CPU
and are left out of the file, so a data folder taken to another machine
serves the same graph there (onnxruntime warns that a graph saved past the
extended level may hold ops of the hardware it was made on).

The key hashes the source's path, size and modification time, onnxruntime's
version and this module's ``GRAPH_VERSION``. The file is made once, by a
session created for that alone before the load's measurement; that session
is freed and the heap trimmed before the measurement starts, so that the
measured session cannot reuse its pages unseen. Only CPU sessions use it
(a GPU provider's fusions are its own). A failure to make or write the file
logs a warning and serves the source as it is.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from tessera.runtimes.cache import ORT_GRAPHS, private_dirs, used
from tessera.runtimes.digest import source_key
from tessera.runtimes.memory import trim_heap

log = logging.getLogger(__name__)

# Bumped when what is written changes, so that older files are not read.
GRAPH_VERSION = 1
_CPU = "CPUExecutionProvider"


def cpu_only(providers: list[Any]) -> bool:
    """Whether a session of ``providers`` runs on the CPU provider alone."""
    names = [p[0] if isinstance(p, tuple) else p for p in providers]
    return names == [_CPU]


def optimized_graph(source: Path, cache_dir: Path | None, name: str = "") -> Path:
    """The file a CPU session of ``source`` should load: its optimised graph
    (from the cache, or made now and cached), or ``source`` itself when there
    is no cache folder or the graph cannot be made."""
    if cache_dir is None:
        return source
    import onnxruntime as ort

    key = source_key(source, onnxruntime=ort.__version__, version=GRAPH_VERSION)
    entry = cache_dir / ORT_GRAPHS / f"{key}.onnx"
    if entry.is_file():
        used(entry)
        return entry
    try:
        private_dirs(entry.parent)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-", suffix=".onnx")
        os.close(fd)
    except OSError as e:
        log.warning("%s: cannot cache its optimised graph (%s)", name or source, e)
        return source
    try:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = tmp
        options.intra_op_num_threads = 1
        ort.InferenceSession(str(source), options, providers=[_CPU])
        os.replace(tmp, entry)  # whole or not at all: a crash leaves no half graph
    except Exception as e:  # onnxruntime's errors derive from Exception; OSError too
        log.warning("%s: cannot cache its optimised graph (%s); loading the source", name, e)
        Path(tmp).unlink(missing_ok=True)
        return source
    finally:
        trim_heap()  # the session's pages go back before the load is measured
    log.info("%s: optimised graph cached at %s", name or source, entry)
    return entry
