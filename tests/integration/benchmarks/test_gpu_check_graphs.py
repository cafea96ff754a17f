"""The GPU check's figures of many models through one architecture's graphs
and of the host tier's swaps, measured on the CPU (an eager runner standing in
for the CUDA graph): the functions the torch step calls on a device run end to
end here (that each model's forward through the graphs is its own is
tests/integration/runtimes/test_graphs.py's)."""

from __future__ import annotations

import copy

import pytest
import torch

from gpu_check import TorchEncoder, bench_sentences, package_dir, shared_graphs_round_robin
from tessera.runtimes.graph_runner import eager_runner

pytestmark = [pytest.mark.slow, pytest.mark.bench]


def test_models_in_turn_through_one_architectures_graphs_give_a_rate() -> None:
    encoder = TorchEncoder(package_dir() / "model", "cpu")
    models = [encoder.model, copy.deepcopy(encoder.model)]
    with torch.no_grad():
        for parameter in models[1].parameters():
            parameter.mul_(1.02)
    batch = encoder.tokens(bench_sentences(1))
    assert shared_graphs_round_robin(encoder, models, batch, 0.2, eager_runner) > 0


def test_the_host_tiers_swap_figures_come_with_and_without_the_pool() -> None:
    # On the CPU the copy maps files or stays in place (no pinned buffer): what
    # runs here is the step's loop, both pools in turn, and the process's pool
    # put back after.
    from gpu_check import host_tier_swaps
    from tessera.runtimes import hostcopy

    pool = hostcopy.PINNED_POOL
    figures = host_tier_swaps(torch.nn.Linear(8, 8), "cpu", 0.05)
    assert set(figures) == {
        f"host_tier_{way}_{kind}_ms"
        for way in ("offload", "restore")
        for kind in ("pooled", "fresh")
    }
    assert all(value > 0 for value in figures.values())
    assert hostcopy.PINNED_POOL is pool


def test_the_workers_figures_come_for_each_count_of_threads() -> None:
    from gpu_check import WORKER_FORMS, graph_workers

    encoder = TorchEncoder(package_dir() / "model", "cpu")
    models = [encoder.model, copy.deepcopy(encoder.model)]
    figures = graph_workers(encoder, models, 0.1, eager_runner)
    assert list(figures) == [
        f"{threads}{' beside a loop' if loop else ''}" for threads, loop in WORKER_FORMS
    ]
    assert all(rate > 0 for rate in figures.values())
