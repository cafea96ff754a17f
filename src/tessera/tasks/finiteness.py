"""Whether a model's answers are numbers a client can use.

A model with broken weights (NaN tensors that still load) or an input that
overflows it answers NaN or infinity. JSON has no such numbers: served, they
became ``null`` (OpenAI's face), a bare ``NaN`` that is not JSON (KServe's) or
a 500 from the encoder. So a non-finite answer is the model's error
(``ModelOutputError``), found where outputs leave the model: at a first load's
warm-up (the model is then failed, as a load that raised) and on every batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tessera.errors import ModelOutputError

from .types import ClassifyOutput, OcrOutput


def is_finite(output: object) -> bool:
    """Whether every number in one output is finite (outputs without numbers are)."""
    if isinstance(output, np.ndarray):
        if output.dtype.kind not in "fc":
            return True
        return bool(np.isfinite(output).all())
    if isinstance(output, float):
        return math.isfinite(output)
    if isinstance(output, ClassifyOutput):
        return all(math.isfinite(s.score) for s in output.labels)
    if isinstance(output, OcrOutput):
        return all(math.isfinite(line.score) for line in output.lines)
    if isinstance(output, list | tuple) and output and isinstance(output[0], float):
        return all(math.isfinite(x) for x in output)
    return True


def check_finite(name: str, outputs: Sequence[Any]) -> None:
    """Raise ``ModelOutputError`` if any of ``outputs`` (model ``name``'s) holds
    a number that is not finite."""
    bad = sum(not is_finite(output) for output in outputs)
    if bad:
        raise ModelOutputError(
            name,
            f"numbers that are not finite (NaN or infinity) for {bad} of {len(outputs)} inputs",
        )


def finite_run(
    name: str, run: Callable[[Sequence[Any]], list[Any]]
) -> Callable[[Sequence[Any]], list[Any]]:
    """``run`` (model ``name``'s), its outputs checked in the thread that ran
    it (``check_finite``): a batch of non-finite answers fails as a batch that
    raised, and the engine's halving finds the inputs at fault."""

    def checked(items: Sequence[Any]) -> list[Any]:
        outputs = run(items)
        check_finite(name, outputs)
        return outputs

    return checked
