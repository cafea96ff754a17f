"""``tessera models add|remove``: what they send to a running server's admin API
(the calls themselves run against a real server in tests/e2e/test_model_rollout.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tessera import cli

Call = tuple[str, str, str | None, object]


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[Call]:
    sent: list[Call] = []

    def admin_call(method: str, url: str, key: str | None, body: object = None) -> None:
        sent.append((method, url, key, body))

    monkeypatch.setattr(cli, "_admin_call", admin_call)
    return sent


def run(*args: str, code: int = 0) -> None:
    result = CliRunner().invoke(cli.app, ["models", *args, "--url", "http://h:1/", "--key", "k"])
    assert result.exit_code == code, result.output


def test_add_sends_a_folder_path(calls: list[Call], tmp_path: Path) -> None:
    run("add", str(tmp_path))
    assert calls == [("POST", "http://h:1/admin/models", "k", {"path": str(tmp_path)})]


def test_add_with_weights_sends_the_card_itself_and_the_weights_path(
    calls: list[Call], tmp_path: Path
) -> None:
    (tmp_path / "model.yaml").write_text("name: sent\ntask: embedding\n")
    run("add", str(tmp_path / "model.yaml"), "--weights", str(tmp_path / "w"))
    body = {"model_yaml": "name: sent\ntask: embedding\n", "weights": str(tmp_path / "w")}
    assert calls == [("POST", "http://h:1/admin/models", "k", body)]


def test_add_with_weights_and_no_card_file_exits_2(calls: list[Call], tmp_path: Path) -> None:
    run("add", str(tmp_path / "missing.yaml"), "--weights", str(tmp_path), code=2)
    assert calls == []


def test_remove_sends_a_delete(calls: list[Call]) -> None:
    run("remove", "minilm")
    assert calls == [("DELETE", "http://h:1/admin/models/minilm", "k", None)]
