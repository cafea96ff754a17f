"""tessera on a Ray cluster of three nodes on this machine (``ray.cluster_utils``,
every node on 127.0.0.1): engine actors over fake models whose batches sleep
(so three nodes fit on two cores), two gateway processes (``tessera cluster``
and ``tessera serve --cluster``) sharing tenants in PostgreSQL and admission
in Redis. Affinity routing, a hot model's extra replica and its removal, one
tenant's limits held by both gateways together, what a tenant is charged (the
engine's run of its batch; the engines' memory in the audit rows), and a node
killed under load.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from builders import write_fake_repository
from harness.fake_models import FAKE_ADAPTERS
from harness.raycluster import LocalRayCluster, local_ray_cluster, running_gateways
from harness.servers import RunningServer
from services import postgres_schema, redis_prefix, redis_url
from tessera.tenants import TenantStore
from tessera.tenants.store import load_secret

MODELS = [f"m{i}" for i in range(6)]
ROUTING = {
    "report_interval_s": 0.25,
    "target_p99_s": 0.3,
    "max_queue_per_replica": 2,
    "target_utilization": 0.5,
    "scale_up_after_s": 1.0,
    "scale_down_after_s": 3.0,
}


BILLED_RUN_S = 0.2


@dataclass
class Deployment:
    ray: LocalRayCluster
    gateways: list[RunningServer]
    keys: dict[str, str]  # tenant -> key

    def post(self, gateway: int, tenant: str, model: str, timeout_s: float = 60) -> int:
        r = httpx.post(
            f"{self.gateways[gateway].base_url}/v1/embeddings",
            json={"model": model, "input": ["hello"]},
            headers={"Authorization": f"Bearer {self.keys[tenant]}"},
            timeout=timeout_s,
        )
        assert r.status_code in (200, 429), r.text
        return r.status_code

    def cluster(self, gateway: int = 0) -> dict[str, Any]:
        r = httpx.get(
            f"{self.gateways[gateway].base_url}/admin/cluster",
            headers={"Authorization": f"Bearer {self.keys['ops']}"},
            timeout=10,
        )
        assert r.status_code == 200, r.text
        result: dict[str, Any] = r.json()
        return result


@contextlib.contextmanager
def deploy(tmp: Path, cpu_share: float) -> Iterator[Deployment]:
    """Three nodes, one engine each, two gateways; tenants ``ops`` (admin),
    ``load`` (no limits), ``acme`` (a burst of 5, then one request per 100 s)
    and ``pair`` (two requests at once)."""
    repo = write_fake_repository(
        tmp / "repo",
        {
            **{m: {"task": "embedding", "options": {"run_s": 0.02}} for m in MODELS},
            # One request a batch, 0.1 s each: ten a second per replica.
            "hot": {
                "task": "embedding",
                "batching": {"max_batch_size": 1, "max_wait_ms": 1},
                "options": {"run_s": 0.1},
            },
            "slow": {"task": "embedding", "options": {"run_s": 2.0}},
            # One request a batch, 0.2 s each: what a tenant is charged there.
            "billed": {
                "task": "embedding",
                "batching": {"max_batch_size": 1, "max_wait_ms": 1},
                "options": {"run_s": BILLED_RUN_S},
            },
        },
    )
    secret_file = tmp / "secret.key"
    with postgres_schema() as url, redis_prefix() as prefix:
        keys: dict[str, str] = {}
        with TenantStore(tmp / "setup", url=url, secret=load_secret(secret_file)) as store:
            store.add_tenant("ops")
            keys["ops"] = store.create_key("ops", admin=True).key
            store.add_tenant("load")
            keys["load"] = store.create_key("load").key
            store.add_tenant("acme", qps=0.01, burst=5)
            keys["acme"] = store.create_key("acme").key
            store.add_tenant("pair", max_concurrency=2)
            keys["pair"] = store.create_key("pair").key
        config = tmp / "config.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "include_default_models": False,
                    "model_repositories": [str(repo)],
                    "adapters": FAKE_ADAPTERS,
                    "memory_budget": "64MiB",
                    "num_threads": 1,
                    "tenant_store": url,
                    "key_secret_file": str(secret_file),
                    "admission_store": redis_url(),
                    "admission_prefix": prefix,
                    "admission_lease_s": 5,
                    "cluster_cpu_share": cpu_share,
                    "cluster_routing": ROUTING,
                }
            )
        )
        with (
            local_ray_cluster(num_nodes=3) as ray_cluster,
            running_gateways(tmp, ray_cluster.address, config) as gateways,
        ):
            yield Deployment(ray_cluster, gateways, keys)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """One deployment for the module; the test that kills a node runs last.
    Half a CPU per engine: Ray may restart a lost node's engine on another."""
    with deploy(tmp_path_factory.mktemp("raycluster"), cpu_share=0.5) as d:
        yield d


def wait_until(check: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


def test_requests_go_where_their_model_lives(deployment: Deployment) -> None:
    d = deployment
    for model in MODELS:  # placed, loaded, reported
        assert d.post(0, "load", model) == 200
    time.sleep(1.0)
    before = d.cluster()["routing"]
    with ThreadPoolExecutor(max_workers=4) as pool:
        statuses = list(pool.map(lambda i: d.post(0, "load", MODELS[i % 6]), range(120)))
    after = d.cluster()
    assert statuses == [200] * 120
    sent = after["routing"]["num_requests"] - before["num_requests"]
    resident = after["routing"]["num_resident"] - before["num_resident"]
    assert sent >= 120
    assert resident / sent >= 0.95
    # Each model lives on one device (a cold model is not loaded everywhere),
    # and the three devices share them.
    replicas = after["replicas"]
    assert all(len(replicas[m]) == 1 for m in MODELS)
    assert len({replicas[m][0] for m in MODELS}) == 3


def test_a_hot_model_gets_a_replica_and_loses_it_when_cold(deployment: Deployment) -> None:
    d = deployment
    assert d.post(0, "load", "hot") == 200
    stop = threading.Event()
    failures: list[int] = []

    def client() -> None:
        while not stop.is_set():
            status = d.post(0, "load", "hot")
            if status != 200:
                failures.append(status)

    threads = [threading.Thread(target=client) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        grew = wait_until(lambda: len(d.cluster()["replicas"].get("hot", [])) >= 2, 60)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert grew, d.cluster()
    assert failures == []
    # Both gateways see the second copy (from the engines' reports).
    assert wait_until(lambda: len(d.cluster(1)["replicas"].get("hot", [])) >= 2, 10)
    # Cold again: one replica goes after scale_down_after_s; the model stays served.
    assert wait_until(lambda: len(d.cluster()["replicas"].get("hot", [])) == 1, 60), d.cluster()
    assert d.post(0, "load", "hot") == 200


def test_one_tenants_limits_hold_across_both_gateways(deployment: Deployment) -> None:
    d = deployment
    total = 12
    with ThreadPoolExecutor(max_workers=6) as pool:
        statuses = list(pool.map(lambda i: d.post(i % 2, "acme", "m0"), range(total)))
    # A bucket each would have let 10 through: the burst of 5 is the pair's.
    assert sorted(statuses) == [200] * 5 + [429] * (total - 5)
    # Two at once, whichever gateway: six callers at once on a 2 s model, so
    # that all six arrive while the first two still run.
    with ThreadPoolExecutor(max_workers=6) as pool:
        statuses = list(pool.map(lambda i: d.post(i % 2, "pair", "slow"), range(6)))
    assert sorted(statuses) == [200] * 2 + [429] * 4


def test_a_request_is_charged_its_engines_run_and_the_engines_memory_is_audited(
    deployment: Deployment,
) -> None:
    d = deployment
    assert d.post(0, "load", "billed") == 200  # placed and loaded

    def timed(i: int) -> tuple[float, float]:
        started = time.monotonic()
        r = httpx.post(
            f"{d.gateways[i % 2].base_url}/v1/embeddings",
            json={"model": "billed", "input": ["hello"]},
            headers={"Authorization": f"Bearer {d.keys['load']}"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        return float(r.headers["x-device-seconds"]), time.monotonic() - started

    # Four at once from both gateways on one engine that runs one batch at a
    # time: the last one waits there behind three others' batches.
    with ThreadPoolExecutor(max_workers=4) as pool:
        answers = list(pool.map(timed, range(4)))
    for device_s, _ in answers:  # the engine's run of its batch, not the call's wall time
        # (under twice the run: a busy CI machine's scheduling adds to a run, and
        # the last call's wait is three runs and more)
        assert BILLED_RUN_S <= device_s < 2 * BILLED_RUN_S, answers
    device_s, wall_s = max(answers, key=lambda a: a[1])
    assert wall_s >= 3 * BILLED_RUN_S, answers
    assert device_s < wall_s / 2, answers

    # The engines' memory, drained by the gateways' polls, lands in the shared
    # audit log's memory_usage rows (written every 10 s), per tenant and model.
    def billed_memory() -> float:
        r = httpx.get(
            f"{d.gateways[1].base_url}/admin/usage",
            params={"since": "-1h"},
            headers={"Authorization": f"Bearer {d.keys['ops']}"},
            timeout=10,
        )
        assert r.status_code == 200, r.text
        rows = r.json()["usage"]
        return float(
            sum(
                row["byte_s"]
                for row in rows
                if row["tenant"] == "load" and row["model"].startswith("billed")
            )
        )

    assert wait_until(lambda: billed_memory() > 0, 30)


# Last in the module: the deployment it leaves has lost a node.
def test_a_node_killed_under_load_loses_no_request(deployment: Deployment) -> None:
    d = deployment
    for model in MODELS:
        assert d.post(0, "load", model) == 200
    time.sleep(1.0)
    engines = {e["name"]: e for e in d.cluster()["engines"]}
    statuses: list[int] = []
    stop = threading.Event()

    def client(i: int) -> None:
        n = i
        while not stop.is_set():
            statuses.append(d.post(n % 2, "load", MODELS[n % 6]))
            n += 1

    with ThreadPoolExecutor(max_workers=4) as pool:
        clients = [pool.submit(client, i) for i in range(4)]
        time.sleep(2.0)
        added_before = sum(d.cluster(g)["routing"]["replicas_added"] for g in (0, 1))
        d.ray.kill_node(d.ray.workers[0])
        killed_at = len(statuses)
        time.sleep(6.0)
        stop.set()
        for c in clients:
            c.result()
    assert len(statuses) > killed_at > 0
    assert set(statuses) == {200}, statuses  # none lost, the ones running there included
    assert len(engines) == 3
    views = [d.cluster(0), d.cluster(1)]
    assert [v["routing"]["num_lost"] for v in views] == [0, 0]
    # The gateways saw the engine go and placed its models again (Ray may
    # have restarted it on another node since: then it is alive once more).
    assert sum(v["routing"]["replicas_added"] for v in views) > added_before
    # Each gateway places a model again as its requests or reports come: a
    # model last asked for on the other gateway may take a report or two
    # (make test once saw one with no replica in one view at this point).
    deadline = time.monotonic() + 10.0
    while not all(placed_on_live_engines(v) for v in views) and time.monotonic() < deadline:
        time.sleep(0.25)
        views = [d.cluster(0), d.cluster(1)]
    for view in views:
        alive = {e["name"] for e in view["engines"] if e["alive"]}
        assert all(set(view["replicas"][m]) <= alive for m in MODELS)
        assert all(view["replicas"][m] for m in MODELS)


def placed_on_live_engines(view: dict[str, Any]) -> bool:
    """Every model of the test has a replica in ``view``, and all on live engines."""
    alive = {e["name"] for e in view["engines"] if e["alive"]}
    return all(view["replicas"].get(m) and set(view["replicas"][m]) <= alive for m in MODELS)
