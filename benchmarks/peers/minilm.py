"""The compute every peer server runs: tessera's MiniLM embedding, reproduced.

Mean pooling over the attention mask, then L2 normalisation; inputs truncated
at 256 word pieces; float32 (on the CPU, or a device where a script is told
so); 384 floats out. The peer scripts run
in their own venvs and cannot import tessera, so this mirrors
``tessera.runtimes.hf.HfEncoder.encode``. Loaded from a local folder only.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

MAX_LENGTH = 256
DIM = 384
MAX_BATCH = 32
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
}


def offline() -> None:
    """Keep every library off the hub (set before transformers is imported)."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)


class MiniLM:
    """The encoder and its tokenizer; ``encode`` is not safe to call concurrently."""

    def __init__(self, model_dir: str, threads: int | None = None, device: str = "cpu") -> None:
        offline()
        import torch
        from transformers import AutoModel, AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.device = device
        self.tokenizer: Any = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        model = AutoModel.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
        self.model: Any = model.to(device).eval()

    def encode(self, texts: list[str]) -> Any:
        """A float32 tensor of shape ``(len(texts), 384)``, on the CPU."""
        torch = self.torch
        batch = self.tokenizer(
            texts, padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt"
        ).to(self.device)
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            vectors = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(vectors, p=2, dim=1).float().cpu()

    def encode_lists(self, texts: list[str]) -> list[list[float]]:
        vectors: list[list[float]] = self.encode(texts).tolist()
        return vectors


def common_args(description: str) -> argparse.ArgumentParser:
    """The arguments every peer script takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model-dir", required=True, help="local MiniLM folder")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--models", required=True, help="NAME[,NAME,...]: the names to serve")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--max-batch", type=int, default=MAX_BATCH)
    parser.add_argument("--delay-ms", type=float, default=5.0, help="max batching delay")
    return parser


def model_names(value: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names:
        raise SystemExit("--models names no model")
    return names
