"""Frames between the engine process and its gateway processes.

A frame is a 4-byte big-endian length and one message (``engine/messages.py``
says what travels, and how) as MessagePack. A reader decodes by what its end
receives (``messages.to_engine``, ``messages.to_gateway``): a frame that is
not such a message is a ``ValueError``, as a length over the bound is.
"""

from __future__ import annotations

import asyncio
import struct
from typing import TypeVar

import msgspec

from .messages import Message, encode_into

T = TypeVar("T")

_LENGTH = struct.Struct("!I")
# A frame larger than this is refused (both ends are ours; a bound still
# keeps a corrupt length from asking for gigabytes).
MAX_FRAME_BYTES = 1 << 30


def encode(message: Message) -> bytearray:
    """A frame of ``message``."""
    frame = bytearray(_LENGTH.size)
    encode_into(message, frame, _LENGTH.size)
    _LENGTH.pack_into(frame, 0, len(frame) - _LENGTH.size)
    return frame


def decode(body: bytes | bytearray, decoder: msgspec.msgpack.Decoder[T]) -> T:
    """The message of a frame's ``body`` (its bytes after the length)."""
    return decoder.decode(body)  # a msgspec.DecodeError is a ValueError


class FrameWriter:
    """Frames to one peer, written together once per turn of the event loop:
    an answer's messages, and many requests' at high rates, cost one system
    call rather than one each."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self._frames: list[bytearray] = []

    def send(self, message: Message) -> None:
        """Queue ``message`` (on the event loop's thread)."""
        self.send_frame(encode(message))

    def send_frame(self, frame: bytearray) -> None:
        """Queue a frame ``encode`` made (one encoding for many peers), after
        the messages queued before it."""
        if self.writer.is_closing():
            return
        if not self._frames:
            asyncio.get_running_loop().call_soon(self._flush)
        self._frames.append(frame)

    def _flush(self) -> None:
        frames, self._frames = self._frames, []
        if frames and not self.writer.is_closing():
            self.writer.write(b"".join(frames))

    def close(self) -> None:
        self._flush()
        self.writer.close()


async def read_frame(reader: asyncio.StreamReader, decoder: msgspec.msgpack.Decoder[T]) -> T | None:
    """The next message, or None at the end of the stream."""
    try:
        head = await reader.readexactly(_LENGTH.size)
    except asyncio.IncompleteReadError:
        return None
    (length,) = _LENGTH.unpack(head)
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {length} bytes is over the bound")
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        return None
    return decode(body, decoder)
