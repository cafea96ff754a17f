"""The peer servers a benchmark compares tessera with, serving the same MiniLM weights.

Each peer lives in a venv of its own under :func:`peers_dir` (installed by
``scripts/bench-peers.sh``, i.e. ``make bench-peers``) and runs a script from
``benchmarks/peers/`` (or its own CLI) with the weights folder it is given.
Every peer computes what tessera's ``hf-encoder`` adapter does: mean pooling
over the attention mask, L2 normalisation, inputs truncated at 256 word
pieces, float32 on the CPU, 384 floats out; each with its documented dynamic
batching at a max batch of 32 and a few milliseconds' delay.

Several model names (the multi-model form) are served the peer's natural way:
PyTriton binds one model per name in one Triton; TorchServe registers one
model per name, each with its own workers; Infinity serves every name from one
process (one ``--model-id`` and ``--served-model-name`` each); LitServe runs one
LitAPI per name, each on its own route with its own workers.

Ray Serve serves many distinct models (``model_dir/NAME`` each) by model
multiplexing: replicas that load models on demand, routed by a header; and
(``rayserve-heads``) many classifier heads over one encoder, as whole models
multiplexed or as an encoder deployment behind a multiplexed ingress.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx

from harness.servers import RunningServer, free_port, running_process


def peers_dir() -> Path:
    """Where ``make bench-peers`` installs the peers: ``$TESSERA_PEERS_DIR`` or
    ``~/.cache/tessera/peers``."""
    return Path(os.environ.get("TESSERA_PEERS_DIR") or Path.home() / ".cache/tessera/peers")


SCRIPTS_DIR = Path(__file__).resolve().parents[1] / "peers"  # benchmarks/peers/
STAMP = ".tessera-peer"  # written by scripts/bench-peers.sh once a venv is complete
DIM = 384
MAX_BATCH = 32
DELAY_MS = 5.0
READY_REQUEST_TIMEOUT_S = 30.0
# Nothing may reach a hub, and no peer may report usage anywhere.
PEER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
    "INFINITY_ANONYMOUS_USAGE_STATS": "0",
    "PYTHONUNBUFFERED": "1",
}


def _vector(value: Any) -> list[float] | None:
    """``value`` when it is a list of 384 numbers, else None."""
    if not isinstance(value, list) or len(value) != DIM:
        return None
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
        return None
    return [float(x) for x in value]


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


@dataclass(frozen=True)
class Launch:
    """One start of a peer: where it lives, what it serves, on which port."""

    peers_dir: Path
    work: Path
    model_dir: Path
    models: list[str]
    threads: int
    port: int
    args: tuple[str, ...] = ()  # the configuration's, for the peer's script


@dataclass(frozen=True)
class Peer:
    """One peer server: how to install-check, start, and call it."""

    name: str
    package: str  # the distribution whose version the report prints
    process_per_worker: bool  # each worker a process with its own weights

    def venv(self, peers_dir: Path) -> Path:
        return peers_dir / self.name

    def python(self, peers_dir: Path) -> Path:
        return self.venv(peers_dir) / "bin" / "python"

    def installed(self, peers_dir: Path) -> bool:
        """Its venv exists and the installer finished it (the stamp file)."""
        venv = self.venv(peers_dir)
        return self.python(peers_dir).exists() and (venv / STAMP).is_file()

    def version(self, peers_dir: Path) -> str:
        """The peer package's version in its venv (read from its metadata)."""
        paths = [str(p) for p in self.venv(peers_dir).glob("lib/python*/site-packages")]
        for dist in metadata.distributions(path=paths):
            if _normalise(dist.metadata["Name"] or "") == _normalise(self.package):
                return str(dist.version)
        raise LookupError(f"{self.package} is not installed in {self.venv(peers_dir)}")

    def default_threads(self, models: int) -> int:
        """Torch threads per process so that all processes together use every core."""
        return 1 if self.process_per_worker else os.cpu_count() or 1

    def workers_per_model(self, models: int, threads: int) -> int:
        """Worker processes per model: enough to fill the cores at ``threads`` each."""
        if not self.process_per_worker:
            return 1
        cores = os.cpu_count() or 1
        return max(1, cores // max(1, threads * models))

    def settings(self, models: list[str], threads: int) -> dict[str, object]:
        """What the report prints about how this peer was run."""
        workers = self.workers_per_model(len(models), threads)
        processes = workers * len(models) if self.process_per_worker else 1
        return {
            "peer": self.name,
            "models": len(models),
            "workers_per_model": workers,
            "processes_with_weights": processes,
            "torch_threads_per_process": threads,
            "torch_threads_total": processes * threads,
            "max_batch_size": MAX_BATCH,
            "max_delay_ms": DELAY_MS,
        }

    def command(self, run: Launch) -> list[str]:
        raise NotImplementedError

    def env(self, peers_dir: Path, threads: int) -> dict[str, str]:
        threads_env = str(threads)
        return {**PEER_ENV, "OMP_NUM_THREADS": threads_env, "MKL_NUM_THREADS": threads_env}

    def embed_call(self, model: str, text: str) -> tuple[str, dict[str, Any]]:
        """POST path and JSON body that embed one sentence with ``model``."""
        raise NotImplementedError

    def model_headers(self, model: str) -> dict[str, str]:
        """Headers a request for ``model`` carries (none but for a header-routed peer)."""
        return {}

    def ready_models(self, models: list[str]) -> list[str]:
        """The names the readiness check embeds: every one, where each is served apart."""
        return models

    def embedding(self, body: bytes) -> list[float] | None:
        """The one vector in a response body, or None when there is none."""
        raise NotImplementedError

    def embed_ok(self, status: int, body: bytes) -> bool:
        """200 and a 384-float vector in the body."""
        return status == 200 and self.embedding(body) is not None

    def _script(self, peers_dir: Path, script: str) -> list[str]:
        path = SCRIPTS_DIR / script
        if not path.is_file():
            raise FileNotFoundError(f"peer script {path} is missing (run from a source checkout)")
        return [str(self.python(peers_dir)), str(path)]

    def _common(self, run: Launch) -> list[str]:
        return [
            *["--model-dir", str(run.model_dir), "--port", str(run.port)],
            *["--models", ",".join(run.models), "--threads", str(run.threads)],
            *["--max-batch", str(MAX_BATCH), "--delay-ms", str(DELAY_MS)],
        ]

    def ready_check(self, base_url: str, models: list[str]) -> Callable[[], bool]:
        """Ready once one real embedding request succeeds for every model name."""

        def ready() -> bool:
            for model in self.ready_models(models):
                path, body = self.embed_call(model, "Is the server ready?")
                response = httpx.post(
                    base_url + path,
                    json=body,
                    headers=self.model_headers(model),
                    timeout=READY_REQUEST_TIMEOUT_S,
                )
                if not self.embed_ok(response.status_code, response.content):
                    return False
            return True

        return ready

    @contextlib.contextmanager
    def serve(
        self,
        peers_dir: Path,
        work: Path,
        model_dir: Path,
        models: list[str],
        threads: int,
        args: tuple[str, ...] = (),
    ) -> Iterator[RunningServer]:
        """Run the peer on a free loopback port until it embeds (``ready_models``); stop it
        on exit. ``args`` go to the peer's script."""
        if not models:
            raise ValueError("serve needs at least one model name")
        if not self.installed(peers_dir):
            raise RuntimeError(f"peer {self.name} is not installed: run `make bench-peers`")
        work.mkdir(parents=True, exist_ok=True)
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        command = self.command(Launch(peers_dir, work, model_dir, models, threads, port, args))
        log_path = _fresh(work / f"peer-{self.name}-{len(models)}m.log")
        ready = self.ready_check(base_url, models)
        env = self.env(peers_dir, threads)
        label = f"{self.name}-{len(models)}m"
        with running_process(label, command, base_url, ready, log_path, env, cwd=work) as server:
            server.extra.update(self.settings(models, threads))
            server.extra["version"] = self.version(peers_dir)
            yield server


class PyTritonPeer(Peer):
    """PyTriton 0.7: Triton's KServe v2 HTTP API over Python callables in one process."""

    def command(self, run: Launch) -> list[str]:
        return [
            *self._script(run.peers_dir, "pytriton_server.py"),
            *self._common(run),
            *["--workspace", str(run.work / f"pytriton-{run.port}")],
        ]

    def env(self, peers_dir: Path, threads: int) -> dict[str, str]:
        env = super().env(peers_dir, threads)
        # Triton's Python backend stub links libpython: it must find the interpreter's
        # own one, not another that the system has (that one crashes it).
        libdir = _interpreter_libdir(self.venv(peers_dir))
        if libdir is not None:
            prior = os.environ.get("LD_LIBRARY_PATH")
            env["LD_LIBRARY_PATH"] = f"{libdir}:{prior}" if prior else str(libdir)
        return env

    def settings(self, models: list[str], threads: int) -> dict[str, object]:
        return {
            **super().settings(models, threads),
            "batching": "Triton dynamic batcher, max_queue_delay 5 ms",
            "layout": "one Triton, one bound model per name, 1 instance each",
        }

    def embed_call(self, model: str, text: str) -> tuple[str, dict[str, Any]]:
        tensor = {"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": [text]}
        return f"/v2/models/{model}/infer", {"inputs": [tensor]}

    def embedding(self, body: bytes) -> list[float] | None:
        answer = _json(body)
        with contextlib.suppress(KeyError, IndexError, TypeError):
            output = answer["outputs"][0]
            if output["shape"] in ([1, DIM], [DIM]):
                return _vector(output["data"])
        return None


class TorchServePeer(Peer):
    """TorchServe 0.12: Java frontend, one Python process per worker."""

    def command(self, run: Launch) -> list[str]:
        workers = self.workers_per_model(len(run.models), run.threads)
        return [
            *self._script(run.peers_dir, "torchserve_server.py"),
            *self._common(run),
            *["--workers", str(workers), "--work", str(run.work / f"torchserve-{run.port}")],
        ]

    def settings(self, models: list[str], threads: int) -> dict[str, object]:
        return {
            **super().settings(models, threads),
            "batching": "TorchServe batchSize 32, maxBatchDelay 5 ms",
            "layout": "one TorchServe, one registered model per name with its own workers",
        }

    def embed_call(self, model: str, text: str) -> tuple[str, dict[str, Any]]:
        return f"/predictions/{model}", {"text": text}

    def embedding(self, body: bytes) -> list[float] | None:
        return _vector(_json(body))


class InfinityPeer(Peer):
    """Infinity 0.0.78: its own ``infinity_emb v2`` CLI, OpenAI-style /embeddings."""

    def command(self, run: Launch) -> list[str]:
        command = [str(self.venv(run.peers_dir) / "bin" / "infinity_emb"), "v2"]
        for model in run.models:
            command += ["--model-id", str(run.model_dir), "--served-model-name", model]
        # Per-model options, given once, apply to every --model-id.
        command += ["--batch-size", str(MAX_BATCH), "--engine", "torch", "--device", "cpu"]
        command += ["--dtype", "float32", "--pooling-method", "mean", "--no-bettertransformer"]
        command += ["--host", "127.0.0.1", "--port", str(run.port)]
        return command

    def settings(self, models: list[str], threads: int) -> dict[str, object]:
        return {
            **super().settings(models, threads),
            # Infinity has no delay knob: it batches what is queued when the model is free.
            "max_delay_ms": None,
            "batching": "Infinity queue, --batch-size 32, no max-delay setting (5 ms poll)",
            "layout": "one process, one --model-id/--served-model-name pair per name",
        }

    def embed_call(self, model: str, text: str) -> tuple[str, dict[str, Any]]:
        return "/embeddings", {"model": model, "input": [text]}

    def embedding(self, body: bytes) -> list[float] | None:
        answer = _json(body)
        with contextlib.suppress(KeyError, IndexError, TypeError):
            return _vector(answer["data"][0]["embedding"])
        return None


class LitServePeer(Peer):
    """LitServe 0.2: a LitAPI per name, inference worker processes, uvicorn front processes."""

    def command(self, run: Launch) -> list[str]:
        workers = self.workers_per_model(len(run.models), run.threads)
        return [
            *self._script(run.peers_dir, "litserve_server.py"),
            *self._common(run),
            *["--workers", str(workers)],
        ]

    def settings(self, models: list[str], threads: int) -> dict[str, object]:
        return {
            **super().settings(models, threads),
            "batching": "LitServe max_batch_size 32, batch_timeout 5 ms",
            "layout": "one LitServer, one LitAPI (route /predict/NAME) per name, own workers",
        }

    def embed_call(self, model: str, text: str) -> tuple[str, dict[str, Any]]:
        return f"/predict/{model}", {"input": text}

    def embedding(self, body: bytes) -> list[float] | None:
        answer = _json(body)
        if not isinstance(answer, dict):
            return None
        return _vector(answer.get("embedding"))


class RayServePeer(Peer):
    """Ray Serve 2.60: one deployment whose replicas multiplex models by a header.

    Its configuration's ``args`` say ``--replicas R --models-per-replica M``;
    Ray's cluster runs on a free GCS port (never Redis's 6379) with its files
    in a temporary folder of its own, removed once it has stopped. Every load
    is a line in ``load_events``: the report's loads and swap-in times.
    """

    def command(self, run: Launch) -> list[str]:
        return [
            *self._script(run.peers_dir, "rayserve_server.py"),
            *self._common(run),
            *["--ray-port", str(free_port()), "--temp-dir", str(_ray_temp(run.port))],
            *["--events", str(self.load_events(run.work, run.port)), *run.args],
        ]

    @staticmethod
    def load_events(work: Path, port: int) -> Path:
        return work / f"rayserve-{port}-loads.jsonl"

    def env(self, peers_dir: Path, threads: int) -> dict[str, str]:
        quiet = {"RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        return {**super().env(peers_dir, threads), **quiet}

    def settings(self, models: list[str], threads: int) -> dict[str, object]:
        return {
            "peer": self.name,
            "models": len(models),
            "torch_threads_total": threads,
            "batching": "none (@serve.batch does not group by model)",
            "layout": "one deployment, @serve.multiplexed replicas, routed by "
            "the serve_multiplexed_model_id header",
        }

    def embed_call(self, model: str, text: str) -> tuple[str, dict[str, Any]]:
        return "/embed", {"input": text}

    def model_headers(self, model: str) -> dict[str, str]:
        return {"serve_multiplexed_model_id": model}

    def ready_models(self, models: list[str]) -> list[str]:
        return models[:1]  # any replica serves any model: one load shows it serves

    def embedding(self, body: bytes) -> list[float] | None:
        answer = _json(body)
        return _vector(answer.get("embedding")) if isinstance(answer, dict) else None

    @contextlib.contextmanager
    def serve(
        self,
        peers_dir: Path,
        work: Path,
        model_dir: Path,
        models: list[str],
        threads: int,
        args: tuple[str, ...] = (),
    ) -> Iterator[RunningServer]:
        """As every peer, and Ray's session folder removed once it has stopped."""
        port: int | None = None
        try:
            with super().serve(peers_dir, work, model_dir, models, threads, args) as server:
                port = int(server.base_url.rsplit(":", 1)[1])
                server.extra["load_events"] = str(self.load_events(work, port))
                server.extra["args"] = " ".join(args)
                yield server
        finally:
            if port is not None:
                shutil.rmtree(_ray_temp(port), ignore_errors=True)


class RayServeHeadsPeer(RayServePeer):
    """Ray Serve 2.60 serving classifier heads over one encoder (a head set,
    ``harness.heads``), as its configuration's ``args`` say: ``--mode
    whole`` (each head a whole model, encoder and head, multiplexed: ``--replicas
    R --models-per-replica M``) or ``--mode expert`` (the encoder once, batched
    with ``@serve.batch``, behind an ingress that multiplexes the heads);
    ``benchmarks/peers/rayserve_heads.py``. Each answer is the head's best
    labels, as tessera's ``encoder-head`` answers."""

    def venv(self, peers_dir: Path) -> Path:
        """Ray Serve's venv (``scripts/bench-peers.sh rayserve``)."""
        return peers_dir / "rayserve"

    def command(self, run: Launch) -> list[str]:
        return [
            *self._script(run.peers_dir, "rayserve_heads.py"),
            *self._common(run),
            *["--ray-port", str(free_port()), "--temp-dir", str(_ray_temp(run.port))],
            *["--events", str(self.load_events(run.work, run.port)), *run.args],
        ]

    def settings(self, models: list[str], threads: int) -> dict[str, object]:
        return {
            "peer": self.name,
            "models": len(models),
            "torch_threads_total": threads,
            "batching": "whole: none (@serve.batch does not group by model); expert: "
            f"@serve.batch on the encoder, max_batch_size {MAX_BATCH}, {DELAY_MS:g} ms",
            "layout": "whole: one deployment, @serve.multiplexed encoder+head per model; "
            "expert: an encoder deployment behind an ingress multiplexing the heads",
        }

    def embed_call(self, model: str, text: str) -> tuple[str, dict[str, Any]]:
        return "/classify", {"input": text}

    def embedding(self, body: bytes) -> list[float] | None:
        return None  # it answers labels, not vectors (``embed_ok``)

    def embed_ok(self, status: int, body: bytes) -> bool:
        """200 and a list of labels, each with a numeric score."""
        answer = _json(body)
        labels = answer.get("labels") if isinstance(answer, dict) else None
        if status != 200 or not isinstance(labels, list) or not labels:
            return False
        return all(
            isinstance(x, dict)
            and isinstance(x.get("label"), str)
            and isinstance(x.get("score"), (int, float))
            for x in labels
        )


def _ray_temp(port: int) -> Path:
    """Ray's session folder: short, as its Unix sockets' paths must be."""
    return Path(tempfile.gettempdir()) / f"tessera-ray-{port}"


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _fresh(path: Path) -> Path:
    """``path``, or ``stem-2.suffix`` and so on where it exists already."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return candidate


def _interpreter_libdir(venv: Path) -> Path | None:
    """The lib folder of the interpreter a venv was made from, where it has libpython."""
    with contextlib.suppress(OSError):
        for line in (venv / "pyvenv.cfg").read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home":
                libdir = Path(value.strip()).parent / "lib"
                if any(libdir.glob("libpython3*.so*")):
                    return libdir
    return None


PEERS: dict[str, Peer] = {
    "pytriton": PyTritonPeer("pytriton", "nvidia-pytriton", process_per_worker=False),
    "torchserve": TorchServePeer("torchserve", "torchserve", process_per_worker=True),
    "infinity": InfinityPeer("infinity", "infinity-emb", process_per_worker=False),
    "litserve": LitServePeer("litserve", "litserve", process_per_worker=True),
    "rayserve": RayServePeer("rayserve", "ray", process_per_worker=False),
    # The same venv as rayserve's (``venv``): another script over it.
    "rayserve-heads": RayServeHeadsPeer("rayserve-heads", "ray", process_per_worker=False),
}
