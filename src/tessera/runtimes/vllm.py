"""vLLM as an external engine (``runtime: external``, ``engine: vllm``).

vLLM cannot be installed on the machines this is built on: the supervisor is
tested against ``tests/fakes/fake_vllm.py``, a small process that speaks the
endpoints used here. On a CUDA machine with vLLM installed, tessera runs, for a
model whose card gives ``memory: {max_bytes: 6GiB}`` on an 80 GiB card::

    VLLM_API_KEY=<per-process key> VLLM_SERVER_DEV_MODE=1 \\
    vllm serve /models/Qwen2.5-1.5B-Instruct --host 127.0.0.1 --port <free port> \\
        --served-model-name qwen --gpu-memory-utilization 0.075000 \\
        --enable-sleep-mode --max-num-seqs 8 [options.args...]

- ``--gpu-memory-utilization`` is the model's slice of tessera's budget (its
  ``memory.max_bytes``, required) over the card's whole memory: vLLM takes that
  fraction of the card for weights, activations and KV cache, and checks at
  launch that it is free. tessera's budget holds the slice before the engine
  starts (the slice is the estimate), and engines of this kind start one after
  another, each once the one before holds its memory. On a machine without a
  GPU the fraction is the slice over the host's memory, passed as it is (the
  fake only reports it).
- ``--enable-sleep-mode`` (and ``VLLM_SERVER_DEV_MODE=1``, which exposes
  ``/sleep``, ``/wake_up`` and ``/is_sleeping``): an eviction puts the engine to
  sleep at level 1 (its weights move to host memory, its KV cache is dropped)
  instead of stopping it; the next request wakes it (``/wake_up``), much faster
  than a start. Its bytes leave and re-enter tessera's budget as a model's do.
- ``--max-num-seqs`` is tessera's window: vLLM never holds more requests than
  tessera forwards, so the per-tenant queue stays tessera's.
- ``/metrics``: the ``vllm:*`` families below are read after each batch and
  exported as ``tessera_engine_*`` (``metrics/prometheus.py``).

A vision-language model (``task: ocr`` with ``vision`` options, HunyuanOCR)
takes images (``takes_images``): its OCR pages and chat images reach it as
``image_url`` parts with ``data:`` URLs (``runtimes/external.py``); HunyuanOCR's
vLLM recipe adds ``--no-enable-prefix-caching --mm-processor-cache-gb 0``
(``options.args``).

Options (model.yaml ``options``), beside the external runtime's:

- ``command``: the engine's command before the model (default
  ``["vllm", "serve"]``; ``{python}`` is this interpreter);
- ``model``: what ``vllm serve`` loads (a hub id or a folder; default the
  card's source path);
- ``args``: further command-line options of the engine, as a list.
"""

from __future__ import annotations

import math
import socket
import sys
from typing import TYPE_CHECKING, Any

from prometheus_client.parser import text_string_to_metric_families

from tessera.errors import ModelUnavailableError
from tessera.runtimes.base import LoadContext
from tessera.runtimes.external import Launch

if TYPE_CHECKING:
    from tessera.repository.spec import ModelSpec

# vLLM's families (as the text format names their samples) -> tessera's engine metrics.
VLLM_METRICS = {
    "vllm:num_requests_running": "requests_running",
    "vllm:num_requests_waiting": "requests_waiting",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage_ratio",
    "vllm:kv_cache_usage_perc": "kv_cache_usage_ratio",  # its name from vLLM 0.10
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
}
DEFAULT_COMMAND = ("vllm", "serve")


class VllmEngine:
    """The ``vllm`` engine kind (``runtimes.external.EngineKind``)."""

    label = "vLLM"
    sleeps = True
    takes_images = True
    native_tools = True
    serial_start = True
    metrics_path = "/metrics"
    default_load_timeout_s = 600.0

    def estimate_bytes(self, spec: ModelSpec) -> int:
        return _slice_bytes(spec)

    def launch(self, spec: ModelSpec, ctx: LoadContext, api_key: str, window: int) -> Launch:
        fraction = _slice_bytes(spec) / ctx.device.total_bytes()
        if not 0.0 < fraction <= 1.0:
            raise ModelUnavailableError(
                spec.name, f"its slice is {fraction:.3f} of the device's memory"
            )
        port = _free_port()
        argv = [
            *_strings(spec, "command", DEFAULT_COMMAND),
            str(spec.options.get("model") or spec.resolve_source()),
            *("--host", "127.0.0.1", "--port", str(port)),
            *("--served-model-name", spec.name),
            # Rounded down: the engine stays within its slice.
            *("--gpu-memory-utilization", f"{math.floor(fraction * 1e6) / 1e6:.6f}"),
            "--enable-sleep-mode",
            *("--max-num-seqs", str(window)),
            *_strings(spec, "args", ()),
        ]
        return Launch(
            argv=tuple(argv),
            env={"VLLM_API_KEY": api_key, "VLLM_SERVER_DEV_MODE": "1"},
            address=f"http://127.0.0.1:{port}",
        )

    def chat_extras(self) -> dict[str, Any]:
        # Usage in every chunk: what an item stopped mid-way has cost.
        return {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}

    def parse_metrics(self, text: str) -> dict[str, float]:
        found: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = VLLM_METRICS.get(sample.name)
                if key is not None:  # summed over the engine's own labels
                    found[key] = found.get(key, 0.0) + float(sample.value)
        return found


def _slice_bytes(spec: ModelSpec) -> int:
    if spec.max_bytes is None:
        raise ModelUnavailableError(
            spec.name, "a vllm model needs memory.max_bytes: its slice of the budget"
        )
    return spec.max_bytes


def _strings(spec: ModelSpec, key: str, default: tuple[str, ...]) -> list[str]:
    raw = spec.options.get(key, default)
    if not isinstance(raw, list | tuple) or not all(isinstance(a, str | int | float) for a in raw):
        raise ModelUnavailableError(spec.name, f"options.{key} must be a list of strings")
    return [str(a).replace("{python}", sys.executable) for a in raw]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
