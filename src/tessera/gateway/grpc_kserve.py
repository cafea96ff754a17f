"""KServe v2 over gRPC (Triton's ``inference.GRPCInferenceService``), for
``tritonclient.grpc`` and the other clients of that protocol.

``grpc_port`` (config file, ``--grpc-port``) starts a ``grpc.aio`` server on
the app's event loop, beside HTTP. Each call is translated to the HTTP
route of the same meaning and run through the app itself, in process (an
ASGI call, no socket): keys, tenant limits, fair scheduling, audit and
metrics are the HTTP API's, exactly, and so are the answers. The call's
metadata become the request's headers (``authorization: Bearer KEY``, as
tritonclient sends its ``headers``), its peer the request's client.

- ``ModelInfer``: inputs in ``raw_input_contents`` (tritonclient's way:
  BYTES elements each after a 4-byte little-endian length, numbers
  little-endian) or in ``contents`` (``bytes_contents``, ``int_contents``...);
  the request's ``parameters`` are the HTTP request's; outputs come back in
  ``raw_output_contents``.
  The call's deadline is the request's ``x-request-timeout``: it waits in the
  engine no longer than its caller does.
- ``ModelMetadata``, ``ModelConfig`` (Triton's ``ModelConfig`` message,
  from the JSON form of ``/v2/models/{name}/config``), ``ModelStatistics``
  (from ``/v2/models/stats`` and its per-model forms), ``ModelReady``,
  ``ServerMetadata``, ``ServerLive``, ``ServerReady``, ``RepositoryIndex``.
- ``ModelStreamInfer`` (tritonclient's ``start_stream`` /
  ``async_stream_infer`` and the aio ``stream_infer``): each request of the
  stream is answered as it comes, side by side with the others, through
  the HTTP infer asked for server-sent events (``Accept:
  text/event-stream``): a streamed generation (``stream`` true) a response a
  piece, ``triton_final_response`` false on each, then a final one where its
  extras or ``enable_empty_final_response`` ask for it; any other request one
  response, final. A request's error is that response's ``error_message``,
  and the stream goes on.
- ``RepositoryModelLoad`` / ``RepositoryModelUnload`` (an admin key): the
  HTTP repository routes' (``kserve_repository.py``).
- The rest (shared memory, tracing, the repository's other calls) answer
  ``UNIMPLEMENTED``, as a Triton without them does.
- An HTTP error becomes its gRPC status (404 ``NOT_FOUND``, 401
  ``UNAUTHENTICATED``, 400 and 422 ``INVALID_ARGUMENT``, 429 ``RESOURCE_EXHAUSTED``,
  503 ``UNAVAILABLE``...) with the same message; a Retry-After rides in the
  trailing metadata as ``retry-after``.

The service's messages come from ``tritonclient[grpc]`` (its generated
``service_pb2``), so the extra ``tessera[grpc]`` carries that and grpcio. In
the process split each gateway process listens on the port (grpcio sets
``SO_REUSEPORT``), as they share the HTTP one.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

from tessera.config import DEFAULT_MAX_BODY_BYTES
from tessera.errors import ConfigError
from tessera.gateway.kserve import EVENT_STREAM
from tessera.gateway.kserve_tensor import HEADER_LENGTH, binary_data

if TYPE_CHECKING:
    import grpc
    from fastapi import FastAPI

log = logging.getLogger(__name__)

TIMEOUT_HEADER = "x-request-timeout"
_INSTALL_HINT = "grpc_port needs the grpc extra: pip install 'tessera[grpc]'"
# A call's metadata, as one HTTP header line may be (max_header_bytes' default).
GRPC_MAX_METADATA_BYTES = 16 * 1024
# A message's room over max_body_bytes: its names, shapes and parameters.
GRPC_FRAMING_BYTES = 64 * 1024
# HTTP statuses as gRPC's codes (by name: grpc is imported only when serving).
_CODES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    405: "UNIMPLEMENTED",
    408: "DEADLINE_EXCEEDED",
    413: "INVALID_ARGUMENT",
    415: "INVALID_ARGUMENT",
    422: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


@dataclass(frozen=True, slots=True)
class _Answer:
    """An HTTP answer of the app: status, headers (lower-case names), body."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def streamed(self) -> bool:
        """Whether it comes as server-sent events."""
        return self.headers.get("content-type", "").startswith(EVENT_STREAM)


def _scope(
    method: str, path: str, headers: Sequence[tuple[str, str]], body: bytes, client: tuple[str, int]
) -> dict[str, Any]:
    """An HTTP request's scope; ``path`` URL-encoded, as a client sends it
    (a model's name quoted within it), decoded in ``path`` as ASGI has it."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": unquote(path),
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        + [(b"content-length", str(len(body)).encode())],
        "client": client,
        "server": ("grpc", 0),
    }


def _receiver(body: bytes, gone: asyncio.Event | None) -> Callable[[], Awaitable[dict[str, Any]]]:
    """The request's ``receive``: its body, then a disconnect once ``gone`` is set."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:  # the body is read: the next wait is for a disconnect
            await (gone or asyncio.Event()).wait()
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


async def whole(chunks: AsyncIterator[_Answer]) -> _Answer:
    """An answer of ``stream_app``, its chunks joined."""
    answer, body = _Answer(500, {}, b""), []
    async for answer in chunks:
        body.append(answer.body)
    return _Answer(answer.status, answer.headers, b"".join(body))


async def stream_app(
    app: FastAPI,
    method: str,
    path: str,
    headers: Sequence[tuple[str, str]],
    body: bytes = b"",
    client: tuple[str, int] = ("127.0.0.1", 0),
    gone: asyncio.Event | None = None,
) -> AsyncIterator[_Answer]:
    """One HTTP request through ``app`` (its middleware and routes), in
    process, its answer's body as the app sends it: an answer a chunk, each
    with the status and headers. The app hears of a disconnect when ``gone``
    is set (the call was cancelled), never otherwise: its routes watch for one
    to stop work nobody waits for."""
    messages: asyncio.Queue[MutableMapping[str, Any] | None] = asyncio.Queue()

    async def send(message: MutableMapping[str, Any]) -> None:
        messages.put_nowait(message)

    async def run() -> None:
        try:
            await app(_scope(method, path, headers, body, client), _receiver(body, gone), send)
        finally:
            messages.put_nowait(None)

    running = asyncio.ensure_future(run())
    status, answer_headers = 500, {}
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                status = int(message["status"])
                for name, value in message.get("headers", []):
                    answer_headers[name.decode("latin-1").lower()] = value.decode("latin-1")
            elif message["type"] == "http.response.body":
                yield _Answer(status, answer_headers, bytes(message.get("body", b"")))
        await running  # its exception, if it raised one
    finally:
        running.cancel()


# Headers the translation writes itself: a caller's metadata of these names is dropped.
_OWN_HEADERS = frozenset({"accept", "content-length", "host", "transfer-encoding", HEADER_LENGTH})


def _headers(context: grpc.aio.ServicerContext[Any, Any]) -> list[tuple[str, str]]:
    """The call's text metadata, as request headers; its deadline, unless the
    metadata name one, as ``x-request-timeout`` (the engine's deadline for it)."""
    headers = [
        (key, value)
        for key, value in (context.invocation_metadata() or ())
        if isinstance(value, str)
        and not key.startswith(":")
        and not key.endswith("-bin")
        and key not in _OWN_HEADERS
    ]
    remaining = context.time_remaining()
    if remaining is not None and not any(key == TIMEOUT_HEADER for key, _ in headers):
        headers.append((TIMEOUT_HEADER, f"{max(remaining, 0.001):.3f}"))
    return headers


def _peer(context: grpc.aio.ServicerContext[Any, Any]) -> tuple[str, int]:
    """``ipv4:127.0.0.1:5000`` (or ``ipv6:[::1]:5000``) as (host, port)."""
    address = context.peer().partition(":")[2]
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port) if port.isdigit() else 0


def _gone(context: grpc.aio.ServicerContext[Any, Any]) -> asyncio.Event:
    """Set when the call ends: cancelled by its caller, or answered."""
    gone = asyncio.Event()
    context.add_done_callback(lambda _: gone.set())
    return gone


def _model_path(name: str, version: str, suffix: str = "") -> str:
    versioned = f"/versions/{quote(version, safe='')}" if version else ""
    return f"/v2/models/{quote(name, safe='')}{versioned}{suffix}"


class KServeService:
    """The servicer's calls, each through the app (``grpc.aio`` calls them)."""

    def __init__(self, app: FastAPI) -> None:
        from tritonclient.grpc import service_pb2

        self.app = app
        self.pb = service_pb2

    async def _get(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        method: str,
        path: str,
        body: bytes = b"",
        more_headers: Sequence[tuple[str, str]] = (),
    ) -> _Answer:
        headers = [*_headers(context), *more_headers]
        return await whole(
            stream_app(self.app, method, path, headers, body, _peer(context), _gone(context))
        )

    async def _ok(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        method: str,
        path: str,
        body: bytes = b"",
        more_headers: Sequence[tuple[str, str]] = (),
    ) -> _Answer:
        """The app's answer, or the call aborted with its error's status."""
        answer = await self._get(context, method, path, body, more_headers)
        if answer.status >= 400:
            await _abort(context, answer)
        return answer

    async def ServerLive(self, request: Any, context: Any) -> Any:
        answer = await self._get(context, "GET", "/v2/health/live")
        return self.pb.ServerLiveResponse(live=answer.status == 200)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        answer = await self._get(context, "GET", "/v2/health/ready")
        return self.pb.ServerReadyResponse(ready=answer.status == 200)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        path = _model_path(request.name, request.version, "/ready")
        answer = await self._get(context, "GET", path)
        if answer.status in (401, 403, 429):  # the key's refusal, not the model's state
            await _abort(context, answer)
        return self.pb.ModelReadyResponse(ready=answer.status == 200)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        found = (await self._ok(context, "GET", "/v2")).json()
        return self.pb.ServerMetadataResponse(
            name=found["name"], version=found["version"], extensions=found.get("extensions", [])
        )

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        path = _model_path(request.name, request.version)
        found = (await self._ok(context, "GET", path)).json()
        tensor = self.pb.ModelMetadataResponse.TensorMetadata

        def tensors(key: str) -> list[Any]:
            return [
                tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"])
                for t in found.get(key, [])
            ]

        return self.pb.ModelMetadataResponse(
            name=found["name"],
            versions=found.get("versions", []),
            platform=found.get("platform", ""),
            inputs=tensors("inputs"),
            outputs=tensors("outputs"),
        )

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        from google.protobuf import json_format
        from tritonclient.grpc import model_config_pb2

        path = _model_path(request.name, request.version, "/config")
        found = (await self._ok(context, "GET", path)).json()
        config = json_format.ParseDict(
            found, model_config_pb2.ModelConfig(), ignore_unknown_fields=True
        )
        return self.pb.ModelConfigResponse(config=config)

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        from google.protobuf import json_format

        path = "/v2/models/stats"
        if request.name:
            path = _model_path(request.name, request.version, "/stats")
        found = (await self._ok(context, "GET", path)).json()
        statistics = self.pb.ModelStatisticsResponse()
        return json_format.ParseDict(found, statistics, ignore_unknown_fields=True)

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        body = json.dumps({"ready": request.ready}).encode()
        found = (await self._ok(context, "POST", "/v2/repository/index", body)).json()
        index = self.pb.RepositoryIndexResponse.ModelIndex
        return self.pb.RepositoryIndexResponse(
            models=[
                index(
                    name=m.get("name", ""),
                    version=str(m.get("version", "")),
                    state=m.get("state", ""),
                    reason=m.get("reason", ""),
                )
                for m in found
            ]
        )

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        await self._repository(context, request, "load")
        return self.pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        await self._repository(context, request, "unload")
        return self.pb.RepositoryModelUnloadResponse()

    async def _repository(self, context: Any, request: Any, action: str) -> None:
        """A load or unload through the HTTP route (its parameters as its body's)."""
        if request.repository_name:
            import grpc

            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "repositories are not named here: every model card's is one",
            )
        parameters = {name: _parameter(value) for name, value in request.parameters.items()}
        body = json.dumps({"parameters": parameters}).encode()
        path = f"/v2/repository/models/{quote(request.model_name, safe='')}/{action}"
        await self._ok(context, "POST", path, body)

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        problem = _raw_problem(request)
        if problem is not None:
            import grpc

            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        head, blob, path = _infer_call(request)
        length = [(HEADER_LENGTH, str(len(head)))]
        return _infer_response(self.pb, await self._ok(context, "POST", path, head + blob, length))

    async def ModelStreamInfer(self, requests: AsyncIterator[Any], context: Any) -> Any:
        """Each request's responses as they come, requests answered side by
        side: a streamed generation's a piece each (infer's server-sent
        events), any other one response; an error in ``error_message``, the
        stream going on."""
        answers: asyncio.Queue[Any] = asyncio.Queue()
        done = object()

        async def read() -> None:
            running: set[asyncio.Future[None]] = set()
            try:
                async for request in requests:
                    task = asyncio.ensure_future(self._stream_answers(request, context, answers))
                    running.add(task)
                    task.add_done_callback(running.discard)
                await asyncio.gather(*running)
            finally:
                for pending in running:
                    pending.cancel()
                answers.put_nowait(done)

        reader = asyncio.ensure_future(read())
        try:
            while (answer := await answers.get()) is not done:
                yield answer
            await reader  # its exception, if reading the requests failed
        finally:
            reader.cancel()

    async def _stream_answers(
        self, request: Any, context: Any, answers: asyncio.Queue[Any]
    ) -> None:
        problem = _raw_problem(request)
        if problem is not None:
            about = _about(self.pb, request)
            answers.put_nowait(
                self.pb.ModelStreamInferResponse(error_message=problem, infer_response=about)
            )
            return
        head, blob, path = _infer_call(request)
        headers = [*_headers(context), (HEADER_LENGTH, str(len(head))), ("accept", EVENT_STREAM)]
        answer, body, events = _Answer(500, {}, b""), b"", b""
        async for answer in stream_app(
            self.app, "POST", path, headers, head + blob, _peer(context), _gone(context)
        ):
            if not answer.streamed:
                body += answer.body
                continue
            events += answer.body
            while b"\n\n" in events:
                event, _, events = events.partition(b"\n\n")
                answers.put_nowait(self._event_response(request, event))
        if answer.streamed:
            return
        answer = _Answer(answer.status, answer.headers, body)
        stream = self.pb.ModelStreamInferResponse
        if answer.status >= 400:
            answers.put_nowait(
                stream(error_message=_message_of(answer), infer_response=_about(self.pb, request))
            )
            return
        response = _infer_response(self.pb, answer)
        response.parameters["triton_final_response"].bool_param = True
        answers.put_nowait(stream(infer_response=response))

    def _event_response(self, request: Any, event: bytes) -> Any:
        """A ``ModelStreamInferResponse`` of one server-sent event of infer."""
        found = json.loads(event.removeprefix(b"data: "))
        stream = self.pb.ModelStreamInferResponse
        if "error" in found:
            return stream(
                error_message=str(found["error"]), infer_response=_about(self.pb, request)
            )
        tensor = self.pb.ModelInferResponse.InferOutputTensor
        response = self.pb.ModelInferResponse(
            model_name=found["model_name"],
            model_version=str(found.get("model_version") or ""),
            id=found.get("id", ""),
            outputs=[
                tensor(name=o["name"], datatype=o["datatype"], shape=o["shape"])
                for o in found["outputs"]
            ],
            raw_output_contents=[binary_data(o["datatype"], o["data"]) for o in found["outputs"]],
        )
        for name, value in found.get("parameters", {}).items():
            response.parameters[name].bool_param = bool(value)
        return stream(infer_response=response)


def _raw_problem(request: Any) -> str | None:
    """What is wrong with a request's ``raw_input_contents``, as Triton refuses
    it: they are given for every input or none, and an input given them has no
    ``contents`` beside."""
    raw = len(request.raw_input_contents)
    if not raw:
        return None
    if raw != len(request.inputs):
        return (
            f"raw_input_contents has {raw} entries for {len(request.inputs)} inputs:"
            " give one for each input, or none"
        )
    for given in request.inputs:
        if given.HasField("contents"):
            return f"input {given.name!r} has both contents and raw_input_contents"
    return None


def _infer_call(request: Any) -> tuple[bytes, bytes, str]:
    """A ``ModelInferRequest`` as the HTTP infer's JSON header, its binary
    data, and its path."""
    header, blob = _infer_body(request)
    path = _model_path(request.model_name, request.model_version, "/infer")
    return json.dumps(header).encode(), blob, path


def _about(pb: Any, request: Any) -> Any:
    """An empty response naming ``request``'s model and id, beside an error."""
    return pb.ModelInferResponse(
        model_name=request.model_name, model_version=request.model_version, id=request.id
    )


def _infer_response(pb: Any, answer: _Answer) -> Any:
    """The HTTP infer's answer (its outputs in binary data) as a ``ModelInferResponse``."""
    split = int(answer.headers.get(HEADER_LENGTH, len(answer.body)))
    found = json.loads(answer.body[:split])
    tensor = pb.ModelInferResponse.InferOutputTensor
    outputs, raw, offset = [], [], split
    for output in found["outputs"]:
        size = int(output["parameters"]["binary_data_size"])
        outputs.append(
            tensor(name=output["name"], datatype=output["datatype"], shape=output["shape"])
        )
        raw.append(answer.body[offset : offset + size])
        offset += size
    return pb.ModelInferResponse(
        model_name=found["model_name"],
        model_version=str(found.get("model_version") or ""),
        id=found.get("id", ""),
        outputs=outputs,
        raw_output_contents=raw,
    )


# ``InferTensorContents``' fields of numbers (a tensor fills the one of its datatype).
_NUMBER_CONTENTS = (
    "bool_contents",
    "int_contents",
    "int64_contents",
    "uint_contents",
    "uint64_contents",
    "fp32_contents",
    "fp64_contents",
)


def _parameter(value: Any) -> Any:
    """An ``InferParameter``'s or a ``ModelRepositoryParameter``'s value (bool,
    int, str or float; bytes as base64), None if unset."""
    kind = value.WhichOneof("parameter_choice")
    found = None if kind is None else getattr(value, kind)
    return base64.b64encode(found).decode() if isinstance(found, bytes) else found


def _infer_body(request: Any) -> tuple[dict[str, Any], bytes]:
    """A ``ModelInferRequest`` as the HTTP infer's JSON header and binary data,
    every output asked for as binary data (``raw_output_contents``)."""
    tensors: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    raw = list(request.raw_input_contents)
    for index, given in enumerate(request.inputs):
        tensor: dict[str, Any] = {
            "name": given.name,
            "datatype": given.datatype,
            "shape": list(given.shape),
        }
        data = raw[index] if index < len(raw) else None
        if data is None and given.contents.bytes_contents:  # as binary data: bytes, not text
            data = binary_data("BYTES", list(given.contents.bytes_contents))
        if data is not None:
            tensor["parameters"] = {"binary_data_size": len(data)}
            blobs.append(data)
        else:  # numbers, or nothing: the HTTP side checks them against the datatype
            tensor["data"] = next(
                (
                    list(values)
                    for field in _NUMBER_CONTENTS
                    if (values := getattr(given.contents, field))
                ),
                [],
            )
        tensors.append(tensor)
    parameters = {name: _parameter(value) for name, value in request.parameters.items()}
    header: dict[str, Any] = {
        "inputs": tensors,
        "parameters": {**parameters, "binary_data_output": True},
    }
    if request.id:
        header["id"] = request.id
    if request.outputs:
        header["outputs"] = [
            {"name": o.name, "parameters": {"binary_data": True}} for o in request.outputs
        ]
    return header, b"".join(blobs)


async def _abort(context: grpc.aio.ServicerContext[Any, Any], answer: _Answer) -> None:
    """End the call with ``answer``'s error as its gRPC status."""
    import grpc

    code = getattr(grpc.StatusCode, _CODES.get(answer.status, "INTERNAL"))
    retry_after = answer.headers.get("retry-after")
    if retry_after is not None:
        context.set_trailing_metadata((("retry-after", retry_after),))
    await context.abort(code, _message_of(answer))


def _message_of(answer: _Answer) -> str:
    """An error answer's message, whichever API's shape it is in."""
    try:
        error = answer.json().get("error")
        message = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = None
    return str(message or f"HTTP {answer.status}")


def _limits(app: FastAPI) -> list[tuple[str, int]]:
    """grpcio's bounds on what a caller sends before its call is known.

    A message may be as large as an HTTP body (``max_body_bytes``, whose
    refusal the app words as HTTP's 413, INVALID_ARGUMENT) and a little
    more, for the request's own framing; grpcio refuses a larger one
    (RESOURCE_EXHAUSTED) before it is read whole (its default was 4 MiB,
    under HTTP's 16). A call's metadata is at most ``GRPC_MAX_METADATA_BYTES``,
    the soft limit made the hard one: grpcio refused calls between its soft
    (8 KiB) and hard (16 KiB) defaults at random."""
    max_body_bytes = int(getattr(app.state, "max_body_bytes", DEFAULT_MAX_BODY_BYTES))
    return [
        ("grpc.max_receive_message_length", max_body_bytes + GRPC_FRAMING_BYTES),
        ("grpc.max_metadata_size", GRPC_MAX_METADATA_BYTES),
        ("grpc.absolute_max_metadata_size", GRPC_MAX_METADATA_BYTES),
    ]


async def start_grpc(app: FastAPI, host: str, port: int) -> grpc.aio.Server:
    """A started gRPC server of KServe v2 over ``app`` on ``host:port``."""
    try:
        import grpc
        from tritonclient.grpc import service_pb2, service_pb2_grpc
    except ImportError as e:  # grpcio, or tritonclient's grpc part
        raise ConfigError(_INSTALL_HINT) from e

    # The calls not served answer UNIMPLEMENTED themselves: the generated
    # servicer's raise NotImplementedError, which grpcio logged with its
    # traceback at every call.
    def unimplemented(name: str) -> Callable[..., Awaitable[None]]:
        async def call(self: KServeService, request: Any, context: Any) -> None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not served")

        return call

    service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    missing = {
        method.name: unimplemented(method.name)
        for method in service.methods
        if not hasattr(KServeService, method.name)
    }
    bases = (KServeService, service_pb2_grpc.GRPCInferenceServiceServicer)
    servicer = type("Servicer", bases, missing)(app)
    server = grpc.aio.server(options=_limits(app))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if server.add_insecure_port(address) == 0:
        raise ConfigError(f"cannot listen for gRPC on {address}")
    await server.start()
    log.info("KServe v2 gRPC on %s", address)
    return server
