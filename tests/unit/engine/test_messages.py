"""The messages between gateways and the engine process, through a frame:
each comes back as the same typed message, its payloads as they were sent
(embeddings as writable arrays of the same dtype and shape), errors as the
same class; a frame that is no message for its reader is refused."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np
import pytest

from tessera.admission import TenantLimits
from tessera.engine import Caller
from tessera.engine.ipc import decode, encode, read_frame
from tessera.engine.messages import (
    Call,
    Cancel,
    Done,
    ErrorInfo,
    Events,
    Failed,
    Logprobs,
    Message,
    Payload,
    Piece,
    Queued,
    Reply,
    Settled,
    State,
    Submit,
    to_engine,
    to_gateway,
)
from tessera.errors import InferenceError, ModelUnavailableError, RateLimitedError, TesseraError
from tessera.metrics import RequestEvent
from tessera.tasks.types import ChatOutput, Task, TextInput, ToolCall

M = TypeVar("M")


def through(message: Message, decoder: msgspec.msgpack.Decoder[M]) -> M:
    return decode(encode(message)[4:], decoder)


def fields(message: object) -> dict[str, Any]:
    """A message's fields, payloads as their values."""
    return {
        name: value.value if isinstance(value, Payload) else value
        for name, value in msgspec.structs.asdict(message).items()  # type: ignore[arg-type]
    }


CALLER = Caller(TenantLimits("acme", qps=2.5, burst=5), tier="vip", weight=4.0)
EVENT = RequestEvent("echo", "embedding", "vip", "acme", 200, 0.01, 0.002, None)

TO_ENGINE: list[Message] = [
    Submit(1, "echo", Task.EMBEDDING, Payload([TextInput("a b")]), 2.0, CALLER, "r-1", (0,)),
    Submit(2, "echo", Task.EMBEDDING, Payload([TextInput("c")]), None, None, None, ()),
    Cancel(3),
    Call(4, "add_model", Payload((Path("/models/extra"), True))),
    Events([EVENT, EVENT]),
]
TO_GATEWAY: list[Message] = [
    Queued(1, "echo", "1", 3.0, 30.0),
    Done(1, Payload([0.5, 0.25]), 0.001, 0.002, 4, None, 0.0),
    Settled(1, 2.5, 0.003),
    Piece(1, 0, "hello"),
    Logprobs(1, 0, Payload([{"token": "a", "logprob": -0.1}])),
    Reply(4, Payload(3), None),
    State("ready", Payload({}), None, whole=True),
]


@pytest.mark.parametrize("message", TO_ENGINE, ids=lambda m: type(m).__name__)
def test_a_gateways_message_arrives_as_it_was_sent(message: Message) -> None:
    arrived = through(message, to_engine)
    assert type(arrived) is type(message)
    assert fields(arrived) == fields(message)


@pytest.mark.parametrize("message", TO_GATEWAY, ids=lambda m: type(m).__name__)
def test_an_engine_message_arrives_as_it_was_sent(message: Message) -> None:
    arrived = through(message, to_gateway)
    assert type(arrived) is type(message)
    assert fields(arrived) == fields(message)


def test_embeddings_come_back_as_writable_arrays_of_their_dtype_and_shape() -> None:
    batch = np.arange(3 * 384, dtype=np.float32).reshape(3, 384)
    for outputs in (list(batch), list(batch[:, ::2]), [np.ones((2, 3), np.float16)] * 2):
        done = through(Done(7, Payload(outputs), 0.0, 0.0, len(outputs), 1.0, 0.0), to_gateway)
        assert isinstance(done, Done)
        arrived = done.outputs.value
        assert len(arrived) == len(outputs)
        for got, sent in zip(arrived, outputs, strict=True):
            assert type(got) is np.ndarray
            assert (got.dtype, got.shape) == (sent.dtype, sent.shape)
            np.testing.assert_array_equal(got, sent)
            assert got.flags.writeable


def test_other_outputs_come_back_as_the_objects_they_were() -> None:
    chat = ChatOutput("hi", 3, 1, "tool_calls", tool_calls=(ToolCall("c1", "f", "{}"),))
    mixed: list[Any] = [np.zeros(4, np.float32), np.zeros(5, np.float32)]  # two shapes
    for outputs in ([chat], mixed, [np.float32(1.5)], []):
        done = through(Done(7, Payload(outputs), 0.0, 0.0, 1, 1.0, 0.0), to_gateway)
        assert isinstance(done, Done)
        assert [type(o) for o in done.outputs.value] == [type(o) for o in outputs]
        assert repr(done.outputs.value) == repr(outputs)


def raised_through(error: BaseException) -> TesseraError:
    failed = through(Failed(1, ErrorInfo.of(error)), to_gateway)
    assert isinstance(failed, Failed)
    return failed.error.exception()


def test_an_error_arrives_as_the_same_class_message_and_fields() -> None:
    sent = RateLimitedError("too fast", reason="rate", retry_after_s=np.float64(2.5), limit=5)
    error = raised_through(sent)
    assert type(error) is RateLimitedError
    assert str(error) == "too fast"
    assert (error.reason, error.retry_after_s, error.limit) == ("rate", 2.5, 5)
    unavailable = raised_through(ModelUnavailableError("m", "no room", retry_after_s=1.0))
    assert type(unavailable) is ModelUnavailableError
    assert vars(unavailable) == {"name": "m", "reason": "no room", "retry_after_s": 1.0}


def test_an_error_that_cannot_travel_arrives_as_an_inference_error() -> None:
    other = raised_through(KeyError("secret"))
    assert type(other) is InferenceError
    assert "KeyError" in str(other)
    assert "secret" not in str(other)
    odd = ModelUnavailableError("m", "x")
    odd.reason = ["not", "a", "scalar"]  # type: ignore[assignment]
    assert type(raised_through(odd)) is InferenceError


def test_a_frame_that_is_no_message_for_its_reader_is_refused() -> None:
    with pytest.raises(ValueError, match="cancel"):
        through(Cancel(1), to_gateway)  # a gateway's message, read by a gateway
    with pytest.raises(ValueError, match="Expected"):
        decode(msgspec.msgpack.encode(["queued", "one"]), to_gateway)


async def test_a_frame_over_the_bound_is_refused() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data((1 << 31).to_bytes(4, "big"))
    with pytest.raises(ValueError, match="over the bound"):
        await read_frame(reader, to_engine)
