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
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tessera.errors import ConfigError, ModelUnavailableError
from tessera.repository import ModelSpec
from tessera.tasks.types import RerankInput, TextInput

if TYPE_CHECKING:
    import numpy.typing as npt

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
def whole_tokenizer(path: str) -> Any | None:
    """The ``tokenizer.json`` at ``path``, cutting and padding nothing (every
    token of a text, as the window check and TEI's ``/tokenize`` count them),
    read once per process; None where it cannot be read (the log says why).
    Only read after it is made, so one serves every thread."""
    try:
        from tokenizers import Tokenizer

        tokenizer: Any = Tokenizer.from_file(path)
    except Exception as e:  # any parse failure
        log.warning("cannot read the tokenizer %s: %s", path, e)
        return None
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


@functools.lru_cache(maxsize=64)
def _counter(path: str) -> TokenCounter | None:
    tokenizer = whole_tokenizer(path)
    if tokenizer is None:
        log.info("%s unread: over-window texts are estimated", path)
        return None

    def count(text: str) -> int:
        return len(tokenizer.encode(text).ids)

    return count


# --- tokenising in gateway processes -----------------------------------------------------

# Adapters whose models take texts tokenised ahead, in a gateway process
# (``TokenizedText``), and tokenise the rest themselves.
TOKENIZED_AHEAD = frozenset({"hf-encoder", "rag-intent", "bi-encoder-rerank", "encoder-head"})
DEFAULT_MAX_LENGTH = 256  # the Hugging Face encoders' option max_length when a card gives none


def capped_length(max_length: int, positions: object) -> int:
    """``max_length`` no longer than the model's position table (where it has one)."""
    if isinstance(positions, int) and positions > 0:
        return min(max_length, positions)
    return max_length


@dataclass(frozen=True, slots=True)
class TokenPlan:
    """How a model tokenises a text: its ``tokenizer.json``, truncated at
    ``max_length`` tokens (special ones included), no padding. ``key`` names
    it in the items made by it: the file's content and the window, so that
    fine-tunes of one base, each with its copy of the file, share a plan (and
    one tokenizer in each gateway)."""

    path: str
    max_length: int
    digest: str  # of the file's bytes

    @property
    def key(self) -> str:
        return f"{self.digest}:{self.max_length}"


@dataclass(frozen=True, slots=True)
class TokenizedText(TextInput):
    """A text with its token ids (int32, this machine's byte order), made in a
    gateway process by the plan named ``plan``. A model whose own plan has
    another key tokenises ``text`` itself."""

    ids: bytes = b""
    plan: str = ""


@dataclass(frozen=True, slots=True)
class TokenizedPair(RerankInput):
    """A (query, document) pair with each text's token ids, made in a gateway
    process by the plan named ``plan`` (as ``TokenizedText``)."""

    query_ids: bytes = b""
    document_ids: bytes = b""
    plan: str = ""


def token_plan(spec: ModelSpec) -> TokenPlan | None:
    """The plan of a model whose adapter takes texts tokenised ahead: its
    encoder's folder's (option ``encoder``, else its source) ``tokenizer.json``,
    at the card's ``max_length`` capped by the model's position table (as the
    runtime caps it). None for other models or a folder without the file."""
    if spec.adapter not in TOKENIZED_AHEAD:
        return None
    try:
        folder = spec.option_path("encoder") or spec.resolve_source()
        max_length = int(spec.options.get("max_length", DEFAULT_MAX_LENGTH))
        config = json.loads((folder / "config.json").read_text())
    except (ConfigError, ModelUnavailableError, OSError, ValueError, TypeError):
        return None  # the model's load says what is wrong
    path = folder / TOKENIZER_FILE
    if not path.is_file():
        return None
    window = capped_length(max_length, config.get("max_position_embeddings"))
    resolved = path.resolve()
    stat = resolved.stat()
    return TokenPlan(str(resolved), window, _digest(str(resolved), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=256)
def _digest(path: str, mtime_ns: int, size: int) -> str:
    """The first 16 hex digits of the SHA-256 of a file as of its (mtime, size)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


@functools.lru_cache(maxsize=64)
def text_tokenizer(plan: TokenPlan) -> TextTokenizer:
    """One ``TextTokenizer`` per plan in a process (a gateway's models share them)."""
    return TextTokenizer(plan)


class TextTokenizer:
    """Tokenises texts by one plan, in a gateway process (one thread: a fast
    tokenizer is not safe to share across threads)."""

    def __init__(self, plan: TokenPlan) -> None:
        from tokenizers import Tokenizer

        self.plan = plan
        self._key = plan.key
        self._tokenizer: Any = Tokenizer.from_file(plan.path)
        self._tokenizer.enable_truncation(plan.max_length)
        self._tokenizer.no_padding()

    def __call__(self, items: list[Any]) -> list[Any]:
        """``items`` with each ``TextInput`` a ``TokenizedText`` and each
        ``RerankInput`` a ``TokenizedPair`` (others as they are); a text that
        comes again (a rerank request's query) is tokenised once."""
        texts: dict[str, bytes] = {}
        for item in items:
            if type(item) is TextInput:
                texts.setdefault(item.text, b"")
            elif type(item) is RerankInput:
                texts.setdefault(item.query, b"")
                texts.setdefault(item.document, b"")
        if not texts:
            return items
        encodings = self._tokenizer.encode_batch(list(texts))
        for text, encoding in zip(list(texts), encodings, strict=True):
            texts[text] = np.asarray(encoding.ids, dtype=np.int32).tobytes()
        out = list(items)
        for i, item in enumerate(items):
            if type(item) is TextInput:
                out[i] = TokenizedText(item.text, texts[item.text], self._key)
            elif type(item) is RerankInput:
                query, document = texts[item.query], texts[item.document]
                out[i] = TokenizedPair(item.query, item.document, query, document, self._key)
        return out


def pair_ids(items: Sequence[Any], key: str) -> dict[str, npt.NDArray[np.int32]] | None:
    """The token ids of each text of ``items``' pairs, where there are items
    and every one was tokenised by the plan ``key`` names; else None."""
    out: dict[str, npt.NDArray[np.int32]] = {}
    for item in items:
        if not isinstance(item, TokenizedPair) or item.plan != key:
            return None
        out[item.query] = np.frombuffer(item.query_ids, dtype=np.int32)
        out[item.document] = np.frombuffer(item.document_ids, dtype=np.int32)
    return out or None


def tokenized_ids(items: Sequence[Any], key: str) -> list[npt.NDArray[np.int32]] | None:
    """Each item's token ids, where there are items and every one was
    tokenised by the plan ``key`` names; else None (the model tokenises the
    texts itself)."""
    out: list[npt.NDArray[np.int32]] = []
    for item in items:
        if not isinstance(item, TokenizedText) or item.plan != key:
            return None
        out.append(np.frombuffer(item.ids, dtype=np.int32))
    return out or None
