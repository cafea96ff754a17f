"""KServe infer for OCR and speech models (``gateway/kserve.py``) over fake
models: pages as image files or pixels, speech as 16-bit samples."""

from __future__ import annotations

import base64
import io
import json
import struct
from typing import Any

import httpx
import numpy as np
import pytest

from tessera.errors import InvalidInputError, PayloadTooLargeError
from tessera.gateway.kserve import _images
from tessera.gateway.kserve_tensor import Tensor
from tessera.tasks.image import decode_image
from tessera.tasks.samples import sample_page


def png(height: int, width: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(sample_page(height, width)[:, :, ::-1]).save(buffer, format="PNG")
    return buffer.getvalue()


PAGE = base64.b64encode(png(4, 4)).decode()


def binary_body(
    tensors: list[tuple[str, str, list[int], bytes]], **header: Any
) -> tuple[bytes, dict[str, str]]:
    """An infer body whose inputs are all binary data, and its header-length header."""
    inputs = [
        {"name": n, "datatype": d, "shape": s, "parameters": {"binary_data_size": len(b)}}
        for n, d, s, b in tensors
    ]
    head = json.dumps({"inputs": inputs, **header}).encode()
    blob = b"".join(b for *_, b in tensors)
    return head + blob, {"inference-header-content-length": str(len(head))}


def files(*images: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(image)) + image for image in images)


async def test_ocr_reads_image_files_in_binary_data_and_base64(
    shared_client: httpx.AsyncClient,
) -> None:
    body, headers = binary_body([("IMAGE", "BYTES", [2], files(png(40, 60), png(30, 20)))])
    r = await shared_client.post("/v2/models/ocr/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    outputs = {o["name"]: o for o in r.json()["outputs"]}
    assert outputs["TEXT"]["data"] == ["60x40", "20x30"]
    assert outputs["LINE_TEXT"]["data"] == ["60x40", "20x30"]
    assert outputs["LINE_IMAGE"]["data"] == [0, 1]
    assert (outputs["LINE_BOX"]["shape"], outputs["LINE_BOX"]["datatype"]) == ([2, 4, 2], "FP32")
    assert outputs["LINE_BOX"]["data"][:8] == [0, 0, 60, 0, 60, 40, 0, 40]  # the fake's box
    assert outputs["LINE_SCORE"]["data"] == [1.0, 1.0]
    # In JSON, an image file is base64 (a data: URL too); mode as a parameter.
    image = {"name": "IMAGE", "datatype": "BYTES", "shape": [1]}
    url = "data:image/png;base64," + base64.b64encode(png(10, 12)).decode()
    body = {"inputs": [{**image, "data": [url]}], "parameters": {"mode": "line"}}
    r = await shared_client.post("/v2/models/ocr/infer", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == ["12x10"]


async def test_ocr_reads_pixels(shared_client: httpx.AsyncClient) -> None:
    pages = np.zeros((2, 5, 7, 3), dtype=np.uint8)
    body, headers = binary_body([("IMAGE", "UINT8", [2, 5, 7, 3], pages.tobytes())])
    r = await shared_client.post("/v2/models/ocr/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == ["7x5", "7x5"]
    gray = {"name": "IMAGE", "datatype": "UINT8", "shape": [2, 3, 1], "data": [0] * 6}
    r = await shared_client.post("/v2/models/ocr/infer", json={"inputs": [gray]})
    assert r.json()["outputs"][0]["data"] == ["3x2"]


def test_pixels_are_taken_as_rgb_and_given_to_the_model_as_decoded_files_are() -> None:
    page = sample_page(20, 30)  # BGR, as decode_image gives
    rgb = np.ascontiguousarray(page[:, :, ::-1])
    tensor = Tensor("UINT8", rgb.shape, rgb.ravel())
    (from_pixels,) = _images(tensor)
    np.testing.assert_array_equal(from_pixels, decode_image(png(20, 30)))
    np.testing.assert_array_equal(from_pixels, page)
    gray = Tensor("UINT8", (2, 2, 1), np.array([0, 50, 100, 150], dtype=np.uint8))
    (three,) = _images(gray)
    assert three.shape == (2, 2, 3)
    assert three[0, 1].tolist() == [50, 50, 50]
    with pytest.raises(PayloadTooLargeError, match="over the limit"):
        _images(Tensor("UINT8", (6400, 6400, 1), np.zeros(6400 * 6400, dtype=np.uint8)))
    with pytest.raises(InvalidInputError, match="H x W x 1 or 3"):
        _images(Tensor("UINT8", (2, 2, 2), np.zeros(8, dtype=np.uint8)))


@pytest.mark.parametrize(
    ("tensor", "parameters", "status", "says"),
    [
        ({"datatype": "FP32", "shape": [1, 1, 3], "data": [0, 0, 0]}, {}, 400, "UINT8 pixels"),
        ({"datatype": "UINT8", "shape": [3], "data": [0, 0, 0]}, {}, 400, "UINT8 pixels"),
        ({"datatype": "BYTES", "shape": [1], "data": ["%%%"]}, {}, 400, "not valid base64"),
        ({"datatype": "BYTES", "shape": [1], "data": ["bm90IGFuIGltYWdl"]}, {}, 415, "decode"),
        ({"datatype": "BYTES", "shape": [0], "data": []}, {}, 400, "at least one image"),
        (
            {"datatype": "BYTES", "shape": [1], "data": [PAGE]},
            {"mode": "word"},
            400,
            "page or line",
        ),
        ({"datatype": "BYTES", "shape": [1], "data": [PAGE]}, {"zoom": 2}, 400, "no parameter"),
        ({"datatype": "BYTES", "shape": [1], "data": [PAGE]}, {"prompt": "hi"}, 400, "prompt"),
    ],
)
async def test_what_an_ocr_model_cannot_read_says_why(
    shared_client: httpx.AsyncClient,
    tensor: dict[str, Any],
    parameters: dict[str, Any],
    status: int,
    says: str,
) -> None:
    body = {"inputs": [{"name": "IMAGE", **tensor}], "parameters": parameters}
    r = await shared_client.post("/v2/models/ocr/infer", json=body)
    assert r.status_code == status, r.text
    assert says in r.json()["error"]


async def test_speech_answers_samples_and_their_rate(shared_client: httpx.AsyncClient) -> None:
    text = {"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": ["hello"]}
    body = {"inputs": [text], "parameters": {"speed": 1.5, "binary_data_output": True}}
    r = await shared_client.post("/v2/models/tts/infer", json=body)
    assert r.status_code == 200, r.text
    split = int(r.headers["inference-header-content-length"])
    header = json.loads(r.content[:split])
    audio, rate = header["outputs"]
    assert (audio["name"], audio["datatype"], audio["shape"]) == ("AUDIO", "INT16", [500])
    assert (rate["name"], rate["datatype"], rate["shape"]) == ("SAMPLE_RATE", "INT32", [1])
    blob = r.content[split:]
    samples = np.frombuffer(blob[: audio["parameters"]["binary_data_size"]], dtype="<i2")
    assert samples.shape == (500,)  # the fake speaks 100 zero samples a character
    assert np.frombuffer(blob[-4:], dtype="<i4").tolist() == [22050]
    for inputs, parameters, says in (
        ([{**text, "shape": [2], "data": ["a", "b"]}], {}, "one text a request, not 2"),
        ([{**text, "data": [" "]}], {}, "must not be blank"),
        ([text], {"speed": 9}, "speed is a number from 0.25 to 4"),
        ([text], {"voice": "x"}, "takes speed alone"),
    ):
        r = await shared_client.post(
            "/v2/models/tts/infer", json={"inputs": inputs, "parameters": parameters}
        )
        assert r.status_code == 400, r.text
        assert says in r.json()["error"]


async def test_ocr_and_speech_metadata_name_their_tensors(shared_client: httpx.AsyncClient) -> None:
    ocr = (await shared_client.get("/v2/models/ocr")).json()
    assert [i["name"] for i in ocr["inputs"]] == ["IMAGE"]
    assert [o["name"] for o in ocr["outputs"]] == [
        "TEXT",
        "LINE_TEXT",
        "LINE_SCORE",
        "LINE_BOX",
        "LINE_IMAGE",
    ]
    config = (await shared_client.get("/v2/models/tts/config")).json()
    assert config["output"] == [
        {"name": "AUDIO", "data_type": "TYPE_INT16", "dims": [-1]},
        {"name": "SAMPLE_RATE", "data_type": "TYPE_INT32", "dims": [1]},
    ]
