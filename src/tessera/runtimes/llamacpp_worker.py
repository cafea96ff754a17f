"""The llama.cpp engine process of one model (``python -m tessera.runtimes.llamacpp_worker``).

The server's ``llamacpp`` runtime starts one of these per loaded GGUF model.
The protocol on its pipes is two JSON lines:

- stdin, first line: the ``EngineSettings`` (as a dict) of the model;
- stdout, one line once the model is loaded: ``{"address": "http://127.0.0.1:PORT"}``,
  or ``{"error": "..."}`` before exiting with status 1.

It then serves llama.cpp's own HTTP server (xllamacpp's ``Server``: OpenAI
chat completions with continuous batching over ``n_parallel`` slots) on
loopback, behind an API key that only the parent knows (it came on stdin, not
on the command line), until its stdin closes: the parent closed it to stop the
engine, or the parent died. Either way the process ends at once, and with it
every byte llama.cpp held.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What the engine process needs to load one model."""

    model_path: str
    api_key: str
    context_tokens: int
    num_slots: int
    threads: int
    gpu_layers: int = 0
    verbosity: int = 1

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def _server(settings: EngineSettings) -> Any:
    import xllamacpp  # type: ignore[import-untyped]  # no stubs, no py.typed

    params = xllamacpp.CommonParams()
    params.model.path = settings.model_path
    params.api_keys = [settings.api_key]
    params.hostnames = ["127.0.0.1"]
    params.port = 0  # any free port; the address is reported on stdout
    # One KV cache of context_tokens cells that every slot draws from (a slot
    # may use the whole context; the slots of a batch share it).
    params.n_ctx = settings.context_tokens
    params.kv_unified = True
    params.n_parallel = settings.num_slots
    params.cont_batching = True
    params.n_batch = min(512, settings.context_tokens)
    params.n_ubatch = min(512, settings.context_tokens)
    # No prompt cache in host memory (llama.cpp keeps up to 8 GiB by default):
    # the bytes this process holds are the weights, the KV cache and buffers.
    params.cache_ram_mib = 0
    params.use_jinja = True  # the GGUF's own chat template, as transformers renders it
    params.cpuparams.n_threads = settings.threads
    params.cpuparams_batch.n_threads = settings.threads
    params.n_threads_http = settings.num_slots + 1
    params.n_gpu_layers = settings.gpu_layers
    params.verbosity = settings.verbosity
    # Neither of llama.cpp's load-time passes: the context and layers are
    # tessera's to set (fitting them to the device's free memory is dry runs
    # of the model), and the parent's readiness completion is the warm-up.
    # Together they were half of a load on a 2-core CPU (0.71-0.91 s to 0.35-0.38 s).
    params.fit_params = False
    params.warmup = False
    return xllamacpp.Server(params)


def main() -> int:
    line = sys.stdin.readline()
    try:
        settings = EngineSettings(**json.loads(line))
        server = _server(settings)
        address = str(server.listening_address)
    except Exception as e:  # reported to the parent, which raises it as the model's load error
        sys.stdout.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        sys.stdout.flush()
        return 1
    sys.stdout.write(json.dumps({"address": address}) + "\n")
    sys.stdout.flush()
    sys.stdin.read()  # until the parent closes the pipe, or dies
    # Skip the server's destructor (it drains slots): the parent is done with
    # this process, and exiting frees all it held.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
