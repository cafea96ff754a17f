"""Weight templates: one module of an architecture that holds, in turn, the
weights of any model of it.

Models of one architecture on a device (same config shape, same tensors:
``signature``) can run through one set of CUDA graphs, captured over a
template module: a graph reads the weights at the addresses it was captured
with, so before a batch of another model than the last, that model's
weights are copied into the template's tensors. On CUDA each model's
weights and the template's are one block laid out alike
(``hostcopy.gather_block``, at the model's load), so that is one copy of
the block; otherwise one fused copy a dtype (``copy_weights``). A stacked
forward's slots (``runtimes/stacking.py``) take models' weights the same way.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tessera.errors import ModelUnavailableError
from tessera.footprint import Footprint
from tessera.runtimes.hostcopy import HostCopy, block_like, one_block, storage_bytes
from tessera.runtimes.memory import torch_module_bytes

if TYPE_CHECKING:
    import torch

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
    """A module's parameters, then its buffers (the order every copy keeps)."""
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


class WeightTemplate:
    """A copy of one model's module whose tensors take any other model's
    weights of its ``signature`` (module notes). ``hold`` is not
    thread-safe: its owner's lock guards it, and whatever replays over the
    template holds that lock until the replay is done."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.num_copies = 0  # times another model's weights were copied in
        self._current: weakref.ref[Any] | None = None
        self._host_copy: HostCopy | None = None
        # Its tensors, walked once: the same objects through copies, offloads
        # and restores (only their data changes), and a walk of the modules
        # costs more than launching the copy.
        self.tensors = weight_tensors(module)
        self._groups = by_dtype(self.tensors)
        self._block = one_block(self.tensors)
        # How each model's weights go into the template's (``_copy_in``), made once.
        self._copies_in: weakref.WeakKeyDictionary[Any, Callable[[], None]] = (
            weakref.WeakKeyDictionary()
        )

    @classmethod
    def of(cls, model: Any) -> WeightTemplate:
        """A template over a copy of ``model``'s weights: one block laid out
        as its, where its are one (``hostcopy.gather_block``)."""
        # Where the model is one block, the template's tensors are made empty
        # and then views of one copy of it: a deep copy would copy each
        # parameter and, for each buffer, the whole block.
        module = copy_of_module(model, lambda tensor: tensor.new_empty(0))
        if block_like(weight_tensors(module), weight_tensors(model)) is None:
            module = copy.deepcopy(model)
        module.requires_grad_(False)
        return cls(module)

    @property
    def num_bytes(self) -> int:
        return torch_module_bytes(self.module)

    @property
    def in_host_tier(self) -> bool:
        return self._host_copy is not None

    def hold(self, model: Any) -> None:
        """The template holds ``model``'s weights (under the owner's lock)."""
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
        (``copy_weights``)."""
        tensors = weight_tensors(model)
        block = one_block(tensors)
        into = self._block
        if block is not None and into is not None and same_layout(self.tensors, tensors):
            return functools.partial(storage_bytes(into).copy_, storage_bytes(block))
        return functools.partial(copy_weights, self._groups, by_dtype(tensors))

    def offload(self) -> Footprint:
        """Its weights to the host tier (under the owner's lock; not there yet)."""
        device = str(self.tensors[0].device)
        self._current = None
        self._host_copy = HostCopy.offload([self.module], device, self.tensors)
        return self._host_copy.footprint()

    def restore(self) -> None:
        held, self._host_copy = self._host_copy, None
        if held is None:
            raise ModelUnavailableError("graphs", "the template is not in the host tier")
        held.restore()

    def close(self) -> None:
        self._current = None
        held, self._host_copy = self._host_copy, None
        if held is not None:
            held.close()


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
    and int64 buffers (BERT's position and token type ids) in one list would
    be a copy kernel a tensor."""
    import torch

    with torch.no_grad():
        for to, values in zip(into, source, strict=True):
            torch._foreach_copy_(list(to), list(values))
