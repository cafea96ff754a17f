"""Graphs per architecture through the engine, on the CPU: copies of the MiniLM
(links to one set of weights, each folder's config naming its copy, as the GPU
check builds them) served with graphs on, an eager runner standing in for the
CUDA graph. Each model answers as a plain encoder does; each is measured with
its architecture's graphs (a template of the weights), and the budget counts
them once; a model sent to the host tier leaves them on the device for the
others, and comes back to them. The engine's close checks that nothing is left.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from builders import fake_engine
from tessera.metrics.prometheus import EngineCollector
from tessera.repository import default_repository_path, read_spec
from tessera.runtimes import forward, graphs
from tessera.runtimes.forward import DeviceOptions
from tessera.runtimes.graph_runner import eager_runner
from tessera.runtimes.hf import SentenceEncoder
from tessera.runtimes.stacking import StackedGraphs
from tessera.runtimes.tokens import text_tokenizer, token_plan
from tessera.tasks.types import Task, TextInput

pytestmark = pytest.mark.slow

SOURCE = read_spec(default_repository_path() / "all-minilm-l6-v2").resolve_source()
TEXTS = ["graphs per architecture", "one template, many models"]


def copies(root: Path, count: int) -> dict[str, dict[str, Any]]:
    models = {}
    config = json.loads((SOURCE / "config.json").read_text())
    for i in range(count):
        folder = root / "weights" / f"copy-{i}"
        folder.mkdir(parents=True)
        for entry in SOURCE.iterdir():
            if entry.name != "config.json":
                (folder / entry.name).symlink_to(entry.resolve())
        (folder / "config.json").write_text(json.dumps({**config, "copy": i}))
        source = {"path": str(folder)}
        models[f"copy-{i}"] = {"task": "embedding", "adapter": "hf-encoder", "source": source}
    return models


@pytest.fixture
def graphs_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forward, "graphs_run_on", lambda device: True)
    monkeypatch.setattr(graphs, "default_runner", lambda: eager_runner)


async def test_copies_share_one_set_of_graphs_counted_once(
    tmp_path: Path, graphs_on_cpu: None
) -> None:
    plain = SentenceEncoder.from_folder(SOURCE, "cpu", DeviceOptions(graphs=False))
    want = plain.encode(TEXTS)
    weights = plain.num_bytes
    plain.close()
    budget = int(3.5 * weights)  # two encoders and the template; not three encoders
    async with fake_engine(
        tmp_path / "repo", copies(tmp_path, 3), memory_budget_bytes=budget
    ) as engine:

        async def answers(name: str) -> None:
            got = await engine.infer(name, Task.EMBEDDING, [TextInput(t) for t in TEXTS])
            np.testing.assert_allclose(np.array(got), want, atol=1e-5)

        await answers("copy-0")
        await answers("copy-1")
        stats = engine.snapshot()
        for name in ("copy-0", "copy-1"):
            model = stats.model(name)
            assert model is not None
            assert model.measured_bytes == 2 * weights  # its encoder and the graphs' template
        assert stats.used_bytes == 3 * weights  # the template once
        await answers("copy-2")  # one of the others waits in the host tier...
        stats = engine.snapshot()
        parked = [m for m in stats.models if m.state == "unloaded" and m.host_bytes]
        assert len(parked) == 1
        assert stats.host_used_bytes == weights  # ...without the graphs: copy-2 uses them
        assert stats.used_bytes == 3 * weights
        await answers(parked[0].name)  # back from the host tier, on the same graphs
        assert engine.snapshot().host_loads_total == 1
        for name in ("copy-0", "copy-1", "copy-2"):
            await engine.unload(name)


async def test_copies_that_stack_answer_in_rounds_on_threads_of_their_own(
    tmp_path: Path, graphs_on_cpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Cards saying `stack: 4`, texts tokenised ahead (as gateways send them):
    # the engine runs their batches on the executor's threads for batches
    # across models, and concurrent batches of different copies meet in
    # stacked rounds, each answered as a plain encoder answers it.
    plain = SentenceEncoder.from_folder(SOURCE, "cpu", DeviceOptions(graphs=False))
    want = plain.encode(TEXTS)
    plain.close()
    rounds: list[tuple[int, str]] = []
    launch = StackedGraphs.launch

    def counted(self: StackedGraphs, calls: list[Any]) -> Any:
        rounds.append((len(calls), threading.current_thread().name))
        return launch(self, calls)

    monkeypatch.setattr(StackedGraphs, "launch", counted)
    models = copies(tmp_path, 4)
    for card in models.values():
        card["options"] = {"stack": 4}
    async with fake_engine(tmp_path / "repo", models, memory_budget_bytes=2 << 30) as engine:
        spec = engine.spec("copy-0")
        plan = token_plan(spec)
        assert plan is not None
        tokenized = text_tokenizer(plan)([TextInput(t) for t in TEXTS])

        async def answers(name: str, which: int) -> None:
            got = await engine.infer(name, Task.EMBEDDING, [tokenized[which]])
            np.testing.assert_allclose(np.array(got), want[which : which + 1], atol=1e-5)

        for name in models:  # loaded one after another, every bucket built at the first
            await answers(name, 0)
        rounds.clear()
        before = engine.snapshot()
        # A model's requests may be batched together (a round takes batches of
        # up to STACK_ROWS texts): each of its batches is one call of a round.
        await asyncio.gather(*(answers(name, i % 2) for i, name in enumerate([*models] * 3)))
        assert all(thread.startswith("tessera-across") for _, thread in rounds)
        assert max(size for size, _ in rounds) >= 2  # some met in a round
        # The engine's stats and metrics count the rounds of two or more.
        stacked = [size for size, _ in rounds if size >= 2]
        after = engine.snapshot()
        assert after.stacked_rounds_total - before.stacked_rounds_total == len(stacked)
        assert after.stacked_batches_total - before.stacked_batches_total == sum(stacked)
        families = {f.name: f for f in EngineCollector(engine.snapshot, {}).collect()}
        (sample,) = families["tessera_stacked_batches"].samples
        assert sample.name == "tessera_stacked_batches_total"
        assert sample.value == after.stacked_batches_total
        for name in models:
            await engine.unload(name)
