"""Fake engine processes for the external runtime's tests, and model folders using them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

FAKE_VLLM = Path(__file__).with_name("fake_vllm.py")
# A server config's ``engine_commands`` that allows the fake's command line.
FAKE_ENGINE_COMMANDS = {"vllm": [["{python}", str(FAKE_VLLM)]]}


def write_fake_vllm_model(
    repository: Path,
    name: str,
    *,
    max_bytes: str = "256MiB",
    args: tuple[str, ...] = (),
    max_batch_size: int = 4,
    task: str = "generate",
    **options: Any,
) -> Path:
    """A ``runtime: external``, ``engine: vllm`` model folder under ``repository``
    whose engine is ``tests/fakes/fake_vllm.py`` (``args``: its command line's end)."""
    folder = repository / name
    folder.mkdir(parents=True)
    card = {
        "name": name,
        "task": task,
        "runtime": "external",
        "engine": "vllm",
        "memory": {"max_bytes": max_bytes},
        "batching": {"max_batch_size": max_batch_size, "max_concurrent_batches": 1},
        "options": {
            "command": ["{python}", str(FAKE_VLLM)],
            "model": f"fake/{name}",
            "args": list(args),
            "load_timeout_s": 30,
            **options,
        },
    }
    (folder / "model.yaml").write_text(yaml.safe_dump(card))
    return folder
