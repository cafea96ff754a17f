"""PyTriton serving MiniLM: one Triton server, one bound model per name.

    python pytriton_server.py --model-dir DIR --port N --models a[,b,c] --threads T \
        --workspace DIR

Triton's HTTP frontend speaks KServe v2 (``POST /v2/models/NAME/infer``, a
BYTES input ``text`` of shape [1, 1]; output ``embedding``, FP32 [1, 384]).
Each model gets Triton's dynamic batcher (max batch 32, ``--delay-ms`` queue
delay) and one instance: its inference callable runs in this process, which
holds every model's weights, so the torch thread budget (``--threads``) is
this one process's. gRPC and metrics are off; PyTriton ships no telemetry.
"""

from __future__ import annotations

import logging
import shutil
import signal

from minilm import DIM, MiniLM, common_args, model_names, offline


def bind(triton: object, name: str, encoder: MiniLM, max_batch: int, delay_ms: float) -> None:
    import numpy as np
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor

    @batch
    def infer(text: np.ndarray) -> dict[str, np.ndarray]:
        sentences = [item.decode("utf-8") for item in text.reshape(-1)]
        return {"embedding": encoder.encode(sentences).numpy()}

    batcher = DynamicBatcher(max_queue_delay_microseconds=int(delay_ms * 1000))
    triton.bind(  # type: ignore[attr-defined]
        model_name=name,
        infer_func=infer,
        inputs=[Tensor(name="text", dtype=bytes, shape=(1,))],
        outputs=[Tensor(name="embedding", dtype=np.float32, shape=(DIM,))],
        config=ModelConfig(max_batch_size=max_batch, batcher=batcher),
        strict=True,
    )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = common_args(__doc__ or "")
    parser.add_argument("--workspace", required=True, help="folder for Triton's model store")
    args = parser.parse_args()
    offline()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from pytriton.triton import Triton, TritonConfig

    names = model_names(args.models)
    # Triton copies its binaries into the workspace and refuses an existing one.
    shutil.rmtree(args.workspace, ignore_errors=True)
    config = TritonConfig(
        http_address="127.0.0.1",
        http_port=args.port,
        allow_grpc=False,
        allow_metrics=False,
        log_verbose=0,
    )
    # SIGTERM as Ctrl+C: leaving the block stops Triton in order, which unloads the
    # models and so removes the shared memory and temp folders their stubs made.
    signal.signal(signal.SIGTERM, _interrupt)
    with Triton(config=config, workspace=args.workspace) as triton:
        for name in names:
            # Each name its own copy of the weights, like separately deployed models.
            bind(triton, name, MiniLM(args.model_dir, args.threads), args.max_batch, args.delay_ms)
        triton.serve()


if __name__ == "__main__":
    main()
