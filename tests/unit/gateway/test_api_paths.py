"""Which API a path belongs to (``gateway/errors.py``'s table): the shape
of its errors, and whether its requests are metered."""

from __future__ import annotations

import pytest

from tessera.gateway.errors import error_body_for, metered


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
        ("/v2/rerank", 422, {"error": {"message": "m", "type": "k", "code": 422}}),
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
