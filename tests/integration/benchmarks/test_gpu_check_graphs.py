"""The GPU check's figure of many models through one architecture's graphs,
measured on the CPU with an eager runner standing in for the CUDA graph: the
function the torch step calls on a device runs end to end here (that each
model's forward through the graphs is its own is tests/integration/runtimes/
test_graphs.py's)."""

from __future__ import annotations

import copy

import pytest
import torch

from gpu_check import TorchEncoder, bench_sentences, package_dir, shared_graphs_round_robin
from tessera.runtimes.graphs import eager_runner

pytestmark = pytest.mark.slow


def test_models_in_turn_through_one_architectures_graphs_give_a_rate() -> None:
    encoder = TorchEncoder(package_dir() / "model", "cpu")
    models = [encoder.model, copy.deepcopy(encoder.model)]
    with torch.no_grad():
        for parameter in models[1].parameters():
            parameter.mul_(1.02)
    batch = encoder.tokens(bench_sentences(1))
    assert shared_graphs_round_robin(encoder, models, batch, 0.2, eager_runner) > 0
