"""Engine errors to HTTP statuses, as JSON; the only place that knows both.

An error body has the shape its API's clients read (``APIS``, one table of
which API a path belongs to, whether its requests are metered, and the
status of an invalid request): the OpenAI shape ``{"error": {"message",
"type", "code"}}`` for OpenAI's, Cohere's and tessera's own routes, KServe's
and Ollama's ``{"error": MESSAGE}``, TEI's with its ``error_type``, DeepL's
``{"message": MESSAGE}``.

An invalid request (a body that is not JSON or does not validate, and
``InvalidInputError``) is answered with the status its API's own servers
answer it with, which its clients turn into their own exception:

- OpenAI's routes, Cohere's and tessera's own under ``/v1`` and ``/v2``:
  400. OpenAI answers 400 ``invalid_request_error`` for a malformed or
  invalid request, and the ``openai`` client raises ``BadRequestError`` for
  400 (``UnprocessableEntityError`` for 422, which an ``except
  BadRequestError`` misses); vLLM's OpenAI server replaces FastAPI's 422
  with 400 in its ``RequestValidationError`` handler
  (``vllm/entrypoints/serve/utils/server_utils.py``); Cohere's error
  reference answers 400 when "the body of the request is not valid".
- KServe v2 (Triton): 400. Triton's HTTP server answers
  ``TRITONSERVER_ERROR_INVALID_ARG`` with 400 (``EVHTP_RES_BADREQ``), and
  KServe's own server raises ``InvalidInput`` as 400.
- Ollama: 400. Its handlers answer a body that does not bind, and a field
  they refuse, with ``http.StatusBadRequest`` (``server/routes.go``).
- DeepL: 400, which the ``deepl`` client raises as "Bad request".
- TEI: 422. Its axum ``Json`` extractor answers a body that does not
  deserialize with 422 (``JsonDataError``), and TEI answers a tokenizer
  error (an input over the model's window) with 422; axum answers a body
  that is not JSON at all with 400, which tessera answers with TEI's 422.
- The rest (``/admin``, ``/metrics``, the live page): 422, as FastAPI
  answers; ``ConfigError`` (``invalid_model``) and ``RolloutFailedError``
  (``rollout_failed``) are 422 everywhere, semantic errors of tessera's
  own admin API (a model definition that does not hold, a version that
  failed to roll out), and ``InvalidTenantError`` is the admin API's 422.

Any other exception (a bug: no input should reach one) is a 500 with the
exception's type only, and logs one line per request; its traceback is logged
once per route and exception type (at most ``MAX_TRACEBACKS`` of them per
process) and otherwise only at DEBUG, so that a tenant who finds such an input
cannot fill the disk with tracebacks.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tessera.errors import (
    ApiKeyNotFoundError,
    AuthenticationError,
    ConfigError,
    DeadlineExceededError,
    InferenceError,
    InvalidInputError,
    InvalidTenantError,
    ModelHiddenError,
    ModelNotFoundError,
    ModelOutputError,
    ModelUnavailableError,
    OverloadedError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RateLimitedError,
    RequestCancelledError,
    ResponseNotFoundError,
    RolloutFailedError,
    ShuttingDownError,
    TaskMismatchError,
    TenantError,
    TenantExistsError,
    TenantNotFoundError,
    TesseraError,
    UnsupportedMediaError,
)

log = logging.getLogger(__name__)

MAX_TRACEBACKS = 100

# None: the status the path's API answers an invalid request with (``ApiPaths.invalid``).
_STATUS: list[tuple[type[TesseraError], int | None, str]] = [
    (PayloadTooLargeError, 413, "payload_too_large"),
    (UnsupportedMediaError, 415, "unsupported_media_type"),
    (InvalidInputError, None, "invalid_request_error"),
    (ModelNotFoundError, 404, "model_not_found"),
    (ConfigError, 422, "invalid_model"),
    (RolloutFailedError, 422, "rollout_failed"),
    (TaskMismatchError, 400, "invalid_request_error"),
    (ModelUnavailableError, 503, "model_unavailable"),
    (OverloadedError, 503, "overloaded"),
    (ShuttingDownError, 503, "shutting_down"),
    (DeadlineExceededError, 504, "deadline_exceeded"),
    (RequestCancelledError, 499, "cancelled"),
    (ModelOutputError, 500, "model_output_error"),
    (InferenceError, 500, "inference_error"),
    (AuthenticationError, 401, "authentication_error"),
    (PermissionDeniedError, 403, "permission_denied"),
    (RateLimitedError, 429, "rate_limit_exceeded"),
    (TenantNotFoundError, 404, "tenant_not_found"),
    (ApiKeyNotFoundError, 404, "key_not_found"),
    (ResponseNotFoundError, 404, "not_found_error"),
    (TenantExistsError, 409, "tenant_exists"),
    (InvalidTenantError, None, "invalid_request_error"),
    (TenantError, 503, "tenant_store_unavailable"),
]


def error_body(status: int, message: str, kind: str) -> dict[str, object]:
    return {"error": {"message": message, "type": kind, "code": status}}


_KSERVE_PREFIXES = ("/v2/health", "/v2/models", "/v2/repository")


def kserve_path(path: str) -> bool:
    """Whether ``path`` is a KServe v2 route, whose errors read ``{"error": MESSAGE}``
    (tritonclient reads the message from that string: given the OpenAI shape's
    object, it raised a TypeError of its own as it formatted the error).
    Cohere's ``/v2/rerank`` and ``/v2/embed`` are not."""
    return path == "/v2" or any(
        path == prefix or path.startswith(prefix + "/") for prefix in _KSERVE_PREFIXES
    )


def _message_error(status: int, message: str, kind: str) -> dict[str, object]:
    return {"error": message}


def _tei_error(status: int, message: str, kind: str) -> dict[str, object]:
    """TEI's: its kinds are Overloaded, Backend, Validation..."""
    if status in (429, 503):
        return {"error": message, "error_type": "Overloaded"}
    return {"error": message, "error_type": "Backend" if status >= 500 else "Validation"}


def _deepl_error(status: int, message: str, kind: str) -> dict[str, object]:
    return {"message": message}


def _deepl_status(status: int, reason: str | None) -> int:
    """DeepL's own statuses, which its clients act on: a key refused is 403
    (``AuthorizationException``), the quota used up 456
    (``QuotaExceededException``: a 429 its client retries for 16 s first)."""
    if status == 401:
        return 403
    if status == 429 and reason == "quota":
        return 456
    return status


def _same_status(status: int, reason: str | None) -> int:
    return status


@dataclass(frozen=True)
class ApiPaths:
    """The paths of one API: the shape its clients read errors in, which of
    its requests are metered (an audit row and a request event each; its
    listings, probes and metadata are not, unless refused for their key),
    and the status it answers an invalid request with; ``status`` turns a
    status (and a refusal's reason) into the API's own."""

    owns: Callable[[str], bool]
    metered: Callable[[str], bool]
    error: Callable[[int, str, str], dict[str, object]]
    invalid: int
    status: Callable[[int, str | None], int] = _same_status


_DEEPL_PATHS = frozenset({"/v2/translate", "/v2/languages", "/v2/usage"})
_OLLAMA_METERED = frozenset({"/api/embed", "/api/embeddings", "/api/chat", "/api/generate"})


def _tei_path(path: str) -> bool:
    return path.startswith("/tei/")


def _tei_runs(path: str) -> bool:
    return not path.endswith(("/info", "/health", "/tokenize", "/decode"))


def _ollama_path(path: str) -> bool:
    return path.startswith("/api/")


def _v1_or_v2(path: str) -> bool:
    return path.startswith(("/v1/", "/v2/"))


def _not_a_listing(path: str) -> bool:
    return path != "/v1/models" and not path.startswith("/v1/models/")


KSERVE = ApiPaths(kserve_path, lambda path: path.startswith("/v2/models"), _message_error, 400)
TEI = ApiPaths(_tei_path, _tei_runs, _tei_error, 422)
DEEPL = ApiPaths(
    _DEEPL_PATHS.__contains__,
    lambda path: path == "/v2/translate",
    _deepl_error,
    400,
    _deepl_status,
)
OLLAMA = ApiPaths(_ollama_path, _OLLAMA_METERED.__contains__, _message_error, 400)
OPENAI = ApiPaths(_v1_or_v2, _not_a_listing, error_body, 400)  # Cohere's and tessera's own too
# The first that owns a path is its API; the rest of the server (admin,
# metrics, the live page) reads errors in the OpenAI shape, is not metered,
# and answers an invalid request with FastAPI's 422.
APIS = (KSERVE, TEI, DEEPL, OLLAMA, OPENAI)
_THE_REST = ApiPaths(lambda path: True, lambda path: False, error_body, 422)


def api_of(path: str) -> ApiPaths:
    return next((api for api in APIS if api.owns(path)), _THE_REST)


def error_body_for(path: str, status: int, message: str, kind: str) -> dict[str, object]:
    """An error's body in the shape of ``path``'s API."""
    return api_of(path).error(status, message, kind)


def metered(path: str) -> bool:
    """Whether a request of ``path`` runs on a model, to be audited and counted."""
    return api_of(path).metered(path)


def status_of(error: TesseraError, api: ApiPaths) -> tuple[int, str]:
    """The HTTP status and error type of an engine error on ``api``'s routes."""
    for cls, status, kind in _STATUS:
        if isinstance(error, cls):
            status = api.invalid if status is None else status
            return api.status(status, getattr(error, "reason", None)), kind
    return 500, "internal_error"


def error_headers(error: TesseraError) -> dict[str, str]:
    if isinstance(error, OverloadedError | ShuttingDownError):
        return {"Retry-After": str(max(1, math.ceil(error.retry_after_s)))}
    if isinstance(error, ModelUnavailableError) and error.retry_after_s is not None:
        return {"Retry-After": str(max(1, math.ceil(error.retry_after_s)))}
    if isinstance(error, RateLimitedError):
        headers = {"Retry-After": str(max(1, math.ceil(error.retry_after_s)))}
        if error.limit is not None:
            headers["x-ratelimit-limit"] = f"{error.limit:g}"
        if error.remaining is not None:
            headers["x-ratelimit-remaining"] = f"{math.floor(error.remaining):d}"
        if error.reset_s is not None:
            headers["x-ratelimit-reset"] = f"{math.ceil(error.reset_s):d}s"
        return headers
    return {}


def reject_reason(error: TesseraError) -> str | None:
    """The reason a refused request is counted under (audit, metrics)."""
    if isinstance(error, RateLimitedError):
        return error.reason
    if isinstance(error, OverloadedError):
        return "queue_full"
    if isinstance(error, ShuttingDownError):
        return "shutting_down"
    if isinstance(error, DeadlineExceededError):
        return "deadline"
    if isinstance(error, AuthenticationError | PermissionDeniedError | ModelHiddenError):
        return "auth"
    return None


def error_response(error: TesseraError, path: str) -> JSONResponse:
    api = api_of(path)
    status, kind = status_of(error, api)
    body = api.error(status, str(error), kind)
    return JSONResponse(body, status_code=status, headers=error_headers(error))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(TesseraError)
    async def _tessera(request: Request, exc: TesseraError) -> JSONResponse:
        info = getattr(request.state, "audit", None)
        if info is not None:
            info.reason = reject_reason(exc) or type(exc).__name__
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        message = "invalid request: " + "; ".join(problems)
        api = api_of(request.url.path)
        body = api.error(api.invalid, message, "invalid_request_error")
        return JSONResponse(body, status_code=api.invalid)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = error_body_for(request.url.path, exc.status_code, str(exc.detail), "http_error")
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


class UnexpectedErrorMiddleware:
    """Any exception a route lets out becomes a JSON 500 here, logged as one
    line; its traceback once per route and exception type (``MAX_TRACEBACKS``
    in all), else at DEBUG. Starlette's own handler for ``Exception`` would
    answer too, but then re-raise, and the server would log a traceback per
    request and close the connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._tracebacks_logged: set[tuple[str, str]] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracking(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except ClientDisconnect:
            # The client left (or its body timed out, already answered 408)
            # while a route read the body: nobody to answer, nothing broken.
            log.info(
                "%s %s: the client left before its body arrived",
                scope.get("method"),
                scope.get("path"),
            )
        except Exception as exc:
            self._log(scope, exc)
            if started:  # a stream under way: it ends here, cut short
                return
            message = f"internal error: {type(exc).__name__}"
            body = error_body_for(scope.get("path", ""), 500, message, "internal_error")
            await JSONResponse(body, status_code=500)(scope, receive, send)

    def _log(self, scope: Scope, exc: Exception) -> None:
        route = getattr(scope.get("route"), "path", scope.get("path", ""))
        log_unhandled(f"{scope.get('method', '')} {route}", exc, self._tracebacks_logged)


def log_unhandled(where: str, exc: Exception, seen: set[tuple[str, str]]) -> None:
    """Log an exception no input should have caused in one line; its traceback
    only the first time for ``where`` and its type (``seen`` remembers them, at
    most ``MAX_TRACEBACKS``), else at DEBUG."""
    key = (where, type(exc).__name__)
    first = key not in seen and len(seen) < MAX_TRACEBACKS
    if first:
        seen.add(key)
    log.error(
        "unhandled error on %s: %s: %r%s",
        key[0],
        key[1],
        str(exc)[:200],
        " (its traceback follows, once for this route and error)" if first else "",
        exc_info=exc if first or log.isEnabledFor(logging.DEBUG) else None,
    )
