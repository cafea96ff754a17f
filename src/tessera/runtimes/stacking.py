"""Batching across models: fine-tunes of one base in one forward.

Encoders of the same architecture, shapes and dtype on one device (many
tenants' fine-tunes of one base, the common case) can run their batches in
one forward: their weights stacked along a new first dimension, their
inputs padded to one (batch, length) with the 4-D additive mask of
``runtimes/padding.py``, and one forward under ``torch.func.vmap`` over
``functional_call`` of a weightless copy of the architecture (eager
attention: torch's fused attention kernels have no batching rule); each
model's rows cut back. A card opts in with ``stack: true`` (or ``stack: N``,
at most N models a forward; ``forward.DEFAULT_STACK`` for ``true``).

Rounds (``Rendezvous``). A batch's thread hands its call to the group: with
no round being launched it leads one, taking what waits (its own first, up
to the group's most); else it waits, and is either answered by a round or
woken to lead the next one itself. A round is launched, then finished: the
leader hands the lead on between the two, so the next round's copies and
replay are queued on the device while this one's vectors come back. A round
of one is the model's own forward (its own graphs where it has them). No
thread works for others longer than one round, and no thread waits for a
round that will not come. The executor runs such models' batches on threads
of their own (``ComputeExecutor.run``, ``across_models``), so that more of
them reach a group at once than it has compute workers.

Two forms:

- ``StackedGraphs`` (on CUDA, texts the gateways tokenised ahead, the common
  path): part of an architecture's graphs (``graphs.SharedGraphs``). Its
  weights are ``max_models`` slots of one block on the device, each laid
  out as a model's own block (``hostcopy.gather_block``), so a model goes
  into a slot as one copy, and a slot keeps a model's weights until another
  needs it (a model that comes back often finds its weights there). Each
  (models, rows, columns) bucket is one CUDA graph of the vmapped forward
  with the pooling in it (``STACK_ROWS`` rows a model at most; a bigger
  batch runs alone, through its own graphs, where batching is already
  within one model); the vectors come back in one copy. The slots and the
  graphs are counted with the architecture's graphs; they leave the device
  with them (the slots are emptied, not copied).
- ``StackGroup`` (anywhere else: the CPU, texts tokenised in the engine):
  eager, its weights stacked for each round (``torch.func.stack_module_state``),
  a transient of up to ``max_models`` x a model's bytes outside the budget.

Why: a small encoder's batch is mostly launches and host work around them;
a round of N models is one replay and about N + 8 host calls, where N
batches alone are N replays and about 11 N.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from tessera.runtimes.graph_runner import BucketRunners, MakeRunner, run_step
from tessera.runtimes.graphs import GraphForward
from tessera.runtimes.hostcopy import (
    block_layout,
    device_bytes,
    one_block,
    storage_bytes,
    typed_view,
)
from tessera.runtimes.padding import (
    Outputs,
    additive_mask,
    bucket_of,
    padded_inputs,
    stacked_inputs,
)
from tessera.runtimes.pooling import mean_pooled
from tessera.runtimes.template import (
    by_dtype,
    copy_of_module,
    copy_weights,
    signature,
    weight_tensors,
)

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch


Solo = Callable[[Mapping[str, "torch.Tensor"]], "torch.Tensor"]
T = TypeVar("T")

# The most rows a model's batch may have to join a stacked round: rounds are
# for models with a request or two each (a hundred models round robin); a
# model with more runs its own graphs, already a batch.
STACK_ROWS = (1, 2, 4)
# The round sizes that have a graph (as well as the group's most, if another).
STACK_MODELS = (2, 4, 8, 16)


@dataclass(eq=False)
class _Call(Generic[T]):
    item: T
    done: threading.Event = field(default_factory=threading.Event)
    lead: bool = False  # woken to lead the next round
    result: Any = None
    error: BaseException | None = None


# A round's launch: its items' work begun; what it returns finishes it (each
# item's result, in order).
Launch = Callable[[list[T]], Callable[[], list[Any]]]


class Rendezvous(Generic[T]):
    """Calls from many threads, run in rounds of up to ``max_calls`` by one of
    them at a time (module notes)."""

    def __init__(self, max_calls: int, launch: Launch[T]) -> None:
        self.max_calls = max_calls
        self._launch = launch
        self._lock = threading.Lock()
        self._waiting: list[_Call[T]] = []
        self._leading = False

    @property
    def num_waiting(self) -> int:
        """Calls waiting for a round (or to lead one)."""
        with self._lock:
            return len(self._waiting)

    def submit(self, item: T) -> Any:
        """``item``'s result, from a round with whatever waits beside it."""
        call = _Call(item)
        with self._lock:
            lead = not self._leading
            self._leading = True
            if not lead:
                self._waiting.append(call)
        if not lead:
            call.done.wait()
            if not call.lead:
                return _answer(call)
        self._lead(call)
        return _answer(call)

    def _lead(self, own: _Call[T]) -> None:
        with self._lock:
            taken = [own, *self._waiting[: self.max_calls - 1]]
            del self._waiting[: len(taken) - 1]
        finish = None
        try:
            finish = self._launch([call.item for call in taken])
        except BaseException as e:  # every call of the round hears it
            for call in taken:
                call.error = e
        finally:
            self._hand_on()
        if finish is not None:
            try:
                for call, result in zip(taken, finish(), strict=True):
                    call.result = result
            except BaseException as e:
                for call in taken:
                    call.error = e
        for call in taken[1:]:
            call.done.set()

    def _hand_on(self) -> None:
        """The first waiting call leads the next round; else none is led."""
        with self._lock:
            if self._waiting:
                after = self._waiting.pop(0)
                after.lead = True
                after.done.set()
            else:
                self._leading = False


class _Totals:
    """The process's stacked rounds (of two or more batches) and the batches in them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.rounds = 0
        self.batches = 0

    def add(self, batches: int) -> None:
        with self._lock:
            self.rounds += 1
            self.batches += batches


_TOTALS = _Totals()


def count_round(batches: int) -> None:
    """A round of ``batches`` (two or more) ran in one forward: counted in
    ``stacked_totals``: this module's rounds and a runtime's own (the fake's)."""
    _TOTALS.add(batches)


def stacked_totals() -> tuple[int, int]:
    """Rounds of two or more models' batches run in this process so far, and
    the batches in them (every group's: the engine's stats and metrics)."""
    with _TOTALS._lock:
        return _TOTALS.rounds, _TOTALS.batches


def _answer(call: _Call[Any]) -> Any:
    if call.error is not None:
        raise call.error
    return call.result


# --- eager rounds -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Forward:
    model: Any
    batch: Mapping[str, torch.Tensor]
    solo: Solo  # the model's own forward, for a round of one


class StackGroup:
    """Models that can share an eager forward, and the rounds that run them."""

    def __init__(self, key: str, max_models: int) -> None:
        self.key = key
        self.max_models = max_models
        self._rounds: Rendezvous[_Forward] = Rendezvous(max_models, self._launch)
        self._skeleton: Any = None
        self._skeleton_lock = threading.Lock()
        self.num_rounds = 0  # rounds of two or more models
        self.num_stacked = 0  # model-forwards run in them

    def forward(self, model: Any, batch: Mapping[str, torch.Tensor], solo: Solo) -> torch.Tensor:
        """``model``'s last hidden state for ``batch``, stacked with other
        models' batches waiting at the same time (``solo(batch)`` when none is)."""
        hidden: torch.Tensor = self._rounds.submit(_Forward(model, batch, solo))
        return hidden

    def _launch(self, calls: list[_Forward]) -> Callable[[], list[Any]]:
        import torch

        if len(calls) == 1:
            (call,) = calls
            with torch.inference_mode():
                alone = call.solo(call.batch)
            return lambda: [alone]
        results = self.stacked([c.model for c in calls], [c.batch for c in calls])
        self.num_rounds += 1
        self.num_stacked += len(calls)
        count_round(len(calls))
        return lambda: list(results)

    def stacked(
        self, models: list[Any], batches: list[Mapping[str, torch.Tensor]]
    ) -> list[torch.Tensor]:
        """Each model's last hidden state for its batch, from one vmapped forward."""
        import torch
        from torch.func import functional_call, stack_module_state, vmap

        skeleton = self._skeleton_of(models[0])
        rows = max(b["input_ids"].shape[0] for b in batches)
        columns = max(b["input_ids"].shape[1] for b in batches)
        keys = sorted({k for b in batches for k in b})
        dtype = next(models[0].parameters()).dtype
        padded = [padded_inputs(b, rows, columns, 0, keys) for b in batches]
        for each in padded:
            each["attention_mask"] = additive_mask(each["attention_mask"], dtype)
        inputs = {key: torch.stack([p[key] for p in padded]) for key in keys}
        params, buffers = stack_module_state(models)

        def one(p: Any, b: Any, kwargs: dict[str, torch.Tensor]) -> torch.Tensor:
            out: torch.Tensor = functional_call(skeleton, (p, b), (), kwargs).last_hidden_state
            return out

        with torch.inference_mode():
            hidden = vmap(one)(params, buffers, inputs)
        return [
            hidden[i, : b["input_ids"].shape[0], : b["input_ids"].shape[1]]
            for i, b in enumerate(batches)
        ]

    def _skeleton_of(self, model: Any) -> Any:
        with self._skeleton_lock:
            if self._skeleton is None:
                self._skeleton = skeleton_of(model)
            return self._skeleton


def skeleton_of(model: Any) -> Any:
    """A weightless copy of ``model`` (on the meta device) with eager attention,
    to run under vmap with stacked weights. Its tensors are made on the meta
    device as the copy meets them: a deep copy of a model gathered into one
    block copies each parameter and, for each buffer, the whole block."""
    import torch

    skeleton = copy_of_module(model, lambda tensor: torch.empty_like(tensor, device="meta"))
    skeleton.set_attn_implementation("eager")
    return skeleton


_GROUPS: dict[str, StackGroup] = {}
_GROUPS_LOCK = threading.Lock()


def group_for(model: Any, device: str, max_models: int) -> StackGroup:
    """The process's stack group of ``model``'s signature on ``device`` (and
    of ``max_models``: cards that ask for another size form another group)."""
    key = f"{signature(model, device)}:{max_models}"
    with _GROUPS_LOCK:
        group = _GROUPS.get(key)
        if group is None:
            group = _GROUPS[key] = StackGroup(key, max_models)
        return group


# --- graphs of stacked rounds -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RoundCall:
    """A batch of texts tokenised ahead for a stacked round (``StackedGraphs.launch``)."""

    model: Any
    ids: Sequence[npt.NDArray[np.int32]]
    pooling: str
    solo: Callable[[], torch.Tensor | None]  # its own graphs' vectors, on the device


class StackedGraphs:
    """One architecture's pooled forward over up to ``max_models`` models'
    weights at once, at bucketed shapes (module notes): a part of its
    ``SharedGraphs``, made from the same template and its ``GraphForward``
    (padding, input names, length buckets, device)."""

    def __init__(
        self, template: Any, graphs: GraphForward, make_runner: MakeRunner, max_models: int
    ) -> None:
        tensors = weight_tensors(template)
        layout = block_layout(tensors)
        if layout is None or any(layout[0] % t.dtype.itemsize for t in tensors):
            raise ValueError("its weights cannot be laid out as slots of one block")
        self.slot_bytes, offsets = layout
        self.max_models = max_models
        self.graphs = graphs
        self.device = graphs.device
        self.model_buckets = tuple(
            sorted({n for n in STACK_MODELS if n < max_models} | {max_models})
        )
        self._block = device_bytes(max_models * self.slot_bytes, str(self.device))
        self._block.zero_()  # slots no model has filled are zeros, not garbage
        storage = self._block.untyped_storage()
        stacked = [
            typed_view(
                storage,
                t.dtype,
                offset,
                (max_models, *t.shape),
                (self.slot_bytes // t.dtype.itemsize, *t.stride()),
            )
            for t, offset in zip(tensors, offsets, strict=True)
        ]
        names = [name for name, _ in template.named_parameters()]
        self._params = dict(zip(names, stacked[: len(names)], strict=True))
        self._buffers = dict(
            zip([name for name, _ in template.named_buffers()], stacked[len(names) :], strict=True)
        )
        self._slot_groups = [by_dtype([t[i] for t in stacked]) for i in range(max_models)]
        self._offsets = offsets
        self._strides = [t.stride() for t in tensors]
        self._skeleton = skeleton_of(template)
        self._dtype = next(template.parameters()).dtype
        self.runners = BucketRunners(self._step, self.device, make_runner)
        self.rounds: Rendezvous[RoundCall] = Rendezvous(max_models, self.launch)
        self._lock = threading.Lock()  # the slots and the runners
        self._held: list[weakref.ref[Any] | None] = [None] * max_models
        self._last_use = [0] * max_models
        self._copies_in: weakref.WeakKeyDictionary[Any, Callable[[int], None]] = (
            weakref.WeakKeyDictionary()
        )
        self.num_rounds = 0  # rounds of two or more models
        self.num_stacked = 0  # batches run in them
        self.num_copies = 0  # models copied into a slot
        self._pinned = self.device.type == "cuda"

    @property
    def num_bytes(self) -> int:
        """The slots' bytes on the device (the graphs' are measured at capture)."""
        return int(self._block.untyped_storage().nbytes())

    def fits(self, ids: Sequence[npt.NDArray[np.int32]]) -> bool:
        """Whether a batch of these texts may join a stacked round."""
        return (
            0 < len(ids) <= STACK_ROWS[-1]
            and bucket_of(max(len(row) for row in ids), self.graphs.length_buckets) is not None
        )

    def round_vectors(
        self,
        model: Any,
        ids: Sequence[npt.NDArray[np.int32]],
        pooling: str,
        solo: Callable[[], torch.Tensor | None],
    ) -> npt.NDArray[np.float32] | None:
        """``model``'s float32 vectors of texts tokenised ahead, pooled as
        ``pooling`` says (not made unit), from a round with whatever other
        models' batches wait beside it; alone, ``solo()`` (its own graphs).
        None where ``solo()`` is, or the texts fit no stacked round and
        ``solo()`` gives none."""
        call = RoundCall(model, ids, pooling, solo)
        found: npt.NDArray[np.float32] | None
        if self.fits(ids):
            found = self.rounds.submit(call)
        else:
            (found,) = _alone([call])()
        return found

    def launch(self, calls: list[RoundCall]) -> Callable[[], list[Any]]:
        """A round of ``calls`` begun (one thread's, the rendezvous's leader):
        alone, or where the round's bucket failed to capture, each through
        its own graphs; else the models into slots, the inputs in and one
        replay, the vectors on their way back; what returns each call's
        vectors once they are (module notes)."""
        key = self._bucket(calls)
        if len(calls) == 1 or self.runners.failed(key):  # its graph failed: each alone
            return _alone(calls)
        models, rows, columns = key
        with self._lock:
            places = self._place([c.model for c in calls], models)
            groups: list[Sequence[npt.NDArray[np.int32]]] = [()] * models
            for call, slot in zip(calls, places, strict=True):
                groups[slot] = call.ids
            graphs = self.graphs
            inputs = stacked_inputs(
                groups, models, rows, columns, graphs.pad_id, graphs.input_keys, pinned=self._pinned
            )
            outputs = self.runners.replay(key, inputs)
            if outputs is None:  # its first use since a reset, or it failed to build
                outputs = run_step(self._step, self.device, inputs)
            back = {p: _copy_back(outputs, p) for p in {c.pooling for c in calls}}
            self.num_rounds += 1
            self.num_stacked += len(calls)
            count_round(len(calls))

        def finish() -> list[Any]:
            ready = {p: wait() for p, wait in back.items()}
            return [
                ready[c.pooling][slot, : len(c.ids)].copy()
                for c, slot in zip(calls, places, strict=True)
            ]

        return finish

    def _bucket(self, calls: list[RoundCall]) -> tuple[int, int, int]:
        """A round's (models, rows, columns) bucket."""
        models = bucket_of(len(calls), self.model_buckets)
        rows = bucket_of(max(len(c.ids) for c in calls), STACK_ROWS)
        length = max(len(row) for c in calls for row in c.ids)
        columns = bucket_of(length, self.graphs.length_buckets)
        if models is None or rows is None or columns is None:  # ``fits`` lets none such in
            raise ValueError(f"a round of {len(calls)} batches fits no stacked bucket")
        return models, rows, columns

    def _place(self, models: list[Any], slots: int) -> list[int]:
        """A slot below ``slots`` for each of ``models``: the one that holds
        its weights already where one does, else the longest unused one,
        its weights copied in (under the lock)."""
        places: list[int | None] = [None] * len(models)
        taken: set[int] = set()
        for i, model in enumerate(models):
            for slot in range(slots):
                held = self._held[slot]
                if slot not in taken and held is not None and held() is model:
                    places[i] = slot
                    taken.add(slot)
                    break
        free = sorted((s for s in range(slots) if s not in taken), key=self._last_use.__getitem__)
        for i, model in enumerate(models):
            if places[i] is None:
                slot = free.pop(0)
                self._copy_into(model, slot)
                places[i] = slot
        found = [slot for slot in places if slot is not None]
        stamp = max(self._last_use) + 1
        for slot in found:
            self._last_use[slot] = stamp
        return found

    def _copy_into(self, model: Any, slot: int) -> None:
        copy_in = self._copies_in.get(model)
        if copy_in is None:
            copy_in = self._copies_in[model] = self._copy_in(model)
        copy_in(slot)
        self._held[slot] = weakref.ref(model)
        self.num_copies += 1

    def _copy_in(self, model: Any) -> Callable[[int], None]:
        """What copies ``model``'s weights into a slot: one copy of its block
        where it is one block laid out as a slot is; else one fused copy a
        dtype (``template.copy_weights``)."""
        tensors = weight_tensors(model)
        block = one_block(tensors)
        if (
            block is not None
            and int(block.nbytes()) == self.slot_bytes
            and [int(t.storage_offset()) for t in tensors] == self._offsets
            and [t.stride() for t in tensors] == self._strides
        ):
            source = storage_bytes(block)
            size = self.slot_bytes

            def one_copy(slot: int) -> None:
                self._block[slot * size : (slot + 1) * size].copy_(source)

            return one_copy
        groups = by_dtype(tensors)
        return lambda slot: copy_weights(self._slot_groups[slot], groups)

    def _step(self, inputs: Mapping[str, torch.Tensor]) -> Outputs:
        """What a bucket's graph records: the forwards of its first slots (as
        many as its inputs have) at once, pooled as ``graphs.graph_step``
        pools (mean and first position, float32)."""
        from torch.func import functional_call, vmap

        skeleton, dtype = self._skeleton, self._dtype

        def one(
            params: dict[str, torch.Tensor],
            buffers: dict[str, torch.Tensor],
            kwargs: dict[str, torch.Tensor],
        ) -> dict[str, torch.Tensor]:
            mask = kwargs["attention_mask"]
            kwargs = {**kwargs, "attention_mask": additive_mask(mask, dtype)}
            hidden = functional_call(skeleton, (params, buffers), (), kwargs).last_hidden_state
            return {"mean": mean_pooled(hidden, mask), "cls": hidden[:, 0].float()}

        models = inputs["input_ids"].shape[0]  # the bucket's first slots (views: no kernel)
        params = {name: value[:models] for name, value in self._params.items()}
        buffers = {name: value[:models] for name, value in self._buffers.items()}
        out: Outputs = vmap(one)(params, buffers, dict(inputs))
        return out

    def prepare(self) -> None:
        """Build every bucket's runner now (a first load: inside its measurement)."""
        import numpy as np

        graphs = self.graphs
        for models in self.model_buckets:
            for rows in STACK_ROWS:
                for columns in graphs.length_buckets:
                    ids = [np.zeros(columns, dtype=np.int32)] * rows
                    example = stacked_inputs(
                        [ids] * models, models, rows, columns, graphs.pad_id, graphs.input_keys
                    )
                    with self._lock:
                        self.runners.build((models, rows, columns), example)

    def offload(self) -> None:
        """Its architecture leaves the device: the graphs are dropped and the
        slots emptied (copies of models' weights: filled again as used)."""
        with self._lock:
            self.runners.reset()
            self._held = [None] * self.max_models
            self._block.untyped_storage().resize_(0)

    def restore(self) -> None:
        with self._lock:
            self._block.untyped_storage().resize_(self.max_models * self.slot_bytes)
            self._block.zero_()

    def close(self) -> None:
        self.offload()


def _alone(calls: list[RoundCall]) -> Callable[[], list[Any]]:
    """Each call through its model's own graphs (a round of one, or a round
    whose stacked graph could not be built)."""
    vectors = [call.solo() for call in calls]
    return lambda: [None if v is None else v.cpu().numpy() for v in vectors]


def _copy_back(outputs: Outputs, pooling: str) -> Callable[[], npt.NDArray[np.float32]]:
    """``outputs[pooling]`` on its way to host memory: on CUDA a copy without
    blocking into page-locked memory and an event after it, so that the next
    round is launched before this one's vectors are back; what returns them."""
    import torch

    values = outputs[pooling]
    if values.device.type != "cuda":
        kept: npt.NDArray[np.float32] = values.numpy().copy()  # a runner's are the next's too
        return lambda: kept
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped upstream
    done.record()

    def wait() -> npt.NDArray[np.float32]:
        done.synchronize()
        found: npt.NDArray[np.float32] = host.numpy()
        return found

    return wait
