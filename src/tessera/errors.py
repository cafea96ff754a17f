"""The one exception hierarchy of tessera.

Core code raises these; only ``gateway/`` maps them to HTTP statuses.

    TesseraError
    ├── ConfigError                 bad configuration or model.yaml (422 when registered)
    ├── InvalidInputError           the request is malformed or empty (400; TEI's and admin's 422)
    │   ├── UnsupportedMediaError   an image or file that cannot be decoded (415)
    │   └── PayloadTooLargeError    over a configured size or count limit (413)
    │       └── RequestTooLargeError a request whose own batch could never fit (413)
    ├── ModelNotFoundError          no such model (404)
    │   └── ModelHiddenError        the tenant may not use it: answered as no such model (404)
    ├── TaskMismatchError           the model does not do that task (400)
    ├── ModelUnavailableError       the model failed to load or cannot fit (503)
    │   └── ModelTooLargeError      its weights alone cannot fit the budget or its cap
    ├── RolloutFailedError          a new version failed to load or answer: rolled back (422)
    ├── OverloadedError             a bounded queue is full (503 + Retry-After)
    ├── ShuttingDownError           the server is draining: no new work (503 + Retry-After)
    ├── AuthenticationError         no key, or an unknown or revoked one (401)
    ├── PermissionDeniedError       the tenant may not use that model or route (403)
    ├── RateLimitedError            a tenant limit refused the request (429 + Retry-After)
    ├── DeadlineExceededError       the deadline passed before it ran (504)
    ├── RequestCancelledError       the caller went away; nobody reads the answer
    ├── InferenceError              the model raised while running a batch (500, JSON)
    │   └── ModelOutputError        it answered numbers that are not finite (NaN, inf) (500)
    └── TenantError                 the tenant store failed (its database) (503)
        ├── TenantNotFoundError     no such tenant (404)
        ├── TenantExistsError       a tenant of that name exists already (409)
        ├── ApiKeyNotFoundError     no API key with that prefix (404)
        └── InvalidTenantError      a bad tenant field: name, tier, limit, models (422)

Too large: the request's fault or the server's? A request whose own
activations, beside the model's weights, could never fit the budget (or the
model's cap) gets ``RequestTooLargeError``, a 413 with the figures: retrying
cannot help, a smaller request can. A model whose weights alone do not fit
gets ``ModelTooLargeError``, a 503: the server's configuration is at fault,
and every request to that model fails alike.
"""

from __future__ import annotations


class TesseraError(Exception):
    """Base of every error tessera raises on purpose."""


class ConfigError(TesseraError):
    """Configuration or a model descriptor is invalid."""


class InvalidInputError(TesseraError):
    """The request is malformed, empty or of the wrong type."""


class UnsupportedMediaError(InvalidInputError):
    """An uploaded image or file cannot be decoded."""


class PayloadTooLargeError(InvalidInputError):
    """The request is over a configured size or count limit."""


class RequestTooLargeError(PayloadTooLargeError):
    """The request's own batch (its activations beside the model's weights)
    needs more bytes than the model may ever have: its cap or the budget."""

    def __init__(
        self, name: str, activation_bytes: int, weights_bytes: int, limit_bytes: int, what: str
    ) -> None:
        super().__init__(
            f"request to model {name!r} needs {activation_bytes:,} bytes of activations beside"
            f" {weights_bytes:,} bytes of weights, over {what} of {limit_bytes:,} bytes:"
            " it could never run; send fewer or shorter inputs"
        )
        self.name = name
        self.activation_bytes = activation_bytes
        self.weights_bytes = weights_bytes
        self.limit_bytes = limit_bytes


class ModelNotFoundError(TesseraError):
    """No model of that name is in the repository."""

    def __init__(self, name: str) -> None:
        super().__init__(f"model {name!r} not found")
        self.name = name


class ModelHiddenError(ModelNotFoundError):
    """The tenant may not use the model: answered as a model that does not
    exist (the same status and body), so that names cannot be enumerated;
    audited as an authorization refusal."""


class TaskMismatchError(TesseraError):
    """The model exists but does not perform the requested task."""


class RolloutFailedError(TesseraError):
    """A new model version failed to load or to answer its smoke input; the
    version it was to replace (if any) still serves."""

    def __init__(self, name: str, version: str, cause: str) -> None:
        super().__init__(f"version {version} of model {name!r} was rolled back: {cause}")
        self.name = name
        self.version = version
        self.cause = cause


class ModelUnavailableError(TesseraError):
    """The model cannot serve now: its load failed, or it cannot fit.

    ``retry_after_s`` is set where waiting may help (a load backing off)."""

    def __init__(self, name: str, reason: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(f"model {name!r} is unavailable: {reason}")
        self.name = name
        self.reason = reason
        self.retry_after_s = retry_after_s


class ModelTooLargeError(ModelUnavailableError):
    """The model's weights alone cannot fit the budget or its cap."""


class OverloadedError(TesseraError):
    """A bounded queue is full; retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ShuttingDownError(TesseraError):
    """The server is stopping: it takes no new work, and work still running
    when the grace period ends is answered with this."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceededError(TesseraError):
    """The request's deadline passed before it could run."""


class RequestCancelledError(TesseraError):
    """The caller disconnected; the request was dropped before it ran."""


class InferenceError(TesseraError):
    """The model raised while running a batch."""


class ModelOutputError(InferenceError):
    """The model answered numbers that are not finite (NaN or infinity): broken
    weights, or an input that overflows it. Never served as an answer."""

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(f"model {name!r} answered {detail}; the answer is withheld")
        self.name = name


class AuthenticationError(TesseraError):
    """No API key, or an unknown or revoked one."""


class PermissionDeniedError(TesseraError):
    """The tenant may not use this model or route."""


class RateLimitedError(TesseraError):
    """A tenant limit refused the request: rate, concurrency or daily quota.

    ``reason`` is ``rate``, ``concurrency`` or ``quota``; ``limit``,
    ``remaining`` and ``reset_s`` fill the ``x-ratelimit-*`` headers.
    """

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        retry_after_s: float,
        limit: float | None = None,
        remaining: float | None = None,
        reset_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.limit = limit
        self.remaining = remaining
        self.reset_s = reset_s


class TenantError(TesseraError):
    """The tenant store failed; subclasses say what was wrong with the request."""


class TenantNotFoundError(TenantError):
    """No tenant of that name."""

    def __init__(self, name: str) -> None:
        super().__init__(f"tenant {name!r} not found")
        self.name = name


class TenantExistsError(TenantError):
    """A tenant of that name exists already."""

    def __init__(self, name: str) -> None:
        super().__init__(f"tenant {name!r} exists already")
        self.name = name


class ResponseNotFoundError(TenantError):
    """No kept response of that id for the caller (never kept, or past its retention)."""

    def __init__(self, response_id: str) -> None:
        super().__init__(f"response {response_id!r} not found")
        self.response_id = response_id


class ApiKeyNotFoundError(TenantError):
    """No API key with that prefix."""

    def __init__(self, prefix: str) -> None:
        super().__init__(f"API key {prefix!r} not found")
        self.prefix = prefix


class InvalidTenantError(TenantError):
    """A tenant field is invalid: its name, tier, a limit or its model list."""
