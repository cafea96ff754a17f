"""Vision-language OCR on a real server: a tiny random HunYuanVL (HunyuanOCR's
architecture, built here) through ``/v1/ocr`` with prompts and tasks, and
through OpenAI chat with ``image_url`` parts (the openai client, streaming
too). Its text is random: the tests check the answers' shape, their usage,
and that the work units charged count the image's tokens."""

from __future__ import annotations

import base64
import io
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from PIL import Image

from builders import TINY_VL_VISION, write_fake_repository, write_tiny_vl_card
from serverproc import Server, start_server, stop_server
from tessera.tasks.types import VisionLimits
from tessera.tenants import TenantStore

VISION = VisionLimits(**TINY_VL_VISION)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vision") / "data"


@pytest.fixture(scope="module")
def server(data_dir: Path) -> Iterator[Server]:
    tmp = data_dir.parent
    with TenantStore(data_dir) as store:
        store.add_tenant("acme")
        key = store.create_key("acme").key
    repo = write_fake_repository(tmp / "repo", {"chatty": {"task": "generate"}})
    write_tiny_vl_card(repo)
    config = tmp / "config.yaml"
    config.write_text(
        yaml.safe_dump({"include_default_models": False, "model_repositories": [str(repo)]})
    )
    process, server = start_server(
        tmp, "--config", str(config), "--data-dir", str(data_dir), key=key
    )
    try:
        yield server
    finally:
        stop_server(process)


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), "white").save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(width: int, height: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png(width, height)).decode()


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


def test_ocr_with_a_prompt_counts_the_images_tokens(server: Server, data_dir: Path) -> None:
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as client:
        answers = []
        for i, (width, height) in enumerate([(300, 200), (64, 640)]):
            body = {"model": "tiny-vl-ocr", "image": data_url(width, height), "prompt": "Read it."}
            r = client.post("/v1/ocr", json=body, headers={"x-request-id": f"vl-{i}"})
            assert r.status_code == 200, r.text
            answer = r.json()
            assert isinstance(answer["text"], str)
            assert answer["finish_reason"] == "length"
            usage = answer["usage"]
            assert usage["completion_tokens"] == 8  # the card's max_tokens_default
            assert usage["total_tokens"] == usage["prompt_tokens"] + 8
            # Charged what ran: the prompt with its image's tokens, and what it wrote.
            assert audit_units(data_dir, f"vl-{i}") == usage["total_tokens"]
            answers.append(answer)
    small, tall = VISION.image_tokens(200, 300), VISION.image_tokens(640, 64)
    assert tall > small
    difference = answers[1]["usage"]["prompt_tokens"] - answers[0]["usage"]["prompt_tokens"]
    assert difference == tall - small


def test_ocr_tasks_fields_and_translate(server: Server) -> None:
    image = png(200, 100)
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as client:
        schema = {"type": "object", "properties": {"total": {"type": "string"}}}
        r = client.post(
            "/v1/ocr",
            data={"model": "tiny-vl-ocr", "task": "fields", "fields": yaml.safe_dump(schema)},
            files={"file": ("page.png", image, "image/png")},
        )
        assert r.status_code == 400  # fields is JSON, not YAML
        r = client.post(
            "/v1/ocr",
            data={"model": "tiny-vl-ocr", "task": "fields", "fields": '["total", "date"]'},
            files={"file": ("page.png", image, "image/png")},
        )
        assert r.status_code == 200, r.text
        assert "fields" in r.json()  # the JSON the model wrote, or null (random weights)
        b64 = base64.b64encode(image).decode()
        body = {"model": "tiny-vl-ocr", "image": b64, "task": "translate", "max_tokens": 3}
        r = client.post("/v1/ocr", json=body)
        assert r.status_code == 400
        assert "language" in r.json()["error"]["message"]
        r = client.post("/v1/ocr", json={**body, "language": "French"})
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == 3
        r = client.post("/v1/ocr", json={**body, "language": "French", "prompt": "Read."})
        assert r.status_code == 400  # a prompt or a task, not both
        r = client.post("/v1/ocr", json={**body, "language": "French", "max_tokens": 65})
        assert r.status_code == 400  # over the card's max_tokens_limit of 64


def test_chat_with_an_image_url_reaches_the_same_model(
    server: Server, request: pytest.FixtureRequest
) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.key)
    request.addfinalizer(client.close)
    content = [
        {"type": "image_url", "image_url": {"url": data_url(300, 200)}},
        {"type": "text", "text": "Read it."},
    ]
    messages = [{"role": "user", "content": content}]
    answer = client.chat.completions.create(
        model="tiny-vl-ocr",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=5,
    )
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 5
    assert answer.choices[0].finish_reason == "length"
    # The same page and prompt as /v1/ocr's: the same prompt tokens.
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as http:
        body = {"model": "tiny-vl-ocr", "image": data_url(300, 200), "prompt": "Read it."}
        ocr = http.post("/v1/ocr", json=body).json()
    assert answer.usage.prompt_tokens == ocr["usage"]["prompt_tokens"]
    stream = client.chat.completions.create(
        model="tiny-vl-ocr",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=5,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer.choices[0].message.content  # greedy: the same text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_images_are_refused_where_they_cannot_go(
    server: Server, request: pytest.FixtureRequest
) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.key)
    request.addfinalizer(client.close)
    remote = [{"type": "image_url", "image_url": {"url": "http://example.com/page.png"}}]
    with pytest.raises(openai.BadRequestError, match="fetches nothing"):
        client.chat.completions.create(
            model="tiny-vl-ocr",
            messages=[{"role": "user", "content": remote}],  # type: ignore[arg-type]
        )
    inline = [{"type": "image_url", "image_url": {"url": data_url(50, 50)}}]
    with pytest.raises(openai.BadRequestError, match="does not take images"):
        client.chat.completions.create(
            model="chatty",
            messages=[{"role": "user", "content": inline}],  # type: ignore[arg-type]
        )
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as http:
        body = {"model": "tiny-vl-ocr", "image": data_url(10, 2100), "prompt": "Read."}
        r = http.post("/v1/ocr", json=body)
        assert r.status_code == 400
        assert "aspect ratio" in r.json()["error"]["message"]
