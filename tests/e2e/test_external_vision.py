"""Vision-language OCR through the external vLLM runtime on a real ``tessera
serve`` process: a ``task: ocr`` card with ``runtime: external``, ``engine:
vllm`` served by ``tests/fakes/fake_vllm.py``, which echoes as JSON the prompt
and the image (its bytes and size) that reached it. OpenAI chat with
``image_url`` parts (the openai client, streaming too) and ``/v1/ocr`` with
tasks ``fields`` and ``translate`` (httpx) reach it with their images and the
in-process adapter's prompts; the charge is the engine's reported usage."""

from __future__ import annotations

import base64
import io
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from PIL import Image

from fakes import FAKE_ENGINE_COMMANDS, write_fake_vllm_model
from serverproc import Server, start_server, stop_server
from tessera.tasks.image import decode_image, encode_png
from tessera.tasks.prompts import ocr_prompt
from tessera.tenants import TenantStore

VISION = {"patch_size": 14, "merge_size": 2, "min_pixels": 56 * 56, "max_pixels": 1024 * 1024}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("external-vision") / "data"


@pytest.fixture(scope="module")
def server(data_dir: Path) -> Iterator[Server]:
    tmp = data_dir.parent
    with TenantStore(data_dir) as store:
        store.add_tenant("acme")
        key = store.create_key("acme").key
    repo = tmp / "repo"
    options = {"vision": VISION, "max_tokens_default": 256, "max_tokens_limit": 512}
    write_fake_vllm_model(repo, "fake-ocr", task="ocr", **options)
    config = tmp / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "include_default_models": False,
                "model_repositories": [str(repo)],
                "engine_commands": FAKE_ENGINE_COMMANDS,
            }
        )
    )
    process, server = start_server(
        tmp, "--config", str(config), "--data-dir", str(data_dir), key=key
    )
    try:
        yield server
    finally:
        stop_server(process)
    assert "Traceback" not in server.log()


def png(width: int, height: int) -> bytes:
    image = Image.new("RGB", (width, height), "white")
    image.putpixel((width // 2, height // 2), (200, 10, 10))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def arrived(raw: bytes, width: int, height: int) -> dict[str, int]:
    """What the fake engine reports of an upload: the PNG tessera re-encodes
    its decoded pixels as (lossless), and its size."""
    return {"bytes": len(encode_png(decode_image(raw))), "width": width, "height": height}


def fake_prompt_tokens(prompt: str, width: int, height: int) -> int:
    """The fake's usage: a token a word, 4 more, one per 32 x 32 block of the image."""
    return len(prompt.split()) + 4 + max(1, (width // 32) * (height // 32))


def audit_units(data_dir: Path, request_id: str) -> float:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with sqlite3.connect(data_dir / "audit.db") as conn:
            row = conn.execute(
                "SELECT units FROM audit WHERE request_id = ?", (request_id,)
            ).fetchone()
        if row is not None:
            return float(row[0])
        time.sleep(0.2)
    raise AssertionError(f"no audit row for {request_id}")


def test_chat_with_an_image_url_reaches_the_vllm_engine_with_its_image(
    server: Server, request: pytest.FixtureRequest
) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.key, max_retries=0)
    request.addfinalizer(client.close)
    raw = png(300, 200)
    content = [
        {"type": "image_url", "image_url": {"url": data_url(raw)}},
        {"type": "text", "text": "Read it."},
    ]
    messages = [{"role": "user", "content": content}]
    answer = client.chat.completions.create(
        model="fake-ocr",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=100,
    )
    text = answer.choices[0].message.content or ""
    assert json.loads(text) == {"prompt": "Read it.", "images": [arrived(raw, 300, 200)]}
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == fake_prompt_tokens("Read it.", 300, 200)
    assert answer.usage.completion_tokens == len(text.split(" "))
    stream = client.chat.completions.create(
        model="fake-ocr",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=3,
        stream=True,
    )
    chunks = list(stream)
    pieces = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert pieces == '{"prompt": "Read it.", '  # its first 3 tokens, streamed
    assert chunks[-1].choices[0].finish_reason == "length"


def test_ocr_tasks_fields_and_translate_through_the_vllm_engine(
    server: Server, data_dir: Path
) -> None:
    raw = png(240, 120)
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as client:
        r = client.post(
            "/v1/ocr",
            data={"model": "fake-ocr", "task": "fields", "fields": '["total", "date"]'},
            files={"file": ("page.png", raw, "image/png")},
            headers={"x-request-id": "ext-fields"},
        )
        assert r.status_code == 200, r.text
        answer = r.json()
        prompt = ocr_prompt(None, "fields", fields=["total", "date"])
        # The JSON the engine wrote, read back as the in-process adapter's is.
        assert answer["fields"] == {"prompt": prompt, "images": [arrived(raw, 240, 120)]}
        usage = answer["usage"]
        assert usage["prompt_tokens"] == fake_prompt_tokens(prompt, 240, 120)
        assert answer["finish_reason"] == "stop"
        # Charged what ran, as the engine reported it (admitted: image tokens + 256).
        assert audit_units(data_dir, "ext-fields") == usage["total_tokens"]

        body = {"model": "fake-ocr", "image": data_url(raw), "task": "translate"}
        r = client.post("/v1/ocr", json=body)
        assert r.status_code == 400
        assert "language" in r.json()["error"]["message"]
        r = client.post("/v1/ocr", json={**body, "language": "French"})
        assert r.status_code == 200, r.text
        echo = json.loads(r.json()["text"])
        assert echo["prompt"] == ocr_prompt(None, "translate", language="French")
        assert echo["images"] == [arrived(raw, 240, 120)]
        r = client.post("/v1/ocr", json={**body, "language": "French", "max_tokens": 2})
        assert (r.json()["finish_reason"], r.json()["usage"]["completion_tokens"]) == (
            "length", 2,
        )  # fmt: skip
        r = client.post("/v1/ocr", json={**body, "language": "French", "max_tokens": 513})
        assert r.status_code == 400  # over the card's max_tokens_limit of 512
        tall = {"model": "fake-ocr", "image": data_url(png(10, 2100)), "prompt": "Read."}
        r = client.post("/v1/ocr", json=tall)
        assert r.status_code == 400
        assert "aspect ratio" in r.json()["error"]["message"]
