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
- The rest (shared memory, loading through the repository, tracing,
  streaming) answer ``UNIMPLEMENTED``, as a Triton without them does.
- An HTTP error becomes its gRPC status (404 ``NOT_FOUND``, 401
  ``UNAUTHENTICATED``, 422 ``INVALID_ARGUMENT``, 429 ``RESOURCE_EXHAUSTED``,
  503 ``UNAVAILABLE``...) with the same message; a Retry-After rides in the
  trailing metadata as ``retry-after``.

The service's messages come from ``tritonclient[grpc]`` (its generated
``service_pb2``), so the extra ``tessera[grpc]`` carries that and grpcio. In
the process split each gateway process listens on the port (grpcio sets
``SO_REUSEPORT``), as they share the HTTP one.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from tessera.errors import ConfigError

if TYPE_CHECKING:
    import grpc
    from fastapi import FastAPI

log = logging.getLogger(__name__)

HEADER_LENGTH = "inference-header-content-length"
TIMEOUT_HEADER = "x-request-timeout"
_INSTALL_HINT = "grpc_port needs the grpc extra: pip install 'tessera[grpc]'"
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


async def call_app(
    app: FastAPI,
    method: str,
    path: str,
    headers: Sequence[tuple[str, str]],
    body: bytes = b"",
    client: tuple[str, int] = ("127.0.0.1", 0),
    gone: asyncio.Event | None = None,
) -> _Answer:
    """One HTTP request through ``app`` (its middleware and routes), in process.
    The app hears of a disconnect when ``gone`` is set (the call was cancelled),
    never otherwise: its routes watch for one to stop work nobody waits for."""
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": quote(path).encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        + [(b"content-length", str(len(body)).encode())],
        "client": client,
        "server": ("grpc", 0),
    }
    sent = False
    status, answer_headers, chunks = 500, {}, []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:  # the body is read: the next wait is for a disconnect
            await (gone or asyncio.Event()).wait()
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])
            for name, value in message.get("headers", []):
                answer_headers[name.decode("latin-1").lower()] = value.decode("latin-1")
        elif message["type"] == "http.response.body":
            chunks.append(bytes(message.get("body", b"")))

    await app(scope, receive, send)
    return _Answer(status, answer_headers, b"".join(chunks))


# Headers the translation writes itself: a caller's metadata of these names is dropped.
_OWN_HEADERS = frozenset({"content-length", "host", "transfer-encoding", HEADER_LENGTH})


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
        return await call_app(self.app, method, path, headers, body, _peer(context), _gone(context))

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

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        header, blob = _infer_body(request)
        head = json.dumps(header).encode()
        path = _model_path(request.model_name, request.model_version, "/infer")
        length = [(HEADER_LENGTH, str(len(head)))]
        answer = await self._ok(context, "POST", path, head + blob, length)
        split = int(answer.headers.get(HEADER_LENGTH, len(answer.body)))
        found = json.loads(answer.body[:split])
        tensor = self.pb.ModelInferResponse.InferOutputTensor
        outputs, raw, offset = [], [], split
        for output in found["outputs"]:
            size = int(output["parameters"]["binary_data_size"])
            outputs.append(
                tensor(name=output["name"], datatype=output["datatype"], shape=output["shape"])
            )
            raw.append(answer.body[offset : offset + size])
            offset += size
        return self.pb.ModelInferResponse(
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
    """An ``InferParameter``'s value (bool, int, str or float), None if unset."""
    kind = value.WhichOneof("parameter_choice")
    return None if kind is None else getattr(value, kind)


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
        if index < len(raw):
            tensor["parameters"] = {"binary_data_size": len(raw[index])}
            blobs.append(raw[index])
        elif given.contents.bytes_contents:
            tensor["data"] = [
                b.decode("utf-8", errors="replace") for b in given.contents.bytes_contents
            ]
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

    try:
        error = answer.json().get("error")
        message = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = None
    code = getattr(grpc.StatusCode, _CODES.get(answer.status, "INTERNAL"))
    retry_after = answer.headers.get("retry-after")
    if retry_after is not None:
        context.set_trailing_metadata((("retry-after", retry_after),))
    await context.abort(code, str(message or f"HTTP {answer.status}"))


async def start_grpc(app: FastAPI, host: str, port: int) -> grpc.aio.Server:
    """A started gRPC server of KServe v2 over ``app`` on ``host:port``."""
    try:
        import grpc
        from tritonclient.grpc import service_pb2_grpc
    except ImportError as e:  # grpcio, or tritonclient's grpc part
        raise ConfigError(_INSTALL_HINT) from e

    class Servicer(KServeService, service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
        pass

    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(app), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if server.add_insecure_port(address) == 0:
        raise ConfigError(f"cannot listen for gRPC on {address}")
    await server.start()
    log.info("KServe v2 gRPC on %s", address)
    return server
