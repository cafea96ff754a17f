"""Content digests of model files, so that identical weights share one key.

Two model folders whose weights are the same bytes (a copied folder, a second
name for one model) must load one shared component, not two: its key is made
from the content of the files a loader reads (weights, configuration,
tokenizer), not from their path. A file is hashed once per process while its
size and modification time stay the same.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from pathlib import Path

# What a Hugging Face or ONNX folder's loaders read; READMEs, code and caches are not hashed.
MODEL_SUFFIXES = frozenset({".json", ".safetensors", ".bin", ".txt", ".model", ".onnx"})
_CHUNK_BYTES = 1 << 20

_digests: dict[tuple[str, int, int], str] = {}
_lock = threading.Lock()


def source_key(source: Path, **extra: object) -> str:
    """A cache entry's name for what was made from ``source``: a hash of its
    resolved path, size and modification time, and of ``extra`` (what else the
    entry depends on: a version, an option). Not of its bytes: cheap to take at
    every load, and a file changed in place gets a new entry."""
    stat = source.stat()
    identity = {
        "path": str(source.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        **extra,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def file_digest(path: Path) -> str:
    """The digest of one file's bytes (cached by path, size and modification time)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    with _lock:
        found = _digests.get(key)
    if found is not None:
        return found
    hasher = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            hasher.update(chunk)
    digest = hasher.hexdigest()
    with _lock:
        _digests[key] = digest
    return digest


def content_digest(path: Path) -> str:
    """The digest of a model file, or of a folder's model files (their names
    and contents, not their location): equal for a folder and its copy."""
    if path.is_file():
        return file_digest(path)
    return _files_digest(path, lambda file: file.suffix in MODEL_SUFFIXES)


def _files_digest(folder: Path, keep: Callable[[Path], bool]) -> str:
    """The digest of the names and contents of ``folder``'s files that ``keep``."""
    hasher = hashlib.blake2b(digest_size=16)
    for file in sorted(p for p in folder.iterdir() if p.is_file() and keep(p)):
        hasher.update(file.name.encode())
        hasher.update(b"\0")
        hasher.update(file_digest(file).encode())
    return hasher.hexdigest()


# The files ``AutoTokenizer`` reads from a folder: its own (by name) and the
# model's config (which may name the tokenizer's class).
_TOKENIZER_PREFIXES = (
    "tokenizer",
    "special_tokens_map",
    "added_tokens",
    "vocab",
    "merges",
    "spiece",
    "sentencepiece",
    "chat_template",
)
_TOKENIZER_FILES = frozenset({"config.json"})


def _tokenizer_file(file: Path) -> bool:
    name = file.name
    if name in _TOKENIZER_FILES or file.suffix == ".model":  # sentencepiece
        return True
    return name.startswith(_TOKENIZER_PREFIXES)


def tokenizer_digest(folder: Path) -> str:
    """The digest of the files a folder's tokenizer is built from (their names
    and contents): equal for fine-tunes of one base that kept its tokenizer,
    whatever their weights and other files."""
    return _files_digest(folder, _tokenizer_file)
