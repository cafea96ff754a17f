"""The peer servers' calls, answers and checks, with no peer installed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from harness import peers
from harness.peers import PEERS, Launch

VECTOR = [0.01 * i for i in range(384)]


def body(value: Any) -> bytes:
    return json.dumps(value).encode()


TRITON_OUTPUT = {"name": "embedding", "datatype": "FP32", "shape": [1, 384], "data": VECTOR}
GOOD = {
    "pytriton": body({"model_name": "m", "outputs": [TRITON_OUTPUT]}),
    "torchserve": body(VECTOR),
    "infinity": body({"object": "list", "data": [{"object": "embedding", "embedding": VECTOR}]}),
    "litserve": body({"embedding": VECTOR}),
    "rayserve": body({"embedding": VECTOR}),
}


def fake_venv(peers_dir: Path, name: str, stamp: bool = True) -> Path:
    venv = peers_dir / name
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    if stamp:
        (venv / peers.STAMP).write_text("torch==2.13.0 ...")
    return venv


def test_every_peer_is_there() -> None:
    embedding = {"pytriton", "torchserve", "infinity", "litserve", "rayserve"}
    assert set(PEERS) == {*embedding, "rayserve-heads"}
    assert set(GOOD) == embedding
    assert all(peer.name == name for name, peer in PEERS.items())


def test_embed_calls() -> None:
    assert PEERS["pytriton"].embed_call("a", "hi") == (
        "/v2/models/a/infer",
        {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": ["hi"]}]},
    )
    assert PEERS["torchserve"].embed_call("a", "hi") == ("/predictions/a", {"text": "hi"})
    infinity = ("/embeddings", {"model": "a", "input": ["hi"]})
    assert PEERS["infinity"].embed_call("a", "hi") == infinity
    assert PEERS["litserve"].embed_call("a", "hi") == ("/predict/a", {"input": "hi"})


@pytest.mark.parametrize("name", sorted(GOOD))
def test_embed_ok_on_a_good_body(name: str) -> None:
    peer = PEERS[name]
    assert peer.embed_ok(200, GOOD[name])
    assert peer.embedding(GOOD[name]) == pytest.approx(VECTOR)


@pytest.mark.parametrize("name", sorted(GOOD))
def test_embed_ok_rejects_bad_answers(name: str) -> None:
    peer = PEERS[name]
    short = GOOD[name].replace(b", 3.83]", b"]")
    assert short != GOOD[name]
    assert not peer.embed_ok(500, GOOD[name])
    assert not peer.embed_ok(200, short)
    assert not peer.embed_ok(200, b"not json")
    assert not peer.embed_ok(200, b"")
    assert not peer.embed_ok(200, body({"error": "model not found"}))
    assert not peer.embed_ok(200, body([True] * 384))
    assert not peer.embed_ok(200, body(["0.1"] * 384))


def test_pytriton_checks_the_output_shape() -> None:
    wrong = body({"outputs": [{"name": "embedding", "shape": [2, 192], "data": VECTOR}]})
    assert not PEERS["pytriton"].embed_ok(200, wrong)


@pytest.mark.parametrize("name", sorted(PEERS))
def test_installed_is_false_on_an_empty_dir(name: str, tmp_path: Path) -> None:
    assert not PEERS[name].installed(tmp_path)


def test_installed_needs_the_stamp(tmp_path: Path) -> None:
    fake_venv(tmp_path, "litserve", stamp=False)
    assert not PEERS["litserve"].installed(tmp_path)
    (tmp_path / "litserve" / peers.STAMP).write_text("done")
    assert PEERS["litserve"].installed(tmp_path)
    assert PEERS["litserve"].python(tmp_path) == tmp_path / "litserve" / "bin" / "python"


def test_version_reads_the_venv_metadata(tmp_path: Path) -> None:
    venv = fake_venv(tmp_path, "infinity")
    dist = venv / "lib" / "python3.11" / "site-packages" / "infinity_emb-0.0.78.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: infinity_emb\nVersion: 0.0.78\n")
    assert PEERS["infinity"].version(tmp_path) == "0.0.78"
    with pytest.raises(LookupError):
        PEERS["litserve"].version(tmp_path)


def test_workers_fill_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    torchserve, pytriton = PEERS["torchserve"], PEERS["pytriton"]
    assert torchserve.default_threads(1) == 1
    assert torchserve.workers_per_model(1, 1) == 2
    assert torchserve.workers_per_model(3, 1) == 1
    assert torchserve.workers_per_model(1, 2) == 1
    assert pytriton.default_threads(3) == 2
    assert pytriton.workers_per_model(1, 2) == 1
    settings = torchserve.settings(["a"], 1)
    assert settings["processes_with_weights"] == 2
    assert settings["torch_threads_total"] == 2
    assert settings["max_batch_size"] == 32
    assert PEERS["infinity"].settings(["a", "b", "c"], 2)["processes_with_weights"] == 1


def launch(tmp_path: Path, models: list[str], threads: int = 1) -> Launch:
    return Launch(tmp_path, tmp_path / "work", Path("/weights"), models, threads, 8123)


def test_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    run = launch(tmp_path, ["a", "b", "c"])
    infinity = PEERS["infinity"].command(run)
    assert infinity[1] == "v2"
    assert infinity.count("--model-id") == 3
    assert [infinity[i + 1] for i, arg in enumerate(infinity) if arg == "--served-model-name"] == [
        "a",
        "b",
        "c",
    ]
    torchserve = PEERS["torchserve"].command(run)
    assert torchserve[1].endswith("benchmarks/peers/torchserve_server.py")
    assert Path(torchserve[1]).is_file()
    assert torchserve[torchserve.index("--models") + 1] == "a,b,c"
    assert torchserve[torchserve.index("--workers") + 1] == "1"
    litserve = PEERS["litserve"].command(launch(tmp_path, ["a"]))
    assert litserve[litserve.index("--workers") + 1] == "2"
    pytriton = PEERS["pytriton"].command(launch(tmp_path, ["a"], threads=2))
    assert pytriton[pytriton.index("--threads") + 1] == "2"
    assert "--workspace" in pytriton


def test_ray_serve_routes_by_header_on_a_port_of_its_own(tmp_path: Path) -> None:
    ray = PEERS["rayserve"]
    run = Launch(tmp_path, tmp_path / "work", Path("/models"), ["m-0", "m-1"], 2, 8123,
                 ("--replicas", "2", "--models-per-replica", "10"))  # fmt: skip
    command = ray.command(run)
    assert Path(command[1]).name == "rayserve_server.py"
    assert Path(command[1]).is_file()
    assert command[-4:] == ["--replicas", "2", "--models-per-replica", "10"]
    assert int(command[command.index("--ray-port") + 1]) not in (6379, 8123)
    assert command[command.index("--events") + 1].startswith(str(tmp_path / "work"))
    assert ray.embed_call("m-1", "hi") == ("/embed", {"input": "hi"})
    assert ray.model_headers("m-1") == {"serve_multiplexed_model_id": "m-1"}
    assert ray.ready_models(["m-0", "m-1"]) == ["m-0"]  # any replica loads any model
    assert PEERS["litserve"].model_headers("m-1") == {}
    assert ray.env(tmp_path, 2)["RAY_USAGE_STATS_ENABLED"] == "0"


def test_env_stays_offline_and_quiet(tmp_path: Path) -> None:
    venv = fake_venv(tmp_path, "pytriton")
    home = tmp_path / "python" / "bin"
    (home.parent / "lib").mkdir(parents=True)
    (home.parent / "lib" / "libpython3.11.so.1.0").write_text("")
    (venv / "pyvenv.cfg").write_text(f"home = {home}\nversion = 3.11.7\n")
    env = PEERS["pytriton"].env(tmp_path, 2)
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["DO_NOT_TRACK"] == "1"
    assert env["INFINITY_ANONYMOUS_USAGE_STATS"] == "0"
    assert env["OMP_NUM_THREADS"] == "2"
    assert env["LD_LIBRARY_PATH"].split(":")[0] == str(home.parent / "lib")
    assert "LD_LIBRARY_PATH" not in PEERS["litserve"].env(tmp_path, 1)


def test_serve_refuses_a_peer_not_installed(tmp_path: Path) -> None:
    with (
        pytest.raises(RuntimeError, match="make bench-peers"),
        PEERS["litserve"].serve(tmp_path, tmp_path / "work", Path("/weights"), ["a"], 1),
    ):
        pass


def test_the_heads_peer_classifies_over_ray_serve_s_venv(tmp_path: Path) -> None:
    heads = PEERS["rayserve-heads"]
    assert heads.embed_call("head-007", "hi") == ("/classify", {"input": "hi"})
    assert heads.model_headers("head-007") == {"serve_multiplexed_model_id": "head-007"}
    fake_venv(tmp_path, "rayserve")
    assert heads.installed(tmp_path)
    run = Launch(
        tmp_path, tmp_path / "work", Path("/heads"), ["a", "b"], 2, 8123, ("--mode", "expert")
    )
    command = heads.command(run)
    assert command[0] == str(tmp_path / "rayserve" / "bin" / "python")
    assert command[1].endswith("benchmarks/peers/rayserve_heads.py")
    assert Path(command[1]).is_file()
    assert command[-2:] == ["--mode", "expert"]


def test_the_heads_peer_takes_labels_with_scores_only() -> None:
    heads = PEERS["rayserve-heads"]
    good = body({"labels": [{"label": "head-000-refund", "score": 0.7}]})
    assert heads.embed_ok(200, good)
    assert not heads.embed_ok(500, good)
    assert not heads.embed_ok(200, body({"labels": []}))
    assert not heads.embed_ok(200, body({"labels": [{"label": "x", "score": "0.7"}]}))
    assert not heads.embed_ok(200, body({"embedding": VECTOR}))
    assert not heads.embed_ok(200, b"not json")
