"""Real weights gone NaN: the packaged MiniLM's folder copied with every tensor
NaN (a valid header, broken data) and preloaded is reported failed at start,
never served as a 200 of ``null``s. The real app in-process over the real
torch runtime."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tessera.engine import Engine, EngineConfig
from tessera.gateway import create_app
from tessera.repository import ModelRepository, default_repository_path, read_spec

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")


def nan_copy(target: Path) -> Path:
    """A model folder named ``nan-minilm``: the packaged MiniLM's files, its
    safetensors rewritten with NaN in every floating-point tensor."""
    source = read_spec(default_repository_path() / "all-minilm-l6-v2").resolve_source()
    folder = target / "nan-minilm"
    weights = folder / "weights"
    weights.mkdir(parents=True)
    for path in source.rglob("*"):
        if path.is_file() and path.name != "model.safetensors":
            (weights / path.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
            (weights / path.relative_to(source)).symlink_to(path)
    tensors = safetensors_torch.load_file(source / "model.safetensors")
    broken = {k: t.fill_(float("nan")) if t.is_floating_point() else t for k, t in tensors.items()}
    safetensors_torch.save_file(broken, weights / "model.safetensors")
    card = yaml.safe_load(
        (default_repository_path() / "all-minilm-l6-v2" / "model.yaml").read_text()
    )
    card.update(name="nan-minilm", source={"path": "weights"}, preload=True)
    (folder / "model.yaml").write_text(yaml.safe_dump(card))
    return target


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    repository = ModelRepository.from_folders([nan_copy(tmp_path / "repo")])
    engine = Engine(
        repository,
        EngineConfig(memory_budget_bytes=2 * 1024**3, device="cpu", num_threads=2, fill=False),
    )
    await engine.preload()
    try:
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://tessera") as client:
            yield client
    finally:
        await engine.close()


def strict_json(response: httpx.Response) -> Any:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in the body: {response.text[:200]}")

    return json.loads(response.text, parse_constant=refuse)


async def test_nan_weights_preloaded_are_failed_at_start_and_every_face_refuses(
    client: httpx.AsyncClient,
) -> None:
    ready = await client.get("/v2/health/ready")
    assert strict_json(ready)["failed_models"] == ["nan-minilm"]
    residency = strict_json(await client.get("/admin/residency"))
    (row,) = [m for m in residency["models"] if m["name"] == "nan-minilm"]
    assert row["state"] == "failed"
    assert "not finite" in row["error"]
    text = {"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["a"]}
    for path, body in [
        ("/v1/embeddings", {"model": "nan-minilm", "input": "a"}),
        ("/v2/models/nan-minilm/infer", {"inputs": [text]}),
        ("/api/embed", {"model": "nan-minilm", "input": "a"}),
        ("/tei/nan-minilm/embed", {"inputs": "a"}),
        ("/v2/embed", {"model": "nan-minilm", "texts": ["a"], "input_type": "search_query"}),
    ]:
        r = await client.post(path, json=body)
        assert r.status_code == 503, (path, r.text)
        strict_json(r)
