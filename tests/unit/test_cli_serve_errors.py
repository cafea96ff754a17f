"""``tessera serve`` refuses a start it cannot make with one line and an exit
code, before it makes a tenant or prints a key: a port in use, a data folder
that is a file."""

from __future__ import annotations

import socket
from pathlib import Path

from typer.testing import CliRunner

from tessera import cli


def serve(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli.app, ["serve", "--no-fill", *args])
    return result.exit_code, result.output


def test_a_port_in_use_is_one_line_before_any_key_is_made(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        data = tmp_path / "data"
        code, output = serve("--port", str(port), "--data-dir", str(data))
    assert code == 3, output
    assert f"error: cannot listen on 127.0.0.1:{port}: in use" in output
    assert "key" not in output
    assert not data.exists()  # no tenant store, no key made


def test_a_data_folder_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.write_text("not a folder")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    code, output = serve("--port", str(port), "--data-dir", str(data))
    assert code == 2, output
    assert f"error: data folder {data}:" in output
    assert "Traceback" not in output
