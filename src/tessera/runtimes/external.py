"""Models served by an OpenAI-compatible engine process of their own (``runtime: external``).

``engine:`` in ``model.yaml`` names the kind: ``llamacpp`` (GGUF models through
xllamacpp's build of llama.cpp's server, ``runtimes/llamacpp.py``) or ``vllm``
(``runtimes/vllm.py``). tessera starts, supervises and stops one engine process
per loaded model; to tenants the model is like any other: the batcher keeps
the per-tenant queue (admission, fair scheduling, deadlines, audit and metrics
are the engine's), and a batch's items are forwarded at once, one HTTP request
each, so the requests the engine holds never exceed its window: the batch size
times the batches that may run at once (``max_batch_size`` x
``max_concurrent_batches``), twice over for the batches of tenants that step
past the busy ones (``batching/batcher.py``), which vLLM is also told
(``--max-num-seqs``) and llama.cpp has as its slots.

Supervision (``EngineProcess`` and ``ExternalModel``):

- the process runs in a session (and process group) of its own, on loopback,
  behind a per-process API key passed on stdin or in its environment, never on
  its command line;
- ready means a real one-token completion answered, not just a live port;
- its exit is seen at once (a thread waits on it, and in-flight connections
  reset): its in-flight items get ``ModelUnavailableError`` (503) with
  Retry-After, the rest of its process group is killed, and the next batch
  starts a fresh engine after a backoff that doubles with each crash in a row;
- a hung engine (no chunk within ``idle_timeout_s``) is killed (its group);
- unloading stops it (closing its stdin, or SIGTERM to its group) and kills
  its group if it has not ended within a grace: no orphans;
- its bytes are measured: the NVML bytes of its process tree on CUDA (when
  pynvml reads the card), else the resident set of its process tree.

An engine that can sleep (vLLM's sleep mode) is evicted by ``sleep()``: its
weights leave the device but the process stays, and ``wake()`` brings them
back faster than a start (``engine/host.py`` keeps it while it sleeps).

Options (model.yaml ``options``), beside each kind's own:

- ``idle_timeout_s``: longest wait for the engine's next chunk (default 60);
- ``load_timeout_s``: longest wait for the engine to answer after its start
  (default 120; vLLM's default 600);
- ``max_tokens_limit``: refuse items whose ``max_tokens`` is larger.

Vision-language OCR (``task: ocr`` with the card's ``vision`` options, on an
engine that takes images: vLLM): an OCR page becomes the chat the in-process
``hf-vision-ocr`` adapter runs (``tasks.prompts.page_chat``: the page, then its
prompt, at most its ``max_tokens``), and a chat's images go to the engine as
``image_url`` parts with PNG ``data:`` URLs; the answer is a ``ChatOutput``
either way, which ``/v1/ocr`` reads as the adapter's (``fields`` JSON
included). Work units count the image's tokens from the ``vision`` options as
for the adapter, and the settled charge is the engine's reported usage. A
card asking for images on an engine that takes none (llama.cpp), or ``task:
ocr`` without ``vision``, is refused at load.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib
import json
import logging
import os
import secrets
import select
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, Protocol, cast

import psutil

from tessera.errors import ConfigError, InvalidInputError, ModelUnavailableError
from tessera.footprint import Footprint
from tessera.request import StopFlag, item_stops
from tessera.runtimes.base import LoadContext
from tessera.runtimes.causal_lm import _validate
from tessera.runtimes.openai_chat import EngineGone, EngineNotReady, complete
from tessera.tasks.prompts import page_chat
from tessera.tasks.types import ChatInput, ChatMessage, ChatOutput, OcrInput, Task

if TYPE_CHECKING:
    from tessera.repository.spec import ModelSpec

logger = logging.getLogger(__name__)

RSS_METHOD = "engine process tree rss"
NVML_METHOD = "engine process tree nvml"
_STOP_WAIT_S = 5.0
_EXIT_SEEN_S = 1.0
_MAX_BACKOFF_S = 30.0
_STDERR_TAIL_BYTES = 2000
_READY_POLL_S = 0.25
_CONTROL_TIMEOUT_S = 30.0
# Engines that measure the memory free at launch (vLLM) start one after another.
_SERIAL_STARTS = threading.Lock()


@dataclass(frozen=True, slots=True)
class Launch:
    """How to start one engine process: its command line, what its environment
    adds, an optional first line for its stdin (settings; closing stdin then
    stops it), and its address, or None when it reports one on stdout as
    ``{"address": "http://127.0.0.1:PORT"}`` (or ``{"error": ...}``)."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    stdin_line: str | None = None
    address: str | None = None


class EngineKind(Protocol):
    """One kind of OpenAI-compatible engine (``engine:`` in model.yaml)."""

    label: str  # in messages: "llama.cpp", "vLLM"
    sleeps: bool  # whether eviction puts it to sleep rather than stopping it
    takes_images: bool  # whether chats may carry images (vision-language OCR)
    native_tools: bool  # whether it calls tools itself (else: tool_calls.py's generic format)
    serial_start: bool  # start one at a time (each measures the memory free at launch)
    metrics_path: str | None  # its Prometheus page, scraped after each batch
    default_load_timeout_s: float

    def estimate_bytes(self, spec: ModelSpec) -> int: ...

    def launch(self, spec: ModelSpec, ctx: LoadContext, api_key: str, window: int) -> Launch: ...

    def chat_extras(self) -> dict[str, Any]:
        """Fields of a chat request beside OpenAI's (sampling defaults, usage)."""
        ...

    def parse_metrics(self, text: str) -> dict[str, float]:
        """Its Prometheus page as tessera's engine metrics (``metrics/prometheus.py``)."""
        ...


ENGINES: dict[str, str] = {
    "llamacpp": "tessera.runtimes.llamacpp:LlamaCppEngine",
    "vllm": "tessera.runtimes.vllm:VllmEngine",
}


def engine_kind(name: str | None) -> EngineKind:
    """The engine kind named by ``engine:`` in model.yaml."""
    if name not in ENGINES:
        raise ConfigError(f"unknown engine {name!r}; known: {sorted(ENGINES)}")
    module_name, _, class_name = ENGINES[name].partition(":")
    return cast(EngineKind, getattr(importlib.import_module(module_name), class_name)())


def checked_kind(spec: ModelSpec) -> EngineKind:
    """``spec``'s engine kind, once its task is one the kind serves: chat
    (``generate``), or a vision-language model's (``ocr``, or ``vision``
    options) on an engine that takes images, with the ``vision`` options work
    units count its image tokens from."""
    kind = engine_kind(spec.engine)
    if spec.task not in (Task.GENERATE, Task.OCR):
        raise ModelUnavailableError(
            spec.name, f"runtime external serves tasks generate and ocr, not {spec.task.value}"
        )
    if spec.task is Task.OCR and spec.inputs.vision is None:
        raise ModelUnavailableError(
            spec.name,
            "task ocr on an external engine is a vision-language model's: its card needs"
            " options.vision (its processor's patch_size, merge_size, min_pixels, max_pixels),"
            " from which work units count an image's tokens",
        )
    if spec.inputs.vision is not None and not kind.takes_images:
        raise ModelUnavailableError(
            spec.name,
            f"the {kind.label} engine (engine: {spec.engine}) does not take images:"
            f" task {spec.task.value} with vision options needs engine: vllm",
        )
    return kind


class ExternalLoader:
    """Loads a model into an engine process of its own (adapter ``external``)."""

    def estimate_bytes(self, spec: ModelSpec) -> int:
        return checked_kind(spec).estimate_bytes(spec)

    def shared_keys(self, spec: ModelSpec) -> tuple[str, ...]:
        return ()

    def load(self, spec: ModelSpec, ctx: LoadContext) -> ExternalModel:
        model = ExternalModel(spec, checked_kind(spec), ctx)
        try:
            model.start()
        except BaseException:
            model.unload()
            raise
        return model


@dataclass(frozen=True, slots=True)
class EngineExit:
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


class EngineProcess:
    """One engine process and its group: start, address, exit, bytes, stop."""

    def __init__(self, name: str, label: str, launch: Launch, timeout_s: float) -> None:
        self._name = name
        self._label = label
        self._launch = launch
        self.stopping = False
        # Its log (stderr) in an unnamed file, whose tail is quoted on failure.
        # Owned by the engine for its whole life: closed by close(), not a with block.
        self._stderr: IO[bytes] = tempfile.TemporaryFile(prefix="tessera-engine-")  # noqa: SIM115
        self._proc = subprocess.Popen(
            launch.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE if launch.address is None else subprocess.DEVNULL,
            stderr=self._stderr,
            env={**os.environ, **launch.env},
            # A session and process group of its own: a Ctrl-C at the terminal
            # reaches the server, which stops its engines, and a stop or a kill
            # reaches the engine's own children (vLLM's engine core) too.
            start_new_session=True,
        )
        self.pid = self._proc.pid
        self.exited = threading.Event()
        threading.Thread(target=self._watch, name=f"tessera-engine-{self.pid}", daemon=True).start()
        try:
            self.address = launch.address or self._handshake(timeout_s)
        except BaseException:
            self.kill()
            self.close()
            raise
        self._ps = psutil.Process(self.pid)

    def _watch(self) -> None:
        """Wait for the process's exit: logged at once, and its group killed."""
        self._proc.wait()
        self.exited.set()
        self._kill_group()
        if not self.stopping:
            exit_ = self.exit_status()
            logger.warning(
                "%s engine of %s (pid %d) %s",
                self._label,
                self._name,
                self.pid,
                exit_.describe() if exit_ else "ended",
            )

    def _handshake(self, timeout_s: float) -> str:
        stdout = self._proc.stdout
        if stdout is None:
            raise ModelUnavailableError(self._name, "the engine process has no stdout")
        self._send_stdin()
        try:
            ready, _, _ = select.select([stdout], [], [], timeout_s)
            line = stdout.readline() if ready else b""
        except OSError:
            ready, line = [], b""
        if not ready:
            raise ModelUnavailableError(
                self._name, f"the {self._label} engine did not load within {timeout_s:g} s"
            )
        try:
            reply = json.loads(line)
        except ValueError:
            reply = {}
        if "address" not in reply:
            self.exited.wait(_EXIT_SEEN_S)
            reason = reply.get("error") or "no reply"
            exit_ = self.exit_status()
            if exit_ is not None:
                reason = f"{reason}; it {exit_.describe()}"
            raise ModelUnavailableError(
                self._name, f"the {self._label} engine failed to start: {reason}"
            )
        return str(reply["address"])

    def _send_stdin(self) -> None:
        if self._launch.stdin_line is None or self._proc.stdin is None:
            return
        with contextlib.suppress(OSError):
            self._proc.stdin.write((self._launch.stdin_line + "\n").encode())
            self._proc.stdin.flush()

    def alive(self) -> bool:
        return not self.exited.is_set()

    def exit_status(self) -> EngineExit | None:
        returncode = self._proc.returncode
        if returncode is None:
            return None
        return EngineExit(returncode, self._stderr_tail())

    def pids(self) -> list[int]:
        """The process and its descendants."""
        try:
            return [self.pid, *(p.pid for p in self._ps.children(recursive=True))]
        except psutil.Error:
            return []

    def rss_bytes(self) -> int | None:
        """Resident bytes of the process tree (None once it has ended)."""
        total = 0
        for pid in self.pids():
            with contextlib.suppress(psutil.Error):
                total += int(psutil.Process(pid).memory_info().rss)
        return total or None

    def stop(self) -> None:
        """Close its stdin (the llama.cpp worker exits) or SIGTERM its group;
        kill the group if it has not ended within a grace."""
        self.stopping = True
        if self._launch.stdin_line is not None and self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        else:
            self._signal_group(signal.SIGTERM)
        if not self.exited.wait(_STOP_WAIT_S):
            self.kill()
        self._kill_group()

    def kill(self) -> None:
        """SIGKILL the group (a hung engine's, or one stopping too slowly)."""
        self.stopping = True
        self._kill_group()
        self.exited.wait()

    def _kill_group(self) -> None:
        self._signal_group(signal.SIGKILL)

    def _signal_group(self, signum: signal.Signals) -> None:
        # The group's id is the process's (start_new_session); it outlives the
        # leader while any member lives, so this reaches orphaned children too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)

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
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        with contextlib.suppress(OSError):
            self._stderr.close()


class RestartBackoff:
    """When a crashed process may be started again: at once after its first
    crash, then after 0.5 s doubling with each crash in a row (30 s at most);
    a success resets the count. Not thread-safe: its owner's lock guards it."""

    def __init__(self) -> None:
        self.num_crashes = 0  # in a row
        self._restart_after = 0.0  # time.monotonic() before which no restart is tried

    def crashed(self) -> None:
        self.num_crashes += 1
        backoff_s = min(_MAX_BACKOFF_S, 0.5 * 2 ** (self.num_crashes - 1))
        self._restart_after = time.monotonic() + (backoff_s if self.num_crashes > 1 else 0.0)

    def succeeded(self) -> None:
        self.num_crashes = 0

    def wait_s(self) -> float:
        """Seconds before a restart may be tried (0 or less: now)."""
        return self._restart_after - time.monotonic()


def nvml_bytes(pids: Sequence[int], index: int) -> int | None:
    """Device bytes NVML counts for ``pids`` on card ``index`` (None without
    pynvml, a card, or any of them on it: then the caller falls back to RSS)."""
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        found = [
            int(p.usedGpuMemory or 0)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            if p.pid in pids
        ]
    except Exception:  # absent, no card, or another pid namespace
        return None
    return sum(found) if found else None


class ExternalModel:
    """A model served by an engine process of its own; see the module docstring."""

    def __init__(self, spec: ModelSpec, kind: EngineKind, ctx: LoadContext) -> None:
        self._spec = spec
        self._kind = kind
        self._ctx = ctx
        self._api_key = secrets.token_urlsafe(24)
        limit = spec.options.get("max_tokens_limit")
        self._max_tokens_limit = int(limit) if limit is not None else None
        self._idle_timeout_s = float(spec.options.get("idle_timeout_s", 60.0))
        self._load_timeout_s = float(
            spec.options.get("load_timeout_s", kind.default_load_timeout_s)
        )
        # The concurrency window: requests in the engine at once, never more
        # (a batch's items, in its slots and as many beyond them).
        self.window = (
            2 * max(1, spec.batching.max_batch_size) * (spec.batching.max_concurrent_batches or 1)
        )
        self._pool = ThreadPoolExecutor(self.window, thread_name_prefix="tessera-engine")
        self._lock = threading.Lock()  # guards the engine handle: start, restart, sleep, stop
        self._engine: EngineProcess | None = None
        self._unloaded = False
        self._asleep = False
        self._backoff = RestartBackoff()  # reset by a batch that succeeds
        self._num_restarts = 0
        self._last_bytes = 0
        self._method = RSS_METHOD
        self._metrics: dict[str, float] = {}

    @property
    def pid(self) -> int | None:
        """The engine process's id (None while none runs)."""
        engine = self._engine
        return engine.pid if engine is not None else None

    @property
    def address(self) -> str | None:
        engine = self._engine
        return engine.address if engine is not None else None

    @property
    def api_key(self) -> str:
        return self._api_key

    def start(self) -> None:
        """Start the engine and check that a real completion answers."""
        with self._lock:
            self._start_locked()

    def _start_locked(self) -> None:
        started = time.perf_counter()
        launch = self._kind.launch(self._spec, self._ctx, self._api_key, self.window)
        with _SERIAL_STARTS if self._kind.serial_start else contextlib.nullcontext():
            engine = EngineProcess(self._spec.name, self._kind.label, launch, self._load_timeout_s)
            self._engine = engine
            self._wait_ready(engine, started + self._load_timeout_s)
        logger.info(
            "%s engine of %s (pid %d) ready in %.2f s at %s",
            self._kind.label,
            self._spec.name,
            engine.pid,
            time.perf_counter() - started,
            engine.address,
        )
        self._scrape(engine)

    def _wait_ready(self, engine: EngineProcess, deadline: float) -> None:
        """Until a one-token completion answers: refused connections and 503s
        are retried (the port may open, or answer 503, before the weights are
        loaded: a live port is not ready), an exit fails at once."""
        probe = ChatInput(messages=(ChatMessage("user", "Hi"),), max_tokens=1)
        while True:
            try:
                self._complete(engine, probe, StopFlag())
                return
            except (EngineGone, EngineNotReady) as e:
                late = time.perf_counter() > deadline
                if not engine.alive() or late:
                    if late:
                        engine.kill()
                    raise ModelUnavailableError(
                        self._spec.name,
                        f"the {self._kind.label} engine does not answer: {self._gone(engine, e)}",
                    ) from e
            engine.exited.wait(_READY_POLL_S)

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
        except EngineGone as e:
            for f in futures:
                f.cancel()
            reason = self._gone(engine, e)
            with self._lock:
                if self._engine is engine:
                    self._crashed_locked(engine)
                retry_s = max(1.0, self._backoff.wait_s())
            raise ModelUnavailableError(
                self._spec.name,
                f"{reason}; the engine restarts on the next batch",
                retry_after_s=retry_s,
            ) from e
        self._backoff.succeeded()
        self._scrape(engine)
        return outputs

    def memory(self) -> Footprint:
        engine = self._engine
        if engine is not None:
            pids = engine.pids()
            device = self._ctx.device
            on_card = (
                nvml_bytes(pids, int(getattr(device, "index", 0)))
                if device.kind == "cuda"
                else None
            )
            if on_card is not None:
                self._last_bytes, self._method = on_card, NVML_METHOD
            else:
                rss = engine.rss_bytes()
                if rss is not None:
                    self._last_bytes, self._method = rss, RSS_METHOD
        return Footprint(own_bytes=self._last_bytes, method=self._method)

    def engine_metrics(self) -> dict[str, float]:
        """tessera's engine metrics of this model: the engine's, as last scraped,
        its restarts and whether it sleeps."""
        return {
            **self._metrics,
            "restarts": float(self._num_restarts),
            "sleeping": 1.0 if self._asleep else 0.0,
        }

    def sleep(self) -> bool:
        """Put the engine to sleep (level 1: its weights leave the device, the
        process stays); False where its kind cannot, or it failed."""
        if not self._kind.sleeps:
            return False
        with self._lock:
            engine = self._engine
            if engine is None or not engine.alive():
                return False
            try:
                self._asleep = self._switch(engine, "/sleep?level=1")
            except EngineGone as e:
                label, name = self._kind.label, self._spec.name
                logger.warning("%s engine of %s did not sleep: %s", label, name, e)
                return False
        self._scrape(engine)
        return self._asleep

    def wake(self) -> None:
        """Wake a sleeping engine (its weights back on the device)."""
        with self._lock:
            engine = self._engine
            if engine is None or not engine.alive():
                raise ModelUnavailableError(self._spec.name, "its sleeping engine has ended")
            try:
                self._asleep = self._switch(engine, "/wake_up")
            except EngineGone as e:
                raise ModelUnavailableError(self._spec.name, f"its engine did not wake: {e}") from e
            if self._asleep:
                raise ModelUnavailableError(self._spec.name, "its engine sleeps after /wake_up")
        self._scrape(engine)

    def _switch(self, engine: EngineProcess, path: str) -> bool:
        """POST ``path`` (sleep or wake), then whether the engine sleeps."""
        self._control(engine, "POST", path)
        try:
            return bool(json.loads(self._control(engine, "GET", "/is_sleeping"))["is_sleeping"])
        except (ValueError, KeyError, TypeError) as e:
            raise EngineGone(f"/is_sleeping: {type(e).__name__}: {e}") from e

    def unload(self) -> None:
        with self._lock:
            self._unloaded = True
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.stop()
            engine.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- the engine's life ----------------------------------------------------------

    def _ready_engine(self) -> EngineProcess:
        """The running engine; a crashed one is replaced, after its backoff."""
        with self._lock:
            if self._unloaded:
                raise ModelUnavailableError(self._spec.name, "the model was unloaded")
            engine = self._engine
            if engine is not None and engine.alive():
                return engine
            if engine is not None:
                self._crashed_locked(engine)
            wait_s = self._backoff.wait_s()
            if wait_s > 0:
                raise ModelUnavailableError(
                    self._spec.name,
                    f"the {self._kind.label} engine crashed {self._backoff.num_crashes} times"
                    " in a row;"
                    f" it restarts in {wait_s:.1f} s",
                    retry_after_s=wait_s,
                )
            self._num_restarts += 1
            try:
                self._start_locked()
            except ModelUnavailableError:
                if self._engine is not None:
                    self._crashed_locked(self._engine)
                raise
            assert self._engine is not None  # set by _start_locked
            return self._engine

    def _crashed_locked(self, engine: EngineProcess) -> None:
        """Forget a dead (or hung) engine and set the backoff before the next start."""
        engine.kill()
        engine.close()
        self._engine = None
        self._backoff.crashed()

    def _gone(self, engine: EngineProcess, error: Exception) -> str:
        """Describe why the engine stopped answering, and make sure it is gone."""
        label = f"the {self._kind.label} engine (pid {engine.pid})"
        # A dead engine's connections reset a moment before its exit is seen.
        if not engine.exited.wait(_EXIT_SEEN_S):  # hung, not dead: kill it
            engine.kill()
            return f"{label} hung ({error}) and was killed"
        exit_ = engine.exit_status()
        return f"{label} {exit_.describe() if exit_ is not None else 'ended'}"

    # --- requests -------------------------------------------------------------------

    def _check(self, item: Any) -> ChatInput:
        """A chat to forward: a chat item as it is, an OCR page (of a
        vision-language model) as the chat the in-process adapter would run."""
        if isinstance(item, OcrInput) and self._spec.inputs.vision is not None:
            item = page_chat(item, self._spec.options.get("prompts"), self._spec.inputs)
        if not isinstance(item, ChatInput):
            raise InvalidInputError(f"expected a chat item, got {type(item).__name__}")
        if not self._kind.takes_images and any(m.images for m in item.messages):
            raise InvalidInputError(f"the {self._kind.label} engine does not take images")
        if item.tools is not None and item.logprobs is not None and not self._kind.native_tools:
            raise InvalidInputError(
                f"logprobs with tools: the {self._kind.label} engine's tool calls are read"
                " from JSON it writes, whose tokens' logprobs are not the answer's"
            )
        _validate(item, self._max_tokens_limit)
        return item

    def _complete(self, engine: EngineProcess, item: ChatInput, stop: StopFlag) -> ChatOutput:
        return complete(
            engine.address,
            self._api_key,
            self._spec.name,
            item,
            self._kind.chat_extras(),
            stop,
            self._idle_timeout_s,
            native_tools=self._kind.native_tools,
        )

    def _control(self, engine: EngineProcess, method: str, path: str) -> bytes:
        """A request to one of the engine's own endpoints; its body."""
        host, _, port = engine.address.removeprefix("http://").partition(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=_CONTROL_TIMEOUT_S)
        try:
            connection.request(method, path, headers={"Authorization": f"Bearer {self._api_key}"})
            response = connection.getresponse()
            body = response.read()
        except (OSError, http.client.HTTPException) as e:
            raise EngineGone(f"{type(e).__name__}: {e}") from e
        finally:
            connection.close()
        if response.status != 200:
            raise EngineGone(f"{method} {path} answered {response.status}")
        return body

    def _scrape(self, engine: EngineProcess) -> None:
        """Read the engine's own metrics (kept for the next snapshot)."""
        if self._kind.metrics_path is None:
            return
        try:
            text = self._control(engine, "GET", self._kind.metrics_path).decode(errors="replace")
            self._metrics = self._kind.parse_metrics(text)
        except (EngineGone, ValueError) as e:
            logger.debug("metrics of %s not read: %s", self._spec.name, e)
