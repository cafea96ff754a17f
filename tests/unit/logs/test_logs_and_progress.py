"""JSON logs carry the request id; preload progress prints plain lines off a TTY."""

from __future__ import annotations

import io
import json
import logging

from tessera.logs import JsonFormatter, RequestIdFilter, request_id
from tessera.progress import PreloadReporter


def test_json_log_line_has_request_id() -> None:
    record = logging.LogRecord(
        "tessera.x", logging.WARNING, __file__, 1, "hello %s", ("you",), None
    )
    token = request_id.set("abc123")
    try:
        RequestIdFilter().filter(record)
    finally:
        request_id.reset(token)
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "hello you"
    assert line["level"] == "warning"
    assert line["request_id"] == "abc123"
    assert line["ts"].endswith("Z")
    outside = logging.LogRecord("tessera.x", logging.INFO, __file__, 1, "idle", (), None)
    RequestIdFilter().filter(outside)
    assert outside.request_id == "-"
    assert "request_id" not in json.loads(JsonFormatter().format(outside))


def test_preload_progress_prints_plain_lines_when_not_a_tty() -> None:
    stream = io.StringIO()
    reporter = PreloadReporter(stream)
    reporter.start(["a", "b"])
    reporter.loaded("a", None)
    reporter.loaded("b", RuntimeError("no weights"))
    reporter.finish()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "loading 2 models: a, b"
    assert lines[1].startswith("a loaded after")
    assert "b FAILED (no weights)" in lines[2]
    assert lines[-1].startswith("models ready after")
