"""The model lifecycle on the real app and engine over fake models: versions
rolled out under load (answers switch at one point, none fails), a broken
version rolled back, a model registered and retired while serving."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import pytest_asyncio
import yaml

from builders import write_fake_repository
from harness.fake_models import FAKE_ADAPTERS
from tessera.engine import Engine, EngineConfig
from tessera.errors import ModelNotFoundError, RolloutFailedError
from tessera.gateway import create_app
from tessera.repository import ModelRepository
from tessera.repository.watch import RepositoryWatcher
from tessera.tasks.types import Task, TextInput


def write_version(model_dir: Path, version: int, **options: Any) -> None:
    """Version folder ``version`` of a model, its options over the model's."""
    folder = model_dir / str(version)
    folder.mkdir()
    (folder / "model.yaml").write_text(yaml.safe_dump({"options": options}))


@contextlib.asynccontextmanager
async def ver_engine(tmp: Path) -> AsyncIterator[Engine]:
    """An engine serving version 1 of model ``ver``, in a budget of 1 MiB."""
    repo = write_fake_repository(tmp / "repo", {"ver": {"task": "embedding"}})
    write_version(repo / "ver", 1, scale=1.0)
    engine = Engine(
        ModelRepository.from_folders([repo]),
        EngineConfig(
            memory_budget_bytes=1 << 20,
            device="cpu",
            num_threads=2,
            max_queue=64,
            adapters=FAKE_ADAPTERS,
        ),
    )
    await engine.preload()
    yield engine
    await engine.close()
    assert engine.snapshot().used_bytes == 0


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    async with ver_engine(tmp_path) as engine:
        yield engine


class Load:
    """Steady load on model ``ver`` from ``num_clients`` callers; records each
    answer's version in the order the engine answers (its futures' callbacks)."""

    def __init__(self, engine: Engine, num_clients: int = 4) -> None:
        self.engine = engine
        self.answered: list[str] = []  # versions, in the engine's answer order
        self.norms: dict[str, set[float]] = {}
        self.failures: list[BaseException] = []
        self._stop = asyncio.Event()
        self._grew = asyncio.Event()
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(num_clients)]

    async def _client(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            submission = self.engine.submit("ver", Task.EMBEDDING, [TextInput(f"c{i} r{n}")])
            version = submission.version
            future = submission.request.future
            future.add_done_callback(lambda _, v=version: self.answered.append(v))
            try:
                (vector,) = await self.engine.wait(submission)
            except Exception as e:
                self.failures.append(e)
                continue
            finally:
                self._grew.set()
            self.norms.setdefault(version, set()).add(round(float(np.linalg.norm(vector)), 3))

    async def until(self, num_answers: int) -> None:
        while len(self.answered) < num_answers:
            self._grew.clear()
            await self._grew.wait()

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def test_a_new_version_takes_over_under_load_at_one_point(
    engine: Engine, tmp_path: Path
) -> None:
    load = Load(engine)
    await load.until(50)
    write_version(tmp_path / "repo" / "ver", 2, scale=2.0, load_s=0.2)
    (rollout,) = await engine.add_model(tmp_path / "repo" / "ver")
    start = len(load.answered)
    await load.until(start + 50)
    await load.stop()

    assert load.failures == []
    assert load.norms == {"1": {1.0}, "2": {2.0}}  # each answer from the version it names
    first_new = load.answered.index("2")
    assert set(load.answered[:first_new]) == {"1"}
    assert set(load.answered[first_new:]) == {"2"}  # no old answer after the first new one
    assert rollout.state == "done"
    assert (rollout.version, rollout.replaces) == ("2", "1")
    assert rollout.started_at <= rollout.loaded_at <= rollout.checked_at  # type: ignore[operator]
    assert rollout.checked_at <= rollout.switched_at <= rollout.drained_at  # type: ignore[operator]
    # The old version is gone and its bytes with it: only version 2 holds the budget.
    stats = engine.snapshot()
    assert [(m.name, m.current) for m in stats.models] == [("ver@2", True)]
    assert rollout.used_bytes_peak >= 2000  # both versions side by side, 1000 each
    assert rollout.used_bytes_after == stats.used_bytes == 1000


@pytest.mark.parametrize("broken", [{"fail_run": True}, {"fail_load": True}])
async def test_a_broken_version_is_rolled_back_and_the_old_one_never_stops(
    engine: Engine, tmp_path: Path, broken: dict[str, Any]
) -> None:
    load = Load(engine)
    await load.until(30)
    used = engine.snapshot().used_bytes
    write_version(tmp_path / "repo" / "ver", 2, **broken)
    with pytest.raises(RolloutFailedError, match="version 2 of model 'ver' was rolled back"):
        await engine.add_model(tmp_path / "repo" / "ver")
    start = len(load.answered)
    await load.until(start + 30)
    await load.stop()

    assert load.failures == []
    assert set(load.answered) == {"1"}
    stats = engine.snapshot()
    assert [m.name for m in stats.models] == ["ver@1"]
    assert stats.used_bytes == used
    (rollout,) = stats.rollouts
    assert rollout.state == "rolled_back"
    assert "load failed" in str(rollout.error)  # the cause, for operators
    assert rollout.switched_at is None
    assert [(c.model, c.outcome, c.num) for c in stats.rollouts_total] == [
        ("ver", "rolled_back", 1)
    ]


async def test_a_watched_repository_rolls_out_a_version_folder_copied_in(
    engine: Engine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    repo = tmp_path / "repo"
    watch = asyncio.create_task(engine.watch_repository(RepositoryWatcher([repo]), 0.05))
    try:
        load = Load(engine)
        await load.until(20)
        write_version(repo / "ver", 2, scale=2.0)
        while [s.key for s in engine.versions("ver")] != ["ver@2"]:
            await load.until(len(load.answered) + 1)
        write_version(repo / "ver", 3, fail_load=True)  # rolled back, logged; 2 serves on
        while len(engine.snapshot().rollouts) < 2:
            await load.until(len(load.answered) + 1)
        await load.until(len(load.answered) + 10)
        await load.stop()
    finally:
        watch.cancel()
    assert load.failures == []
    assert load.answered[-1] == "2"
    assert [s.key for s in engine.versions("ver")] == ["ver@2"]
    assert [(r.version, r.state) for r in engine.snapshot().rollouts] == [
        ("2", "done"),
        ("3", "rolled_back"),
    ]
    assert "repository watch: ver not served: version 3 of model 'ver' was rolled back" in (
        caplog.text
    )


@pytest.fixture
async def client(engine: Engine, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(engine, model_roots=[tmp_path])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://tessera") as client:
        yield client


# The refusals share one app for the module, its root the folder it may register
# from: each leaves the engine as it found it (and checks so).
@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def refusing(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[httpx.AsyncClient, Path]]:
    root = tmp_path_factory.mktemp("refusals")
    async with ver_engine(root) as engine:
        app = create_app(engine, model_roots=[root])
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tessera") as client:
            yield client, root


async def test_requests_name_a_version_while_the_policy_serves_two(
    engine: Engine, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    model_dir = tmp_path / "repo" / "ver"
    card = yaml.safe_load((model_dir / "model.yaml").read_text())
    card["version_policy"] = {"latest": {"num_versions": 2}}
    (model_dir / "model.yaml").write_text(yaml.safe_dump(card))
    write_version(model_dir, 2, scale=2.0)
    response = await client.post("/admin/models", json={"path": str(model_dir)})
    assert response.status_code == 201, response.text
    assert response.json()["versions"] == ["1", "2"]

    for model, version, norm in (("ver", "2", 2.0), ("ver@1", "1", 1.0), ("ver@2", "2", 2.0)):
        answer = await client.post("/v1/embeddings", json={"model": model, "input": "hi"})
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-model-version"] == version
        assert np.linalg.norm(answer.json()["data"][0]["embedding"]) == pytest.approx(norm)
    missing = await client.post("/v1/embeddings", json={"model": "ver@7", "input": "hi"})
    assert missing.status_code == 404
    assert "ver@7" in missing.json()["error"]["message"]

    body = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}
    for path, version in (("/v2/models/ver", "2"), ("/v2/models/ver/versions/1", "1")):
        answer = await client.post(f"{path}/infer", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model_version"] == version
        assert answer.headers["x-model-version"] == version
    metadata = await client.get("/v2/models/ver/versions/1")
    assert metadata.json()["versions"] == ["1", "2"]
    assert (await client.get("/v2/models/ver/versions/9")).status_code == 404


async def test_a_model_registered_while_serving_answers_at_once_and_gives_its_bytes_back(
    engine: Engine, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    folder = write_fake_repository(
        tmp_path / "more", {"new": {"task": "embedding", "options": {"own_bytes": 5000}}}
    )
    before = (await client.get("/admin/residency")).json()["used_bytes"]
    added = await client.post("/admin/models", json={"path": str(folder / "new")})
    assert added.status_code == 201, added.text
    assert added.json()["rollouts"][0]["state"] == "done"
    again = await client.post("/admin/models", json={"path": str(folder / "new")})
    assert again.status_code == 200, again.text  # nothing new: named as it serves
    assert again.json() == {"name": "new", "versions": ["1"], "rollouts": []}
    answer = await client.post("/v1/embeddings", json={"model": "new", "input": "hi"})
    assert answer.status_code == 200
    assert (await client.get("/admin/residency")).json()["used_bytes"] == before + 5000

    removed = await client.delete("/admin/models/new")
    assert removed.status_code == 200
    assert removed.json()["freed_bytes"] == 5000
    residency = (await client.get("/admin/residency")).json()
    assert residency["used_bytes"] == before
    assert "new" not in [m["name"] for m in residency["models"]]
    gone = await client.post("/v1/embeddings", json={"model": "new", "input": "hi"})
    assert gone.status_code == 404
    assert (await client.delete("/admin/models/new")).status_code == 404


@pytest.mark.parametrize(
    ("path", "status", "kind"),
    [
        ("relative/path", 422, "invalid_request_error"),
        ("{root}/nonexistent/model", 422, "invalid_model"),
        ("/nonexistent/model", 403, "permission_denied"),  # outside the roots
    ],
)
async def test_a_bad_registration_is_refused_with_its_reason(
    refusing: tuple[httpx.AsyncClient, Path], path: str, status: int, kind: str
) -> None:
    client, root = refusing
    response = await client.post("/admin/models", json={"path": path.format(root=root)})
    assert response.status_code == status
    assert response.json()["error"]["type"] == kind


async def test_a_broken_new_model_is_not_registered(
    client: httpx.AsyncClient, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = write_fake_repository(
        tmp_path / "more", {"bad": {"task": "embedding", "options": {"fail_run": True}}}
    )
    response = await client.post("/admin/models", json={"path": str(folder / "bad")})
    assert response.status_code == 422
    assert response.json()["error"]["type"] == "rollout_failed"
    residency = (await client.get("/admin/residency")).json()
    assert "bad" not in [m["name"] for m in residency["models"]]
    assert residency["rollouts"][-1]["state"] == "rolled_back"
    assert "fake model failure" in residency["rollouts"][-1]["error"]
    # The rollback is in the log (with its cause) and in the metric too.
    assert "version 1 of model bad rolled back: " in caplog.text
    metrics = (await client.get("/metrics")).text
    assert 'tessera_model_rollouts_total{model="bad",outcome="rolled_back"} 1.0' in metrics


async def test_a_model_yaml_sent_with_the_path_of_its_weights_registers_and_rolls_out(
    engine: Engine, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    weights = tmp_path / "weights"
    weights.mkdir()
    card: dict[str, Any] = {
        "name": "sent",
        "task": "embedding",
        "runtime": "torch",
        "adapter": "fake",
    }
    body = {"model_yaml": yaml.safe_dump(card), "weights": str(weights)}
    added = await client.post("/admin/models", json=body)
    assert added.status_code == 201, added.text
    answer = await client.post("/v1/embeddings", json={"model": "sent", "input": "hi"})
    assert answer.status_code == 200, answer.text
    assert engine.versions("sent")[0].resolve_source() == weights
    # A second card pinning version 2 rolls it out over the first.
    card |= {"version": 2, "options": {"scale": 2.0}}
    added = await client.post("/admin/models", json={**body, "model_yaml": yaml.safe_dump(card)})
    assert added.status_code == 201, added.text
    assert added.json()["versions"] == ["2"]
    answer = await client.post("/v1/embeddings", json={"model": "sent", "input": "hi"})
    assert answer.headers["x-model-version"] == "2"
    assert np.linalg.norm(answer.json()["data"][0]["embedding"]) == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        ({"model_yaml": "name: x\ntask: embedding", "weights": "{root}/no"}, "invalid_model"),
        ({"model_yaml": "task: [", "weights": "{root}"}, "invalid_model"),
        ({"model_yaml": "task: embedding", "weights": "{root}"}, "invalid_model"),  # no name
        (
            {"model_yaml": "name: x\ntask: nope\nruntime: torch", "weights": "{root}"},
            "invalid_model",
        ),
        ({"model_yaml": "name: x", "weights": "relative"}, "invalid_request_error"),
        ({"model_yaml": "name: x"}, "invalid_request_error"),
        ({"path": "/", "model_yaml": "name: x", "weights": "/"}, "invalid_request_error"),
    ],
)
async def test_a_bad_model_yaml_or_weights_path_is_refused_before_registering(
    refusing: tuple[httpx.AsyncClient, Path], body: dict[str, str], kind: str
) -> None:
    client, root = refusing
    body = {key: value.format(root=root) for key, value in body.items()}
    response = await client.post("/admin/models", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["type"] == kind
    residency = (await client.get("/admin/residency")).json()
    assert [m["name"] for m in residency["models"]] == ["ver@1"]
    assert residency["rollouts"] == []


async def test_a_retired_model_answers_its_requests_in_flight_first(
    engine: Engine, tmp_path: Path
) -> None:
    folder = write_fake_repository(
        tmp_path / "more", {"slow": {"task": "embedding", "options": {"run_s": 0.05}}}
    )
    await engine.add_model(folder / "slow")
    submissions = [engine.submit("slow", Task.EMBEDDING, [TextInput(f"r{i}")]) for i in range(40)]
    freed = await engine.remove_model("slow")
    results = await asyncio.gather(*(engine.wait(s) for s in submissions), return_exceptions=True)
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert freed == 1000
    with pytest.raises(ModelNotFoundError):
        engine.submit("slow", Task.EMBEDDING, [TextInput("late")])


async def test_the_serving_version_is_not_evicted_to_make_room_for_the_new_one(
    tmp_path: Path,
) -> None:
    # Room for two models of three: the new version's load must evict one, and
    # the least recently used (the one LRU picks) is the serving version. The
    # slack (half a model) holds the batches' measured activations, which vary.
    own = 64 << 20
    card = {"task": "embedding", "options": {"own_bytes": own}}
    repo = write_fake_repository(tmp_path / "repo", {"ver": card, "other": card})
    write_version(repo / "ver", 1, scale=1.0)
    config = EngineConfig(
        memory_budget_bytes=2 * own + own // 2,
        device="cpu",
        num_threads=2,
        eviction_policy="lru",
        adapters=FAKE_ADAPTERS,
    )
    engine = Engine(ModelRepository.from_folders([repo]), config)
    try:
        await engine.wait(engine.submit("ver", Task.EMBEDDING, [TextInput("first")]))
        await engine.wait(engine.submit("other", Task.EMBEDDING, [TextInput("later")]))
        write_version(repo / "ver", 2, scale=2.0)
        (rollout,) = await engine.add_model(repo / "ver")
        stats = engine.snapshot()
    finally:
        await engine.close()
    assert rollout.state == "done"
    assert {m.name: (m.state, m.evictions) for m in stats.models} == {
        "other": ("unloaded", 1),
        "ver@2": ("ready", 0),
    }
    assert stats.evictions_total == 1


async def test_two_versions_over_one_shared_component_hold_it_once(
    engine: Engine, tmp_path: Path
) -> None:
    model_dir = tmp_path / "repo" / "shared"
    write_fake_repository(
        tmp_path / "repo",
        {"shared": {"task": "embedding", "options": {"shared": {"encoder": 5000}}}},
    )
    write_version(model_dir, 1)
    await engine.add_model(model_dir)
    before = engine.snapshot().used_bytes
    write_version(model_dir, 2, scale=2.0)  # a new head (1000 bytes) over the same encoder
    (rollout,) = await engine.add_model(model_dir)
    assert rollout.used_bytes_before == before
    assert rollout.used_bytes_peak == before + 1000  # not another 5000 for the encoder
    assert rollout.used_bytes_after == before


async def test_a_version_must_answer_its_cards_smoke_checks_to_take_over(tmp_path: Path) -> None:
    # The fake classifier answers label-<len(text) % 3>: "ab" is label-2.
    repo = write_fake_repository(tmp_path / "repo", {"cls": {"task": "classify"}})
    write_version(repo / "cls", 1)
    engine = Engine(
        ModelRepository.from_folders([repo]),
        EngineConfig(
            memory_budget_bytes=1 << 20,
            device="cpu",
            num_threads=2,
            max_queue=64,
            adapters=FAKE_ADAPTERS,
        ),
    )
    await engine.preload()
    try:
        good = {"smoke": [{"input": "ab", "expect": "label-2"}, {"input": "x"}]}
        (repo / "cls" / "2").mkdir()
        (repo / "cls" / "2" / "model.yaml").write_text(yaml.safe_dump(good))
        (rollout,) = await engine.add_model(repo / "cls")
        assert rollout.state == "done"
        wrong = {"smoke": {"input": "ab", "expect": "label-0"}}
        (repo / "cls" / "3").mkdir()
        (repo / "cls" / "3" / "model.yaml").write_text(yaml.safe_dump(wrong))
        with pytest.raises(RolloutFailedError, match="version 3 of model 'cls' was rolled back"):
            await engine.add_model(repo / "cls")
        failed = engine.snapshot().rollouts[-1]
        assert failed.state == "rolled_back"
        assert "answered 'label-2', not containing 'label-0'" in str(failed.error)
        assert [m.name for m in engine.snapshot().models] == ["cls@2"]  # 2 serves on
    finally:
        await engine.close()
