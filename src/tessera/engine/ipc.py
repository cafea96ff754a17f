"""Frames between the engine process and its gateway processes.

A frame is a 4-byte big-endian length and a pickle (protocol 5) of a tuple
whose first element names the message. Both ends are processes of one
server, started by one command, over a Unix socket in the server's own
0700 data folder: what arrives was sent by a trusted peer, so pickle (which
carries numpy arrays, dataclasses and the task types as they are) is the
codec. The engine process ships the requests' inputs and outputs unchanged.

Errors travel by class and attributes (``encode_error``): a ``TesseraError``
comes back as the same class with the same message and fields (the
gateway's error handlers then answer as they would in one process);
anything else as an ``InferenceError`` whose cause is in the engine's log.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from typing import Any

from tessera import errors
from tessera.errors import InferenceError, TesseraError

_LENGTH = struct.Struct("!I")
# A frame larger than this is refused (both ends are ours; a bound still
# keeps a corrupt length from asking for gigabytes).
MAX_FRAME_BYTES = 1 << 30


def encode(message: tuple[Any, ...]) -> bytes:
    body = pickle.dumps(message, protocol=5)
    return _LENGTH.pack(len(body)) + body


class FrameWriter:
    """Frames to one peer, written together once per turn of the event loop:
    an answer's messages, and many requests' at high rates, cost one system
    call rather than one each."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self._frames: list[bytes] = []

    def send(self, message: tuple[Any, ...]) -> None:
        """Queue ``message`` (on the event loop's thread)."""
        self.send_frame(encode(message))

    def send_frame(self, frame: bytes) -> None:
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


async def read_frame(reader: asyncio.StreamReader) -> tuple[Any, ...] | None:
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
    message = pickle.loads(body)
    if not isinstance(message, tuple) or not message:
        raise ValueError("a frame is a non-empty tuple")
    return message


def encode_error(error: BaseException) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """(class name, args, fields) of a ``TesseraError``; another exception
    becomes an ``InferenceError`` that says where its cause is."""
    if not isinstance(error, TesseraError) or getattr(errors, type(error).__name__, None) is not (
        type(error)
    ):
        error = InferenceError(
            f"the engine failed on this request ({type(error).__name__});"
            " the cause is in the server log"
        )
    return type(error).__name__, error.args, dict(vars(error))


def decode_error(encoded: tuple[str, tuple[Any, ...], dict[str, Any]]) -> TesseraError:
    name, args, fields = encoded
    cls = getattr(errors, name, None)
    if not isinstance(cls, type) or not issubclass(cls, TesseraError):
        return InferenceError(f"the engine failed ({name})")
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    vars(error).update(fields)
    return error
