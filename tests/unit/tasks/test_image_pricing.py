"""Images are priced from their headers before any pixel is decoded: work
units by pixels (what rapidocr's resize throws away included), and a request's
pixels and pages bounded, refused with 413 naming its figure and the limit."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from tessera.errors import PayloadTooLargeError, UnsupportedMediaError
from tessera.tasks.image import (
    DEFAULT_MAX_REQUEST_PIXELS,
    EncodedImage,
    RequestImageLimits,
    check_request_images,
    decode_image,
    pixels,
    read_image,
)
from tessera.tasks.types import (
    DECODE_PIXELS_PER_UNIT,
    ChatInput,
    ChatMessage,
    InputLimits,
    OcrInput,
    TextInput,
    VisionLimits,
    item_images,
    work_units,
)


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` pixels; its data is empty,
    so decoding it fails: what reads only its header never notices."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b""))


def png(width: int, height: int) -> bytes:
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[:, :, 0] = 200  # red in the file, last in BGR
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def test_an_image_is_priced_from_its_header_as_its_decoded_array_is() -> None:
    big = read_image(png_header(6300, 6300))  # never decoded: its data is empty
    assert big.shape == (6300, 6300, 3)
    array = np.zeros((6300, 6300, 3), dtype=np.uint8)
    assert work_units(OcrInput(big)) == pytest.approx(work_units(OcrInput(array)))
    with pytest.raises(UnsupportedMediaError):
        big.decode()


def test_a_page_beyond_rapidocrs_bound_costs_the_pixels_its_resize_throws_away() -> None:
    # Within the bound a page costs its detection pass alone.
    assert work_units(OcrInput(read_image(png_header(736, 736)))) == pytest.approx(1.0)
    page = work_units(OcrInput(read_image(png_header(2000, 2000))))
    assert page == pytest.approx(2000 * 2000 / 736**2)
    bounded = 1984 * 1984 / 736**2  # the detection pass over its 2,000-pixel copy (x32)
    thrown_away = 6300 * 6300 - 1984 * 1984
    big = work_units(OcrInput(read_image(png_header(6300, 6300))))
    assert big == pytest.approx(bounded + thrown_away / DECODE_PIXELS_PER_UNIT)
    assert big > 1.35 * page  # 10.2 units: it was priced as a 2,000-pixel page


def test_a_vision_models_image_costs_its_tokens_from_the_header() -> None:
    limits = InputLimits(vision=VisionLimits(), max_tokens_default=16)
    header = read_image(png_header(1024, 1024))
    array = np.zeros((1024, 1024, 3), dtype=np.uint8)
    chat = ChatInput((ChatMessage("user", "read", images=(header,)),), max_tokens=16)
    assert work_units(chat, limits) == work_units(
        ChatInput((ChatMessage("user", "read", images=(array,)),), max_tokens=16), limits
    )
    assert work_units(OcrInput(header), limits) == work_units(OcrInput(array), limits)


def test_an_encoded_image_decodes_to_the_array_decode_image_makes() -> None:
    raw = png(40, 30)
    encoded = read_image(raw)
    assert (encoded.width, encoded.height) == (40, 30)
    decoded = pixels(encoded)
    assert decoded.shape == (30, 40, 3)
    np.testing.assert_array_equal(decoded, decode_image(raw))
    assert decoded[0, 0].tolist() == [0, 0, 200]  # BGR
    assert pixels(decoded) is decoded
    assert "data" not in repr(encoded)  # its bytes stay out of logs


def test_twelve_pages_at_the_pixel_limit_are_refused_naming_the_figure_and_the_limit() -> None:
    pages = [OcrInput(read_image(png_header(6300, 6300))) for _ in range(12)]
    with pytest.raises(PayloadTooLargeError) as refused:
        check_request_images(item_images(pages), RequestImageLimits())
    message = str(refused.value)
    assert f"{12 * 6300 * 6300:,} pixels" in message
    assert f"at most {DEFAULT_MAX_REQUEST_PIXELS:,} pixels (max_request_pixels)" in message


def test_a_normal_multi_page_request_passes() -> None:
    # 13 A4 pages scanned at 300 dpi, and 64 phone-sized receipts.
    a4 = [read_image(png_header(2480, 3508)) for _ in range(13)]
    check_request_images(a4, RequestImageLimits())
    receipts = [np.zeros((1600, 600, 3), dtype=np.uint8) for _ in range(64)]
    check_request_images(receipts, RequestImageLimits())


def test_pages_over_the_limit_are_refused_and_the_limits_are_configurable() -> None:
    small = [read_image(png_header(10, 10)) for _ in range(5)]
    with pytest.raises(PayloadTooLargeError, match=r"5 images .* at most 4 \(max_request_pages\)"):
        check_request_images(small, RequestImageLimits(max_request_pages=4))
    with pytest.raises(PayloadTooLargeError, match="500 pixels in all"):
        check_request_images(small, RequestImageLimits(max_request_pixels=499))
    check_request_images(small, RequestImageLimits(max_request_pixels=500, max_request_pages=5))


def test_the_images_of_items_are_pages_and_chat_images() -> None:
    a, b, c = (read_image(png_header(5, 5)) for _ in range(3))
    items: list[object] = [
        OcrInput(a),
        TextInput("no image"),
        ChatInput((ChatMessage("user", "x", images=(b, c)), ChatMessage("user", "y"))),
    ]
    assert item_images(items) == [a, b, c]


def test_an_encoded_image_compares_and_pickles_as_a_value() -> None:
    import pickle

    encoded = read_image(png(4, 3))
    assert pickle.loads(pickle.dumps(encoded)) == encoded
    assert isinstance(encoded, EncodedImage)
