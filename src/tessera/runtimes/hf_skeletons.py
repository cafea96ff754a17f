"""Hugging Face models built from a kept skeleton: the modules once per config,
the weights mapped from each folder's safetensors file.

``from_pretrained`` builds every module in Python, initialises it, then
reads the checkpoint into it: about 70 ms for a MiniLM on this CPU, of which
reading the weights is a few. A hundred fine-tunes of one base share one
``config.json``: the first load of a config keeps its model as a skeleton
(its parameters on the ``meta`` device, no bytes; its buffers real), and a
later folder of the same config is a copy of the skeleton with the folder's
tensors in the places of the skeleton's (``safetensors`` maps the file, as
``from_pretrained`` does, so the host tier can let the pages go and map them
back).

A skeleton is used only where it makes what ``from_pretrained`` makes: when
it is kept, the folder it came from is built through it and compared tensor
by tensor with the model ``from_pretrained`` made (a config whose loading
renames or converts weights fails here and is never built from a skeleton);
a later folder's file must hold exactly the skeleton's tensors, by name,
shape and dtype (buffers the module makes itself may be in it too, and are
left out, as ``from_pretrained`` leaves them). Anything else loads through
``from_pretrained``.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.runtimes.digest import file_digest

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
# Skeletons kept (the most recently used): each is Python objects and small
# buffers, no weights.
MAX_SKELETONS = 32


@dataclass(frozen=True, slots=True)
class Skeleton:
    module: Any  # parameters on meta, buffers real
    tensors: dict[str, tuple[tuple[int, ...], Any]]  # the checkpoint's: shape, dtype
    made_here: frozenset[str]  # buffers the module makes (not in its state dict)
    # The module's tensors by state-dict name: a copy puts the file's in their place.
    slots: dict[str, Any]


_lock = threading.Lock()
_skeletons: OrderedDict[tuple[str, str], Skeleton | None] = OrderedDict()


def load_pretrained(auto_class: Any, folder: Path) -> Any:
    """``auto_class.from_pretrained(folder)`` (local files only), or the same
    model built from the skeleton of its config (see the module notes)."""
    weights, config = folder / WEIGHTS, folder / CONFIG
    if not (weights.is_file() and config.is_file()):
        return _from_pretrained(auto_class, folder)
    key = (auto_class.__name__, file_digest(config))
    with _lock:
        known = key in _skeletons
        skeleton = _skeletons.get(key)
        if known:
            _skeletons.move_to_end(key)
    if skeleton is not None:
        built = _from_skeleton(skeleton, weights)
        if built is not None:
            built.name_or_path = str(folder)
            return built
    model = _from_pretrained(auto_class, folder)
    if not known:
        _keep(key, _skeleton_checked(model, weights))
    return model


def _from_pretrained(auto_class: Any, folder: Path) -> Any:
    return auto_class.from_pretrained(str(folder), local_files_only=True).eval()


def _keep(key: tuple[str, str], skeleton: Skeleton | None) -> None:
    with _lock:
        _skeletons[key] = skeleton
        while len(_skeletons) > MAX_SKELETONS:
            _skeletons.popitem(last=False)


def skeleton_of(model: Any) -> Skeleton:
    """``model``'s modules without its parameters' bytes (on ``meta``)."""
    import torch

    memo: dict[int, Any] = {}
    for parameter in model.parameters():
        meta = torch.empty_like(parameter, device="meta")
        memo[id(parameter)] = torch.nn.Parameter(meta, requires_grad=parameter.requires_grad)
    module = copy.deepcopy(model, memo)
    state = module.state_dict(keep_vars=True)
    tensors = {name: (tuple(t.shape), t.dtype) for name, t in state.items()}
    made_here = frozenset(name for name, _ in module.named_buffers()) - frozenset(state)
    return Skeleton(module, tensors, made_here, dict(state))


def _skeleton_checked(model: Any, weights: Path) -> Skeleton | None:
    """The skeleton of ``model`` where building ``weights`` through it gives
    ``model``'s every tensor, bit for bit; else None (never used)."""
    import torch

    try:
        skeleton = skeleton_of(model)
        built = _from_skeleton(skeleton, weights)
    except Exception as e:  # a model deepcopy or meta tensors cannot take
        log.info("%s: no skeleton (%s: %s)", type(model).__name__, type(e).__name__, e)
        return None
    if built is None:
        return None
    made, expected = built.state_dict(), model.state_dict()
    same = made.keys() == expected.keys() and all(
        torch.equal(made[name], expected[name]) for name in expected
    )
    if not same:
        log.info("%s: built from its skeleton it differs; loads use from_pretrained", type(model))
        return None
    return skeleton


def _from_skeleton(skeleton: Skeleton, weights: Path) -> Any | None:
    """A copy of ``skeleton`` with ``weights``' tensors, or None where the file
    does not hold exactly the skeleton's tensors."""
    from safetensors.torch import load_file

    state = load_file(str(weights))
    for name in skeleton.made_here & state.keys():
        del state[name]
    if state.keys() != skeleton.tensors.keys() or any(
        (tuple(t.shape), t.dtype) != skeleton.tensors[name] for name, t in state.items()
    ):
        return None
    # The copy takes the file's tensors where the skeleton has its own
    # (``deepcopy``'s memo): nothing is copied, then assigned again.
    import torch

    memo: dict[int, Any] = {}
    for name, tensor in state.items():
        slot = skeleton.slots[name]
        if isinstance(slot, torch.nn.Parameter):
            tensor = torch.nn.Parameter(tensor, requires_grad=slot.requires_grad)
        memo[id(slot)] = tensor
    model = copy.deepcopy(skeleton.module, memo)
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return None
    return model.eval()
