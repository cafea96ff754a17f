"""Small encoders on a GPU: reduced precision checked against float32, and
CUDA graphs per shape bucket (issue 15, item 2).

Precision. A card's ``dtype`` option (``auto``, ``float32``, ``float16``,
``bfloat16``) says what the weights run in; ``auto`` is float16 on CUDA and
float32 on the CPU. A reduced precision is kept only if the model's outputs
on ``CHECK_TEXTS`` stay within ``MIN_COSINE`` of float32's, row by row
(pooled token vectors for an encoder, logits for a classifier); otherwise
the model goes back to float32 and the load says why in the log.

Graphs. One forward of MiniLM at batch 1 is 3.4 ms of kernel launches on an
H200 and 0.57 ms as a CUDA graph (shared/GPU.md). ``GraphForward`` runs a
Hugging Face encoder at bucketed shapes: a batch is padded up to the
smallest (batch, length) bucket that holds it (``BATCH_BUCKETS`` x
``LENGTH_BUCKETS``), run by that bucket's runner, and its rows and
positions cut back; a larger batch runs eager (it is compute, not launches).
What a bucket runs is ``graph_step``: it makes the 4-D additive mask from
the 0/1 one itself, which transformers passes through as it is (its own mask
building tests whether there is padding, which reads the device, and a
graph capture forbids that), and for token vectors pools them too (mean and
first position, float32). Texts tokenised ahead by a gateway (the common
path) are padded to their bucket on the host and copied into the graph's
inputs, and leave as pooled rows (``GraphForward.pooled``): around the
replay the host launches one copy in, a cut and one copy out, where
the device-side padding, masking and pooling were about thirty operators
(``benchmarks/graph_host_bench.py``).
Padding with a masked position changes no real position's vector (tested on
the CPU against the plain forward). On CUDA a bucket's runner is a graph
captured from static inputs (``CudaGraphRunners``), all in one memory
pool (a new one after a reset), replayed one at a time (a lock); every
capture on a device is recorded on one stream. A bucket whose capture fails
runs eager until the next reset. On the CPU there are no graphs and no padding.

Graphs per architecture, not per model (``SharedGraphs``). A graph reads
the weights at the addresses it was captured with, so graphs of a model's
own would be lost each time its weights leave for the host tier (they come
back at new addresses), and a hundred fine-tunes of one base would capture
a hundred sets. Instead every model of one architecture on a device (same
config shape, same tensors: ``signature``) replays one set, captured over a
template module: before a batch of another model than the last, that
model's weights are copied into the template's tensors. On CUDA each model's
weights and the template's are one block laid out alike
(``hostcopy.gather_block``, at the model's load), so that is one copy of the
block; otherwise one fused copy a dtype (``copy_weights``).
The template and the graphs are one shared
component (``GraphsHold``: counted once, offloaded with the last of its
models to leave the device, freed with the last to go); the first model of
an architecture makes it at its load, every bucket captured inside that
load's measurement.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from tessera.errors import ModelUnavailableError
from tessera.footprint import Footprint
from tessera.runtimes.base import SharedComponents
from tessera.runtimes.hostcopy import (
    HostCopy,
    block_like,
    gather_block,
    one_block,
    storage_bytes,
)
from tessera.runtimes.memory import torch_module_bytes

if TYPE_CHECKING:
    import numpy.typing as npt
    import torch

    from tessera.repository.spec import ModelSpec

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "float16", "bfloat16")
MIN_COSINE = 0.999
# Up to a card's usual max_batch_size: on an H200 a MiniLM forward of 32
# sentences took as long eager as one of 1 (3.4 ms of launches, GPU.md), so a
# batch of 32 is still launches, not compute, and a graph is what shortens it.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
LENGTH_BUCKETS = (16, 32, 64)
# After a reset (a return from the host tier), a bucket's graph is captured on
# its second use: a capture costs about three eager forwards.
CAPTURE_ON_USE = 2
# Config keys that name or describe a copy rather than shape its forward.
_NOT_SHAPE = frozenset(
    {
        "_name_or_path",
        "name_or_path",
        "transformers_version",
        "architectures",
        "id2label",
        "label2id",
        "dtype",
        "torch_dtype",
        "_attn_implementation_autoset",
    }
)
# The vectors an encoder's graph leaves on the device beside its token vectors.
POOLINGS = ("mean", "cls")
# The most models a stacked forward holds where a card says ``stack: true``.
DEFAULT_STACK = 16
# What a reduced precision is checked on: short and long, plain and odd.
CHECK_TEXTS = (
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    "Quarterly revenue rose 12% to $4.1 billion, beating estimates.",
    "¿Dónde está la estación de tren más cercana?",
    "ERROR 503: upstream timed out after 30000 ms (retry in 5 s)",
    "A receipt: 2 x coffee 3.50, 1 x bagel 2.25, total 9.25 EUR",
    "def add(a, b):\n    return a + b",
    "Une phrase en français, pour voir ce que devient la précision.",
)

Inputs = dict[str, "torch.Tensor"]
Outputs = dict[str, "torch.Tensor"]
# The inputs ``host_inputs`` makes: one int64 block (keys, rows, columns), by name.
HOST_KEYS = ("input_ids", "attention_mask", "token_type_ids")


class PackedInputs(dict[str, "torch.Tensor"]):
    """Inputs that are, in their order, the rows of one tensor ``block``: a
    runner whose static inputs are packed alike copies them in one call
    (``CudaGraphRunners``). Each torch call releases the interpreter lock and
    takes it back, a handover whenever another thread waits for it."""

    def __init__(self, block: torch.Tensor, keys: Sequence[str]) -> None:
        super().__init__(zip(keys, block.unbind(0), strict=True))
        self.block = block


# What a bucket runs: padded inputs (the attention mask 0/1) to named outputs.
Step = Callable[[Inputs], Outputs]
Runner = Callable[[Inputs], Outputs]
MakeRunner = Callable[[Step, Inputs], Runner]


class StackedRounds(Protocol):
    """Rounds of several models' batches in one forward, part of their
    architecture's graphs and moved and freed with them
    (``runtimes/stacking.py``'s ``StackedGraphs``)."""

    @property
    def num_bytes(self) -> int: ...

    def pooled(
        self,
        model: Any,
        ids: Sequence[npt.NDArray[np.int32]],
        pooling: str,
        solo: Callable[[], torch.Tensor | None],
    ) -> npt.NDArray[np.float32] | None: ...

    def prepare(self) -> None: ...

    def offload(self) -> None: ...

    def restore(self) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Stacking:
    """Stacked rounds asked for: the most models one holds, and what makes
    them over an architecture's template and graphs (``StackedGraphs``)."""

    max_models: int
    make: Callable[[Any, GraphForward, MakeRunner, int], StackedRounds]


@dataclass(frozen=True, slots=True)
class PaddedIds:
    """Texts tokenised ahead, padded to a bucket in host memory (``host_inputs``)."""

    key: tuple[int, int]  # the bucket: (rows, columns)
    size: int  # the rows that are texts
    inputs: Inputs
    reused: bool = False  # in its thread's own block (``GraphForward.padded_ids``)


class _ThreadBlocks(threading.local):
    """Each thread's input blocks by bucket (``GraphForward.padded_ids``)."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[int, int], tuple[npt.NDArray[np.int64], PackedInputs]] = {}


@dataclass(frozen=True, slots=True)
class DeviceOptions:
    """A card's ``dtype`` (``DTYPES``), ``cuda_graphs`` (true) and ``stack``
    (``runtimes/stacking.py``: the most models a stacked forward holds; 0, off)."""

    dtype: str = "auto"
    graphs: bool = True
    stack: int = 0


def stack_option(spec: ModelSpec) -> int:
    """How many models a stacked forward of ``spec``'s group may hold (0: off)."""
    value = spec.options.get("stack", False)
    if value is True:
        return DEFAULT_STACK
    if value is False:
        return 0
    if not isinstance(value, int) or value < 2:
        raise ModelUnavailableError(
            spec.name, "option stack must be true, false or a whole number from 2"
        )
    return value


def device_options(spec: ModelSpec) -> DeviceOptions:
    dtype = spec.options.get("dtype", "auto")
    if dtype not in DTYPES:
        raise ModelUnavailableError(spec.name, f"option dtype must be one of {', '.join(DTYPES)}")
    graphs = spec.options.get("cuda_graphs", True)
    if not isinstance(graphs, bool):
        raise ModelUnavailableError(spec.name, "option cuda_graphs must be true or false")
    return DeviceOptions(str(dtype), graphs, stack_option(spec))


def encoder_variant(spec: ModelSpec) -> str:
    """What tells apart the copies of one encoder that cards' options make
    (empty for the defaults): part of its shared-component key."""
    options = device_options(spec)
    if options == DeviceOptions():
        return ""
    variant = f":{options.dtype}" + ("" if options.graphs else ":eager")
    return variant + (f":stack{options.stack}" if options.stack else "")


def wanted_dtype(option: str, device: str) -> str:
    """The dtype ``option`` asks for on ``device`` (``auto``: float16 on CUDA)."""
    if option == "auto":
        return "float16" if device.startswith("cuda") else "float32"
    return option


def bucket_of(size: int, buckets: Sequence[int]) -> int | None:
    for bucket in buckets:
        if size <= bucket:
            return bucket
    return None


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A (batch, length) 0/1 mask as the (batch, 1, 1, length) additive mask
    attention adds to its scores: 0 where attended, the dtype's lowest where not."""
    import torch

    keep = mask[:, None, None, :].to(dtype)
    return (1.0 - keep) * torch.finfo(dtype).min


def padded_inputs(
    batch: Mapping[str, torch.Tensor],
    rows: int,
    columns: int,
    pad_id: int,
    keys: Sequence[str] = (),
) -> Inputs:
    """A tokenized ``batch`` padded to (rows, columns), ``input_ids`` with
    ``pad_id`` and the rest with 0 (``keys`` it lacks made of zeros): padding
    is masked, and changes no real position's vector."""
    import torch

    size, length = batch["input_ids"].shape
    inputs: Inputs = {}
    for key in dict.fromkeys([*batch, *keys]):
        fill = pad_id if key == "input_ids" else 0
        value = batch.get(key)
        if value is None:
            value = torch.zeros_like(batch["input_ids"])
        value = torch.nn.functional.pad(value, (0, columns - length), value=fill)
        if rows > size:
            value = torch.cat([value, value.new_full((rows - size, columns), fill)])
        inputs[key] = value
    return inputs


def host_inputs(
    ids: Sequence[npt.NDArray[np.int32]],
    rows: int,
    columns: int,
    pad_id: int,
    keys: Sequence[str],
    *,
    pinned: bool = False,
) -> PackedInputs:
    """Texts tokenised ahead (``runtimes.tokens``) as a batch of (rows, columns)
    in host memory, padded as ``padded_inputs`` pads (``token_type_ids`` all
    0 where ``keys`` name them): a bucket's inputs made without a device op,
    one block of them in ``keys``' order (``PackedInputs``).

    ``pinned`` (for a CUDA device): in page-locked memory from torch's caching
    host allocator, so a copy to the device ``non_blocking`` is one: from
    pageable memory the driver stages the bytes and may wait for the stream
    first, and inside the graphs' lock that wait was the other worker's replay
    (the H200's 100-model round robin: each batch 3.1 ms on its worker, about
    0.75 of it on a core). The allocator reuses such a block only once the
    copies that read it have run."""
    filled, names = _filled([ids], 1, rows, columns, pad_id, keys)
    return _packed(filled[:, 0], names, pinned)


def stacked_inputs(
    groups: Sequence[Sequence[npt.NDArray[np.int32]]],
    slots: int,
    rows: int,
    columns: int,
    pad_id: int,
    keys: Sequence[str],
    *,
    pinned: bool = False,
) -> PackedInputs:
    """``host_inputs`` of several batches at once, one a slot: each input
    (slots, rows, columns), slot ``i`` ``groups[i]``'s texts padded, the
    slots past ``groups`` all padding (``runtimes/stacking.py``)."""
    filled, names = _filled(groups, slots, rows, columns, pad_id, keys)
    return _packed(filled, names, pinned)


def _filled(
    groups: Sequence[Sequence[npt.NDArray[np.int32]]],
    slots: int,
    rows: int,
    columns: int,
    pad_id: int,
    keys: Sequence[str],
) -> tuple[npt.NDArray[np.int64], list[str]]:
    names = host_names(keys)
    filled = np.empty((len(names), slots, rows, columns), dtype=np.int64)
    _fill(filled, groups, pad_id, names)
    return filled, names


def host_names(keys: Sequence[str]) -> list[str]:
    """The inputs ``host_inputs`` makes for a tokenizer's ``keys``, in order."""
    names = [key for key in keys if key in HOST_KEYS]
    return names + [key for key in HOST_KEYS[:2] if key not in names]


def _fill(
    filled: npt.NDArray[np.int64],
    groups: Sequence[Sequence[npt.NDArray[np.int32]]],
    pad_id: int,
    names: Sequence[str],
) -> None:
    """``filled`` (names, slots, rows, columns) made ``groups``' padded inputs."""
    filled.fill(0)
    input_ids, mask = filled[names.index("input_ids")], filled[names.index("attention_mask")]
    input_ids[...] = pad_id
    for slot, ids in enumerate(groups):
        for row, row_ids in enumerate(ids):
            input_ids[slot, row, : len(row_ids)] = row_ids
            mask[slot, row, : len(row_ids)] = 1


def _packed(filled: npt.NDArray[np.int64], names: list[str], pinned: bool) -> PackedInputs:
    import torch

    block = torch.from_numpy(filled)  # no torch operator: numpy's memory
    return PackedInputs(block.pin_memory() if pinned else block, names)


def graph_step(model: Any, output: str) -> Step:
    """What a bucket's graph records: the additive mask made from the 0/1 one,
    the forward, and for token vectors (``last_hidden_state``) their mean
    over the mask and the first position's, both float32 (``POOLINGS``):
    an encoder's batch then leaves the device as its vectors, with no
    pooling launched around the replay."""

    def step(inputs: Inputs) -> Outputs:
        dtype = next(model.parameters()).dtype
        mask = inputs["attention_mask"]
        out = primary(model(**{**inputs, "attention_mask": additive_mask(mask, dtype)}), output)
        if output != "last_hidden_state":
            return {"out": out}
        return {"out": out, "mean": pooled(out, mask), "cls": out[:, 0].float()}

    return step


def primary(outputs: Any, output: str) -> torch.Tensor:
    tensor: torch.Tensor = getattr(outputs, output)
    return tensor


def pooled(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Rows to compare: token vectors mean-pooled over the mask, or logits as they are."""
    if values.dim() == 2:
        return values.float()
    weights = mask.unsqueeze(-1).to(values.dtype)
    return ((values * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)).float()


def reduce_precision(
    model: Any, batch: Mapping[str, torch.Tensor], dtype: str, output: str, min_cosine: float
) -> float:
    """Turn ``model`` to ``dtype`` if its outputs on ``batch`` keep a cosine of
    at least ``min_cosine`` to float32's, row by row; else leave it float32.
    Returns the lowest cosine."""
    import torch

    with torch.inference_mode():
        reference = pooled(primary(model(**batch), output), batch["attention_mask"])
        model.to(getattr(torch, dtype))
        trial = pooled(primary(model(**batch), output), batch["attention_mask"])
    cosine = float(torch.nn.functional.cosine_similarity(reference, trial, dim=-1).min())
    if cosine < min_cosine:
        model.to(torch.float32)
    return cosine


def choose_precision(
    model: Any, tokenizer: Any, device: str, option: str, output: str, name: str
) -> str:
    """Run ``model`` in the dtype ``option`` asks for on ``device`` if it passes
    the check (module notes); the dtype it runs in."""
    wanted = wanted_dtype(option, device)
    if wanted == "float32":
        return wanted
    batch = tokenizer(list(CHECK_TEXTS), padding=True, truncation=True, return_tensors="pt")
    batch = batch.to(device)
    cosine = reduce_precision(model, batch, wanted, output, MIN_COSINE)
    if cosine < MIN_COSINE:
        log.warning(
            "%s stays float32: in %s its outputs' cosine to float32's fell to %.5f (< %g)",
            name,
            wanted,
            cosine,
            MIN_COSINE,
        )
        return "float32"
    log.info("%s runs in %s (cosine to float32 >= %.5f)", name, wanted, cosine)
    return wanted


def run_eager(model: Any, output: str, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``model``'s ``output`` for ``inputs``, in inference mode."""
    import torch

    with torch.inference_mode():
        return primary(model(**inputs), output)


def run_step(step: Step, device: torch.device, inputs: Inputs) -> Outputs:
    """``step`` of ``inputs`` (moved to ``device``), in inference mode."""
    import torch

    with torch.inference_mode():
        return step({key: value.to(device) for key, value in inputs.items()})


def eager_runner(step: Step, example: Inputs) -> Runner:
    """A bucket's step run as it is, padded (what a graph replays; the CPU
    tests' runner)."""
    return functools.partial(run_step, step, next(iter(example.values())).device)


class CudaGraphRunners:
    """Builds buckets' runners as CUDA graphs over static copies of an
    example: a run copies its inputs in and replays; the result is the
    graph's own output tensor, valid until the next replay.

    All of one ``GraphForward``'s graphs go in one memory pool, and ``renew``
    starts a new one once they are all dropped: the allocator forgets a pool
    whose graphs are gone, and a capture into its handle then fails an
    internal assert ("use_count > 0"; seen on the H200 for every capture after
    a return from the host tier). Every capture on a device warms up and
    records on one stream (``capture_stream``) under one lock: cuBLAS keeps a
    workspace for each stream it has run on (32 MiB on a Hopper card), and a
    stream a bucket kept 18 of them (the first H200 run: a MiniLM's 18
    buckets held 700 MB, its weights 45 MB; the second, on one stream: 86 MB
    for the template and the graphs). The capture is
    begun and ended by hand: ``torch.cuda.graph`` synchronises the whole
    device and empties the allocator's cache at each one, which stalls every
    other model's batch and returns the blocks the host tier keeps. Graphs
    that share the capture stream's workspace never run at once: every replay
    goes to the workers' one stream, the device's default.
    """

    def __init__(self) -> None:
        self._pool: Any = None

    def __call__(self, step: Step, example: Inputs) -> Runner:
        import torch

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        static, packed = static_inputs(example)
        device = static[next(iter(static))].device
        with _CAPTURE_LOCK:
            side = capture_stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side), torch.inference_mode():
                for _ in range(2):  # kernels chosen and workspaces allocated before capture
                    step(static)
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    outputs = step(static)
                finally:
                    graph.capture_end()
            torch.cuda.current_stream(device).wait_stream(side)

        def run(inputs: Inputs) -> Outputs:
            # From the host (``host_inputs``, page-locked) without blocking:
            # the stream orders the copy after the last replay.
            copy_inputs(static, packed, inputs)
            graph.replay()
            return outputs

        return run

    def renew(self) -> None:
        """A new pool for the next captures (the graphs of the last are gone)."""
        self._pool = None


_CAPTURE_LOCK = threading.Lock()
_capture_streams: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream every capture on ``device`` warms up and records on."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _capture_streams.get(index)
    if stream is None:
        stream = _capture_streams[index] = torch.cuda.Stream(index)  # type: ignore[no-untyped-call]  # untyped upstream
    return stream


class GraphForward:
    """An encoder's forward at bucketed shapes (module notes). ``output`` is
    the attribute of the model's outputs wanted (``last_hidden_state`` or
    ``logits``); ``make_runner(model, output, example)`` builds a bucket's
    runner from an example of its padded inputs."""

    def __init__(
        self,
        model: Any,
        output: str,
        pad_id: int,
        make_runner: MakeRunner,
        *,
        batch_buckets: Sequence[int] = BATCH_BUCKETS,
        length_buckets: Sequence[int] = LENGTH_BUCKETS,
        max_length: int | None = None,
        input_keys: Sequence[str] = ("input_ids", "attention_mask"),
    ) -> None:
        self.model = model
        self.input_keys = tuple(input_keys)
        self.output = output
        self.pad_id = pad_id
        self.batch_buckets = tuple(batch_buckets)
        self.length_buckets = tuple(
            b for b in length_buckets if max_length is None or b <= max_length
        )
        self.step = graph_step(model, output)
        # Its weights stay on this device (a trip to the host tier keeps each
        # tensor's device): read once, not a walk of the modules a batch.
        self.device: torch.device = next(model.parameters()).device
        self.runners = BucketRunners(self.step, self.device, make_runner)
        self._lock = threading.Lock()
        self._thread_blocks = _ThreadBlocks()

    @property
    def num_runners(self) -> int:
        """Buckets with a runner built (a failed one counts as none)."""
        return self.runners.num_runners

    @property
    def pools(self) -> bool:
        """Whether its graphs leave pooled vectors (``graph_step``)."""
        return self.output == "last_hidden_state"

    def __call__(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The wanted output of ``batch``, as the plain forward gives it."""
        size, length = batch["input_ids"].shape
        key = self.bucket(size, length)
        if key is not None:
            inputs = padded_inputs(batch, *key, self.pad_id)
            with self._lock:
                outputs = self.runners.replay(key, inputs)
                if outputs is not None:
                    out = outputs["out"]
                    return out[:size, :length].clone() if out.dim() == 3 else out[:size].clone()
        return self.eager(batch)

    def padded_ids(
        self, ids: Sequence[npt.NDArray[np.int32]], *, reuse: bool = False
    ) -> PaddedIds | None:
        """Texts tokenised ahead, padded to their bucket in host memory for
        ``pooled`` (no lock, no device op); None where they fit none or the
        graphs give no vectors. ``reuse``: in this thread's own block for the
        bucket, made once (page-locked on CUDA) and filled here by numpy: no
        torch call, where a new block was three (made from numpy, page-locked
        by torch's caching host allocator, split into its inputs), each a
        hand-over of the interpreter lock when another thread waits for it.
        The caller must have the vectors in host memory (a copy back that
        waits for the device, after the copy in) before this thread pads
        again with ``reuse``: the block is then read."""
        if not self.pools or not ids:
            return None
        size, length = len(ids), max(len(row) for row in ids)
        key = self.bucket(size, length)
        if key is None:
            return None
        pinned = self.device.type == "cuda"
        if reuse:
            filled, inputs = self._thread_block(key, pinned)
            _fill(filled, [ids], self.pad_id, tuple(inputs))
        else:
            inputs = host_inputs(ids, *key, self.pad_id, self.input_keys, pinned=pinned)
        return PaddedIds(key, size, inputs, reused=reuse)

    def _thread_block(
        self, key: tuple[int, int], pinned: bool
    ) -> tuple[npt.NDArray[np.int64], PackedInputs]:
        """This thread's input block for bucket ``key``: a numpy view of it
        (names, 1, rows, columns) and its inputs (``padded_ids``)."""
        blocks = self._thread_blocks.blocks
        found = blocks.get(key)
        if found is None:
            import torch

            names = host_names(self.input_keys)
            block = torch.empty((len(names), *key), dtype=torch.int64, pin_memory=pinned)
            filled = block.numpy()[:, None]
            found = blocks[key] = (filled, PackedInputs(block, names))
        return found

    def pooled(self, padded: PaddedIds, pooling: str) -> torch.Tensor:
        """Float32 vectors ``(size, dim)`` on the device, pooled as ``pooling``
        (``POOLINGS``) says: the padded ids copied into the graph's inputs,
        the graph replayed, its pooled rows cut back; no other op on the device."""
        try:
            with self._lock:
                outputs = self.runners.replay(padded.key, padded.inputs)
                if outputs is not None:
                    return outputs[pooling][: padded.size].clone()
            # A bucket's first use since a reset, or one that failed to build.
            return run_step(self.step, self.device, padded.inputs)[pooling][: padded.size]
        except BaseException:
            if padded.reused:  # a copy from it may still be on its way: not used again
                self._thread_blocks.blocks.pop(padded.key, None)
            raise

    def bucket(self, size: int, length: int) -> tuple[int, int] | None:
        """The (rows, columns) bucket of a batch of ``size`` rows of ``length``
        tokens; None where it fits none."""
        rows = bucket_of(size, self.batch_buckets)
        columns = bucket_of(length, self.length_buckets)
        if rows is None or columns is None:
            return None
        return rows, columns

    def eager(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return run_eager(self.model, self.output, batch)

    def holds(self, size: int, length: int) -> bool:
        """Whether a batch of ``size`` rows of ``length`` tokens fits a bucket."""
        return self.bucket(size, length) is not None

    def prepare(self, device: str) -> None:
        """Build every bucket's runner now (a first load: inside its measurement)."""
        import torch

        for rows in self.batch_buckets:
            for columns in self.length_buckets:
                ids = torch.full((rows, columns), self.pad_id, dtype=torch.long, device=device)
                batch = {key: torch.zeros_like(ids) for key in self.input_keys}
                batch.update(input_ids=ids, attention_mask=torch.ones_like(ids))
                example = padded_inputs(batch, rows, columns, self.pad_id)
                with self._lock:
                    self.runners.build((rows, columns), example)

    def reset(self) -> None:
        """Drop the runners (the weights they read are leaving the device)."""
        with self._lock:
            self.runners.reset()


class BucketRunners:
    """A step's runners by bucket (any key: ``GraphForward``'s (rows,
    columns), a stacked forward's (models, rows, columns)): built at
    ``build`` (a first load's capture) or on a bucket's ``CAPTURE_ON_USE``-th
    use since the last ``reset``; a bucket whose runner fails to build runs
    eager until the next reset. Not thread-safe: its owner's lock guards it."""

    def __init__(self, step: Step, device: torch.device, make_runner: MakeRunner) -> None:
        self.step = step
        self.device = device
        self.make_runner = make_runner
        self._runners: dict[tuple[int, ...], Runner | None] = {}
        self._uses: dict[tuple[int, ...], int] = {}

    @property
    def num_runners(self) -> int:
        """Buckets with a runner built (a failed one counts as none)."""
        return sum(r is not None for r in self._runners.values())

    def failed(self, key: tuple[int, ...]) -> bool:
        """Whether the bucket's runner failed to build (since the last reset)."""
        return key in self._runners and self._runners[key] is None

    def replay(self, key: tuple[int, ...], inputs: Inputs) -> Outputs | None:
        """The bucket's outputs for its padded ``inputs``; None where it runs
        eager: before its second use since the last reset (a model back from
        the host tier for one request does not pay a capture), or when its
        runner could not be built."""
        if key not in self._runners:
            self._uses[key] = self._uses.get(key, 0) + 1
            if self._uses[key] < CAPTURE_ON_USE:
                return None
        runner = self.build(key, inputs)
        return runner(inputs) if runner is not None else None

    def build(self, key: tuple[int, ...], example: Inputs) -> Runner | None:
        if key in self._runners:
            return self._runners[key]
        device = self.device
        on_device = {key: value.to(device) for key, value in example.items()}
        try:
            runner: Runner | None = self.make_runner(self.step, on_device)
        except Exception as e:  # a model that cannot be captured runs eager
            log.warning("bucket %s runs eager: building its runner failed: %s", key, e)
            runner = None
        self._runners[key] = runner
        return runner

    def reset(self) -> None:
        """Drop the runners (the weights they read are leaving the device)."""
        self._runners.clear()
        self._uses.clear()
        if isinstance(self.make_runner, CudaGraphRunners):
            self.make_runner.renew()


def static_inputs(example: Inputs) -> tuple[Inputs, torch.Tensor | None]:
    """A graph's static copies of ``example``'s inputs, as rows of one block
    (returned beside them) where they share a shape and dtype; else each its
    own (and None)."""
    import torch

    values = list(example.values())
    first = values[0]
    if all(v.shape == first.shape and v.dtype == first.dtype for v in values):
        packed = torch.stack(values)
        return dict(zip(example, packed.unbind(0), strict=True)), packed
    return {key: value.clone() for key, value in example.items()}, None


def copy_inputs(static: Inputs, packed: torch.Tensor | None, inputs: Inputs) -> None:
    """``inputs`` into a graph's ``static`` ones (``static_inputs``), without
    blocking: one copy where both are one block in one order, else one a key."""
    if (
        packed is not None
        and isinstance(inputs, PackedInputs)
        and tuple(inputs) == tuple(static)
        and inputs.block.shape == packed.shape
    ):
        packed.copy_(inputs.block, non_blocking=True)
        return
    for key, value in inputs.items():
        static[key].copy_(value, non_blocking=True)


def graphs_run_on(device: str) -> bool:
    """Whether encoders on ``device`` run through graphs (where cards allow)."""
    return device.startswith("cuda")


def default_runner() -> MakeRunner:
    """A bucket's runner: a CUDA graph, all of one ``GraphForward``'s in one pool."""
    return CudaGraphRunners()


def graph_forward(
    model: Any, tokenizer: Any, output: str, make_runner: MakeRunner | None = None
) -> GraphForward:
    """``model``'s forward at bucketed shapes: as CUDA graphs unless
    ``make_runner`` says otherwise (the CPU tests)."""
    if make_runner is None:
        make_runner = default_runner()
    positions = getattr(model.config, "max_position_embeddings", None)
    return GraphForward(
        model,
        output,
        tokenizer.pad_token_id or 0,
        make_runner,
        max_length=positions if isinstance(positions, int) else None,
        input_keys=tuple(tokenizer.model_input_names),
    )


def graphs_key(model: Any, device: str, output: str, stack: int = 0) -> str:
    """The shared component (``runtimes.base.SharedComponents``) of the graphs
    of ``model``'s architecture on ``device`` (with ``stack``, those that
    also run stacked rounds of that many models)."""
    return f"graphs:{signature(model, device)}:{output}" + (f":stack{stack}" if stack else "")


def signature(model: Any, device: str) -> str:
    """What models must share to run one architecture's graphs or one stacked
    forward: the device, the config's shaping keys, and every parameter's and
    buffer's name, shape and dtype."""
    config = _shaping_config(model.config)
    tensors = [(n, tuple(t.shape), str(t.dtype)) for n, t in model.named_parameters()]
    tensors += [(n, tuple(t.shape), str(t.dtype)) for n, t in model.named_buffers()]
    text = json.dumps([device, config, tensors], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _shaping_config(config: Any) -> dict[str, Any]:
    """The config's keys that its class defines (a key a copy added, such as
    the GPU check's copy number, shapes nothing), less those that name or
    describe the copy."""
    values: dict[str, Any] = config.to_dict()
    try:
        known = set(type(config)().to_dict())
    except Exception:  # a config class that needs arguments: every key counts
        known = set(values)
    return {k: v for k, v in values.items() if k in known and k not in _NOT_SHAPE}


def weight_tensors(model: Any) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def copy_of_module(model: Any, make: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A deep copy of ``model`` whose parameters and buffers are ``make`` of its
    own (tied ones stay tied), made as the copy meets them: their data is
    never copied."""
    import torch

    memo: dict[int, Any] = {}
    for parameter in model.parameters():
        made = torch.nn.Parameter(make(parameter), requires_grad=parameter.requires_grad)
        memo[id(parameter)] = made
    for buffer in model.buffers():
        memo[id(buffer)] = make(buffer)
    return copy.deepcopy(model, memo)


class SharedGraphs:
    """The graphs of one architecture on one device, for every model of it
    (module notes): a template module holding a copy of some model's weights,
    and its ``GraphForward``. A bucketed batch of another model than the one
    whose weights the template holds first copies that model's weights in
    (one fused copy a dtype on the device: about 45 MB for MiniLM in
    float16), then replays; a batch outside the buckets runs
    the model's own eager forward. So a model has no graphs of its own: a
    first load captures nothing once its architecture has graphs, and a
    model back from the host tier replays at once."""

    def __init__(
        self, template: Any, graphs: GraphForward, stacked: StackedRounds | None = None
    ) -> None:
        self.template = template
        self.graphs = graphs
        self.stacked = stacked  # rounds of several models' batches (``runtimes/stacking.py``)
        self.num_copies = 0  # times another model's weights were copied in
        self._current: weakref.ref[Any] | None = None
        self._lock = threading.Lock()
        self._host_copy: HostCopy | None = None
        # Each module's tensors, walked once: the same objects through copies,
        # offloads and restores (only their data changes), and a walk of a
        # MiniLM's modules costs more than launching the copy.
        self._template_tensors = weight_tensors(template)
        self._template_groups = by_dtype(self._template_tensors)
        self._template_block = one_block(self._template_tensors)
        # How each model's weights go into the template's (``_copy_in``), made once.
        self._copies_in: weakref.WeakKeyDictionary[Any, Callable[[], None]] = (
            weakref.WeakKeyDictionary()
        )

    @classmethod
    def of(
        cls,
        model: Any,
        tokenizer: Any,
        output: str,
        make_runner: MakeRunner | None = None,
        stacking: Stacking | None = None,
    ) -> SharedGraphs:
        """Graphs of ``model``'s architecture over a copy of its weights (one
        block laid out as its, where its are one: ``hostcopy.gather_block``);
        with ``stacking`` (token vectors only), stacked rounds too, their
        graphs in a pool of their own."""
        # Where the model is one block, the template's tensors are made empty and
        # then views of one copy of it; a deep copy first copied each parameter
        # and, for each buffer, the whole block (about 90 MB more for a MiniLM).
        template = copy_of_module(model, lambda tensor: tensor.new_empty(0))
        if block_like(weight_tensors(template), weight_tensors(model)) is None:
            template = copy.deepcopy(model)
        template.requires_grad_(False)
        graphs = graph_forward(template, tokenizer, output, make_runner)
        stacked = None
        if stacking is not None and graphs.pools:
            runner = make_runner or default_runner()
            try:
                stacked = stacking.make(template, graphs, runner, stacking.max_models)
            except ValueError as e:  # its batches run alone, through these graphs
                log.warning("no stacked rounds for this architecture: %s", e)
        return cls(template, graphs, stacked)

    def __call__(self, model: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``model``'s wanted output for ``batch``, as its plain forward gives it."""
        size, length = batch["input_ids"].shape
        if not self.graphs.holds(size, length):
            return run_eager(model, self.graphs.output, batch)
        with self._lock:
            self._hold_weights_of(model)
            return self.graphs(batch)

    def pooled(
        self,
        model: Any,
        ids: Sequence[npt.NDArray[np.int32]],
        pooling: str,
        *,
        reuse: bool = False,
    ) -> torch.Tensor | None:
        """``model``'s pooled vectors of texts tokenised ahead, on the device
        (``GraphForward.pooled``); None where its graphs do not make them.
        ``reuse``: padded in this thread's own block (``GraphForward.padded_ids``
        says what the caller must do)."""
        padded = self.graphs.padded_ids(ids, reuse=reuse)  # outside the lock another batch may hold
        if padded is None:
            return None
        with self._lock:
            self._hold_weights_of(model)
            return self.graphs.pooled(padded, pooling)

    def _hold_weights_of(self, model: Any) -> None:
        """The template holds ``model``'s weights (under the lock)."""
        current = self._current() if self._current is not None else None
        if current is not model:
            copy_in = self._copies_in.get(model)
            if copy_in is None:
                copy_in = self._copies_in[model] = self._copy_in(model)
            copy_in()
            self._current = weakref.ref(model)
            self.num_copies += 1

    def _copy_in(self, model: Any) -> Callable[[], None]:
        """What copies ``model``'s weights into the template's: one copy of its
        block into the template's where both are one block laid out alike,
        over byte views made here once (a model gathered stays one block: its
        evictions empty and refill that storage); else one fused copy a dtype
        (``copy_weights``), which for MiniLM's hundred tensors was 17% of the
        compute workers' samples in the H200's 100-model round robin (run 3)."""
        tensors = weight_tensors(model)
        block = one_block(tensors)
        into = self._template_block
        if block is not None and into is not None and same_layout(self._template_tensors, tensors):
            return functools.partial(storage_bytes(into).copy_, storage_bytes(block))
        return functools.partial(copy_weights, self._template_groups, by_dtype(tensors))

    def prepare(self, device: str) -> int:
        """Capture every bucket now; the device bytes the template and the
        graphs hold (a first load: inside its measurement)."""
        if not device.startswith("cuda"):
            self._prepare(device)
            return self.num_bytes
        import torch

        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        self._prepare(device)
        torch.cuda.synchronize(device)
        captured = max(0, torch.cuda.memory_allocated(device) - before)
        return self.num_bytes + captured

    def _prepare(self, device: str) -> None:
        self.graphs.prepare(device)
        if self.stacked is not None:
            self.stacked.prepare()

    @property
    def num_bytes(self) -> int:
        """The template's bytes and the stacked rounds' slots (not the graphs)."""
        slots = self.stacked.num_bytes if self.stacked is not None else 0
        return torch_module_bytes(self.template) + slots

    @property
    def in_host_tier(self) -> bool:
        return self._host_copy is not None

    def offload(self) -> Footprint | None:
        """No model of the architecture is left on the device: the template's
        weights go to the host tier and the graphs are dropped (captured again
        on their buckets' second use once one is back)."""
        with self._lock:
            if self._host_copy is not None:
                return None
            device = str(self._template_tensors[0].device)
            self.graphs.reset()
            if self.stacked is not None:
                self.stacked.offload()
            self._current = None
            self._host_copy = HostCopy.offload([self.template], device, self._template_tensors)
            return self._host_copy.footprint()

    def restore(self) -> None:
        with self._lock:
            held, self._host_copy = self._host_copy, None
            if held is None:
                raise ModelUnavailableError("graphs", "the template is not in the host tier")
            held.restore()
            if self.stacked is not None:
                self.stacked.restore()

    def close(self) -> None:
        """Drop the graphs and the template (its last model has gone)."""
        with self._lock:
            self.graphs.reset()
            if self.stacked is not None:
                self.stacked.close()
            self._current = None
            held, self._host_copy = self._host_copy, None
            if held is not None:
                held.close()


@dataclass(eq=False)
class GraphsHold:
    """An encoder's hold on its architecture's ``SharedGraphs``: a component of
    ``shared`` (its bytes, the template's and the captured graphs', counted
    once however many models use it), offloaded when the last encoder holding
    it leaves the device and freed when the last is gone."""

    shared: SharedComponents
    key: str
    graphs: SharedGraphs

    @classmethod
    def acquire(
        cls,
        shared: SharedComponents,
        model: Any,
        tokenizer: Any,
        output: str,
        capture: bool = True,
        make_runner: MakeRunner | None = None,
        stacking: Stacking | None = None,
    ) -> GraphsHold:
        """The graphs of ``model``'s architecture (with stacked rounds where
        ``stacking`` asks: ``SharedGraphs.of``): made from ``model`` by the
        first of it, every bucket captured then if ``capture`` (a first load:
        inside its measurement)."""
        device = str(next(iter(weight_tensors(model))).device)
        if device.startswith("cuda"):
            gather_block(weight_tensors(model))  # one copy into the template a batch
        stack = stacking.max_models if stacking is not None else 0
        key = graphs_key(model, device, output, stack)

        def build() -> tuple[SharedGraphs, int]:
            graphs = SharedGraphs.of(model, tokenizer, output, make_runner, stacking)
            num_bytes = graphs.prepare(device) if capture else graphs.num_bytes
            return graphs, num_bytes

        return cls(shared, key, shared.acquire(key, build, on_free=SharedGraphs.close))

    @property
    def num_bytes(self) -> int:
        return self.shared.bytes_of(self.key)

    def park(self) -> None:
        self.shared.park(self.key)

    def unpark(self) -> None:
        self.shared.unpark(self.key)

    def release(self, *, parked: bool) -> None:
        self.shared.release(self.key, parked=parked)


def by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` in groups of one dtype, the groups in the order their
    dtypes first appear and each in the order given (so two models of one
    ``signature`` group alike)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    return list(groups.values())


def same_layout(into: Sequence[torch.Tensor], source: Sequence[torch.Tensor]) -> bool:
    """Whether two models' tensors sit alike in blocks of one size: each pair
    of one dtype, shape, stride and place in its block."""
    return (
        len(into) == len(source)
        and into[0].untyped_storage().nbytes() == source[0].untyped_storage().nbytes()
        and all(
            a.dtype == b.dtype
            and a.shape == b.shape
            and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset()
            for a, b in zip(into, source, strict=True)
        )
    )


def copy_weights(
    into: Sequence[Sequence[torch.Tensor]], source: Sequence[Sequence[torch.Tensor]]
) -> None:
    """``source``'s values into ``into``'s tensors, in place, group by group
    (``by_dtype``): one fused copy a dtype. On CUDA ``_foreach_copy_`` takes
    its fused route only for a list of one dtype; a model's float16 weights
    and int64 buffers (BERT's position and token type ids) in one list were a
    copy kernel a tensor: on the H200, 0.73 ms a swap of MiniLM's weights,
    42% of the compute workers' samples in the 100-model round robin."""
    import torch

    with torch.no_grad():
        for to, values in zip(into, source, strict=True):
            torch._foreach_copy_(list(to), list(values))
