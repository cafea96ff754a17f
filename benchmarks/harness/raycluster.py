"""A Ray cluster of several nodes on this machine, and tessera gateways over it.

Every node is on 127.0.0.1 (``ray.cluster_utils.Cluster``: one raylet each,
with its own share of CPUs), Ray's usage stats are off, and its GCS takes a
free port: Ray's default, 6379, is Redis's on these machines. The first gateway
is ``tessera cluster`` (it starts one engine actor per node), the others
``tessera serve --cluster`` over the same engines. The integration tests and
``benchmarks/cluster_bench.py`` both use this.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.fake_models import harness_pythonpath
from harness.servers import RunningServer, free_port, running_process, tessera_command, url_ok

# On a machine whose outward address is not reachable from itself (a sandbox),
# Ray turns 127.0.0.1 into that address when a driver connects; this keeps a
# cluster of one machine on the loopback (it only matters to Ray on one machine).
LOOPBACK_RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@dataclass
class LocalRayCluster:
    """Ray's ``Cluster`` (``cluster``), its address and its worker nodes."""

    cluster: Any
    address: str
    workers: list[Any]

    def kill_node(self, node: Any) -> None:
        """End a worker node's raylet and every process on it (a machine lost)."""
        self.cluster.remove_node(node, allow_graceful=False)
        self.workers.remove(node)


@contextlib.contextmanager
def local_ray_cluster(num_nodes: int = 3, cpus_per_node: float = 1) -> Iterator[LocalRayCluster]:
    """A head and ``num_nodes - 1`` worker nodes on the loopback; shut down after.
    Their engine actors can import the harness (its fake models)."""
    os.environ.update(LOOPBACK_RAY_ENV)  # the raylets started below inherit it
    os.environ["PYTHONPATH"] = harness_pythonpath()  # and their workers this
    from ray.cluster_utils import Cluster

    node_args: dict[str, Any] = {"num_cpus": cpus_per_node, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**node_args, "gcs_server_port": free_port(), "include_dashboard": False},
    )
    try:
        workers = [cluster.add_node(**node_args) for _ in range(num_nodes - 1)]
        cluster.wait_for_nodes()
        yield LocalRayCluster(cluster, cluster.address, workers)
    finally:
        cluster.shutdown()  # type: ignore[no-untyped-call]


@contextlib.contextmanager
def running_gateways(
    work: Path, address: str, config: Path, num_gateways: int = 2, args: tuple[str, ...] = ()
) -> Iterator[list[RunningServer]]:
    """``tessera cluster`` (which starts the engines) and ``num_gateways - 1``
    more ``tessera serve --cluster`` gateways, each on a free loopback port."""
    with contextlib.ExitStack() as stack:
        gateways = []
        for i in range(num_gateways):
            port = free_port()
            base_url = f"http://127.0.0.1:{port}"
            if i == 0:
                command = [*tessera_command(), "cluster", "--address", address]
            else:
                command = [*tessera_command(), "serve", "--cluster", address]
            command += ["--host", "127.0.0.1", "--port", str(port), "--config", str(config)]
            command += ["--data-dir", str(work / f"data-gateway-{i}"), *args]
            gateway = stack.enter_context(
                running_process(
                    f"gateway-{i}",
                    command,
                    base_url,
                    url_ok(f"{base_url}/v2/health/ready"),
                    work / f"gateway-{i}.log",
                    env=LOOPBACK_RAY_ENV,
                )
            )
            gateways.append(gateway)
        yield gateways
