"""A gateway joining a Ray cluster by address asks for Ray's token where one is at hand."""

from __future__ import annotations

from pathlib import Path

from tessera.cluster.client import RAY_AUTH_MODE_ENV, use_ray_token


def test_a_token_file_turns_token_mode_on(tmp_path: Path) -> None:
    token = tmp_path / "auth_token"
    token.write_text("abc")
    environ: dict[str, str] = {}
    assert use_ray_token(environ, token)
    assert environ[RAY_AUTH_MODE_ENV] == "token"


def test_a_token_in_the_environment_turns_token_mode_on(tmp_path: Path) -> None:
    environ = {"RAY_AUTH_TOKEN": "abc"}
    assert use_ray_token(environ, tmp_path / "absent")
    assert environ[RAY_AUTH_MODE_ENV] == "token"


def test_a_token_path_in_the_environment_wins_over_the_default_file(tmp_path: Path) -> None:
    default = tmp_path / "auth_token"
    default.write_text("abc")
    environ = {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "absent")}
    assert not use_ray_token(environ, default)
    assert RAY_AUTH_MODE_ENV not in environ


def test_no_token_leaves_the_mode_unset(tmp_path: Path) -> None:
    environ: dict[str, str] = {}
    assert not use_ray_token(environ, tmp_path / "absent")
    assert environ == {}


def test_the_operators_mode_is_kept(tmp_path: Path) -> None:
    token = tmp_path / "auth_token"
    token.write_text("abc")
    environ = {RAY_AUTH_MODE_ENV: "disabled"}
    assert not use_ray_token(environ, token)
    assert environ == {RAY_AUTH_MODE_ENV: "disabled"}
