"""``isolation: process``: models in worker processes of their own, loaded with
``IsolatedLoader`` outside the engine: answers as inline (large arrays through
shared memory), an ``os.abort()``, a hang and a leak that end only the worker,
unloading that ends it, a real native model (bergamot) answering as inline, and
a worker loading with the server's cache folder."""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from multiprocessing import Pipe
from pathlib import Path

import numpy as np
import psutil
import pytest

from builders import make_spec
from harness.fake_models import FAKE_ADAPTERS, FakeModel
from tessera.errors import ModelUnavailableError
from tessera.repository import read_spec
from tessera.repository.spec import ModelSpec
from tessera.runtimes.base import standalone_context
from tessera.runtimes.isolated import (
    MPS_CONTROL,
    SHM_MIN_BYTES,
    IsolatedLoader,
    IsolatedModel,
    _WorkerArgs,
    worker_main,
)
from tessera.runtimes.registry import get_loader
from tessera.tasks.samples import sample_page
from tessera.tasks.types import OcrInput, SpeechInput, Task, TextInput, TranslateInput

MODELS = Path(__file__).resolve().parents[3] / "src" / "tessera" / "models"
SHM = Path("/dev/shm")


def isolated(spec: ModelSpec) -> IsolatedModel:
    spec = dataclasses.replace(spec, isolation="process")
    return IsolatedLoader(spec.adapter, FAKE_ADAPTERS).load(spec, standalone_context())


def gone(pid: int) -> bool:
    """Whether the worker has ended (the model reaps its workers as they end)."""
    return not psutil.pid_exists(pid)


def shm_blocks() -> set[str]:
    return {p.name for p in SHM.glob("psm_*")} if SHM.exists() else set()


def test_worker_answers_as_inline_with_large_arrays_through_shared_memory() -> None:
    speech = make_spec("speech", task=Task.TTS)
    ocr = make_spec("ocr", task=Task.OCR)
    page = np.random.default_rng(0).integers(0, 255, (600, 800, 3), dtype=np.uint8)
    texts = ["short", "long " * 200]  # the long one's audio is over SHM_MIN_BYTES
    before = shm_blocks()
    speaker, reader = isolated(speech), isolated(ocr)
    try:
        audio = speaker.run([SpeechInput(t) for t in texts])
        inline = FakeModel(speech).run([SpeechInput(t) for t in texts])
        assert audio[1].samples.nbytes >= SHM_MIN_BYTES > audio[0].samples.nbytes
        for got, want in zip(audio, inline, strict=True):
            np.testing.assert_array_equal(got.samples, want.samples)
            assert got.sample_rate == want.sample_rate
        assert page.nbytes >= SHM_MIN_BYTES
        assert reader.run([OcrInput(page)]) == FakeModel(ocr).run([OcrInput(page)])
        assert speaker.memory().method == "worker process rss"
        assert speaker.memory().own_bytes > 0
    finally:
        speaker.unload()
        reader.unload()
    assert shm_blocks() <= before  # every block was unlinked


def test_abort_fails_only_its_batch_with_retry_after_and_a_new_worker_serves() -> None:
    model = isolated(make_spec("crashy", abort_on="CRASH"))
    try:
        assert len(model.run([TextInput("fine")])) == 1
        first = model.pid
        assert first is not None
        with pytest.raises(ModelUnavailableError, match="SIGABRT") as caught:
            model.run([TextInput("fine too"), TextInput("CRASH here")])
        assert caught.value.retry_after_s is not None
        assert caught.value.retry_after_s >= 1
        assert gone(first)
        (output,) = model.run([TextInput("again")])  # a first crash: no backoff
        assert model.pid not in (None, first)
        (want,) = FakeModel(make_spec("x")).run([TextInput("again")])
        np.testing.assert_array_equal(output, want)
        assert model.engine_metrics()["restarts"] == 1
    finally:
        model.unload()


def test_a_hung_batch_kills_its_worker() -> None:
    model = isolated(make_spec("slow", run_s=60, run_timeout_s=0.5))
    try:
        pid = model.pid
        assert pid is not None
        with pytest.raises(ModelUnavailableError, match="hung"):
            model.run([TextInput("x")])
        assert gone(pid)
    finally:
        model.unload()


def test_a_worker_past_max_bytes_is_ended_after_its_batch() -> None:
    model = isolated(make_spec("leaky", max_bytes=1024))  # any interpreter is larger
    try:
        pid = model.pid
        assert pid is not None
        assert len(model.run([TextInput("x")])) == 1  # the answer is kept
        assert gone(pid)
        assert model.pid is None
        assert len(model.run([TextInput("y")])) == 1  # and the next batch restarts it
    finally:
        model.unload()


def test_load_failure_is_unavailable_and_unload_ends_the_worker() -> None:
    with pytest.raises(ModelUnavailableError, match="fake load failure"):
        isolated(make_spec("broken", fail_load=True))
    model = isolated(make_spec("fine"))
    pid = model.pid
    assert pid is not None
    model.unload()
    assert gone(pid)
    with pytest.raises(ModelUnavailableError, match="unloaded"):
        model.run([TextInput("x")])


def fake_mps_control(folder: Path, *, lists_children: bool) -> None:
    """A stand-in ``nvidia-cuda-mps-control`` on the PATH: one MPS server, 4242,
    whose clients are the children of the process that asks (the worker is one)
    if ``lists_children``, else one unrelated pid."""
    script = folder / MPS_CONTROL
    script.write_text(
        f"#!{sys.executable}\n"
        "import os, sys, psutil\n"
        "command = sys.stdin.readline().split()\n"
        "if command == ['get_server_list']:\n"
        "    print(4242)\n"
        "elif command == ['get_client_list', '4242']:\n"
        f"    if {lists_children}:\n"
        "        print(*(c.pid for c in psutil.Process(os.getppid()).children()))\n"
        "    else:\n"
        "        print(1)\n"
        "else:\n"
        "    sys.exit(1)\n"
    )
    script.chmod(0o755)


@pytest.mark.parametrize(
    ("control", "client"), [("lists the worker", 1.0), ("lists others", 0.0), ("none", None)]
)
def test_mps_share_is_reported_and_verified_against_the_daemon(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    control: str,
    client: float | None,
) -> None:
    if control != "none":
        fake_mps_control(tmp_path, lists_children=control == "lists the worker")
    monkeypatch.setenv("PATH", f"{tmp_path}:/nonexistent")  # no real daemon either way
    spec = dataclasses.replace(make_spec("mps"), mps_active_thread_percentage=30)
    model = isolated(spec)
    try:
        metrics = model.engine_metrics()
        assert metrics["mps_active_thread_percentage"] == 30
        assert metrics["worker_pid"] == model.pid != os.getpid()
        assert metrics.get("mps_client") == client
    finally:
        model.unload()
    warned = "asks for an MPS share" in caplog.text
    assert warned == (client != 1.0)


def test_the_worker_sets_its_mps_share_in_its_environment_before_its_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker's own function, run here on a thread: CUDA reads the variable
    when it starts, so it must be in the environment once the model has loaded."""
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100")  # restored after
    spec = dataclasses.replace(make_spec("mps"), runtime="onnx")  # leaves torch's threads be
    server, worker = Pipe()
    thread = threading.Thread(
        target=worker_main, args=(worker, _WorkerArgs(spec, "cpu", 1, 30, adapters=FAKE_ADAPTERS))
    )
    thread.start()
    try:
        assert server.poll(30), "the worker did not answer its load"
        server.recv_bytes()  # its load's reply
        assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    finally:
        server.close()  # the worker sees the pipe end and returns
        thread.join(timeout=30)
    assert not thread.is_alive()


@pytest.mark.slow
def test_bergamot_in_a_worker_answers_as_inline() -> None:
    spec = read_spec(MODELS / "bergamot-en-pt")
    items = [TranslateInput(t) for t in ("Good morning.", "Where is the station?", "Thank you!")]
    inline = get_loader(spec.adapter).load(spec, standalone_context())
    try:
        want = inline.run(items)
    finally:
        inline.unload()
    model = isolated(spec)
    try:
        assert model.run(items) == want
    finally:
        model.unload()


@pytest.mark.slow
def test_a_worker_loads_with_the_servers_cache_folder(tmp_path: Path) -> None:
    spec = dataclasses.replace(read_spec(MODELS / "pp-ocrv6"), isolation="process")
    ctx = dataclasses.replace(standalone_context(), cache_dir=tmp_path, warm_up=False)
    model = IsolatedLoader(spec.adapter).load(spec, ctx)
    try:
        (output,) = model.run([OcrInput(sample_page())])
        assert output.lines
    finally:
        model.unload()
    # The worker made its three optimised graphs there, for every later load.
    assert len(list((tmp_path / "onnx-optimized").glob("*.onnx"))) == 3
