"""Chat with GGUF models at their quantised size through llama.cpp (adapter ``llamacpp``).

Each loaded model is a supervised engine process of its own
(``tessera.runtimes.llamacpp_worker``: xllamacpp's build of llama.cpp's HTTP
server, on loopback, behind a per-process API key). The weights stay in their
GGUF blocks (Q4_1: 98 MB for SmolLM2-135M, where transformers dequantises to
513 MB of fp32), and running them out of the server's process buys two things:

- a crash in native code is this model's alone: in-flight items get
  ``ModelUnavailableError`` (503) naming the exit, and the next batch starts a
  fresh engine (after a backoff that doubles with each crash in a row);
- unloading returns the memory for sure: the process ends.

The bytes a model holds are measured, not estimated: the engine process's
resident set (psutil), which takes in the mapped weights, the KV cache
(llama.cpp clears it at start, so it is resident from the first moment) and
the compute buffers. ``memory()`` reads it live.

A batch's items are sent at once, one HTTP request each, to the engine's
``num_slots`` parallel slots (the model's ``max_batch_size``), where llama.cpp's
continuous batching decodes them together. Every request streams (SSE), which
serves ``on_text``, tells a crash mid-answer apart from a slow answer, and
bounds a hung engine: no chunk within ``idle_timeout_s`` kills it. llama.cpp
applies the chat template of the GGUF (Jinja, as transformers renders it),
the stop strings (holding back a partial match while streaming), ``max_tokens``,
temperature, top_p and seed; top-k and min-p are off, as OpenAI's API has them.

An item whose caller has gone (its stop flag, ``request.item_stops``) stops at
the next chunk: the connection is closed, and llama.cpp's server cancels a
streamed task when its client goes, which frees the slot. Its output counts
the prompt and the tokens made so far, from the chunk's ``timings``.

Options (model.yaml ``options``):

- ``gguf_file``: the GGUF file's name inside the source folder.
- ``context_tokens``: KV cache cells, shared by the slots (default 2048).
- ``max_tokens_limit``: refuse items whose ``max_tokens`` is larger.
- ``idle_timeout_s``: longest wait for the engine's next chunk (default 60).
- ``load_timeout_s``: longest wait for the engine to load the model (default 120).
- ``gpu_layers``: layers offloaded on a GPU device (default: all); 0 on the CPU.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import secrets
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

import psutil

from tessera.errors import InferenceError, InvalidInputError, ModelUnavailableError
from tessera.footprint import Footprint
from tessera.request import item_stops
from tessera.runtimes.base import LoadContext
from tessera.runtimes.causal_lm import _validate
from tessera.runtimes.llamacpp_worker import EngineSettings
from tessera.runtimes.memory import files_bytes
from tessera.tasks.types import ChatInput, ChatMessage, ChatOutput

if TYPE_CHECKING:
    from tessera.repository.spec import ModelSpec

logger = logging.getLogger(__name__)

METHOD = "engine process rss"
DEFAULT_CONTEXT_TOKENS = 2048
# Bytes of the engine process beside the weights and the KV cache (the Python
# interpreter, llama.cpp's libraries, compute buffers): measured ~40 MiB on CPU.
_PROCESS_BYTES = 48 * 1024 * 1024
# An unreadable GGUF header: count this many KV bytes a context token.
_KV_BYTES_PER_TOKEN_FALLBACK = 32 * 1024
_STOP_WAIT_S = 5.0
_EXIT_SEEN_S = 1.0
_MAX_BACKOFF_S = 30.0
_STDERR_TAIL_BYTES = 2000


class LlamaCppLoader:
    """Loads a GGUF chat model into a llama.cpp engine process of its own."""

    def estimate_bytes(self, spec: ModelSpec) -> int:
        path = _gguf_path(spec)
        kv_per_token = _kv_bytes_per_token(path) or _KV_BYTES_PER_TOKEN_FALLBACK
        return files_bytes(path) + _context_tokens(spec) * kv_per_token + _PROCESS_BYTES

    def shared_keys(self, spec: ModelSpec) -> tuple[str, ...]:
        return ()

    def load(self, spec: ModelSpec, ctx: LoadContext) -> LlamaCppModel:
        gpu_layers = 0 if ctx.device.kind == "cpu" else int(spec.options.get("gpu_layers", 999))
        settings = EngineSettings(
            model_path=str(_gguf_path(spec)),
            api_key=secrets.token_urlsafe(24),
            context_tokens=_context_tokens(spec),
            num_slots=max(1, spec.batching.max_batch_size),
            threads=max(1, ctx.threads),
            gpu_layers=gpu_layers,
        )
        model = LlamaCppModel(spec, settings)
        try:
            model.start()
        except BaseException:
            model.unload()
            raise
        return model


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


@dataclass(frozen=True, slots=True)
class _Exit:
    """How an engine process ended."""

    returncode: int
    stderr_tail: str

    def describe(self) -> str:
        if self.returncode < 0:
            try:
                how = f"killed by {signal.Signals(-self.returncode).name}"
            except ValueError:
                how = f"killed by signal {-self.returncode}"
        else:
            how = f"exited with status {self.returncode}"
        tail = f"; its last words: {self.stderr_tail}" if self.stderr_tail else ""
        return how + tail


class _Engine:
    """One engine process: start, address, liveness, resident set, stop."""

    def __init__(self, name: str, settings: EngineSettings, load_timeout_s: float) -> None:
        self._name = name
        self._settings = settings
        # llama.cpp logs to stderr: kept in an unnamed file, its tail quoted on failure.
        # Owned by the engine for its whole life: closed by close(), not a with block.
        self._stderr: IO[bytes] = tempfile.TemporaryFile(prefix="tessera-llamacpp-")  # noqa: SIM115
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tessera.runtimes.llamacpp_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            # Its own session: a Ctrl-C at the terminal reaches the server, which
            # drains and stops its engines, not the engines mid-batch.
            start_new_session=True,
        )
        self.pid = self._proc.pid
        try:
            self.address = self._handshake(load_timeout_s)
        except BaseException:
            self.close()
            raise
        self._ps = psutil.Process(self.pid)

    def _handshake(self, timeout_s: float) -> str:
        stdin, stdout = self._proc.stdin, self._proc.stdout
        if stdin is None or stdout is None:
            raise ModelUnavailableError(self._name, "the engine process has no pipes")
        try:
            stdin.write((self._settings.to_json() + "\n").encode())
            stdin.flush()
            ready, _, _ = select.select([stdout], [], [], timeout_s)
            line = stdout.readline() if ready else b""
        except OSError:
            line = b""
        if not ready:
            self.kill()
            raise ModelUnavailableError(
                self._name, f"the llama.cpp engine did not load within {timeout_s:g} s"
            )
        try:
            reply = json.loads(line)
        except ValueError:
            reply = {}
        if "address" not in reply:
            if not self.wait_exit(_EXIT_SEEN_S):
                self.kill()
            exit_ = self.exit_status()
            reason = reply.get("error") or "no reply"
            if exit_ is not None:
                reason = f"{reason}; it {exit_.describe()}"
            raise ModelUnavailableError(
                self._name, f"the llama.cpp engine failed to start: {reason}"
            )
        return str(reply["address"])

    def alive(self) -> bool:
        return self._proc.poll() is None

    def wait_exit(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the process to end; whether it has."""
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def exit_status(self) -> _Exit | None:
        returncode = self._proc.poll()
        if returncode is None:
            return None
        return _Exit(returncode, self._stderr_tail())

    def rss_bytes(self) -> int | None:
        try:
            return int(self._ps.memory_info().rss)
        except psutil.Error:
            return None

    def stop(self) -> None:
        """Close its stdin (it exits at once), then kill it if it has not."""
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        try:
            self._proc.wait(_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self.kill()
        self._close_files()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self._proc.kill()
        self._proc.wait()
        self._close_files()

    def _close_files(self) -> None:
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    def _stderr_tail(self) -> str:
        try:
            size = self._stderr.seek(0, os.SEEK_END)
            self._stderr.seek(max(0, size - _STDERR_TAIL_BYTES))
            text = self._stderr.read().decode(errors="replace")
        except (OSError, ValueError):
            return ""
        lines = [line for line in text.splitlines() if line.strip()]
        return " | ".join(lines[-3:])

    def close(self) -> None:
        """Close its pipes and log file (after it has ended)."""
        self._close_files()
        with contextlib.suppress(OSError):
            self._stderr.close()


class _EngineGone(Exception):
    """The engine closed a connection or stopped answering (internal)."""


class LlamaCppModel:
    """A GGUF model served by its own llama.cpp engine process; see the module docstring."""

    def __init__(self, spec: ModelSpec, settings: EngineSettings) -> None:
        self._spec = spec
        self._settings = settings
        limit = spec.options.get("max_tokens_limit")
        self._max_tokens_limit = int(limit) if limit is not None else None
        self._idle_timeout_s = float(spec.options.get("idle_timeout_s", 60.0))
        self._load_timeout_s = float(spec.options.get("load_timeout_s", 120.0))
        self._pool = ThreadPoolExecutor(settings.num_slots, thread_name_prefix="tessera-llamacpp")
        self._lock = threading.Lock()  # guards the engine handle: start, restart, stop
        self._engine: _Engine | None = None
        self._unloaded = False
        self._num_crashes = 0  # in a row: reset by a batch that succeeds
        self._restart_after = 0.0  # time.monotonic() before which no restart is tried
        self._last_rss = 0

    @property
    def settings(self) -> EngineSettings:
        """What its engine process was started with."""
        return self._settings

    @property
    def pid(self) -> int | None:
        """The engine process's id (None while none runs)."""
        engine = self._engine
        return engine.pid if engine is not None else None

    def start(self) -> None:
        """Start the engine and check that a real completion answers."""
        with self._lock:
            self._start_locked()

    def _start_locked(self) -> None:
        started = time.perf_counter()
        engine = _Engine(self._spec.name, self._settings, self._load_timeout_s)
        self._engine = engine
        probe = ChatInput(messages=(ChatMessage("user", "Hi"),), max_tokens=1)
        try:
            self._complete(engine, probe, threading.Event())
        except _EngineGone as e:
            raise ModelUnavailableError(
                self._spec.name, f"the llama.cpp engine does not answer: {self._gone(engine, e)}"
            ) from e
        logger.info(
            "llama.cpp engine of %s (pid %d) ready in %.2f s at %s",
            self._spec.name,
            engine.pid,
            time.perf_counter() - started,
            engine.address,
        )

    def run(self, items: Sequence[Any]) -> list[ChatOutput]:
        checked = [self._check(item) for item in items]
        stops = item_stops(len(checked))
        engine = self._ready_engine()
        futures = [
            self._pool.submit(self._complete, engine, item, stop)
            for item, stop in zip(checked, stops, strict=True)
        ]
        try:
            outputs = [f.result() for f in futures]
        except _EngineGone as e:
            for f in futures:
                f.cancel()
            reason = self._gone(engine, e)
            raise ModelUnavailableError(
                self._spec.name, f"{reason}; the engine restarts on the next batch"
            ) from e
        self._num_crashes = 0
        return outputs

    def memory(self) -> Footprint:
        engine = self._engine
        rss = engine.rss_bytes() if engine is not None else None
        if rss is not None:
            self._last_rss = rss
        return Footprint(own_bytes=self._last_rss, method=METHOD)

    def unload(self) -> None:
        with self._lock:
            self._unloaded = True
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.stop()
            engine.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- the engine's life ----------------------------------------------------------

    def _ready_engine(self) -> _Engine:
        """The running engine; a crashed one is replaced, after its backoff."""
        with self._lock:
            if self._unloaded:
                raise ModelUnavailableError(self._spec.name, "the model was unloaded")
            engine = self._engine
            if engine is not None and engine.alive():
                return engine
            if engine is not None:
                self._crashed_locked(engine)
            wait_s = self._restart_after - time.monotonic()
            if wait_s > 0:
                raise ModelUnavailableError(
                    self._spec.name,
                    f"the llama.cpp engine crashed {self._num_crashes} times in a row;"
                    f" it restarts in {wait_s:.1f} s",
                )
            try:
                self._start_locked()
            except ModelUnavailableError:
                if self._engine is not None:
                    self._crashed_locked(self._engine)
                raise
            assert self._engine is not None  # set by _start_locked
            return self._engine

    def _crashed_locked(self, engine: _Engine) -> None:
        """Forget a dead (or hung) engine and set the backoff before the next start."""
        exit_ = engine.exit_status()
        logger.warning(
            "llama.cpp engine of %s (pid %d) %s",
            self._spec.name,
            engine.pid,
            exit_.describe() if exit_ else "was stopped",
        )
        engine.kill()
        engine.close()
        self._engine = None
        self._num_crashes += 1
        backoff_s = min(_MAX_BACKOFF_S, 0.5 * 2 ** (self._num_crashes - 1))
        self._restart_after = time.monotonic() + (backoff_s if self._num_crashes > 1 else 0.0)

    def _gone(self, engine: _Engine, error: _EngineGone) -> str:
        """Describe why the engine stopped answering, and make sure it is gone."""
        # A dead engine's connections reset a moment before its exit is seen.
        if not engine.wait_exit(
            _EXIT_SEEN_S
        ):  # hung, not dead: kill it, the next batch restarts it
            engine.kill()
            return f"the llama.cpp engine (pid {engine.pid}) hung ({error}) and was killed"
        exit_ = engine.exit_status()
        how = exit_.describe() if exit_ is not None else "ended"
        return f"the llama.cpp engine (pid {engine.pid}) {how}"

    # --- one item -------------------------------------------------------------------

    def _check(self, item: Any) -> ChatInput:
        if not isinstance(item, ChatInput):
            raise InvalidInputError(f"expected a chat item, got {type(item).__name__}")
        _validate(item, self._max_tokens_limit)
        return item

    def _complete(self, engine: _Engine, item: ChatInput, stop: threading.Event) -> ChatOutput:
        """One chat completion, streamed, until ``stop`` is set (the connection
        is then closed, which ends it in the engine); raises ``_EngineGone`` if
        the engine is."""
        host, _, port = engine.address.removeprefix("http://").partition(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=self._idle_timeout_s)
        try:
            connection.request(
                "POST",
                "/v1/chat/completions",
                body=json.dumps(_request_body(item)),
                headers={
                    "Content-Type": "application/json",
                    "Authorization": f"Bearer {self._settings.api_key}",
                },
            )
            response = connection.getresponse()
            if response.status != 200:
                raise _http_error(self._spec.name, response.status, response.read())
            return _read_stream(response, item, stop)
        except (OSError, http.client.HTTPException) as e:  # reset, refused, timed out
            raise _EngineGone(f"{type(e).__name__}: {e}") from e
        finally:
            connection.close()


def _request_body(item: ChatInput) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": m.role, "content": m.content} for m in item.messages],
        "max_tokens": item.max_tokens,
        "temperature": item.temperature,
        "top_p": item.top_p,
        # OpenAI semantics: no top-k, no min-p unless asked (llama.cpp's defaults
        # are 40 and 0.05); no penalties.
        "top_k": 0,
        "min_p": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        # Token counts in every chunk: what an item stopped mid-way has cost.
        "timings_per_token": True,
        "cache_prompt": True,
    }
    if item.stop:
        body["stop"] = list(item.stop)
    if item.seed is not None:
        body["seed"] = item.seed
    return body


def _http_error(name: str, status: int, raw: bytes) -> Exception:
    try:
        error = json.loads(raw).get("error", {})
        message = str(error.get("message", raw[:200]))
    except (ValueError, AttributeError):
        message = raw[:200].decode(errors="replace")
    if 400 <= status < 500:
        return InvalidInputError(f"model {name!r} refused the chat: {message}")
    return InferenceError(f"model {name!r}: the llama.cpp engine answered {status}: {message}")


def _sse_events(response: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    """The JSON events of a server-sent-events stream, up to ``[DONE]``."""
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[len(b"data:") :].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


def _read_stream(
    response: http.client.HTTPResponse, item: ChatInput, stop: threading.Event
) -> ChatOutput:
    pieces: list[str] = []
    on_text = item.on_text
    finish: str | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] = {}
    for event in _sse_events(response):
        if "error" in event:
            raise InferenceError(f"the llama.cpp engine failed the chat: {event['error']}")
        usage = event.get("usage") or usage
        timings = event.get("timings") or timings
        if stop.is_set():  # the caller has gone: what ran so far, nothing more
            return ChatOutput(
                text="".join(pieces),
                prompt_tokens=int(timings.get("cache_n", 0)) + int(timings.get("prompt_n", 0)),
                completion_tokens=int(timings.get("predicted_n", len(pieces))),
                finish_reason="stop",
            )
        for choice in event.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content") or ""
            finish = choice.get("finish_reason") or finish
            if not piece:
                continue
            pieces.append(piece)
            if on_text is not None:
                try:
                    on_text(piece)
                except Exception:  # a failing listener must not fail the other items
                    logger.exception("on_text raised; streaming to it stops")
                    on_text = None
    if finish is None or usage is None:
        raise _EngineGone("the stream ended before its last chunk")
    reason: Literal["stop", "length"] = "length" if finish == "length" else "stop"
    return ChatOutput(
        text="".join(pieces),
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        finish_reason=reason,
    )
