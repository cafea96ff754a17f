"""Exact token counts of texts, before a model runs them.

A card with ``truncate: false`` refuses a text over its window with 413
rather than cutting it (``tasks.types``). Characters / 4 only approximates a
tokenizer: digits, code and most scripts other than English take more
tokens a character, so the estimate lets over-window texts through, and the
runtime then truncates them after all. Where the model's tokenizer is a
Hugging Face ``tokenizer.json`` (the card's ``tokenizer`` or ``encoder``
folder, else the weights' folder), the check counts with it: the same
tokens, special ones included, that the runtime's window cuts at. A model
without one keeps the estimate, and the log says so once.

Tokenizers are read once per file and shared: the engine counts on its
event loop, one text at a time, and only for ``truncate: false`` cards.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tessera.errors import ConfigError, ModelUnavailableError
from tessera.repository import ModelSpec

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
# Options naming a folder that holds the model's tokenizer, in the order looked at.
_TOKENIZER_OPTIONS = ("tokenizer", "encoder")

TokenCounter = Callable[[str], int]


def tokenizer_file(spec: ModelSpec) -> Path | None:
    """The model's ``tokenizer.json``, or None where it has none."""
    folders: list[Path] = []
    try:
        for key in _TOKENIZER_OPTIONS:
            path = spec.option_path(key)
            if path is not None:
                folders.append(path)
        weights = spec.resolve_source()
        folders.append(weights if weights.is_dir() else weights.parent)
    except (ConfigError, ModelUnavailableError):
        pass  # a missing path: its model fails at load, with the cause
    for folder in folders:
        path = folder if folder.is_file() else folder / TOKENIZER_FILE
        if path.name == TOKENIZER_FILE and path.is_file():
            return path
    return None


def token_counter(spec: ModelSpec) -> TokenCounter | None:
    """A function that counts a text's tokens as the model's tokenizer does
    (special tokens included), or None where the model has no tokenizer file
    or it cannot be read."""
    path = tokenizer_file(spec)
    if path is None:
        log.info("%s has no %s: over-window texts are estimated", spec.key, TOKENIZER_FILE)
        return None
    return _counter(str(path.resolve()))


@functools.lru_cache(maxsize=64)
def _counter(path: str) -> TokenCounter | None:
    try:
        from tokenizers import Tokenizer

        tokenizer: Any = Tokenizer.from_file(path)
    except Exception as e:  # any parse failure: keep the estimate
        log.warning("cannot read the tokenizer %s (%s): over-window texts are estimated", path, e)
        return None
    tokenizer.no_truncation()
    tokenizer.no_padding()

    def count(text: str) -> int:
        return len(tokenizer.encode(text).ids)

    return count
