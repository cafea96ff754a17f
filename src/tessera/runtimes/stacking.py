"""Batching across models: fine-tunes of one base in one forward (issue 15, item 3).

Encoders of the same architecture, shapes and dtype on one device (many
tenants' fine-tunes of one base, the common case) form a *stack group*
(``group_for``: keyed by ``signature``). A card opts in with ``stack: true``
(or ``stack: N``, at most N models a forward; 16 for ``true``). When
batches of two or more of its models reach the group at once, one thread
runs them together: their weights stacked along a new first dimension
(``torch.func.stack_module_state``), their inputs padded to one (batch,
length) with the 4-D additive mask of ``runtimes/graphs.py``, and one
forward under ``torch.func.vmap`` over ``functional_call`` of a weightless
copy of the architecture (eager attention: torch's fused attention kernels
have no batching rule); each model's rows and positions cut back. A batch
alone runs its model's own forward (its CUDA graphs where it has them).

Combining is flat: a batch's thread hands its forward to the group; if no
round runs it leads one, taking what waits (its own first, up to the
group's ``max_models``); else it waits, and is either answered by a round
or woken to lead the next one itself. No thread works for others longer
than one round, and no thread waits for a round that will not come.

Costs and limits: a round copies the weights of its models (the stack), a
transient of up to ``max_models`` x a model's bytes on the device, outside
the budget as the CUDA context is; at MiniLM's size on an H200 (shared/GPU.md)
16 models stacked ran 0.62 ms a model-forward eager against 3.4 ms for one
eager forward and 0.57 ms for one as a CUDA graph, so stacking pays against
eager forwards, not against graphs; a graph of the stacked forward over
weights kept stacked is the next step. Off by default (docs/benchmarks.md
has what it measured on the CPU).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tessera.runtimes.graphs import additive_mask, padded_inputs, signature

if TYPE_CHECKING:
    import torch


Solo = Callable[[Mapping[str, "torch.Tensor"]], "torch.Tensor"]


@dataclass(eq=False)
class _Call:
    model: Any
    batch: Mapping[str, torch.Tensor]
    solo: Solo  # the model's own forward, for a round of one
    done: threading.Event = field(default_factory=threading.Event)
    lead: bool = False  # woken to lead the next round
    result: torch.Tensor | None = None
    error: BaseException | None = None


class StackGroup:
    """Models that can share a forward, and the rounds that run them (module notes)."""

    def __init__(self, key: str, max_models: int) -> None:
        self.key = key
        self.max_models = max_models
        self._lock = threading.Lock()
        self._waiting: list[_Call] = []
        self._leading = False
        self._skeleton: Any = None
        self.num_rounds = 0  # rounds of two or more models
        self.num_stacked = 0  # model-forwards run in them

    def forward(self, model: Any, batch: Mapping[str, torch.Tensor], solo: Solo) -> torch.Tensor:
        """``model``'s last hidden state for ``batch``, stacked with other
        models' batches waiting at the same time (``solo(batch)`` when none is)."""
        call = _Call(model, batch, solo)
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

    def _lead(self, own: _Call) -> None:
        with self._lock:
            taken = [own, *self._waiting[: self.max_models - 1]]
            del self._waiting[: len(taken) - 1]
        try:
            self._run(taken)
        except BaseException as e:  # every call of the round hears it
            for call in taken:
                call.error = e
        finally:
            with self._lock:
                if self._waiting:  # the first waiting leads the next round
                    after = self._waiting.pop(0)
                    after.lead = True
                    after.done.set()
                else:
                    self._leading = False
            for call in taken[1:]:
                call.done.set()

    def _run(self, calls: list[_Call]) -> None:
        import torch

        if len(calls) == 1:
            (call,) = calls
            with torch.inference_mode():
                call.result = call.solo(call.batch)
            return
        call_result = self.stacked([c.model for c in calls], [c.batch for c in calls])
        for call, result in zip(calls, call_result, strict=True):
            call.result = result
        self.num_rounds += 1
        self.num_stacked += len(calls)

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
        with self._lock:
            if self._skeleton is None:
                skeleton = copy.deepcopy(model).to("meta")
                skeleton.set_attn_implementation("eager")
                self._skeleton = skeleton
            return self._skeleton


def _answer(call: _Call) -> torch.Tensor:
    if call.error is not None:
        raise call.error
    assert call.result is not None
    return call.result


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
