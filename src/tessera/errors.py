"""The one exception hierarchy of tessera.

Core code raises these; only ``gateway/`` maps them to HTTP statuses.

    TesseraError
    ├── ConfigError                 bad configuration or model.yaml (at start)
    ├── InvalidInputError           the request is malformed or empty (400/422)
    │   ├── UnsupportedMediaError   an image or file that cannot be decoded (415)
    │   └── PayloadTooLargeError    over a configured size or count limit (413)
    ├── ModelNotFoundError          no such model (404)
    ├── TaskMismatchError           the model does not do that task (400)
    ├── ModelUnavailableError       the model failed to load or cannot fit (503)
    │   └── ModelTooLargeError      cannot fit even alone in the budget or its cap
    ├── OverloadedError             a bounded queue is full (503 + Retry-After)
    ├── DeadlineExceededError       the deadline passed before it ran (504)
    ├── RequestCancelledError       the caller went away; nobody reads the answer
    └── InferenceError              the model raised while running a batch (500, JSON)
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


class ModelNotFoundError(TesseraError):
    """No model of that name is in the repository."""

    def __init__(self, name: str) -> None:
        super().__init__(f"model {name!r} not found")
        self.name = name


class TaskMismatchError(TesseraError):
    """The model exists but does not perform the requested task."""


class ModelUnavailableError(TesseraError):
    """The model cannot serve now: its load failed, or it cannot fit."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"model {name!r} is unavailable: {reason}")
        self.name = name
        self.reason = reason


class ModelTooLargeError(ModelUnavailableError):
    """The model (with a batch's activations) cannot fit even alone."""


class OverloadedError(TesseraError):
    """A bounded queue is full; retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceededError(TesseraError):
    """The request's deadline passed before it could run."""


class RequestCancelledError(TesseraError):
    """The caller disconnected; the request was dropped before it ran."""


class InferenceError(TesseraError):
    """The model raised while running a batch."""
