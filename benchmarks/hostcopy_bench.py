"""What a swap through the host tier costs the CPU, on the CUDA path besides
the copies themselves and on the CPU path, side by side with other source trees.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/hostcopy_bench.py \
        [--against SRC ...] [--cycles 300] [--rounds 3] [--out benchmarks/results]

A model with MiniLM-L6's modules and tensors (``BertModel``, 6 layers: 105
parameters and buffers) but a hidden size of 8, so that the bytes copied are
negligible, goes to the host tier (``HostCopy.offload``) and back
(``restore``) ``--cycles`` times, through the CUDA path's bookkeeping run on
CPU tensors with stand-ins for the device: page-locking answers at once,
copies take no stream, the device block is process memory. What it measures
is the Python and torch calls a swap makes (walking the modules, views,
storages, allocations, the copies' launches), which on a GPU hold the engine
process's interpreter lock while batches wait for it; not the copies, which a
GPU's copy engines make (the GPU check's ``host_tier_*`` figures). Each
source tree runs in a child process of its own, in turn, for ``--rounds``
rounds: this checkout, then each ``--against`` folder (e.g. ``src`` of a
``git worktree`` of an older commit, put first on ``PYTHONPATH``), each as
its runtimes call it (a tree with ``hostcopy.tensors_of`` is given the
model's tensors walked once). Then, before the stand-ins, the CPU path: the
packaged all-MiniLM-L6-v2, whose tensors map its safetensors file, let go and
mapped again (``--cycles`` / 10 times), where finding which storages map
which file unwritten is the cost. Reports the CPU milliseconds of an offload
and of a restore (process time over the cycles) of each. Writes
``OUT/hostcopy-DATE[-N].{md,json}``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.report import write_report
from harness.trees import rerun_command


class _Cudart:
    """Page-locking that answers at once (the buffers stay process memory)."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        return 0


def measure_cpu_path(cycles: int) -> dict[str, float]:
    """CPU ms of an offload and of a restore of the packaged MiniLM on the CPU
    path (its safetensors mapped, let go and mapped again), in this process's
    tessera, with torch and transformers imported as a server has them."""
    from transformers import AutoModel

    from tessera.repository import default_repository_path, read_spec
    from tessera.runtimes.hostcopy import HostCopy

    spec = read_spec(default_repository_path() / "all-minilm-l6-v2")
    model = AutoModel.from_pretrained(str(spec.resolve_source()), local_files_only=True)
    out_s = back_s = 0.0
    for _ in range(cycles):
        start = time.process_time()
        copy = HostCopy.offload([model], "cpu")
        middle = time.process_time()
        copy.restore()
        out_s += middle - start
        back_s += time.process_time() - middle
    return {
        "cpu_path_offload_ms": 1000 * out_s / cycles,
        "cpu_path_restore_ms": 1000 * back_s / cycles,
    }


def measure(cycles: int) -> dict[str, float]:
    """CPU ms of an offload and of a restore, in this process's tessera."""
    import torch
    from transformers import BertConfig, BertModel

    from tessera.runtimes import hostcopy as module

    # Any: the stand-ins replace internals that differ from tree to tree.
    hostcopy: Any = module
    cuda: Any = torch.cuda
    cuda.cudart = _Cudart

    @contextlib.contextmanager
    def copying(*args: Any) -> Iterator[Any]:
        yield lambda tensor: None

    hostcopy.copying = copying
    if hasattr(hostcopy, "device_bytes"):
        hostcopy.device_bytes = lambda n, device: torch.empty(n, dtype=torch.uint8)
    else:  # a tree that allocated a block a storage
        to_device = hostcopy._Pinned.to_device
        hostcopy._Pinned.to_device = lambda self, nbytes, device: to_device(self, nbytes, "cpu")
    config = BertConfig(
        vocab_size=64,
        hidden_size=8,
        num_hidden_layers=6,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=32,
    )
    model: Any = BertModel(config)
    model.eval()
    walked = getattr(hostcopy, "tensors_of", None)
    extra = (walked([model]),) if walked is not None else ()

    def offload() -> Any:
        return hostcopy.HostCopy.offload([model], "cuda", *extra)

    for _ in range(20):  # warm-up
        offload().restore()
    out_s = back_s = 0.0
    for _ in range(cycles):
        start = time.process_time()
        copy = offload()
        middle = time.process_time()
        copy.restore()
        out_s += middle - start
        back_s += time.process_time() - middle
    return {"offload_cpu_ms": 1000 * out_s / cycles, "restore_cpu_ms": 1000 * back_s / cycles}


def child(source: Path | None, cycles: int) -> dict[str, float]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if source is not None:
        env["PYTHONPATH"] = str(source)
    command = [sys.executable, __file__, "--child", "--cycles", str(cycles)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"{source or 'this checkout'}: {done.stderr[-2000:]}")
    figures: dict[str, float] = json.loads(done.stdout.splitlines()[-1])
    return figures


def commit_of(source: Path) -> str:
    """The commit a source tree is checked out at (its git's HEAD), or "?"."""
    done = subprocess.run(
        ["git", "-C", str(source), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", type=Path, nargs="*", default=[])
    parser.add_argument("--cycles", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        cpu_path = measure_cpu_path(max(1, args.cycles // 10))  # before the stand-ins
        print(json.dumps({**measure(args.cycles), **cpu_path}))
        return
    sources: list[tuple[str, Path | None]] = [("this checkout", None)]
    sources += [(f"{path} ({commit_of(path)})", path.resolve()) for path in args.against]
    runs: list[dict[str, Any]] = []
    for round_ in range(1, args.rounds + 1):
        for name, source in sources:
            run: dict[str, Any] = {"round": round_, "source": name, **child(source, args.cycles)}
            runs.append(run)
            print(
                f"round {round_}, {name}: offload {run['offload_cpu_ms']:.3f},"
                f" restore {run['restore_cpu_ms']:.3f} CPU ms",
                flush=True,
            )
    keys = ("offload_cpu_ms", "restore_cpu_ms", "cpu_path_offload_ms", "cpu_path_restore_ms")
    medians = {
        name: {key: statistics.median(r[key] for r in runs if r["source"] == name) for key in keys}
        for name, _ in sources
    }
    date = datetime.date.today().isoformat()
    rerun = rerun_command(__file__, args.against)
    lines = [
        f"# A host-tier swap's CPU, {date}",
        "",
        "CUDA path: a model with MiniLM-L6's 105 tensors (hidden size 8: the bytes"
        " negligible) out to the host tier and back through the CUDA path's bookkeeping,"
        f" on CPU tensors with stand-ins for the device, {args.cycles} cycles a run; not"
        " the copies, what the calls around them cost the interpreter. CPU path: the"
        " packaged all-MiniLM-L6-v2, its safetensors mapped, let go and mapped again,"
        f" {max(1, args.cycles // 10)} cycles a run. Each tree in a process of its own"
        f" ({os.cpu_count()} cores, shared). Rerun:",
        f"`HF_HUB_OFFLINE=1 .venv/bin/python {rerun}`.",
        "",
        "| round | source | CUDA path: offload CPU ms | restore CPU ms |"
        " CPU path (MiniLM): offload CPU ms | restore CPU ms |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['round']} | {r['source']} | {r['offload_cpu_ms']:.3f} |"
            f" {r['restore_cpu_ms']:.3f} | {r['cpu_path_offload_ms']:.2f} |"
            f" {r['cpu_path_restore_ms']:.2f} |"
            for r in runs
        ),
        "",
        "Medians, CUDA path: "
        + "; ".join(
            f"{name} {m['offload_cpu_ms']:.3f} + {m['restore_cpu_ms']:.3f} CPU ms"
            for name, m in medians.items()
        )
        + ".",
        "Medians, CPU path: "
        + "; ".join(
            f"{name} {m['cpu_path_offload_ms']:.2f} + {m['cpu_path_restore_ms']:.2f} CPU ms"
            for name, m in medians.items()
        )
        + ".",
        "",
    ]
    figures = {"cycles": args.cycles, "runs": runs, "medians": medians}
    write_report(args.out, date, "hostcopy", figures, "\n".join(lines))


if __name__ == "__main__":
    main()
