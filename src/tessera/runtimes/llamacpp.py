"""llama.cpp as an external engine (``runtime: external``, ``engine: llamacpp``).

GGUF chat models at their quantised size, each in an engine process of its own
(``tessera.runtimes.llamacpp_worker``: xllamacpp's build of llama.cpp's HTTP
server, on loopback), supervised by ``runtimes/external.py``. The weights stay
in their GGUF blocks (Q4_1: 98 MB for SmolLM2-135M, where transformers
dequantises to 513 MB of fp32). The worker gets its settings (the API key
among them) on stdin, reports its address on stdout once the model is loaded,
and exits when its stdin closes: an unload, or the server's death.

The bytes it holds are measured: the resident set of the engine process, which
takes in the mapped weights, the KV cache (llama.cpp clears it at start, so it
is resident from the first moment) and the compute buffers. llama.cpp's
continuous batching decodes a batch's items (one request each, over
``num_slots`` parallel slots: the model's window) together, and applies the
chat template of the GGUF (Jinja, as transformers renders it), the stop
strings, ``max_tokens``, temperature, top_p and seed; top-k and min-p are off,
as OpenAI's API has them. An item stopped mid-way counts the prompt and the
tokens made so far, from each chunk's ``timings``.

Options (model.yaml ``options``), beside the external runtime's:

- ``gguf_file``: the GGUF file's name inside the source folder.
- ``context_tokens``: KV cache cells, shared by the slots (default 2048).
- ``gpu_layers``: layers offloaded on a GPU device (default: all); 0 on the CPU.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tessera.errors import ModelUnavailableError
from tessera.runtimes.base import LoadContext
from tessera.runtimes.external import Launch
from tessera.runtimes.llamacpp_worker import EngineSettings
from tessera.runtimes.memory import files_bytes

if TYPE_CHECKING:
    from tessera.repository.spec import ModelSpec

DEFAULT_CONTEXT_TOKENS = 2048
# Bytes of the engine process beside the weights and the KV cache (the Python
# interpreter, llama.cpp's libraries, compute buffers): measured ~40 MiB on CPU.
_PROCESS_BYTES = 48 * 1024 * 1024
# An unreadable GGUF header: count this many KV bytes a context token.
_KV_BYTES_PER_TOKEN_FALLBACK = 32 * 1024


class LlamaCppEngine:
    """The ``llamacpp`` engine kind (``runtimes.external.EngineKind``)."""

    label = "llama.cpp"
    sleeps = False
    takes_images = False
    native_tools = False
    serial_start = False
    metrics_path = None
    default_load_timeout_s = 120.0

    def estimate_bytes(self, spec: ModelSpec) -> int:
        path = _gguf_path(spec)
        kv_per_token = _kv_bytes_per_token(path) or _KV_BYTES_PER_TOKEN_FALLBACK
        return files_bytes(path) + _context_tokens(spec) * kv_per_token + _PROCESS_BYTES

    def settings(
        self, spec: ModelSpec, ctx: LoadContext, api_key: str, window: int
    ) -> EngineSettings:
        """What the worker loads the model with."""
        gpu_layers = 0 if ctx.device.kind == "cpu" else int(spec.options.get("gpu_layers", 999))
        return EngineSettings(
            model_path=str(_gguf_path(spec)),
            api_key=api_key,
            context_tokens=_context_tokens(spec),
            num_slots=window,
            threads=max(1, ctx.threads),
            gpu_layers=gpu_layers,
        )

    def launch(self, spec: ModelSpec, ctx: LoadContext, api_key: str, window: int) -> Launch:
        settings = self.settings(spec, ctx, api_key, window)
        return Launch(
            argv=(sys.executable, "-m", "tessera.runtimes.llamacpp_worker"),
            stdin_line=settings.to_json(),
        )

    def chat_extras(self) -> dict[str, Any]:
        return {
            # OpenAI semantics: no top-k, no min-p unless asked (llama.cpp's
            # defaults are 40 and 0.05); no penalties.
            "top_k": 0,
            "min_p": 0.0,
            # Token counts in every chunk: what an item stopped mid-way has cost.
            "timings_per_token": True,
            "cache_prompt": True,
        }

    def parse_metrics(self, text: str) -> dict[str, float]:
        return {}


def _gguf_path(spec: ModelSpec) -> Path:
    source = spec.resolve_source()
    if source.is_file():
        if source.suffix != ".gguf":
            raise ModelUnavailableError(spec.name, f"{source} is not a .gguf file")
        return source
    gguf_file = spec.options.get("gguf_file")
    if isinstance(gguf_file, str) and (source / gguf_file).is_file():
        return source / gguf_file
    if gguf_file is None:
        found = sorted(source.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
    raise ModelUnavailableError(
        spec.name, f"no GGUF file in {source}; set options.gguf_file (got {gguf_file!r})"
    )


def _context_tokens(spec: ModelSpec) -> int:
    value = int(spec.options.get("context_tokens", DEFAULT_CONTEXT_TOKENS))
    if value < 16:
        raise ModelUnavailableError(spec.name, f"context_tokens must be >= 16, got {value}")
    return value


_KV_KEYS = (
    ".block_count",
    ".attention.head_count",
    ".attention.head_count_kv",
    ".embedding_length",
)
# GGUF metadata value types of unsigned and signed integers -> struct format.
_INT_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}


def _kv_bytes_per_token(path: Path) -> int | None:
    """f16 K and V bytes a context token takes, from the GGUF header (None if unreadable)."""
    found = _gguf_header_ints(path, _KV_KEYS)
    if found is None or len(found) < len(_KV_KEYS):
        return None
    heads = max(1, found[".attention.head_count"])
    head_dim = found[".embedding_length"] // heads
    return found[".block_count"] * 2 * found[".attention.head_count_kv"] * head_dim * 2


def _gguf_header_ints(path: Path, suffixes: tuple[str, ...]) -> dict[str, int] | None:
    """Integer metadata of a GGUF file whose keys end with ``suffixes`` (by suffix)."""
    # The value skipping is causal_lm's header reader (one GGUF parser in the tree).
    from tessera.runtimes.causal_lm import _skip_string, _skip_value

    found: dict[str, int] = {}
    try:
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                return None
            version, _, num_kv = struct.unpack("<IQQ", f.read(20))
            if version not in (2, 3):
                return None
            for _ in range(num_kv):
                (length,) = struct.unpack("<Q", f.read(8))
                key = f.read(length).decode(errors="replace")
                (value_type,) = struct.unpack("<I", f.read(4))
                suffix = next((s for s in suffixes if key.endswith(s)), None)
                fmt = _INT_FORMATS.get(value_type)
                if suffix is not None and fmt is not None:
                    (found[suffix],) = struct.unpack(fmt, f.read(struct.calcsize(fmt)))
                elif value_type == 8:
                    _skip_string(f)
                else:
                    _skip_value(f, value_type)
                if len(found) == len(suffixes):
                    break
    except (OSError, struct.error, ValueError):
        return None
    return found
