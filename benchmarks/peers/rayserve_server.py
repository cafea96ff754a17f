"""Ray Serve serving many MiniLM-class models by model multiplexing.

    python rayserve_server.py --model-dir ROOT --port N --models a[,b,...] --threads T \
        --ray-port P --temp-dir DIR --events FILE [--replicas R] [--models-per-replica M]

One deployment of R replicas; each loads model NAME from ROOT/NAME on its first
request for it (``@serve.multiplexed(max_num_models_per_replica=M)``: beyond M,
the least recently used is dropped) with transformers' AutoModel, and embeds
one sentence a request as tessera's hf-encoder does (mean pooling, L2
normalisation, 256 word pieces, float32 on the CPU). Serve's proxy routes a
request by its ``serve_multiplexed_model_id`` header to a replica that holds
the model where one does: ``POST /embed`` with ``{"input": "..."}`` answers
``{"embedding": [384 floats]}``. No batching: Serve's ``@serve.batch`` does not
group requests by model. Each replica has T // R torch threads (at least one).

Ray runs here as a local cluster this process starts and owns: its GCS on port
P, its files under DIR, no dashboard, no usage reports; SIGTERM shuts Serve
and Ray down. Every load appends a JSON line (model, seconds, replica's PID)
to FILE, which the benchmark reads for its load count and swap-in times.
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
MODEL_ID_HEADER = "serve_multiplexed_model_id"


def record(events: str, model: str, load_s: float) -> None:
    """One load, as a JSON line appended to ``events`` (short: an atomic append)."""
    with open(events, "a", encoding="utf-8") as f:
        f.write(json.dumps({"model": model, "load_s": load_s, "pid": os.getpid()}) + "\n")


def build(model_dir: str, threads: int, events: str, replicas: int, per_replica: int) -> Any:
    from ray import serve
    from starlette.requests import Request

    @serve.deployment(num_replicas=replicas, ray_actor_options={"num_cpus": 0})
    class Embedder:
        def __init__(self) -> None:
            import torch

            torch.set_num_threads(threads)

        @serve.multiplexed(max_num_models_per_replica=per_replica)
        async def get_model(self, model_id: str) -> MiniLM:
            began = time.perf_counter()
            model = MiniLM(os.path.join(model_dir, model_id), threads)
            record(events, model_id, time.perf_counter() - began)
            return model

        async def __call__(self, request: Request) -> dict[str, list[float]]:
            model = await self.get_model(serve.get_multiplexed_model_id())
            body = await request.json()
            return {"embedding": model.encode_lists([str(body["input"])])[0]}

    return Embedder.bind()


def main() -> None:
    parser = common_args(__doc__ or "")
    parser.add_argument("--ray-port", type=int, required=True, help="the GCS port")
    parser.add_argument("--temp-dir", required=True, help="Ray's session files")
    parser.add_argument("--events", required=True, help="a JSON line per model load")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--models-per-replica", type=int, default=20)
    args = parser.parse_args()
    model_names(args.models)  # the names are checked; each replica loads them on demand
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
    app = build(args.model_dir, threads, args.events, args.replicas, args.models_per_replica)
    serve.run(app, name="embed", route_prefix="/embed")
    print(f"serving on 127.0.0.1:{args.port}, GCS on {args.ray_port}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
