"""TorchServe custom handler for MiniLM (packed into the .mar by torchserve_server.py).

A request is ``POST /predictions/NAME`` with a JSON body ``{"text": "..."}``;
the answer is the 384 floats as a JSON list. TorchServe hands the handler a
batch of up to ``batchSize`` requests gathered within ``maxBatchDelay`` ms.
The folder of the weights and the torch thread count come from
``peer_config.json``, an extra file of the archive.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


class MiniLMHandler:
    """One worker process's copy of the encoder (TorchServe's class entry point)."""

    def __init__(self) -> None:
        self.encoder: Any = None

    def initialize(self, context: Any) -> None:
        model_dir = context.system_properties["model_dir"]
        sys.path.insert(0, model_dir)  # minilm.py is an extra file of the archive
        from minilm import MiniLM

        with open(os.path.join(model_dir, "peer_config.json")) as file:
            config = json.load(file)
        self.encoder = MiniLM(config["model_dir"], int(config["threads"]))

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[Any]:
        texts = [_text(row.get("data") or row.get("body")) for row in data]
        return self.encoder.encode_lists(texts)


def _text(body: Any) -> str:
    if isinstance(body, (bytes, bytearray)):
        body = json.loads(body)
    if isinstance(body, dict):
        return str(body["text"])
    return str(body)
