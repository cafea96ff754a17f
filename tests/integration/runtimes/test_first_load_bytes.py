"""A model's bytes, measured as the process's growth at its first load, are the
model's, not its libraries' one-time memory: each in a fresh process, the
engine host's first load of a packaged native or ONNX model counts about what
a later load of the same model adds (without the priming load, bergamot's
first load counted 101 MiB against 24 MiB, OCR's 87 against 37)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

MIB = 1024**2

SCRIPT = """
import asyncio, json, sys
from tessera.device import CpuDevice
from tessera.engine.executor import ComputeExecutor
from tessera.engine.host import EngineHost
from tessera.repository import default_repository_path, read_spec
from tessera.residency import ActivationBook
from tessera.runtimes.base import standalone_context
from tessera.runtimes.registry import get_loader

async def main(name):
    spec = read_spec(default_repository_path() / name)
    device = CpuDevice()
    executor = ComputeExecutor(device, 1, 1)
    host = EngineHost(device, executor, ActivationBook())
    model = await host.load(spec)
    first = model.memory().own_bytes
    await host.unload(spec, model)
    again = get_loader(spec.adapter).load(spec, standalone_context(threads=1))
    later = again.memory().own_bytes
    again.unload()
    host.shutdown()
    executor.shutdown()
    print(json.dumps({"first": first, "later": later}))

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.parametrize("name", ["bergamot-en-pt", "pp-ocrv6"])
def test_a_first_load_counts_the_model_not_its_libraries(name: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, name],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    first, later = figures["first"], figures["later"]
    # The same model, counted twice: equal within the resident set's noise,
    # which is wide for OCR (its warm-up page grows onnxruntime's arena, and
    # glibc keeps what an unload frees for the next load): 75 against 46 MiB
    # was seen once beside other tests. Unprimed, the first counted 2.3-3.9x.
    assert first <= later * 1.75 + 8 * MIB, figures
    assert later <= first * 1.75 + 8 * MIB, figures
