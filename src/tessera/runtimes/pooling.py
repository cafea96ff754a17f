"""What a forward leaves of a batch (``Readout``): token vectors pooled into
one vector per text, or a model's output as it is.

Two poolings (``POOLINGS``): ``mean``, the token vectors' mean over the
attention mask, and ``cls``, the first position's vector. Either may be made
unit (L2) after. A padded position is masked, so it changes no text's vector.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt
    import torch

Pooling = Literal["mean", "cls"]
# The vectors an encoder's graph leaves on the device beside its token vectors.
POOLINGS: tuple[Pooling, ...] = ("mean", "cls")


def masked_mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token vectors ``(batch, length, dim)`` averaged over the 0/1 ``mask``
    ``(batch, length)``, in their own dtype (a row with no position: zeros)."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    mean: torch.Tensor = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
    return mean


def mean_pooled(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``masked_mean`` in float32: what a graph leaves for ``mean``."""
    return masked_mean(hidden, mask).float()


def unit_rows(vectors: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """Each row over its length (as torch's ``normalize``: a zero row stays zero)."""
    lengths = np.linalg.norm(vectors, axis=1, keepdims=True)
    unit: npt.NDArray[np.float32] = vectors / np.maximum(lengths, 1e-12)
    return unit


@dataclass(frozen=True, slots=True)
class Readout:
    """What a forward leaves of a batch: token vectors pooled as ``pooling``
    says (unit where ``normalize``), or with no ``pooling`` the model's
    output as it is (a classifier's logits)."""

    pooling: Pooling | None = None
    normalize: bool = False

    def rows(self, outputs: torch.Tensor, mask: torch.Tensor) -> npt.NDArray[np.float32]:
        """One float32 row per text of ``outputs`` (the forward's, on its
        device), pooled and made unit in their own dtype."""
        import torch

        if self.pooling is None:
            vectors = outputs
        else:
            vectors = outputs[:, 0] if self.pooling == "cls" else masked_mean(outputs, mask)
            if self.normalize:
                vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
        result: npt.NDArray[np.float32] = vectors.float().cpu().numpy()
        return result
