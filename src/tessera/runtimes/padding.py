"""Tokenised batches padded to a shape: what a bucketed forward, a CUDA
graph or a stacked round takes.

Padding adds masked positions (``input_ids`` the tokenizer's pad id, the
rest 0) on the right of each row and whole padded rows below: a masked
position changes no real position's vector. Texts tokenised ahead
(``runtimes.tokens``) are padded in host memory with no device op, every
input a row of one int64 block (``PackedInputs``), so a runner whose static
inputs are packed alike copies them in one call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt
    import torch

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


def bucket_of(size: int, buckets: Sequence[int]) -> int | None:
    """The smallest of ``buckets`` (ascending) that holds ``size``; None where none does."""
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
    first, which inside the graphs' lock is a wait for another worker's
    replay. The allocator reuses such a block only once the copies that read
    it have run."""
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
    fill_ids(filled, groups, pad_id, names)
    return filled, names


def host_names(keys: Sequence[str]) -> list[str]:
    """The inputs ``host_inputs`` makes for a tokenizer's ``keys``, in order."""
    names = [key for key in keys if key in HOST_KEYS]
    return names + [key for key in HOST_KEYS[:2] if key not in names]


def fill_ids(
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
