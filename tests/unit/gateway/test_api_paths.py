"""Which API a path belongs to (``gateway/errors.py``'s table): the shape
of its errors, whether its requests are metered, and the status of an
invalid request."""

from __future__ import annotations

import pytest

from tessera.errors import (
    ConfigError,
    InvalidInputError,
    InvalidTenantError,
    PayloadTooLargeError,
    TaskMismatchError,
    UnsupportedMediaError,
)
from tessera.gateway.errors import api_of, error_body_for, metered, status_of


@pytest.mark.parametrize(
    ("path", "runs"),
    [
        ("/v1/embeddings", True),
        ("/v1/responses", True),
        ("/v1/models", False),
        ("/v1/models/all-minilm-l6-v2", False),
        ("/v2/models/embed/infer", True),
        ("/v2/models/embed", True),  # KServe's metadata, as before the table
        ("/v2/health/ready", False),
        ("/v2/repository/index", False),
        ("/v2", False),
        ("/v2/rerank", True),
        ("/v2/translate", True),
        ("/v2/languages", False),
        ("/v2/usage", False),
        ("/tei/embed-model/embed", True),
        ("/tei/embed-model/info", False),
        ("/tei/embed-model/health", False),
        ("/tei/embed-model/tokenize", False),  # the tokenizer's, no model run
        ("/tei/embed-model/decode", False),
        ("/api/chat", True),
        ("/api/tags", False),
        ("/api/show", False),
        ("/admin/residency", False),
        ("/metrics", False),
    ],
)
def test_what_is_metered(path: str, runs: bool) -> None:
    assert metered(path) is runs


@pytest.mark.parametrize(
    ("path", "status", "body"),
    [
        ("/v1/chat/completions", 404, {"error": {"message": "m", "type": "k", "code": 404}}),
        ("/v2/rerank", 400, {"error": {"message": "m", "type": "k", "code": 400}}),
        ("/admin/models", 403, {"error": {"message": "m", "type": "k", "code": 403}}),
        ("/v2/models/embed/infer", 404, {"error": "m"}),
        ("/v2/health/live", 503, {"error": "m"}),
        ("/tei/e/embed", 429, {"error": "m", "error_type": "Overloaded"}),
        ("/tei/e/embed", 500, {"error": "m", "error_type": "Backend"}),
        ("/tei/e/embed", 422, {"error": "m", "error_type": "Validation"}),
        ("/v2/translate", 456, {"message": "m"}),
        ("/api/chat", 404, {"error": "m"}),
    ],
)
def test_errors_in_each_apis_shape(path: str, status: int, body: dict[str, object]) -> None:
    assert error_body_for(path, status, "m", "k") == body


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/v1/embeddings", 400),  # OpenAI's
        ("/v1/chat/completions", 400),
        ("/v2/rerank", 400),  # Cohere's
        ("/v1/ws", 400),  # tessera's own under /v1
        ("/v2/models/embed/infer", 400),  # KServe's
        ("/v2/translate", 400),  # DeepL's
        ("/api/chat", 400),  # Ollama's
        ("/tei/e/embed", 422),  # TEI's
        ("/admin/models", 422),  # tessera's admin API
        ("/admin/tenants", 422),
    ],
)
def test_an_invalid_request_gets_its_apis_status(path: str, status: int) -> None:
    api = api_of(path)
    assert api.invalid == status
    assert status_of(InvalidInputError("x"), api) == (status, "invalid_request_error")
    assert status_of(InvalidTenantError("x"), api) == (status, "invalid_request_error")
    # The other refusals keep their statuses on every API.
    assert status_of(PayloadTooLargeError("x"), api)[0] == 413
    assert status_of(UnsupportedMediaError("x"), api)[0] == 415
    assert status_of(TaskMismatchError("x"), api)[0] == 400
    assert status_of(ConfigError("x"), api) == (422, "invalid_model")
