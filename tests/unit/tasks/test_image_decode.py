"""Images as callers send them: base64 wrapped as the ``base64`` tool wraps it,
and bytes that are no image, refused without PIL's object addresses."""

from __future__ import annotations

import base64
import io
import textwrap

import numpy as np
import pytest
from PIL import Image

from tessera.errors import InvalidInputError, UnsupportedMediaError
from tessera.tasks.image import decode_base64, decode_image


def png(width: int = 40, height: int = 30) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), 200, dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def test_base64_wrapped_at_76_or_with_spaces_is_the_same_image() -> None:
    raw = png()
    encoded = base64.b64encode(raw).decode()
    wrapped = "\n".join(textwrap.wrap(encoded, 76)) + "\n"
    assert decode_base64(wrapped) == raw
    assert decode_base64(f"data:image/png;base64, {wrapped}") == raw
    with pytest.raises(InvalidInputError, match="not valid base64"):
        decode_base64(encoded[:-3] + "!!!")


def test_bytes_that_are_no_image_say_so_without_an_address() -> None:
    with pytest.raises(UnsupportedMediaError) as refused:
        decode_image(b"not an image at all")
    assert "0x" not in str(refused.value)
    assert "not a format it reads" in str(refused.value)
    assert decode_image(png()).shape == (30, 40, 3)
