"""How a torch encoder's batches run: one path a model, chosen at its load.

A card's options (``DeviceOptions``: ``dtype``, ``cuda_graphs``, ``stack``)
and the device choose one of four paths (``forward_path``), and every batch
of the model goes through that path's ``forward``; no batch asks again
which way it runs:

- ``EagerPath``: the model's own forward (the CPU; ``cuda_graphs: false``).
- ``StackGroupPath``: eager, in rounds with other models of its architecture
  waiting at the same time (``stack`` off CUDA graphs: ``stacking.StackGroup``).
- ``GraphsPath``: its architecture's CUDA graphs (``graphs.SharedGraphs``);
  texts tokenised ahead leave the graph as pooled vectors.
- ``StackedGraphsPath``: as ``GraphsPath``, and texts tokenised ahead run in
  stacked rounds of the graphs (``stack`` on CUDA: ``stacking.StackedGraphs``).

A batch is either a tokenized batch on the model's device (a mapping of
tensors) or texts tokenised ahead (``TokenIds``); ``forward`` returns one
float32 row per text in host memory, as its ``Readout`` says. Every path
answers every batch: a graphs path runs eager what its graphs do not take
(a batch outside the buckets, a first use since a reset), and a stacked path
runs alone what fits no round. Whatever the path, a batch's rows are what
the model's own forward gives them, up to the precision it runs in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from tessera.errors import ModelUnavailableError
from tessera.runtimes.base import SharedComponents
from tessera.runtimes.graph_runner import model_output
from tessera.runtimes.graphs import GraphsHold, StackedRounds, Stacking
from tessera.runtimes.padding import host_inputs
from tessera.runtimes.pooling import Readout, unit_rows
from tessera.runtimes.precision import DTYPES
from tessera.runtimes.stacking import StackedGraphs, StackGroup, group_for

if TYPE_CHECKING:
    import numpy.typing as npt
    import torch

    from tessera.repository.spec import ModelSpec

# The most models a stacked forward holds where a card says ``stack: true``.
DEFAULT_STACK = 16
TOKEN_VECTORS = "last_hidden_state"


@dataclass(frozen=True, slots=True)
class DeviceOptions:
    """A card's ``dtype`` (``precision.DTYPES``), ``cuda_graphs`` (true) and
    ``stack`` (``runtimes/stacking.py``: the most models a stacked forward
    holds; 0, off)."""

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


def graphs_run_on(device: str) -> bool:
    """Whether encoders on ``device`` run through graphs (where cards allow)."""
    return device.startswith("cuda")


@dataclass(frozen=True, slots=True)
class TokenIds:
    """Texts tokenised ahead (``runtimes.tokens``): each text's ids, unpadded,
    their token types all 0 (``SentenceEncoder.takes_ids``)."""

    rows: Sequence[npt.NDArray[np.int32]]


# A tokenized batch on the model's device, or texts tokenised ahead.
Batch = Mapping[str, "torch.Tensor"] | TokenIds


class ForwardPath(Protocol):
    """How one model's batches run (module notes): chosen at its load
    (``forward_path``), the one way every batch of it takes."""

    def forward(self, batch: Batch, readout: Readout) -> npt.NDArray[np.float32]:
        """One float32 row per text of ``batch``, as ``readout`` says."""
        ...

    def stacks(self, *, ids_ahead: bool) -> bool:
        """Whether its batches may run in one forward with other models'
        (``runtimes.base.stacks``): ``ids_ahead``, of texts tokenised ahead."""
        ...

    def shared_bytes(self, *, host: bool = False) -> dict[str, int]:
        """The shared components the path holds beside the model's weights
        (with ``host``, only those waiting in the host tier)."""
        ...

    def park(self) -> None:
        """The model's weights are leaving the device for the host tier."""
        ...

    def unpark(self) -> None:
        """The model's weights are back on the device."""
        ...

    def release(self, *, parked: bool) -> None:
        """The model is closed (``parked``: from the host tier); called once."""
        ...


class EagerPath:
    """The model's own forward, eager, a batch at a time (a ``ForwardPath``)."""

    def __init__(self, model: Any, tokenizer: Any, device: str, output: str) -> None:
        self.model = model
        self.device = device
        self.output = output
        self._pad_id = tokenizer.pad_token_id
        self._input_keys = tuple(tokenizer.model_input_names)

    def forward(self, batch: Batch, readout: Readout) -> npt.NDArray[np.float32]:
        """One float32 row per text of ``batch``, as ``readout`` says."""
        import torch

        tensors = self.on_device(batch.rows) if isinstance(batch, TokenIds) else batch
        with torch.inference_mode():
            return readout.rows(self.outputs(tensors), tensors["attention_mask"])

    def outputs(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The model's wanted output for a tokenized batch on its device."""
        return model_output(self.model(**batch), self.output)

    def on_device(self, ids: Sequence[npt.NDArray[np.int32]]) -> dict[str, torch.Tensor]:
        """Texts tokenised ahead as the batch the tokenizer would make of
        them, padded on the host and copied to the device."""
        pinned = self.device.startswith("cuda")
        length = max(len(row) for row in ids)
        batch = host_inputs(
            ids, len(ids), length, int(self._pad_id), self._input_keys, pinned=pinned
        )
        # Not blocking, from page-locked memory (``host_inputs``): a blocking
        # copy would synchronise the stream after it, so these inputs would
        # wait for every batch queued before; the stream keeps the order, and
        # the copy back waits.
        return {key: value.to(self.device, non_blocking=True) for key, value in batch.items()}

    def stacks(self, *, ids_ahead: bool) -> bool:
        return False

    def shared_bytes(self, *, host: bool = False) -> dict[str, int]:
        return {}

    def park(self) -> None:
        pass

    def unpark(self) -> None:
        pass

    def release(self, *, parked: bool) -> None:
        self.model = None


class StackGroupPath(EagerPath):
    """Eager, in one forward with the batches of other models of its group
    that wait at the same time (``stacking.StackGroup``); alone, its own."""

    def __init__(self, model: Any, tokenizer: Any, device: str, group: StackGroup) -> None:
        super().__init__(model, tokenizer, device, TOKEN_VECTORS)
        self.group = group

    def outputs(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.group.forward(self.model, batch, super().outputs)

    def stacks(self, *, ids_ahead: bool) -> bool:
        return True


class GraphsPath(EagerPath):
    """Through its architecture's graphs (``graphs.SharedGraphs``): a
    tokenized batch replayed at its bucket, texts tokenised ahead padded to
    their bucket on the host and pooled in the graph (the host's work a batch
    is a copy in, a replay and a copy back, the vectors made unit on the
    host); what fits no bucket, eager."""

    def __init__(self, model: Any, tokenizer: Any, device: str, hold: GraphsHold) -> None:
        super().__init__(model, tokenizer, device, hold.graphs.graphs.output)
        self.hold = hold
        self._held = True

    def forward(self, batch: Batch, readout: Readout) -> npt.NDArray[np.float32]:
        if isinstance(batch, TokenIds) and readout.pooling is not None:
            import torch

            with torch.inference_mode():
                found = self.graph_vectors(batch.rows, readout.pooling)
            if found is not None:
                return unit_rows(found) if readout.normalize else found
        return super().forward(batch, readout)

    def graph_vectors(
        self, ids: Sequence[npt.NDArray[np.int32]], pooling: str
    ) -> npt.NDArray[np.float32] | None:
        """Pooled vectors of texts tokenised ahead from its graphs; None where
        they fit no bucket."""
        # In this thread's own input block: the copy back waits for the device,
        # so the block is free again before this thread's next batch.
        vectors = self.hold.graphs.vectors(self.model, ids, pooling, reuse=True)
        return None if vectors is None else vectors.cpu().numpy()

    def outputs(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.hold.graphs(self.model, batch)

    def shared_bytes(self, *, host: bool = False) -> dict[str, int]:
        """Its graphs' (with ``host``, only while they wait in the host tier
        too: while another model uses them on the device, they are not in
        the host tier)."""
        hold = self.hold
        if not self._held or (host and not hold.graphs.in_host_tier):
            return {}
        return {hold.key: hold.num_bytes}

    def park(self) -> None:
        self.hold.park()

    def unpark(self) -> None:
        self.hold.unpark()

    def release(self, *, parked: bool) -> None:
        super().release(parked=parked)
        self._held = False
        self.hold.release(parked=parked)


class StackedGraphsPath(GraphsPath):
    """As ``GraphsPath``; texts tokenised ahead run in a stacked round with
    other models' batches where its graphs' ``rounds`` take them, else alone
    through its graphs."""

    def __init__(
        self, model: Any, tokenizer: Any, device: str, hold: GraphsHold, rounds: StackedRounds
    ) -> None:
        super().__init__(model, tokenizer, device, hold)
        self.rounds = rounds

    def graph_vectors(
        self, ids: Sequence[npt.NDArray[np.int32]], pooling: str
    ) -> npt.NDArray[np.float32] | None:
        model, graphs = self.model, self.hold.graphs
        return self.rounds.round_vectors(
            model, ids, pooling, lambda: graphs.vectors(model, ids, pooling)
        )

    def stacks(self, *, ids_ahead: bool) -> bool:
        return ids_ahead


def forward_path(
    model: Any,
    tokenizer: Any,
    device: str,
    options: DeviceOptions,
    output: str = TOKEN_VECTORS,
    *,
    capture: bool = True,
    shared: SharedComponents | None = None,
) -> ForwardPath:
    """The path ``model`` (on ``device``, in its precision) runs every batch
    on, as ``options`` ask: its architecture's graphs on CUDA unless they say
    not (a component of ``shared``, of its own without; captured when made if
    ``capture``, a first load), with stacked rounds where ``stack`` asks and
    the architecture allows; else eager, stacked where ``stack`` asks. Only
    token vectors stack."""
    stack = options.stack if output == TOKEN_VECTORS else 0
    if options.graphs and graphs_run_on(device):
        stacking = Stacking(stack, StackedGraphs) if stack else None
        hold = GraphsHold.acquire(
            shared or SharedComponents(), model, tokenizer, output, capture, stacking=stacking
        )
        return graphs_path(model, tokenizer, device, hold)
    if stack:
        return StackGroupPath(model, tokenizer, device, group_for(model, device, stack))
    return EagerPath(model, tokenizer, device, output)


def graphs_path(model: Any, tokenizer: Any, device: str, hold: GraphsHold) -> GraphsPath:
    """The path through ``hold``'s graphs: stacked where they run stacked rounds."""
    rounds = hold.graphs.stacked
    if rounds is None:
        return GraphsPath(model, tokenizer, device, hold)
    return StackedGraphsPath(model, tokenizer, device, hold, rounds)
