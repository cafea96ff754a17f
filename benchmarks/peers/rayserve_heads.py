"""Ray Serve serving many classifier heads over one MiniLM encoder, two ways.

    python rayserve_heads.py --model-dir ROOT --port N --models a[,b,...] --threads T \
        --ray-port P --temp-dir DIR --events FILE --mode whole|expert \
        [--replicas R] [--models-per-replica M] [--max-batch B] [--delay-ms D]

ROOT is a head set (``harness.heads``): ``ROOT/heads.json`` names the encoder's
folder, ``ROOT/NAME`` holds head NAME (``head.safetensors``: ``weight``,
labels x 384, and ``bias``; ``labels.json``). Each answer is what tessera's
``encoder-head`` adapter answers: the encoder as tessera's hf-encoder (mean
pooling, L2 normalisation, 256 word pieces, float32 on the CPU), logits
``vector @ weight.T + bias``, a softmax, the 3 best labels.
``POST /classify`` with ``{"input": "..."}`` and the
``serve_multiplexed_model_id`` header naming the head answers
``{"labels": [{"label": ..., "score": ...}, ...]}``.

``--mode whole``: every head a whole model, as a service of separate models
is written with Ray Serve: one deployment of R replicas whose
``@serve.multiplexed(max_num_models_per_replica=M)`` loads NAME's encoder and
head together on its first request (beyond M, the least recently used goes).
No batching: ``@serve.batch`` does not group requests by model.

``--mode expert``: Ray Serve's way for a shared base (model composition): an
``Encoder`` deployment holds the encoder once and batches its calls
(``@serve.batch``, at most B texts, D ms of wait), and a multiplexed ingress
looks the heads up (``@serve.multiplexed``, every head kept: each is a few
KiB), sends the text to the encoder's handle and applies the head to the
vector.

Ray runs as a local cluster this process starts and owns (its GCS on port P,
its files under DIR, no dashboard, no usage reports); SIGTERM shuts Serve
and Ray down. Every load (a model, or a head) appends a JSON line to FILE.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from minilm import MiniLM, common_args, model_names, offline

SCRIPTS = str(Path(__file__).resolve().parent)
TOP_K = 3


def record(events: str, model: str, load_s: float) -> None:
    """One load, as a JSON line appended to ``events`` (short: an atomic append)."""
    with open(events, "a", encoding="utf-8") as f:
        f.write(json.dumps({"model": model, "load_s": load_s, "pid": os.getpid()}) + "\n")


class Head:
    """A linear head: its weight, bias and labels, read without pickle."""

    def __init__(self, folder: str) -> None:
        from safetensors.numpy import load_file

        tensors = load_file(os.path.join(folder, "head.safetensors"))
        self.weight, self.bias = tensors["weight"], tensors["bias"]
        with open(os.path.join(folder, "labels.json"), encoding="utf-8") as f:
            self.labels: list[str] = json.load(f)

    def labels_of(self, vector: Any) -> list[dict[str, Any]]:
        """The ``TOP_K`` best labels of one vector, by softmax probability."""
        import numpy as np

        logits = np.asarray(vector, dtype=np.float32) @ self.weight.T + self.bias
        shifted = np.exp(logits.astype(np.float64) - logits.max())
        scores = shifted / shifted.sum()
        best = np.argsort(-scores, kind="stable")[:TOP_K]
        return [{"label": self.labels[i], "score": float(scores[i])} for i in best]


def encoder_dir(model_dir: str) -> str:
    with open(os.path.join(model_dir, "heads.json"), encoding="utf-8") as f:
        return str(json.load(f)["encoder"])


def build_whole(args: Any, threads: int) -> Any:
    """One deployment; each replica multiplexes whole models (encoder and head)."""
    from ray import serve
    from starlette.requests import Request

    model_dir, events, encoder = args.model_dir, args.events, encoder_dir(args.model_dir)

    @serve.deployment(num_replicas=args.replicas, ray_actor_options={"num_cpus": 0})
    class Classifier:
        def __init__(self) -> None:
            import torch

            torch.set_num_threads(threads)

        @serve.multiplexed(max_num_models_per_replica=args.models_per_replica)
        async def get_model(self, model_id: str) -> tuple[MiniLM, Head]:
            began = time.perf_counter()
            loaded = MiniLM(encoder, threads), Head(os.path.join(model_dir, model_id))
            record(events, model_id, time.perf_counter() - began)
            return loaded

        async def __call__(self, request: Request) -> dict[str, Any]:
            model, head = await self.get_model(serve.get_multiplexed_model_id())
            body = await request.json()
            return {"labels": head.labels_of(model.encode([str(body["input"])])[0].numpy())}

    return Classifier.bind()


def build_expert(args: Any, threads: int) -> Any:
    """An encoder deployment, batched, behind an ingress that multiplexes heads."""
    from ray import serve
    from starlette.requests import Request

    model_dir, events, encoder = args.model_dir, args.events, encoder_dir(args.model_dir)
    max_batch, wait_s = args.max_batch, args.delay_ms / 1000

    @serve.deployment(num_replicas=args.replicas, ray_actor_options={"num_cpus": 0})
    class Encoder:
        def __init__(self) -> None:
            self.model = MiniLM(encoder, threads)

        @serve.batch(max_batch_size=max_batch, batch_wait_timeout_s=wait_s)
        async def encode(self, texts: list[str]) -> list[list[float]]:
            return self.model.encode_lists(texts)

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Ingress:
        def __init__(self, encoder_handle: Any) -> None:
            self.encoder = encoder_handle

        @serve.multiplexed(max_num_models_per_replica=len(model_names(args.models)))
        async def get_head(self, model_id: str) -> Head:
            began = time.perf_counter()
            head = Head(os.path.join(model_dir, model_id))
            record(events, model_id, time.perf_counter() - began)
            return head

        async def __call__(self, request: Request) -> dict[str, Any]:
            head = await self.get_head(serve.get_multiplexed_model_id())
            body = await request.json()
            vector = await self.encoder.encode.remote(str(body["input"]))
            return {"labels": head.labels_of(vector)}

    return Ingress.bind(Encoder.bind())


def main() -> None:
    parser = common_args(__doc__ or "")
    parser.add_argument("--ray-port", type=int, required=True, help="the GCS port")
    parser.add_argument("--temp-dir", required=True, help="Ray's session files")
    parser.add_argument("--events", required=True, help="a JSON line per load")
    parser.add_argument("--mode", choices=("whole", "expert"), required=True)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--models-per-replica", type=int, default=20)
    args = parser.parse_args()
    model_names(args.models)  # the names are checked; replicas load them on demand
    offline()
    # The replicas' workers inherit this process's environment: they find minilm.py,
    # and Ray's GCS listens where it is told.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [SCRIPTS, os.environ.get("PYTHONPATH")])
    )
    os.environ["RAY_GCS_SERVER_PORT"] = str(args.ray_port)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray
    from ray import serve

    ray.init(
        include_dashboard=False,
        _temp_dir=args.temp_dir,
        logging_level="WARNING",
        _node_ip_address="127.0.0.1",
    )

    def stop(signum: int, frame: object) -> None:
        serve.shutdown()
        ray.shutdown()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    threads = max(1, args.threads // args.replicas)
    build = build_whole if args.mode == "whole" else build_expert
    serve.run(build(args, threads), name="classify", route_prefix="/classify")
    print(f"serving on 127.0.0.1:{args.port}, GCS on {args.ray_port}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
