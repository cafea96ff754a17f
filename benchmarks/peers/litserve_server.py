"""LitServe serving MiniLM: one LitAPI per model name, all in one LitServer.

    python litserve_server.py --model-dir DIR --port N --models a[,b,c] --threads T \
        --workers W [--accelerator cpu|cuda]

Each name is a LitAPI on its own route, ``POST /predict/NAME`` with
``{"input": "..."}`` answering ``{"embedding": [384 floats]}`` (LitServe's
documented way to serve several models from one server: a list of LitAPIs,
each with its ``api_path``). Each API has W inference worker processes on the
CPU, or on each GPU with ``--accelerator cuda`` (``workers_per_device``; the
GPU check's peer, float32 there too), T torch threads each, and LitServe's batching
(``max_batch_size`` 32, ``batch_timeout`` ``--delay-ms``). The HTTP servers
are LitServe's default: one process per inference worker.
"""

from __future__ import annotations

import litserve as ls
from minilm import MiniLM, common_args, model_names, offline


class MiniLMAPI(ls.LitAPI):  # type: ignore[misc]
    """One model name: its own route and its own worker processes."""

    def __init__(self, model_dir: str, name: str, threads: int, max_batch: int, delay_s: float):
        super().__init__(
            max_batch_size=max_batch, batch_timeout=delay_s, api_path=f"/predict/{name}"
        )
        self.model_dir = model_dir
        self.threads = threads

    def setup(self, device: str) -> None:
        self.encoder = MiniLM(self.model_dir, self.threads, device)

    # No annotations on these two: LitServe builds its route's request and response
    # types from them (and a string annotation would become a query parameter).
    def decode_request(self, request):
        return str(request["input"])

    def predict(self, texts: list[str]) -> list[list[float]]:
        return self.encoder.encode_lists(list(texts))

    def encode_response(self, output):
        return {"embedding": output}


def main() -> None:
    parser = common_args(__doc__ or "")
    parser.add_argument("--workers", type=int, default=1, help="worker processes per model")
    parser.add_argument("--accelerator", default="cpu", help="cpu, or cuda: every GPU")
    args = parser.parse_args()
    offline()
    apis = [
        MiniLMAPI(args.model_dir, name, args.threads, args.max_batch, args.delay_ms / 1000)
        for name in model_names(args.models)
    ]
    server = ls.LitServer(apis, accelerator=args.accelerator, workers_per_device=args.workers)
    server.run(host="127.0.0.1", port=args.port, generate_client_file=False)


if __name__ == "__main__":
    main()
