"""The ``fake`` adapter: a model for the tests and benchmarks of the engine and its
policies, with the real interface and no weights. A server or an engine gets it
through its config's ``adapters`` (``FAKE_ADAPTERS``; ``tessera serve --adapter
fake=harness.fake_models:FakeLoader``, with ``benchmarks/`` on ``PYTHONPATH``).

Its descriptor's ``options`` set what it reports and does::

    options:
      own_bytes: 1000        # bytes it reports holding (also its estimate)
      estimate_bytes: 800    # a different estimate before load (optional)
      shared: {enc: 500}     # shared components it uses, by key
      fail_load: false       # raise on load
      load_s: 0.0            # seconds a load sleeps (integration tests only)
      fail_run: false        # raise on every batch
      fail_on: poison        # raise on a batch with an input whose text (a chat's prompt or
                             # messages) holds this (optional)
      abort_on: crash        # os.abort() the process on such a batch (a native crash;
                             # for a model with isolation: process)
      max_batch_chars: 1000  # raise MemoryError on a batch of longer texts together (optional)
      run_s: 0.0             # seconds each batch sleeps (integration tests only)
      unit_s: 0.0            # and seconds more for each of its work units
      word_s: 0.0            # seconds per word a chat answer takes; an item whose
                             # stop flag is set (its caller left) stops at the next word,
                             # and each word after the first is a step (step_boundary)
      scratch_bytes_per_unit: 0  # bytes a batch really allocates (and touches) per
                                 # work unit while it runs: a measurable peak
      items_alone: false     # true: items run one after another, each with its own
                             # scratch, freed before the next (ItemsApart)
      scale: 1.0             # embeddings of this norm (tells two versions apart)
      nan_on: poison         # NaN embeddings (scores) for inputs whose text holds this
                             # ("": every input, its warm-up's too: weights gone NaN)
      stack: 0               # N: its batches meet other such models' in rounds of up to N
                             # (runtimes/stacking.Rendezvous; a round runs them one after
                             # another in its leader's thread, and a failure fails the
                             # round), on the executor's threads for batches across models
      host_calls: 0          # calls a batch makes that hand the interpreter lock to a
                             # waiting thread (time.sleep(0)), as each torch call that
                             # launches a GPU's work does
      device_s: 0.0          # seconds of the device a batch takes, one batch at a time in
                             # the process (a sleep under one lock): with host_calls, a
                             # model of a GPU's host side (benches; _DeviceModel)
      round_host_calls: 0    # the same for a whole stacked round (default: a batch's);
      round_device_s: 0.0    # a round's batches then make none of their own
      host_tier: false       # true: waits in the host tier when evicted (OffloadingModel)
      host_bytes: 1000       # the host bytes it then reports (default: own_bytes)
      fail_restore: false    # raise when brought back from the host tier
      offload_s: 0.0         # seconds a move to the host tier sleeps, and a return
      restore_s: 0.0         # from it (a device's copies, in the copy thread; benches):
                             # one at a time each way, the two ways at once, as on
                             # CUDA's copy stream each way
      copy_calls: 0          # calls each such copy (of more than 0 s) makes first that
                             # hand the interpreter lock over: a copy in 4 MiB pieces
      stage: enc             # a head model (runtimes.base.EncoderHead) of stage key
                             # "fake-stage:enc": its first stage the fake embeddings
                             # (run_s, unit_s, fail_on as a batch's), its head a label
                             # named after the model, scored by the vector
      fail_head: false       # its head raises on rows of texts holding HEAD_POISON

``run`` answers each item with an output of its task's type derived from the
item alone (an embedding seeded by the text, a translation that is the text
reversed...), so a test can tell that each caller got exactly its own result.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tessera.errors import ModelUnavailableError
from tessera.footprint import Footprint
from tessera.repository.spec import ModelSpec
from tessera.request import StopFlag, item_stops
from tessera.runtimes.base import LoadContext
from tessera.runtimes.stacking import Rendezvous, count_round
from tessera.step import step_boundary
from tessera.tasks.types import (
    ChatInput,
    ChatOutput,
    ClassifyOutput,
    LabelScore,
    OcrInput,
    OcrLine,
    OcrOutput,
    RerankInput,
    SpeechInput,
    SpeechOutput,
    Task,
    TextInput,
    TranslateInput,
    refuse_engine_only,
    work_units,
)

# A config's ``adapters`` (``EngineConfig.adapters``) that registers the fake.
FAKE_ADAPTERS = {"fake": "harness.fake_models:FakeLoader"}
# Where ``harness`` is imported from: on a server process's PYTHONPATH.
BENCHMARKS_DIR = Path(__file__).resolve().parents[1]


def fake_adapter_args() -> list[str]:
    """``tessera serve`` (or ``cluster``) options that register the fake."""
    return [a for name, target in FAKE_ADAPTERS.items() for a in ("--adapter", f"{name}={target}")]


def harness_pythonpath(environ: Mapping[str, str] = os.environ) -> str:
    """``environ``'s PYTHONPATH with ``benchmarks/`` first, for a server process
    that serves fake models."""
    first = str(BENCHMARKS_DIR)
    rest = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != first]
    return os.pathsep.join([first, *rest])


FAKE_DIMS = 8
# A text whose row a fake head of ``fail_head`` raises on (``FakeHeadModel``).
HEAD_POISON = "poison-head"


def _text_of(item: object) -> str:
    """An item's text: a chat's, its prompt and its messages' contents."""
    if isinstance(item, ChatInput):
        return "\n".join([item.prompt or "", *(m.content for m in item.messages)])
    text = getattr(item, "text", "")
    return text if isinstance(text, str) else ""


def fake_embedding(text: str) -> np.ndarray[Any, np.dtype[np.float32]]:
    """A deterministic unit vector for ``text``."""
    seed = zlib.crc32(text.encode())
    vector = np.random.default_rng(seed).standard_normal(FAKE_DIMS).astype(np.float32)
    return vector / np.linalg.norm(vector)


def fake_output(item: object, *, word_s: float = 0.0, stop: StopFlag | None = None) -> object:
    """The fake answer to one item, by its task (a chat echoes its last message
    word by word, ``word_s`` each, a step boundary between words, until
    ``stop`` is set)."""
    match item:
        case TextInput(text=text):
            return fake_embedding(text)
        case RerankInput(query=query, document=document):
            return float(fake_embedding(query) @ fake_embedding(document))
        case TranslateInput(text=text):
            return text[::-1]
        case SpeechInput(text=text):
            return SpeechOutput(np.zeros(len(text) * 100, dtype=np.int16), 22050)
        case OcrInput(image=image):
            height, width = image.shape[:2]
            box = (
                (0.0, 0.0),
                (float(width), 0.0),
                (float(width), float(height)),
                (0.0, float(height)),
            )
            return OcrOutput((OcrLine(f"{width}x{height}", 1.0, box),))
        case ChatInput(messages=messages, on_text=on_text, prompt=prompt):
            refuse_engine_only(item, "a fake model")
            words: list[str] = []
            said = prompt if prompt is not None else messages[-1].content
            for word in said.split():
                if words:
                    step_boundary()
                if stop is not None and stop.is_set():
                    break
                time.sleep(word_s)
                words.append(word)
                if on_text is not None:
                    on_text(word + " ")
            text = " ".join(words) + " "
            return ChatOutput(text, len(messages) if prompt is None else 1, len(words), "stop")
    raise TypeError(f"fake model cannot answer {type(item).__name__}")


def fake_classify(text: str) -> ClassifyOutput:
    return ClassifyOutput((LabelScore(f"label-{len(text) % 3}", 0.9), LabelScore("other", 0.1)))


class FakeComponent:
    """A shared component that can follow its holders into the host tier."""

    def __init__(self, num_bytes: int) -> None:
        self.num_bytes = num_bytes
        self.offloaded = False

    def offload(self) -> Footprint:
        self.offloaded = True
        return Footprint(self.num_bytes, method="fake host copy")

    def restore(self) -> None:
        self.offloaded = False


def _component(num_bytes: int) -> tuple[FakeComponent, int]:
    return FakeComponent(num_bytes), num_bytes


class FakeModel:
    def __init__(self, spec: ModelSpec, ctx: LoadContext | None = None) -> None:
        self.spec = spec
        self._ctx = ctx
        self.num_batches = 0
        self.unloaded = False
        self.offloaded = False  # waiting in the host tier
        self._lock = threading.Lock()
        self._shared: dict[str, int] = dict(spec.options.get("shared", {}))
        if ctx is not None:
            for key, num_bytes in self._shared.items():
                ctx.shared.acquire(key, functools.partial(_component, num_bytes))

    @property
    def stacks_across_models(self) -> bool:
        return bool(self.spec.options.get("stack"))

    def run(self, items: Sequence[Any]) -> list[Any]:
        stack = int(self.spec.options.get("stack", 0))
        stops = item_stops(len(items))  # this thread's: a round may run it in another
        options = self.spec.options
        if stack:
            device = _DeviceModel(
                int(options.get("round_host_calls", options.get("host_calls", 0))),
                float(options.get("round_device_s", options.get("device_s", 0.0))),
            )
            call = functools.partial(self._run, items, stops)
            outputs: list[Any] = _rounds(stack, device).submit(call)
            return outputs
        _DeviceModel(int(options.get("host_calls", 0)), float(options.get("device_s", 0.0))).run()
        return self._run(items, stops)

    def _run(self, items: Sequence[Any], stops: Sequence[StopFlag]) -> list[Any]:
        if self.offloaded:
            raise ModelUnavailableError(self.spec.name, "the model waits in the host tier")
        with self._lock:
            self.num_batches += 1
        per_unit = int(self.spec.options.get("scratch_bytes_per_unit", 0))
        units = [work_units(i, self.spec.inputs) for i in items]
        if self.spec.options.get("items_alone"):
            for one in units:  # each item's scratch, freed before the next one's
                _touch(per_unit * math.ceil(one))
            scratch = bytearray()
        else:
            scratch = _touch(per_unit * math.ceil(sum(units)))
        run_s = float(self.spec.options.get("run_s", 0.0))
        run_s += float(self.spec.options.get("unit_s", 0.0)) * sum(units)
        if run_s:  # a failure below comes at the end of the run, as a real one may
            time.sleep(run_s)
        if self.spec.options.get("fail_run"):
            raise RuntimeError("fake model failure")
        crash = self.spec.options.get("abort_on")
        if crash and any(crash in getattr(item, "text", "") for item in items):
            os.abort()
        marker = self.spec.options.get("fail_on")
        if marker and any(marker in _text_of(item) for item in items):
            raise RuntimeError(f"fake model failure on an input holding {marker!r}")
        max_chars = self.spec.options.get("max_batch_chars")
        num_chars = sum(len(getattr(item, "text", "")) for item in items)
        if max_chars is not None and num_chars > int(max_chars):
            raise MemoryError(f"fake model out of memory: {num_chars} characters > {max_chars}")
        del scratch
        if self.spec.task is Task.CLASSIFY:
            return [fake_classify(item.text) for item in items]
        word_s = float(self.spec.options.get("word_s", 0.0))
        outputs = [
            fake_output(item, word_s=word_s, stop=stop)
            for item, stop in zip(items, stops, strict=True)
        ]
        scale = float(self.spec.options.get("scale", 1.0))
        if scale != 1.0 and self.spec.task is Task.EMBEDDING:
            outputs = [np.asarray(output) * np.float32(scale) for output in outputs]
        nan_on = self.spec.options.get("nan_on")
        if nan_on is not None:
            outputs = [
                _nan_like(output) if nan_on in _text_of(item) else output
                for item, output in zip(items, outputs, strict=True)
            ]
        return outputs

    def memory(self) -> Footprint:
        return Footprint(
            own_bytes=int(self.spec.options.get("own_bytes", 0)),
            shared_bytes=dict(self._shared),
            method="fake",
        )

    def unload(self) -> None:
        self.unloaded = True
        if self._ctx is not None:
            for key in self._shared:
                self._ctx.shared.release(key, parked=self.offloaded)


# The process's one device (option device_s): a batch's or a round's time on it.
_DEVICE = threading.Lock()


@dataclass(frozen=True)
class _DeviceModel:
    """What a batch, or a stacked round, costs as on a GPU (options
    ``host_calls``, ``device_s``): its launch, calls that each hand the
    interpreter lock to a thread waiting for it, as a torch call does (on the
    H200 a thread's batch waited for the lock at each of them while the
    engine's loop ran); then waiting for its time on the one device. Nothing
    where both are zero."""

    host_calls: int = 0
    device_s: float = 0.0

    def run(self) -> None:
        self.launch()
        self.wait()

    def launch(self) -> None:
        for _ in range(self.host_calls):
            time.sleep(0)

    def wait(self) -> None:
        if self.device_s:
            with _DEVICE:
                time.sleep(self.device_s)


_ROUNDS: dict[tuple[int, _DeviceModel], Rendezvous[Callable[[], list[Any]]]] = {}
_ROUNDS_LOCK = threading.Lock()


def _rounds(max_calls: int, device: _DeviceModel) -> Rendezvous[Callable[[], list[Any]]]:
    """The process's rounds of fake batches of up to ``max_calls`` (option
    ``stack``), each costing ``device`` once."""
    with _ROUNDS_LOCK:
        key = (max_calls, device)
        rounds = _ROUNDS.get(key)
        if rounds is None:
            rounds = _ROUNDS[key] = Rendezvous(max_calls, functools.partial(_run_round, device))
        return rounds


def _run_round(
    device: _DeviceModel, calls: list[Callable[[], list[Any]]]
) -> Callable[[], list[Any]]:
    device.launch()
    results = [call() for call in calls]
    if len(calls) > 1:
        count_round(len(calls))

    def finish() -> list[Any]:  # after the lead is handed on, as a real round's wait
        device.wait()
        return results

    return finish


# A device's copy streams, one each way (offload_s, restore_s).
_COPY_OUT = threading.Lock()
_COPY_BACK = threading.Lock()


class FakeOffloadingModel(FakeModel):
    """A fake model that can wait in the host tier (option ``host_tier``)."""

    def offload(self) -> Footprint | None:
        """Into the host tier, its shared components parked with it (they move
        once no holder is left on the device)."""
        if self.offloaded:
            return None
        if self._ctx is not None:
            parked = [key for key in self._shared if self._ctx.shared.park(key)]
            if len(parked) < len(self._shared):
                for key in parked:
                    self._ctx.shared.unpark(key)
                return None
        self._copy(_COPY_OUT, float(self.spec.options.get("offload_s", 0.0)))
        self.offloaded = True
        own = int(self.spec.options.get("host_bytes", self.spec.options.get("own_bytes", 0)))
        return Footprint(own, dict(self._shared), method="fake host copy")

    def restore(self) -> None:
        if self.spec.options.get("fail_restore"):
            raise RuntimeError("fake restore failure")
        self._copy(_COPY_BACK, float(self.spec.options.get("restore_s", 0.0)))
        if self._ctx is not None:
            for key in self._shared:
                self._ctx.shared.unpark(key)
        self.offloaded = False

    def _copy(self, stream: threading.Lock, seconds: float) -> None:
        """A copy of ``seconds`` on one of the device's copy streams, after the
        calls that launch it (options ``copy_calls``); none where it takes 0 s."""
        if not seconds:
            return
        for _ in range(int(self.spec.options.get("copy_calls", 0))):
            time.sleep(0)
        with stream:
            time.sleep(seconds)


def _touch(num_bytes: int) -> bytearray:
    """``num_bytes`` filled, so that every page is resident (a zeroed one may
    be left unmapped)."""
    return bytearray(b"\x01") * num_bytes


class FakeLoader:
    """The ``fake`` adapter."""

    def estimate_bytes(self, spec: ModelSpec) -> int:
        return int(spec.options.get("estimate_bytes", spec.options.get("own_bytes", 0)))

    def shared_keys(self, spec: ModelSpec) -> tuple[str, ...]:
        return tuple(spec.options.get("shared", {}))

    def alone_units(self, spec: ModelSpec, item: object) -> float | None:
        return work_units(item, spec.inputs) if spec.options.get("items_alone") else None

    def stage_key(self, spec: ModelSpec, device: object = None) -> str | None:
        return fake_stage_key(spec)

    def load(self, spec: ModelSpec, ctx: LoadContext) -> FakeModel:
        load_s = float(spec.options.get("load_s", 0.0))
        if load_s:
            time.sleep(load_s)
        if spec.options.get("fail_load"):
            raise ModelUnavailableError(spec.name, "fake load failure")
        return make_fake_model(spec, ctx)


def make_fake_model(spec: ModelSpec, ctx: LoadContext | None = None) -> FakeModel:
    """The fake model of ``spec``: one that can wait in the host tier if its
    options say ``host_tier``, a head model if they say ``stage``."""
    if spec.options.get("host_tier"):
        return FakeOffloadingModel(spec, ctx)
    if spec.options.get("stage"):
        return FakeHeadModel(spec, ctx)
    return FakeModel(spec, ctx)


def fake_stage_key(spec: ModelSpec) -> str | None:
    """The stage key of a fake head model (option ``stage``), else None."""
    stage = spec.options.get("stage")
    return f"fake-stage:{stage}" if stage else None


class FakeHeadModel(FakeModel):
    """A fake head model (``runtimes.base.EncoderHead``, option ``stage``):
    its first stage's rows are the fake embeddings of the texts and a last
    column, 1 for a text holding ``HEAD_POISON``; its head answers each row
    with one label, the model's name, scored by the row (and raises on a
    poisoned row where the options say ``fail_head``)."""

    @property
    def stage_key(self) -> str:
        key = fake_stage_key(self.spec)
        assert key is not None  # made only for a spec with a stage
        return key

    def vectors(self, items: Sequence[Any]) -> np.ndarray[Any, np.dtype[np.float32]]:
        """The first stage of ``items``, as a fake batch runs (its time, its failures)."""
        options = self.spec.options
        with self._lock:
            self.num_batches += 1
        units = sum(work_units(item, self.spec.inputs) for item in items)
        run_s = float(options.get("run_s", 0.0)) + float(options.get("unit_s", 0.0)) * units
        if run_s:
            time.sleep(run_s)
        marker = options.get("fail_on")
        if marker and any(marker in _text_of(item) for item in items):
            raise RuntimeError(f"fake model failure on an input holding {marker!r}")
        texts = [_text_of(item) for item in items]
        poisoned = np.array([[float(HEAD_POISON in t)] for t in texts], dtype=np.float32)
        return np.hstack([np.stack([fake_embedding(t) for t in texts]), poisoned])

    def head(self, vectors: np.ndarray[Any, np.dtype[np.float32]]) -> list[Any]:
        if self.spec.options.get("fail_head") and vectors[:, -1].any():
            raise RuntimeError(f"fake head failure of {self.spec.name}")
        return [
            ClassifyOutput((LabelScore(self.spec.name, float(abs(row[0]))),)) for row in vectors
        ]

    def run(self, items: Sequence[Any]) -> list[Any]:
        if not items:
            return []
        return self.head(self.vectors(items))


def _nan_like(output: Any) -> Any:
    """``output`` with its numbers NaN (an embedding's, a score)."""
    if isinstance(output, np.ndarray):
        return np.full_like(output, np.nan, dtype=np.float32)
    if isinstance(output, float):
        return math.nan
    return output
