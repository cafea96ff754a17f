"""One Hugging Face tokenizer per distinct tokenizer files in a process.

A hundred fine-tunes of one base model carry the same tokenizer files; each
load building its own tokenizer parses the same ``tokenizer.json`` again
(about 45 ms of a MiniLM's 160 ms load on this CPU) and holds another copy.
``shared_tokenizer(folder)`` gives every folder whose tokenizer files are the
same bytes (``digest.tokenizer_digest``) one ``SharedTokenizer``, built once
and kept while a model holds it, and the ``RECENT`` last asked for besides
(a model unloaded and loaded again, a hundred models taking turns in a
budget for twenty, finds it built).

A fast tokenizer keeps its padding and truncation settings as mutable state,
so concurrent calls raise "Already borrowed": every call through a
``SharedTokenizer`` takes its one lock, whichever model makes it. Its other
attributes (``pad_token_id``, ``model_input_names``...) read through.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any

from tessera.runtimes.digest import tokenizer_digest


class SharedTokenizer:
    """A tokenizer whose calls take one lock; other attributes read through."""

    __slots__ = ("__weakref__", "_lock", "_tokenizer", "checked")

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        # Answers that depend on the tokenizer alone, kept by their askers
        # (``hf.SentenceEncoder.takes_ids``: a plan's key to its answer).
        self.checked: dict[str, bool] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._tokenizer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


RECENT = 8  # tokenizers kept while no model holds them, the last asked for

_lock = threading.Lock()
_built: weakref.WeakValueDictionary[str, SharedTokenizer] = weakref.WeakValueDictionary()
_recent: OrderedDict[str, SharedTokenizer] = OrderedDict()


def shared_tokenizer(folder: Path) -> SharedTokenizer:
    """The tokenizer of ``folder`` (``AutoTokenizer``, local files only), shared
    with every folder whose tokenizer files are the same bytes."""
    key = tokenizer_digest(folder)
    with _lock:
        found = _built.get(key)
        if found is not None:
            return _used(key, found)
    from transformers import AutoTokenizer

    made = SharedTokenizer(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))
    with _lock:  # two loads that built it at once keep the first
        return _used(key, _built.setdefault(key, made))


def _used(key: str, tokenizer: SharedTokenizer) -> SharedTokenizer:
    """Mark ``tokenizer`` the last asked for (under ``_lock``)."""
    _recent[key] = tokenizer
    _recent.move_to_end(key)
    while len(_recent) > RECENT:
        _recent.popitem(last=False)
    return tokenizer
