"""Decoding uploaded images into the arrays the OCR models take.

An image is read in two steps. The gateway reads its header alone
(``read_image``: its format, width and height; no pixel decoded), which is
enough to refuse a decompression bomb, to price the image in work units and
to bound a request's pixels and pages (``check_request_images``), all before
any pixel is decoded. The model's runtime decodes it (``pixels``) when its
batch runs, one page at a time, inside the memory the batch reserved and is
measured by: a queued request holds the compressed bytes, not three bytes a
pixel, and a decode runs on a worker thread, not on the gateway's event loop.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from tessera.errors import InvalidInputError, PayloadTooLargeError, UnsupportedMediaError

if TYPE_CHECKING:
    from PIL.Image import Image

MAX_IMAGE_PIXELS = 40_000_000
# A decoded image is BGR, a byte a channel: three bytes a pixel.
DECODED_CHANNELS = 3
# A request's images together (``RequestImageLimits``): three pages at the
# per-image limit, or 13 A4 pages scanned at 300 dpi (8.7 megapixels each);
# and 64 pages, as many as an OCR card's ``max_inputs``.
DEFAULT_MAX_REQUEST_PIXELS = 120_000_000
DEFAULT_MAX_REQUEST_PAGES = 64


def decode_base64(data: str) -> bytes:
    """Plain base64 or a ``data:image/...;base64,`` URL; line breaks and
    spaces in it are left out (the ``base64`` tool's output wraps at 76)."""
    if data.startswith("data:"):
        _, _, data = data.partition(",")
    try:
        return base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidInputError("image is not valid base64") from e


@dataclass(frozen=True, slots=True)
class EncodedImage:
    """An image file whose header was read (``read_image``), its pixels not
    decoded yet. ``shape`` is the decoded array's, (height, width, 3), so work
    units and the checks of an image's sides read it as they read an array's."""

    data: bytes = field(repr=False)
    width: int
    height: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.height, self.width, DECODED_CHANNELS)

    def decode(self) -> np.ndarray[Any, Any]:
        return decode_image(self.data)


def pixels(image: EncodedImage | np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """An item's image as an H x W x 3 BGR array: decoded now if it is still encoded."""
    return image.decode() if isinstance(image, EncodedImage) else image


def num_pixels(image: EncodedImage | np.ndarray[Any, Any]) -> int:
    return int(image.shape[0]) * int(image.shape[1])


@dataclass(frozen=True, slots=True)
class RequestImageLimits:
    """The most pixels (width x height, summed) and pages (images) one request
    may carry; its images are decoded one at a time, but each is priced and
    each costs its decode, so a request's total is bounded too."""

    max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS
    max_request_pages: int = DEFAULT_MAX_REQUEST_PAGES


def check_request_images(
    images: Iterable[EncodedImage | np.ndarray[Any, Any]], limits: RequestImageLimits
) -> None:
    """Refuse (413, naming the request's figure and the limit) a request whose
    images are more pages or more pixels than ``limits``: read from their
    headers, before any is decoded."""
    sizes = [num_pixels(image) for image in images]
    if len(sizes) > limits.max_request_pages:
        raise PayloadTooLargeError(
            f"{len(sizes)} images in one request; at most {limits.max_request_pages:,}"
            " (max_request_pages)"
        )
    total = sum(sizes)
    if total > limits.max_request_pixels:
        raise PayloadTooLargeError(
            f"{len(sizes)} images of {total:,} pixels in all in one request; at most"
            f" {limits.max_request_pixels:,} pixels (max_request_pixels)"
        )


def read_image(raw: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> EncodedImage:
    """An image file's header, read and checked (415 for bytes that are no
    image it reads, 413 over ``max_pixels``), its pixels left encoded."""
    with _open(raw, max_pixels) as image:
        width, height = image.size
    return EncodedImage(raw, width, height)


def _open(raw: bytes, max_pixels: int) -> Image:
    """``Image.open`` (the header alone) of ``raw``, its size checked.

    Decompression bombs are refused here, before decoding: width x height
    against ``max_pixels`` (413). PIL's own bomb check (a warning, then an
    error at twice its limit) is silenced in favour of this one.
    """
    from PIL import Image, UnidentifiedImageError

    if not raw:
        raise InvalidInputError("image is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw))
    except Image.DecompressionBombError as e:
        raise PayloadTooLargeError(f"image is over the limit of {max_pixels:,} pixels: {e}") from e
    except UnidentifiedImageError as e:
        # PIL's message names the buffer object and its address: not the caller's.
        raise UnsupportedMediaError(
            "cannot decode image: not a format it reads (PNG, JPEG, WebP, BMP, TIFF, GIF...)"
        ) from e
    except (OSError, SyntaxError, ValueError) as e:
        raise UnsupportedMediaError(f"cannot decode image: {e}") from e
    width, height = image.size
    if width * height > max_pixels:
        image.close()
        raise PayloadTooLargeError(
            f"image of {width} x {height} pixels is over the limit of {max_pixels:,} pixels"
        )
    if width < 1 or height < 1:
        image.close()
        raise UnsupportedMediaError("cannot decode image: it has no pixels")
    return image


def decode_image(raw: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray[Any, Any]:
    """Image bytes (PNG, JPEG, WebP, BMP, TIFF...) to an H x W x 3 uint8 BGR array.

    The header is checked first (``_open``). At most two copies of the pixels
    are held at once: PIL's image is closed before the channels are reversed.
    """
    from PIL import Image

    image = _open(raw, max_pixels)
    try:
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        array = np.asarray(rgb, dtype=np.uint8)
        rgb.close()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise UnsupportedMediaError(f"cannot decode image: {e}") from e
    finally:
        image.close()
    if array.ndim != 3 or array.shape[0] < 1 or array.shape[1] < 1:
        raise UnsupportedMediaError("cannot decode image: it has no pixels")
    return np.ascontiguousarray(array[:, :, ::-1])


def encode_png(image: np.ndarray[Any, Any]) -> bytes:
    """A decoded (BGR) image as PNG bytes: lossless, so an engine out of process
    reads the pixels this server decoded."""
    from PIL import Image

    buffer = io.BytesIO()
    rgb = Image.fromarray(np.ascontiguousarray(image[:, :, ::-1]))
    rgb.save(buffer, format="PNG", compress_level=1)  # fast: the bytes stay on loopback
    return buffer.getvalue()


def png_data_url(image: EncodedImage | np.ndarray[Any, Any]) -> str:
    """An image (decoded, BGR, or still encoded) as a ``data:image/png;base64,``
    URL (OpenAI's ``image_url`` part, as an engine out of process takes it)."""
    return "data:image/png;base64," + base64.b64encode(encode_png(pixels(image))).decode()
