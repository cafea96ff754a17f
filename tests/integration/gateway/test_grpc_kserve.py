"""KServe v2 over gRPC (``gateway/grpc_kserve.py``) on the real app over fake
models: tritonclient's aio client, and the raw stub for what it never sends."""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import pytest_asyncio

from harness.fake_models import fake_classify, fake_embedding
from serverproc import free_port
from tessera.engine import Engine
from tessera.gateway import create_app
from tessera.tenants import TenantStore

grpc = pytest.importorskip("grpc")
triton = pytest.importorskip("tritonclient.grpc.aio")
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from tessera.gateway.grpc_kserve import _headers, start_grpc  # noqa: E402


@contextlib.asynccontextmanager
async def grpc_server(engine: Engine) -> AsyncIterator[str]:
    """The gRPC face of ``engine``'s app; its address."""
    app = create_app(engine, max_body_bytes=64 * 1024)
    port = free_port()
    server = await start_grpc(app, "127.0.0.1", port)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@pytest.fixture
async def address(engine: Engine) -> AsyncIterator[str]:
    async with grpc_server(engine) as address:
        yield address


# One server for the module's calls that leave nothing behind (answers, refusals).
@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared_address(shared_engine: Engine) -> AsyncIterator[str]:
    async with grpc_server(shared_engine) as address:
        yield address


def texts_input(texts: list[str]) -> object:
    tensor = triton.InferInput("TEXT", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    return tensor


async def test_infer_answers_embeddings_and_labels_as_the_models_do(shared_address: str) -> None:
    async with triton.InferenceServerClient(shared_address) as client:
        result = await client.infer("embed", [texts_input(["a b", "c"])], request_id="r-1")
        np.testing.assert_allclose(
            result.as_numpy("EMBEDDING"), [fake_embedding("a b"), fake_embedding("c")], rtol=1e-6
        )
        assert result.get_response().id == "r-1"
        # Metadata named as the headers the translation writes are not taken for them.
        lying = {"content-length": "1", "inference-header-content-length": "2"}
        again = await client.infer("embed", [texts_input(["c"])], headers=lying)
        np.testing.assert_allclose(again.as_numpy("EMBEDDING"), [fake_embedding("c")], rtol=1e-6)
        labels = await client.infer("intent", [texts_input(["hello"])])
        expected = fake_classify("hello").labels[0]
        assert labels.as_numpy("LABEL").tolist() == [expected.label.encode()]
        np.testing.assert_allclose(labels.as_numpy("SCORE"), [expected.score], rtol=1e-6)
        # Only the output asked for comes back.
        only = await client.infer(
            "intent", [texts_input(["hello"])], outputs=[triton.InferRequestedOutput("SCORE")]
        )
        assert [o.name for o in only.get_response().outputs] == ["SCORE"]
        # A reranker's two inputs, each in its raw contents.
        query = triton.InferInput("QUERY", [1], "BYTES")
        query.set_data_from_numpy(np.array([b"abc"], dtype=object))
        ranked = await client.infer("rerank", [query, texts_input(["abc", "xy"])])
        expected = [float(fake_embedding("abc") @ fake_embedding(d)) for d in ("abc", "xy")]
        np.testing.assert_allclose(ranked.as_numpy("SCORE"), expected, rtol=1e-5)


async def test_texts_in_bytes_contents_are_read_as_in_raw_contents(shared_address: str) -> None:
    request = service_pb2.ModelInferRequest(model_name="embed")
    tensor = request.inputs.add(name="TEXT", datatype="BYTES", shape=[2])
    tensor.contents.bytes_contents.extend([b"a b", b"c"])
    async with grpc.aio.insecure_channel(shared_address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        response = await stub.ModelInfer(request)
    vectors = np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(2, -1)
    np.testing.assert_allclose(vectors, [fake_embedding("a b"), fake_embedding("c")], rtol=1e-6)


async def test_raw_contents_are_for_every_input_or_none_as_triton_holds(
    shared_address: str,
) -> None:
    both = service_pb2.ModelInferRequest(model_name="embed")
    tensor = both.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.append(b"a")
    both.raw_input_contents.append(b"\x01\x00\x00\x00b")
    extra = service_pb2.ModelInferRequest(model_name="embed")
    extra.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
    extra.raw_input_contents.extend([b"\x01\x00\x00\x00b", b"\x01\x00\x00\x00c"])
    async with grpc.aio.insecure_channel(shared_address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for request, says in ((both, "both contents and raw"), (extra, "2 entries for 1")):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ModelInfer(request)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert says in str(refused.value.details())


async def test_image_files_in_bytes_contents_stay_bytes(shared_address: str) -> None:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (9, 5)).save(buffer, format="PNG")  # its bytes hold NULs and non-UTF-8
    request = service_pb2.ModelInferRequest(model_name="ocr")
    tensor = request.inputs.add(name="IMAGE", datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.append(buffer.getvalue())
    async with grpc.aio.insecure_channel(shared_address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        response = await stub.ModelInfer(request)
    assert [o.name for o in response.outputs][:2] == ["TEXT", "LINE_TEXT"]
    assert response.raw_output_contents[0] == b"\x03\x00\x00\x009x5"


async def test_a_generation_takes_numbers_and_parameters_raw_and_in_contents(
    shared_address: str,
) -> None:
    prompt = triton.InferInput("text_input", [1, 1], "BYTES")
    prompt.set_data_from_numpy(np.array([[b"one two three"]], dtype=object))
    tokens = triton.InferInput("max_tokens", [1, 1], "INT32")
    tokens.set_data_from_numpy(np.array([[2]], dtype=np.int32))
    async with triton.InferenceServerClient(shared_address) as client:
        result = await client.infer(
            "chat",
            [prompt, tokens],
            parameters={"temperature": 0.5, "return_num_input_tokens": True},
        )
    assert result.as_numpy("text_output").tolist() == [[b"one two three "]]
    assert result.as_numpy("num_input_tokens").tolist() == [[1]]
    # Numbers in ``contents``, as clients other than tritonclient send them.
    request = service_pb2.ModelInferRequest(model_name="chat")
    text = request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    text.contents.bytes_contents.append(b"a b")
    seed = request.inputs.add(name="random_seed", datatype="UINT64", shape=[1])
    seed.contents.uint64_contents.append(7)
    flag = request.inputs.add(name="exclude_input_in_output", datatype="BOOL", shape=[1])
    flag.contents.bool_contents.append(False)
    request.parameters["max_tokens"].int64_param = 5
    async with grpc.aio.insecure_channel(shared_address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        response = await stub.ModelInfer(request)
        assert response.raw_output_contents[0] == b"\x07\x00\x00\x00a ba b "
        request.parameters["top_k"].int64_param = 9
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.ModelInfer(request)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "top-k sampling is not served" in str(error.value.details())


def generation_inputs(prompt: str, stream: bool) -> list[object]:
    text = triton.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    flag = triton.InferInput("stream", [1], "BOOL")
    flag.set_data_from_numpy(np.array([stream]))
    return [text, flag]


async def test_a_stream_answers_each_request_as_it_comes(shared_address: str) -> None:
    async def requests() -> AsyncIterator[dict[str, object]]:
        yield {
            "model_name": "chat",
            "inputs": generation_inputs("one two three", True),
            "request_id": "g",
        }
        yield {
            "model_name": "chat",
            "inputs": generation_inputs("four five", False),
            "request_id": "w",
        }
        yield {"model_name": "embed", "inputs": [texts_input(["x"])], "request_id": "e"}
        empty = triton.InferInput("TEXT", [1], "BYTES")  # declared, never filled
        yield {"model_name": "embed", "inputs": [empty], "request_id": "bad"}
        yield {"model_name": "nope", "inputs": [texts_input(["x"])], "request_id": "lost"}

    answers: dict[str, list[object]] = {}
    errors: list[str] = []
    async with triton.InferenceServerClient(shared_address) as client:
        async for result, error in client.stream_infer(requests()):
            if error is not None:
                errors.append(str(error.message()))
                continue
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param
            name = "text_output" if response.model_name == "chat" else "EMBEDDING"
            answers.setdefault(response.id, []).append((result.as_numpy(name).tolist(), final))
    # The streamed generation a piece a response, none of them final (no empty
    # final response was asked for); the rest one final response each.
    assert answers["g"] == [([b"one "], False), ([b"two "], False), ([b"three "], False)]
    assert answers["w"] == [([b"four five "], True)]
    assert answers["e"] == [([fake_embedding("x").tolist()], True)]
    assert sorted(errors) == [
        "input 'TEXT' has shape [1] (1 elements) but 0 strings",
        "model 'nope' not found",
    ]


async def test_an_empty_final_response_ends_a_streamed_generation_where_asked(
    shared_address: str,
) -> None:
    import tritonclient.grpc as triton_sync

    def generate() -> list[tuple[list[bytes], bool]]:
        got: queue.Queue[tuple[object, object]] = queue.Queue()
        client = triton_sync.InferenceServerClient(shared_address)
        try:
            client.start_stream(callback=lambda result, error: got.put((result, error)))
            client.async_stream_infer(
                "chat", generation_inputs("a b", True), enable_empty_final_response=True
            )
            responses = []
            while not responses or not responses[-1][1]:
                result, error = got.get(timeout=30)
                assert error is None, error
                response = result.get_response()  # type: ignore[attr-defined]
                final = response.parameters["triton_final_response"].bool_param
                responses.append(([o.name for o in response.outputs], final))
            client.stop_stream()
            return responses
        finally:
            client.close()

    assert await asyncio.to_thread(generate) == [
        (["text_output"], False),
        (["text_output"], False),
        ([], True),
    ]


async def test_tritonclient_loads_and_unloads_over_grpc(address: str) -> None:
    async with triton.InferenceServerClient(address) as client:

        async def state() -> str:
            index = (await client.get_model_repository_index()).models
            return next(model.state for model in index if model.name == "mt")

        assert await state() == "UNAVAILABLE"
        await client.load_model("mt")
        assert await state() == "READY"
        await client.unload_model("mt", unload_dependents=True)
        assert await state() == "UNAVAILABLE"
        with pytest.raises(InferenceServerException) as refused:
            await client.load_model("mt", config='{"max_batch_size": 8}')
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        with pytest.raises(InferenceServerException) as missing:
            await client.unload_model("nope")
        assert missing.value.status() == "StatusCode.NOT_FOUND"
    async with grpc.aio.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.RepositoryModelLoadRequest(repository_name="other", model_name="mt")
        with pytest.raises(grpc.aio.AioRpcError) as named:
            await stub.RepositoryModelLoad(request)
    assert named.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("model", "status", "says"),
    [
        ("nope", "StatusCode.NOT_FOUND", "'nope' not found"),
        ("a b", "StatusCode.NOT_FOUND", "'a b' not found"),  # named as HTTP names it
        ("chat", "StatusCode.INVALID_ARGUMENT", "'text_input' is missing"),
        ("broken", "StatusCode.UNAVAILABLE", "broken"),
    ],
)
async def test_errors_take_their_grpc_status_and_message(
    shared_address: str, model: str, status: str, says: str
) -> None:
    async with triton.InferenceServerClient(shared_address) as client:
        with pytest.raises(InferenceServerException) as error:
            await client.infer(model, [texts_input(["x"])])
    assert error.value.status() == status
    assert says in str(error.value.message())


async def test_a_call_its_client_cancels_is_counted_499_as_http_counts_it(
    engine: Engine,
) -> None:
    app = create_app(engine, max_body_bytes=64 * 1024)
    port = free_port()
    server = await start_grpc(app, "127.0.0.1", port)
    try:
        request = service_pb2.ModelInferRequest(model_name="slow")  # a batch runs 0.1 s
        tensor = request.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
        tensor.contents.bytes_contents.append(b"x")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
            await asyncio.sleep(0.03)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            for _ in range(200):  # recorded once the batch it was in ends
                metrics = (await client.get("/metrics")).text
                counted = [
                    line
                    for line in metrics.splitlines()
                    if line.startswith("tessera_requests_total") and 'model="slow"' in line
                ]
                if counted:
                    break
                await asyncio.sleep(0.01)
        assert any('status="499"' in line for line in counted), counted
        assert not any('status="500"' in line for line in counted)
    finally:
        await server.stop(None)


async def test_readiness_asked_without_a_key_is_unauthenticated_not_unready(
    engine: Engine, tmp_path: Path
) -> None:
    with TenantStore(tmp_path / "data") as store:
        store.add_tenant("acme")
        key = store.create_key("acme").key
        app = create_app(engine, tenant_store=store)
        port = free_port()
        server = await start_grpc(app, "127.0.0.1", port)
        try:
            async with triton.InferenceServerClient(f"127.0.0.1:{port}") as client:
                assert await client.is_model_ready(
                    "embed", headers={"authorization": f"Bearer {key}"}
                )
                with pytest.raises(InferenceServerException) as refused:
                    await client.is_model_ready("embed")
            assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
        finally:
            await server.stop(None)


async def test_metadata_config_readiness_and_the_index(shared_address: str) -> None:
    async with triton.InferenceServerClient(shared_address) as client:
        assert await client.is_server_live()
        metadata = await client.get_model_metadata("embed")
        assert [(t.name, t.datatype) for t in metadata.outputs] == [("EMBEDDING", "FP32")]
        config = (await client.get_model_config("intent")).config
        assert [o.name for o in config.output] == ["LABEL", "SCORE"]
        assert await client.is_model_ready("embed")  # preloaded
        assert not await client.is_model_ready("nope")
        index = await client.get_model_repository_index()
        assert {"embed", "intent"} <= {m.name for m in index.models}


async def test_what_is_not_served_is_unimplemented(
    shared_address: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with grpc.aio.insecure_channel(shared_address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.SystemSharedMemoryStatus(service_pb2.SystemSharedMemoryStatusRequest())
        with pytest.raises(grpc.aio.AioRpcError) as traced:
            await stub.TraceSetting(service_pb2.TraceSettingRequest())
    assert error.value.code() == traced.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "SystemSharedMemoryStatus is not served" in str(error.value.details())
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # no traceback a call


class Context:
    """What ``_headers`` reads of a call's context: its metadata and deadline."""

    def __init__(self, metadata: tuple[tuple[str, str], ...], remaining: float | None) -> None:
        self.metadata, self.remaining = metadata, remaining

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def time_remaining(self) -> float | None:
        return self.remaining


def test_the_calls_deadline_is_the_requests_timeout() -> None:
    key = ("authorization", "Bearer k")
    assert _headers(Context((key,), 2.5)) == [key, ("x-request-timeout", "2.500")]
    assert _headers(Context((key,), None)) == [key]
    # A timeout the caller named in its metadata is kept as it is.
    named = ("x-request-timeout", "9")
    assert _headers(Context((named,), 2.5)) == [named]
