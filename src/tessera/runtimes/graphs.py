"""Small encoders on a GPU: CUDA graphs per shape bucket, one set per
architecture.

Graphs. A small encoder's forward at a small batch is kernel launches more
than compute, and a graph replays them as one. ``GraphForward`` runs a
Hugging Face encoder at bucketed shapes: a batch is padded up to the
smallest (batch, length) bucket that holds it (``BATCH_BUCKETS`` x
``LENGTH_BUCKETS``, ``runtimes/padding.py``), run by that bucket's runner
(``runtimes/graph_runner.py``), and its rows and positions cut back; a
larger batch runs eager (it is compute, not launches). What a bucket runs
is ``graph_step``: it makes the 4-D additive mask from the 0/1 one itself,
which transformers passes through as it is (its own mask building tests
whether there is padding, which reads the device, and a graph capture
forbids that), and for token vectors pools them too (mean and first
position, float32). Texts tokenised ahead by a gateway (the common path) are
padded to their bucket on the host and copied into the graph's inputs, and
leave as pooled vectors (``GraphForward.replay_vectors``): around the replay
the host launches one copy in, a cut and one copy out. Padding with a masked
position changes no real position's vector (tested on the CPU against the
plain forward). On CUDA all of a ``GraphForward``'s graphs share one memory
pool (a new one after a reset) and replay one at a time (a lock). A bucket
whose capture fails runs eager until the next reset. On the CPU there are no
graphs and no padding.

Graphs per architecture, not per model (``SharedGraphs``). A graph reads
the weights at the addresses it was captured with, so graphs of a model's
own would be lost each time its weights leave for the host tier (they come
back at new addresses), and a hundred fine-tunes of one base would capture
a hundred sets. Instead every model of one architecture on a device
replays one set, captured over a weight template (``runtimes/template.py``)
that takes each model's weights before its batch. The template and the
graphs are one shared component (``GraphsHold``: counted once, offloaded
with the last of its models to leave the device, freed with the last to
go); the first model of an architecture makes it at its load, every bucket
captured inside that load's measurement.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from tessera.footprint import Footprint
from tessera.runtimes.base import SharedComponents
from tessera.runtimes.graph_runner import (
    BucketRunners,
    MakeRunner,
    Step,
    default_runner,
    model_output,
    run_eager,
    run_step,
)
from tessera.runtimes.hostcopy import gather_block
from tessera.runtimes.padding import (
    Inputs,
    Outputs,
    PackedInputs,
    additive_mask,
    bucket_of,
    fill_ids,
    host_inputs,
    host_names,
    padded_inputs,
)
from tessera.runtimes.pooling import mean_pooled
from tessera.runtimes.template import WeightTemplate, signature, weight_tensors

if TYPE_CHECKING:
    import numpy.typing as npt
    import torch

log = logging.getLogger(__name__)

# Up to a card's usual max_batch_size: at a small encoder's size a batch of
# 32 is still launches, not compute, and a graph is what shortens it.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
LENGTH_BUCKETS = (16, 32, 64)


class StackedRounds(Protocol):
    """Rounds of several models' batches in one forward, part of their
    architecture's graphs and moved and freed with them
    (``runtimes/stacking.py``'s ``StackedGraphs``)."""

    @property
    def num_bytes(self) -> int: ...

    def round_vectors(
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


def graph_step(model: Any, output: str) -> Step:
    """What a bucket's graph records: the additive mask made from the 0/1 one,
    the forward, and for token vectors (``last_hidden_state``) their mean
    over the mask and the first position's, both float32 (``pooling.POOLINGS``):
    an encoder's batch then leaves the device as its vectors, with no
    pooling launched around the replay."""

    def step(inputs: Inputs) -> Outputs:
        dtype = next(model.parameters()).dtype
        mask = inputs["attention_mask"]
        masked = {**inputs, "attention_mask": additive_mask(mask, dtype)}
        out = model_output(model(**masked), output)
        if output != "last_hidden_state":
            return {"out": out}
        return {"out": out, "mean": mean_pooled(out, mask), "cls": out[:, 0].float()}

    return step


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
    def makes_vectors(self) -> bool:
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
        ``replay_vectors`` (no lock, no device op); None where they fit none
        or the graphs give no vectors. ``reuse``: in this thread's own block
        for the bucket, made once (page-locked on CUDA) and filled here by
        numpy: no torch call, where a new block is three (made from numpy,
        page-locked by torch's caching host allocator, split into its
        inputs), each a hand-over of the interpreter lock when another thread
        waits for it.
        The caller must have the vectors in host memory (a copy back that
        waits for the device, after the copy in) before this thread pads
        again with ``reuse``: the block is then read."""
        if not self.makes_vectors or not ids:
            return None
        size, length = len(ids), max(len(row) for row in ids)
        key = self.bucket(size, length)
        if key is None:
            return None
        pinned = self.device.type == "cuda"
        if reuse:
            filled, inputs = self._thread_block(key, pinned)
            fill_ids(filled, [ids], self.pad_id, tuple(inputs))
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

    def replay_vectors(self, padded: PaddedIds, pooling: str) -> torch.Tensor:
        """Float32 vectors ``(size, dim)`` on the device, pooled as
        ``pooling`` (``pooling.POOLINGS``) says: the padded ids copied into
        the graph's inputs, the graph replayed, its rows cut back; no other
        op on the device."""
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


class SharedGraphs:
    """The graphs of one architecture on one device, for every model of it
    (module notes): a weight template holding some model's weights, and its
    ``GraphForward``. A bucketed batch of another model than the one whose
    weights the template holds first copies that model's weights in, then
    replays; a batch outside the buckets runs the model's own eager forward.
    So a model has no graphs of its own: a first load captures nothing once
    its architecture has graphs, and a model back from the host tier replays
    at once."""

    def __init__(
        self, template: WeightTemplate, graphs: GraphForward, stacked: StackedRounds | None = None
    ) -> None:
        self.template = template
        self.graphs = graphs
        self.stacked = stacked  # rounds of several models' batches (``runtimes/stacking.py``)
        self._lock = threading.Lock()  # the template's weights, from a copy in to its replay

    @classmethod
    def of(
        cls,
        model: Any,
        tokenizer: Any,
        output: str,
        make_runner: MakeRunner | None = None,
        stacking: Stacking | None = None,
    ) -> SharedGraphs:
        """Graphs of ``model``'s architecture over a copy of its weights
        (``WeightTemplate.of``); with ``stacking`` (token vectors only),
        stacked rounds too, their graphs in a pool of their own."""
        template = WeightTemplate.of(model)
        graphs = graph_forward(template.module, tokenizer, output, make_runner)
        stacked = None
        if stacking is not None and graphs.makes_vectors:
            runner = make_runner or default_runner()
            try:
                stacked = stacking.make(template.module, graphs, runner, stacking.max_models)
            except ValueError as e:  # its batches run alone, through these graphs
                log.warning("no stacked rounds for this architecture: %s", e)
        return cls(template, graphs, stacked)

    def __call__(self, model: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``model``'s wanted output for ``batch``, as its plain forward gives it."""
        size, length = batch["input_ids"].shape
        if not self.graphs.holds(size, length):
            return run_eager(model, self.graphs.output, batch)
        with self._lock:
            self.template.hold(model)
            return self.graphs(batch)

    def vectors(
        self,
        model: Any,
        ids: Sequence[npt.NDArray[np.int32]],
        pooling: str,
        *,
        reuse: bool = False,
    ) -> torch.Tensor | None:
        """``model``'s float32 vectors of texts tokenised ahead, pooled on the
        device (``GraphForward.replay_vectors``); None where its graphs do not
        make them. ``reuse``: padded in this thread's own block
        (``GraphForward.padded_ids`` says what the caller must do)."""
        padded = self.graphs.padded_ids(ids, reuse=reuse)  # outside the lock another batch may hold
        if padded is None:
            return None
        with self._lock:
            self.template.hold(model)
            return self.graphs.replay_vectors(padded, pooling)

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
        return self.template.num_bytes + slots

    @property
    def in_host_tier(self) -> bool:
        return self.template.in_host_tier

    def offload(self) -> Footprint | None:
        """No model of the architecture is left on the device: the template's
        weights go to the host tier and the graphs are dropped (captured again
        on their buckets' second use once one is back)."""
        with self._lock:
            if self.template.in_host_tier:
                return None
            self.graphs.reset()
            if self.stacked is not None:
                self.stacked.offload()
            return self.template.offload()

    def restore(self) -> None:
        with self._lock:
            self.template.restore()
            if self.stacked is not None:
                self.stacked.restore()

    def close(self) -> None:
        """Drop the graphs and the template (its last model has gone)."""
        with self._lock:
            self.graphs.reset()
            if self.stacked is not None:
                self.stacked.close()
            self.template.close()


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
