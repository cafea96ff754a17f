"""Decoding uploaded images into the arrays the OCR models take."""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from typing import Any

import numpy as np

from tessera.errors import InvalidInputError, PayloadTooLargeError, UnsupportedMediaError

MAX_IMAGE_PIXELS = 40_000_000


def decode_base64(data: str) -> bytes:
    """Plain base64 or a ``data:image/...;base64,`` URL; line breaks and
    spaces in it are left out (the ``base64`` tool's output wraps at 76)."""
    if data.startswith("data:"):
        _, _, data = data.partition(",")
    try:
        return base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidInputError("image is not valid base64") from e


def decode_image(raw: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray[Any, Any]:
    """Image bytes (PNG, JPEG, WebP, BMP, TIFF...) to an H x W x 3 uint8 BGR array.

    Decompression bombs are refused before decoding: ``Image.open`` reads only
    the header, and its width x height is checked against ``max_pixels`` (413)
    before any pixel is decoded. PIL's own bomb check (a warning, then an error
    at twice its limit) is silenced in favour of this one.
    """
    from PIL import Image, UnidentifiedImageError

    if not raw:
        raise InvalidInputError("image is empty")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(raw))
        except Image.DecompressionBombError as e:
            raise PayloadTooLargeError(
                f"image is over the limit of {max_pixels:,} pixels: {e}"
            ) from e
        except UnidentifiedImageError as e:
            # PIL's message names the buffer object and its address: not the caller's.
            raise UnsupportedMediaError(
                "cannot decode image: not a format it reads (PNG, JPEG, WebP, BMP, TIFF, GIF...)"
            ) from e
        except (OSError, SyntaxError, ValueError) as e:
            raise UnsupportedMediaError(f"cannot decode image: {e}") from e
        width, height = image.size
        if width * height > max_pixels:
            raise PayloadTooLargeError(
                f"image of {width} x {height} pixels is over the limit of {max_pixels:,} pixels"
            )
        try:
            rgb = np.asarray(image.convert("RGB"), dtype=np.uint8)
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            raise UnsupportedMediaError(f"cannot decode image: {e}") from e
    if rgb.ndim != 3 or rgb.shape[0] < 1 or rgb.shape[1] < 1:
        raise UnsupportedMediaError("cannot decode image: it has no pixels")
    return np.ascontiguousarray(rgb[:, :, ::-1])


def encode_png(image: np.ndarray[Any, Any]) -> bytes:
    """A decoded (BGR) image as PNG bytes: lossless, so an engine out of process
    reads the pixels this server decoded."""
    from PIL import Image

    buffer = io.BytesIO()
    rgb = Image.fromarray(np.ascontiguousarray(image[:, :, ::-1]))
    rgb.save(buffer, format="PNG", compress_level=1)  # fast: the bytes stay on loopback
    return buffer.getvalue()


def png_data_url(image: np.ndarray[Any, Any]) -> str:
    """A decoded (BGR) image as a ``data:image/png;base64,`` URL (OpenAI's
    ``image_url`` part, as an engine out of process takes it)."""
    return "data:image/png;base64," + base64.b64encode(encode_png(image)).decode()
