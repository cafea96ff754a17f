"""The messages between the gateway processes and the engine process.

One engine process per device owns the queues, the fair scheduler, admission
(rates, concurrency and quotas are counted there, so they are exact however
many gateways there are), residency and the device; the gateway processes do
HTTP, authentication, JSON and the audit, and hand each request to the engine
as it came (``engine/core.py`` serves, ``engine/remote.py`` is a gateway's
end). Each message is a msgspec ``Struct`` with a tag, the same class at both
ends; a frame (``engine/ipc.py``) holds one, as a MessagePack array: its tag,
then its fields in order.

A gateway sends (``ToEngine``):

- ``Submit``: queue a request. ``streamed``: the items whose ``on_text`` and
  ``on_logprobs`` the gateway keeps (they are sent as None); their text
  comes back as ``Piece`` messages, and where logprobs are asked for, a
  piece's tokens as a ``Logprobs`` message just before it.
- ``Cancel``: the request's caller left.
- ``Call``: an admin call (load, unload, add_model, remove_model).
- ``Events``: requests the gateway answered, for the metrics the engine
  process serves.

The engine process sends (``ToGateway``):

- ``Queued`` or ``Failed`` at once for a ``Submit``; then ``Done`` or
  ``Failed``. ``Done.units`` is the request's charge, or None when it is
  settled later (a generation stops at its next step), as ``Settled``; a
  request that failed once queued is charged by a ``Settled`` too.
- ``Piece`` (after ``Logprobs``, where asked for) while a streamed chat
  generates.
- ``Reply`` for a ``Call``, just after a whole ``State``: the gateway reads
  what the call changed before its answer.
- ``State`` every ``state_interval_s``, after each call, and first on each
  connection: what a gateway reads models, probes and ``/v2`` from.
  ``served`` is None when the served models are those of the last state:
  the interval's states carry them only when a model was added, versioned or
  removed (a hundred models' specs are a quarter of a state's cost).
  ``whole``: each model's ``recent_batches`` is its whole window (a
  gateway's first state, a call's); else only the batches run since the last
  interval's state, which the gateway adds to the windows it keeps (a
  hundred models' whole windows are over a megabyte: too much to encode on
  the engine's loop four times a second).

Scalars, the task, the caller and request events travel as MessagePack and
are checked against the message's types on arrival. Requests' inputs and
outputs, the snapshot, the served specs and admin values are ``Payload``s:
Python objects as they are (task inputs and outputs are many dataclasses, of
every task, and MessagePack would return them as maps), pickled. Both ends
are processes of one server, started by one command, over a Unix socket in
its own 0700 data folder: what arrives was sent by a trusted peer. A list of
numpy arrays of one dtype and shape (embeddings) travels as one block of
bytes instead: pickling each array costs more than the request's other
messages together.

Errors travel by class name and scalar attributes (``ErrorInfo``): a
``TesseraError`` comes back as the same class with the same message and
fields (the gateway's error handlers then answer as they would in one
process); anything else as an ``InferenceError`` whose cause is in the
engine's log.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np

from tessera import errors
from tessera.errors import InferenceError, TesseraError
from tessera.metrics import EngineStats, RequestEvent
from tessera.tasks.types import Task

from .lifecycle import ServedModel
from .types import Caller

T = TypeVar("T")

Scalar = str | int | float | bool | None


class Payload(Generic[T]):
    """A Python object carried as it is (module notes)."""

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Payload({self.value!r})"


class ErrorInfo(msgspec.Struct, frozen=True, array_like=True):
    """An error as it travels: its class's name in ``tessera.errors``, its
    arguments and its attributes."""

    name: str
    args: tuple[Scalar, ...]
    fields: dict[str, Scalar]

    @classmethod
    def of(cls, error: BaseException) -> ErrorInfo:
        """A ``TesseraError`` as it is; another exception, or one with an
        attribute that is not a scalar, as an ``InferenceError`` that says
        where its cause is."""
        if isinstance(error, TesseraError) and getattr(errors, type(error).__name__, None) is (
            type(error)
        ):
            try:
                args = tuple(_scalar(arg) for arg in error.args)
                fields = {name: _scalar(value) for name, value in vars(error).items()}
            except TypeError:
                pass
            else:
                return cls(type(error).__name__, args, fields)
        cause = InferenceError(
            f"the engine failed on this request ({type(error).__name__});"
            " the cause is in the server log"
        )
        return cls(type(cause).__name__, cause.args, {})

    def exception(self) -> TesseraError:
        """The error, as the engine raised it."""
        cls = getattr(errors, self.name, None)
        if not isinstance(cls, type) or not issubclass(cls, TesseraError):
            return InferenceError(f"the engine failed ({self.name})")
        error = cls.__new__(cls)
        Exception.__init__(error, *self.args)
        vars(error).update(self.fields)
        return error


class Message(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """A message between a gateway and the engine process."""


# -- a gateway to the engine process ------------------------------------------


class Submit(Message, frozen=True, tag="submit"):
    call_id: int
    model: str
    task: Task
    items: Payload[list[Any]]
    timeout_s: float | None
    caller: Caller | None
    request_id: str | None
    streamed: tuple[int, ...]


class Cancel(Message, frozen=True, tag="cancel"):
    call_id: int


class Call(Message, frozen=True, tag="call"):
    call_id: int
    method: str
    args: Payload[tuple[Any, ...]]


class Events(Message, frozen=True, tag="events"):
    events: list[RequestEvent]


# -- the engine process to a gateway ------------------------------------------


class Queued(Message, frozen=True, tag="queued"):
    call_id: int
    model: str
    version: str
    units: float
    timeout_s: float


class Failed(Message, frozen=True, tag="error"):
    call_id: int
    error: ErrorInfo


class Done(Message, frozen=True, tag="done"):
    call_id: int
    outputs: Payload[list[Any]]
    queued_s: float
    run_s: float
    batch_size: int
    units: float | None
    device_s: float  # its share of its batches' run time (``tessera.costs``), when settled


class Settled(Message, frozen=True, tag="settled"):
    call_id: int
    units: float
    device_s: float


class Piece(Message, frozen=True, tag="piece"):
    call_id: int
    item: int
    text: str


class Logprobs(Message, frozen=True, tag="logprobs"):
    call_id: int
    item: int
    tokens: Payload[Any]


class Reply(Message, frozen=True, tag="reply"):
    """A call's value, or the error it raised."""

    call_id: int
    value: Payload[Any] | None
    error: ErrorInfo | None


class State(Message, frozen=True, tag="state"):
    phase: str
    served: Payload[dict[str, ServedModel]] | None
    snapshot: Payload[EngineStats] | None
    whole: bool


ToEngine = Submit | Cancel | Call | Events
ToGateway = Queued | Failed | Done | Settled | Piece | Logprobs | Reply | State


# -- the codec -----------------------------------------------------------------

_PICKLED = 1
_ARRAYS = 2
# An arrays block's head: its dtype's name, the number of arrays, their rank;
# then their shape (a 4-byte count a dimension), then the arrays' bytes.
_HEAD = struct.Struct("!8sII")


def _scalar(value: object) -> Scalar:
    """``value`` as the plain scalar it is (a numpy float as a float); a
    TypeError if it is none."""
    if value is None:
        return None
    for kind in (bool, int, float, str):
        if isinstance(value, kind):
            return kind(value)
    raise TypeError(f"{type(value).__name__} is not a scalar")


def _arrays(value: object) -> list[np.ndarray[Any, Any]] | None:
    """``value`` if it is a non-empty list of numpy arrays (not scalars) of
    one numeric dtype and one shape; else None."""
    if type(value) is not list or not value:
        return None
    first = value[0]
    if type(first) is not np.ndarray or first.ndim == 0 or first.dtype.kind not in "biufc":
        return None
    dtype, shape = first.dtype, first.shape
    for array in value:
        if type(array) is not np.ndarray or array.dtype != dtype or array.shape != shape:
            return None
    return value


def _enc_hook(obj: object) -> msgspec.msgpack.Ext:
    if not isinstance(obj, Payload):
        raise NotImplementedError(f"{type(obj).__name__} is not a message's field type")
    arrays = _arrays(obj.value)
    if arrays is None:
        return msgspec.msgpack.Ext(_PICKLED, pickle.dumps(obj.value, protocol=5))
    first = arrays[0]
    head = _HEAD.pack(first.dtype.str.encode(), len(arrays), first.ndim)
    shape = struct.pack(f"!{first.ndim}I", *first.shape)
    blocks = ((a if a.flags.c_contiguous else np.ascontiguousarray(a)).data for a in arrays)
    return msgspec.msgpack.Ext(_ARRAYS, b"".join((head, shape, *blocks)))


def _ext_hook(code: int, data: memoryview) -> Payload[Any]:
    if code == _PICKLED:
        return Payload(pickle.loads(data))
    if code != _ARRAYS:
        raise ValueError(f"an unknown extension {code}")
    dtype, count, ndim = _HEAD.unpack_from(data)
    shape = struct.unpack_from(f"!{ndim}I", data, _HEAD.size)
    # A copy: writable arrays, as unpickled ones are, that outlive the frame.
    block = bytearray(data[_HEAD.size + 4 * ndim :])
    arrays = np.frombuffer(block, np.dtype(dtype.rstrip(b"\0").decode()))
    return Payload(list(arrays.reshape((count, *shape))))


def _dec_hook(kind: type, obj: object) -> object:
    if isinstance(obj, Payload):
        return obj
    raise TypeError(f"expected a payload, got {type(obj).__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
to_engine: msgspec.msgpack.Decoder[ToEngine] = msgspec.msgpack.Decoder(
    ToEngine, ext_hook=_ext_hook, dec_hook=_dec_hook
)
to_gateway: msgspec.msgpack.Decoder[ToGateway] = msgspec.msgpack.Decoder(
    ToGateway, ext_hook=_ext_hook, dec_hook=_dec_hook
)


def encode_into(message: Message, buffer: bytearray, offset: int) -> None:
    """``message`` encoded into ``buffer`` from ``offset`` on (which it ends)."""
    _encoder.encode_into(message, buffer, offset)
