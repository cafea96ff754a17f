"""Models run in a worker process of their own (``isolation: process`` in model.yaml).

A native runtime that crashes (an ``abort()``, a segfault), hangs or leaks
inside the server takes every tenant with it; in a worker it takes only its
own model's batches. ``IsolatedLoader`` wraps the model's adapter: the worker
is *spawned* (not forked: it inherits no threads and no held locks), loads the
model with the adapter there, and runs each batch it is sent.

- **Messages**: a pipe of pickled messages, one batch in the worker at a time.
  numpy arrays of 64 KiB or more (an OCR page, a speech answer's audio) are not
  pickled: the sender writes them into a shared-memory block and sends its
  name; the receiver copies them out and the block is unlinked (by the server,
  which outlives both sides of each exchange).
- **Crash**: the pipe ends at once when the worker dies, so the batch in flight
  fails at once with ``ModelUnavailableError`` (503, Retry-After) naming the
  signal ("killed by SIGABRT"); the next batch starts a fresh worker after
  ``external.RestartBackoff`` (none after the first crash in a row).
- **Hang**: a batch not answered within ``run_timeout_s`` (option, default
  120 s) kills the worker; its items get 503.
- **Leak**: a worker whose resident set passes the card's ``memory.max_bytes``
  after a batch is ended (the batch's answers are kept) and restarted on the
  next batch.
- **Bytes**: the worker's resident set (its interpreter included), or on CUDA
  the bytes NVML counts for its pid.
- **Load**: with the server's cache folder (converted and optimised graphs
  are made once and read back by every later worker) and its warm-up choice
  (a reload skips it).
- **Stop**: unloading closes the pipe (the worker unloads its model and exits)
  and kills it after a grace; a worker also exits when the server dies (its
  pipe ends), unless it is stuck in a batch.
- **MPS**: ``mps_active_thread_percentage`` on the card is set as
  ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` in the worker before its model touches
  CUDA, and reported with the worker's pid and restarts in ``engine_metrics``.
  Once the worker has loaded, it is verified: its pid must be among the
  clients of a running MPS server (``nvidia-cuda-mps-control``'s
  ``get_server_list``, then ``get_client_list PID``); ``mps_client`` is 1
  when it is, 0 when an MPS daemon answers without it (the share does not
  apply: a warning says so), and absent when no daemon answers (a warning too).

Not for chat models: their items carry the server's streaming callbacks.
"""

from __future__ import annotations

import contextlib
import io
import logging
import multiprocessing
import os
import pickle
import shutil
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import psutil

from tessera.errors import ModelUnavailableError, TesseraError
from tessera.footprint import Footprint
from tessera.runtimes.base import ItemsApart, LoadContext, SharedComponents
from tessera.runtimes.external import EngineExit, RestartBackoff, nvml_bytes
from tessera.runtimes.memory import measure_rss
from tessera.runtimes.registry import get_loader

if TYPE_CHECKING:
    from tessera.repository.spec import ModelSpec

logger = logging.getLogger(__name__)

RSS_METHOD = "worker process rss"
NVML_METHOD = "worker process nvml"
SHM_MIN_BYTES = 64 * 1024
_LOAD_TIMEOUT_S = 600.0
_STOP_WAIT_S = 5.0
_EXIT_SEEN_S = 1.0


# --- messages ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Run:
    items: list[Any]


@dataclass(frozen=True, slots=True)
class _Reply:
    outputs: list[Any] = field(default_factory=list)
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class _SharedArray:
    """A numpy array left in a shared-memory block (a pickle persistent id)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.blocks: list[SharedMemory] = []

    def persistent_id(self, obj: Any) -> _SharedArray | None:
        if not isinstance(obj, np.ndarray) or obj.nbytes < SHM_MIN_BYTES or obj.dtype.hasobject:
            return None
        block = SharedMemory(create=True, size=obj.nbytes)
        self.blocks.append(block)
        np.ndarray(obj.shape, obj.dtype, buffer=block.buf)[...] = obj
        return _SharedArray(block.name, obj.shape, obj.dtype.str)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self.names: list[str] = []

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, _SharedArray):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        self.names.append(pid.name)
        block = SharedMemory(pid.name)
        try:
            return np.ndarray(pid.shape, np.dtype(pid.dtype), buffer=block.buf).copy()
        finally:
            block.close()


def _send(conn: Connection, message: object) -> list[SharedMemory]:
    """Send ``message``; the shared-memory blocks its large arrays went in
    (closed here, not yet unlinked)."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    try:
        pickler.dump(message)
        conn.send_bytes(buffer.getbuffer())
    finally:
        for block in pickler.blocks:
            block.close()
    return pickler.blocks


def _receive(conn: Connection, *, unlink: bool) -> Any:
    """Receive a message, its arrays copied out of their blocks (which are
    unlinked when ``unlink``)."""
    unpickler = _Unpickler(io.BytesIO(conn.recv_bytes()))
    try:
        return unpickler.load()
    finally:
        if unlink:
            _unlink(unpickler.names)


def _unlink(names: Sequence[str]) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            block = SharedMemory(name)
            block.close()
            block.unlink()


def _portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling (the server raises it as the model
    would inline), else a RuntimeError that names it."""
    try:
        copy = pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return copy if isinstance(copy, BaseException) else RuntimeError(str(error))


# --- the worker's side ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _WorkerArgs:
    spec: ModelSpec
    device: str  # make_device's name: cpu, cuda:N
    threads: int
    mps_active_thread_percentage: int | None
    cache_dir: Path | None = None  # the server's, for converted and optimised graphs
    warm_up: bool = True
    trusted_pickle_dirs: tuple[Path, ...] = ()
    adapters: Mapping[str, str] = field(default_factory=dict)  # the config's (registry.py)


def worker_main(conn: Connection, args: _WorkerArgs) -> None:
    """The worker process: load the model, answer batches until the pipe ends."""
    if args.mps_active_thread_percentage is not None:  # read when CUDA starts
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(args.mps_active_thread_percentage)
    from tessera.device import make_device

    try:
        device = make_device(args.device)
        if args.spec.runtime == "torch":
            import torch

            torch.set_num_threads(args.threads)
        ctx = LoadContext(
            device,
            args.threads,
            SharedComponents(),
            measure_rss,
            cache_dir=args.cache_dir,
            warm_up=args.warm_up,
            trusted_pickle_dirs=args.trusted_pickle_dirs,
        )
        model = get_loader(args.spec.adapter, args.adapters).load(args.spec, ctx)
    except BaseException as e:
        _send(conn, _Reply(error=_portable(e)))
        return
    _send(conn, _Reply())
    try:
        while True:
            try:
                message = _receive(conn, unlink=False)  # the server unlinks its blocks
            except EOFError:  # unloaded, or the server has gone
                return
            try:
                reply = _Reply(outputs=model.run(message.items))
            except Exception as e:
                reply = _Reply(error=_portable(e))
            _send(conn, reply)
    finally:
        model.unload()


# --- the server's side ------------------------------------------------------------


class _WorkerGone(Exception):
    """The worker died or hung during an exchange."""


@dataclass
class _Worker:
    process: BaseProcess
    conn: Connection

    @property
    def pid(self) -> int:
        return self.process.pid or 0

    def describe_exit(self) -> str:
        try:
            self.process.join(_EXIT_SEEN_S)
            code = self.process.exitcode
        except ValueError:  # closed: stopped by an unload
            return "was stopped"
        return EngineExit(code, "").describe() if code is not None else "did not end"

    def stop(self) -> None:
        """Close its pipe (it unloads and exits); kill it after a grace."""
        self.conn.close()
        self.process.join(_STOP_WAIT_S)
        if self.process.is_alive():
            self.kill()
        self.process.close()

    def kill(self) -> None:
        with contextlib.suppress(ValueError):  # already closed
            self.process.kill()
            self.process.join()


class IsolatedLoader:
    """Loads a model of adapter ``adapter`` (a built-in one or one of
    ``adapters``, the config's) into a worker process of its own."""

    def __init__(self, adapter: str, adapters: Mapping[str, str] | None = None) -> None:
        self._adapters = dict(adapters or {})
        self._inner = get_loader(adapter, self._adapters)

    def estimate_bytes(self, spec: ModelSpec) -> int:
        return self._inner.estimate_bytes(spec)

    def shared_keys(self, spec: ModelSpec) -> tuple[str, ...]:
        return ()  # a worker shares nothing with the server's models

    def alone_units(self, spec: ModelSpec, item: object) -> float | None:
        """As the adapter runs it in the worker."""
        if isinstance(self._inner, ItemsApart):
            return self._inner.alone_units(spec, item)
        return None

    def load(self, spec: ModelSpec, ctx: LoadContext) -> IsolatedModel:
        model = IsolatedModel(spec, ctx, self._adapters)
        model.start()
        return model


class IsolatedModel:
    """A model in a worker process; see the module docstring."""

    def __init__(
        self, spec: ModelSpec, ctx: LoadContext, adapters: Mapping[str, str] | None = None
    ) -> None:
        self._spec = spec
        self._ctx = ctx
        device = ctx.device
        self._args = _WorkerArgs(
            spec=spec,
            device="cpu" if device.kind == "cpu" else f"cuda:{device.index}",
            threads=ctx.threads,
            mps_active_thread_percentage=spec.mps_active_thread_percentage,
            cache_dir=ctx.cache_dir,
            warm_up=ctx.warm_up,
            trusted_pickle_dirs=ctx.trusted_pickle_dirs,
            adapters=dict(adapters or {}),
        )
        self._run_timeout_s = float(spec.options.get("run_timeout_s", 120.0))
        self._run_lock = threading.Lock()  # one batch in the worker at a time
        self._lock = threading.Lock()  # guards the worker handle and the backoff
        self._worker: _Worker | None = None
        self._unloaded = False
        self._backoff = RestartBackoff()
        self._num_restarts = 0
        self._last_bytes = 0
        self._method = RSS_METHOD
        self._mps_client: bool | None = None  # verified after each load where asked

    @property
    def pid(self) -> int | None:
        """The worker's process id (None while none runs)."""
        worker = self._worker
        return worker.pid if worker is not None else None

    def start(self) -> None:
        with self._lock:
            self._worker = self._spawn()

    def _spawn(self) -> _Worker:
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        process = context.Process(
            target=worker_main,
            args=(theirs, self._args),
            name=f"tessera-worker-{self._spec.key}",
            daemon=True,  # ended by multiprocessing at the server's exit too
        )
        process.start()
        theirs.close()
        worker = _Worker(process, ours)
        try:
            reply = self._exchange(worker, None, _LOAD_TIMEOUT_S)
        except _WorkerGone as e:
            worker.kill()
            raise ModelUnavailableError(self._spec.key, f"its worker did not load: {e}") from e
        if reply.error is not None:
            worker.stop()
            if isinstance(reply.error, TesseraError):
                raise reply.error
            reason = f"its worker did not load: {type(reply.error).__name__}: {reply.error}"
            raise ModelUnavailableError(self._spec.key, reason) from reply.error
        logger.info("worker of %s (pid %d) loaded", self._spec.key, worker.pid)
        if self._args.mps_active_thread_percentage is not None:
            self._mps_client = self._check_mps(worker.pid)
        return worker

    def _check_mps(self, pid: int) -> bool | None:
        """Whether the worker ``pid`` is an MPS client (None: no daemon answers)."""
        clients = mps_clients()
        if clients is None:
            logger.warning(
                "%s asks for an MPS share, but no MPS control daemon answers: not applied",
                self._spec.key,
            )
            return None
        if pid not in clients:
            logger.warning(
                "%s asks for an MPS share, but its worker (pid %d) is not an MPS client",
                self._spec.key,
                pid,
            )
            return False
        return True

    def _exchange(self, worker: _Worker, message: _Run | None, timeout_s: float) -> _Reply:
        """Send ``message`` (None: only wait for the load's reply) and wait for
        the reply within ``timeout_s``; raises _WorkerGone at its death or
        after the timeout (then it has been killed)."""
        blocks: list[SharedMemory] = []
        try:
            if message is not None:
                blocks = _send(worker.conn, message)
            if not worker.conn.poll(timeout_s):
                worker.kill()
                raise _WorkerGone(f"pid {worker.pid} hung ({timeout_s:g} s) and was killed")
            reply = _receive(worker.conn, unlink=True)
        except (EOFError, OSError) as e:
            raise _WorkerGone(f"pid {worker.pid} {worker.describe_exit()}") from e
        finally:
            _unlink([block.name for block in blocks])
        if not isinstance(reply, _Reply):
            raise _WorkerGone(f"pid {worker.pid} sent {type(reply).__name__}")
        return reply

    def run(self, items: Sequence[Any]) -> list[Any]:
        with self._run_lock:
            worker = self._ready_worker()
            try:
                reply = self._exchange(worker, _Run(list(items)), self._run_timeout_s)
            except _WorkerGone as e:
                with self._lock:
                    if self._worker is worker:
                        self._crashed_locked(worker)
                    retry_s = max(1.0, self._backoff.wait_s())
                raise ModelUnavailableError(
                    self._spec.key,
                    f"its worker (pid {worker.pid}) failed: {e}; it restarts on the next batch",
                    retry_after_s=retry_s,
                ) from e
            with self._lock:
                self._backoff.succeeded()
            self._end_if_leaking(worker)
        if reply.error is not None:
            raise reply.error
        return reply.outputs

    def _ready_worker(self) -> _Worker:
        """The running worker; a crashed one is replaced, after its backoff."""
        with self._lock:
            if self._unloaded:
                raise ModelUnavailableError(self._spec.key, "the model was unloaded")
            worker = self._worker
            if worker is not None and worker.process.is_alive():
                return worker
            if worker is not None:
                self._crashed_locked(worker)
            wait_s = self._backoff.wait_s()
            if wait_s > 0:
                raise ModelUnavailableError(
                    self._spec.key,
                    f"its worker crashed {self._backoff.num_crashes} times in a row;"
                    f" it restarts in {wait_s:.1f} s",
                    retry_after_s=wait_s,
                )
            self._num_restarts += 1
            try:
                self._worker = self._spawn()
            except ModelUnavailableError:
                self._backoff.crashed()
                raise
            return self._worker

    def _crashed_locked(self, worker: _Worker) -> None:
        worker.kill()
        worker.conn.close()
        self._worker = None
        self._backoff.crashed()

    def _end_if_leaking(self, worker: _Worker) -> None:
        """End a worker grown past the card's ``max_bytes`` (restarted on the next batch)."""
        limit = self._spec.max_bytes
        rss = _rss(worker.pid)
        if limit is None or rss is None or rss <= limit:
            return
        logger.warning(
            "worker of %s (pid %d) holds %d bytes > max_bytes %d: ended (restarts when needed)",
            self._spec.key,
            worker.pid,
            rss,
            limit,
        )
        with self._lock:
            if self._worker is worker:
                self._worker = None
        worker.stop()

    def memory(self) -> Footprint:
        worker = self._worker
        if worker is not None:
            device = self._ctx.device
            on_card = nvml_bytes([worker.pid], device.index) if device.kind == "cuda" else None
            rss = _rss(worker.pid)
            if on_card is not None:
                self._last_bytes, self._method = on_card, NVML_METHOD
            elif rss is not None:
                self._last_bytes, self._method = rss, RSS_METHOD
        return Footprint(own_bytes=self._last_bytes, method=self._method)

    def engine_metrics(self) -> dict[str, float]:
        """The worker's figures for the snapshot (``/admin/residency``)."""
        metrics = {"restarts": float(self._num_restarts)}
        pid = self.pid
        if pid is not None:
            metrics["worker_pid"] = float(pid)
        if self._args.mps_active_thread_percentage is not None:
            metrics["mps_active_thread_percentage"] = float(self._args.mps_active_thread_percentage)
            if self._mps_client is not None:
                metrics["mps_client"] = 1.0 if self._mps_client else 0.0
        return metrics

    def unload(self) -> None:
        with self._lock:
            self._unloaded = True
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop()


def _rss(pid: int) -> int | None:
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return None


MPS_CONTROL = "nvidia-cuda-mps-control"


def mps_clients() -> set[int] | None:
    """The pids of every running MPS server's clients, or None where no MPS
    control daemon answers (no binary on the PATH, or it fails)."""
    servers = _mps_query("get_server_list")
    if servers is None:
        return None
    clients: set[int] = set()
    for server in servers:
        clients.update(_mps_query(f"get_client_list {server}") or ())
    return clients


def _mps_query(command: str) -> list[int] | None:
    executable = shutil.which(MPS_CONTROL)
    if executable is None:
        return None
    try:
        done = subprocess.run(
            [executable], input=command + "\n", capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return [int(word) for word in done.stdout.split() if word.isdecimal()]
