"""A card's ``dtype`` for a torch encoder or classifier, kept only where it
answers as float32 does.

``dtype`` is ``auto``, ``float32``, ``float16`` or ``bfloat16``; ``auto`` is
float16 on CUDA and float32 on the CPU. A reduced precision is kept only if
the model's outputs on ``CHECK_TEXTS`` stay within ``MIN_COSINE`` of
float32's, row by row (token vectors mean-pooled for an encoder, logits for
a classifier); otherwise the model goes back to float32 and the load says
why in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tessera.runtimes.pooling import mean_pooled

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "float16", "bfloat16")
MIN_COSINE = 0.999
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


def wanted_dtype(option: str, device: str) -> str:
    """The dtype ``option`` asks for on ``device`` (``auto``: float16 on CUDA)."""
    if option == "auto":
        return "float16" if device.startswith("cuda") else "float32"
    return option


def compared_rows(outputs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The float32 rows the check compares: token vectors mean-pooled over
    the mask, logits as they are."""
    return outputs.float() if outputs.dim() == 2 else mean_pooled(outputs, mask)


def reduce_precision(
    model: Any, batch: Mapping[str, torch.Tensor], dtype: str, output: str, min_cosine: float
) -> float:
    """Turn ``model`` to ``dtype`` if its outputs on ``batch`` keep a cosine of
    at least ``min_cosine`` to float32's, row by row; else leave it float32.
    Returns the lowest cosine."""
    import torch

    mask = batch["attention_mask"]
    with torch.inference_mode():
        reference = compared_rows(getattr(model(**batch), output), mask)
        model.to(getattr(torch, dtype))
        trial = compared_rows(getattr(model(**batch), output), mask)
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
