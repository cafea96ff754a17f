"""gRPC's bounds on what a caller sends before its call runs: a message as
large as an HTTP body and little more, and a call's metadata
(``grpc_kserve._limits``), on the real app over fake models."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest

from harness.fake_models import fake_embedding
from serverproc import free_port
from tessera.engine import Engine
from tessera.gateway import create_app

grpc = pytest.importorskip("grpc")
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402

from tessera.gateway.grpc_kserve import (  # noqa: E402
    GRPC_FRAMING_BYTES,
    GRPC_MAX_METADATA_BYTES,
    start_grpc,
)

MAX_BODY_BYTES = 64 * 1024


@pytest.fixture
async def stub(engine: Engine) -> AsyncIterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    app = create_app(engine, max_body_bytes=MAX_BODY_BYTES)
    port = free_port()
    server = await start_grpc(app, "127.0.0.1", port)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    finally:
        await server.stop(None)


def infer_of(text: bytes) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="embed")
    request.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(len(text).to_bytes(4, "little") + text)
    return request


async def test_a_message_far_over_the_body_cap_is_refused_by_grpc(
    stub: service_pb2_grpc.GRPCInferenceServiceStub,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.ModelInfer(infer_of(b"x" * (MAX_BODY_BYTES + GRPC_FRAMING_BYTES)))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_a_message_just_over_the_body_cap_gets_the_apps_answer(
    stub: service_pb2_grpc.GRPCInferenceServiceStub,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.ModelInfer(infer_of(b"x" * MAX_BODY_BYTES))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # HTTP's 413


async def test_metadata_over_the_cap_is_refused_every_time_and_under_it_served(
    stub: service_pb2_grpc.GRPCInferenceServiceStub,
) -> None:
    big = [("x-big", "a" * (GRPC_MAX_METADATA_BYTES + 1))]
    for _ in range(5):  # grpcio's default refused some calls over 8 KiB, at random
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ModelInfer(infer_of(b"a"), metadata=big)
        assert refused.value.code() in (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.INTERNAL,
        )
    fits = [("x-fits", "a" * (GRPC_MAX_METADATA_BYTES // 2))]
    for _ in range(5):
        answer = await stub.ModelInfer(infer_of(b"a"), metadata=fits)
        vector = np.frombuffer(answer.raw_output_contents[0], dtype="<f4")
        np.testing.assert_allclose(vector, fake_embedding("a"), rtol=1e-6)
