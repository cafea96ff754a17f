"""Copies out of the host tier's swaps: how many evictions copy a model's
weights to page-locked memory, and how many find them still held there,
side by side with other source trees.

    .venv/bin/python benchmarks/host_pool_bench.py [--against SRC ...] \
        [--models 100] [--holds 20] [--swaps 4000] [--zipf 1.1] [--pool-buffers B ...] \
        [--out benchmarks/results]

On CUDA an evicted model's weights go to a page-locked host buffer, and a
buffer kept from the model's last restore still holds them, so its eviction
can copy nothing (on the H200 a MiniLM's copy out was 2.15 ms of a 5.38 ms
swap-in). Whether a buffer is still there depends only on the host tier's
pool of buffers (``hostcopy.PinnedPool``) and the order of swaps, not on
the device: here the real ``HostCopy`` and pool run on CPU tensors with a
stand-in for CUDA's page-locking calls (as the host tier's unit tests do).
``--models`` small modules, a budget that holds ``--holds`` of them, the
least recently used evicted; each starts loaded (as from files), the rest
evicted; then a round robin over all of them, then requests drawn by
Zipf(``--zipf``) popularity (seeded), until ``--swaps`` swaps each. Counts,
per load: swaps, evictions that copied out, evictions that copied nothing,
new page-locked buffers (a registration each: on the H200 a fresh buffer
cost 37 ms against 2.5 ms from the pool), buffers left in the pool. Each
source tree (this checkout's ``src``, then each ``--against`` folder, first
on ``PYTHONPATH`` of a child process) runs the same sequence, once with the
pool's own bounds and once for each ``--pool-buffers`` bound on its buffers
(a pool that cannot keep a buffer for every model on the device, as 2 GiB
cannot for larger models).
Writes ``OUT/host-pool-DATE[-N].{md,json}``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def child(
    models: int, holds: int, swaps: int, zipf: float, pool_buffers: int | None
) -> dict[str, Any]:
    import torch

    from tessera.runtimes import hostcopy
    from tessera.runtimes.hostcopy import HostCopy, PinnedPool, _Pinned, tensors_of

    class Cudart:  # page-locking stands in: the pool's choices are the point
        registered = 0

        def cudaHostRegister(self, *args: Any) -> int:
            Cudart.registered += 1
            return 0

        def cudaHostUnregister(self, *args: Any) -> int:
            return 0

    @contextlib.contextmanager
    def copying(device: str, direction: str) -> Iterator[Any]:
        yield lambda tensor: None

    torch.cuda.cudart = Cudart  # type: ignore[assignment]

    def host_bytes(nbytes: int, device: str) -> Any:  # the "device" is host memory
        return torch.empty(nbytes, dtype=torch.uint8)

    hostcopy.copying = copying
    pool = PinnedPool() if pool_buffers is None else PinnedPool(max_buffers=pool_buffers)
    hostcopy.PINNED_POOL = pool
    hostcopy.device_bytes = host_bytes
    copied = [0]
    copy_of = _Pinned.copy_of.__func__  # type: ignore[attr-defined]

    def counted(cls: type[_Pinned], storages: list[Any], device: str) -> _Pinned:
        copied[0] += 1
        return copy_of(cls, storages, device)  # type: ignore[no-any-return]

    _Pinned.copy_of = classmethod(counted)  # type: ignore[assignment]
    modules = [torch.nn.Linear(16, 16) for _ in range(models)]
    tensors = [tensors_of([m]) for m in modules]
    owners = [object() for _ in modules]
    copies: dict[int, Any] = {}
    resident = list(range(models))  # least recently used first

    def evict() -> None:
        victim = resident.pop(0)
        copies[victim] = HostCopy.offload(
            [modules[victim]], "cuda", tensors[victim], owner=owners[victim]
        )

    while len(resident) > holds:
        evict()
    rng = random.Random(0)
    weights = [1 / (rank + 1) ** zipf for rank in range(models)]
    loads = []
    for load in ("round robin", f"Zipf({zipf:g})"):
        copied[0] = Cudart.registered = done = requests = 0
        while done < swaps:
            model = (
                requests % models
                if load == "round robin"
                else rng.choices(range(models), weights)[0]
            )
            requests += 1
            if model in resident:
                resident.remove(model)
            else:
                evict()
                copies.pop(model).restore()
                done += 1
            resident.append(model)
        loads.append(
            {
                "load": load,
                "requests": requests,
                "swaps": done,
                "copied_out": copied[0],
                "copied_nothing": done - copied[0],
                "new_buffers": Cudart.registered,
                "pool_buffers": len(pool._free),
            }
        )
    return {"loads": loads}


def run_child(
    source: Path | None, args: argparse.Namespace, pool_buffers: int | None
) -> dict[str, Any]:
    from harness.trees import child_figures

    arguments = ["--models", str(args.models), "--holds", str(args.holds)]
    arguments += ["--swaps", str(args.swaps), "--zipf", str(args.zipf)]
    if pool_buffers is not None:
        arguments += ["--pool-buffers", str(pool_buffers)]
    return child_figures(__file__, source, arguments)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", type=Path, nargs="*", default=[])
    parser.add_argument("--models", type=int, default=100)
    parser.add_argument("--holds", type=int, default=20)
    parser.add_argument("--swaps", type=int, default=4000)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--pool-buffers", type=int, nargs="*", default=[])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        bound = args.pool_buffers[0] if args.pool_buffers else None
        print(json.dumps(child(args.models, args.holds, args.swaps, args.zipf, bound)))
        return
    from harness.report import write_report
    from harness.trees import rerun_command, tree_sources

    sources = tree_sources(args.against)
    rows = []
    for bound in [None, *args.pool_buffers]:
        pool = "its own" if bound is None else f"{bound} buffers"
        for name, source in sources:
            for load in run_child(source, args, bound)["loads"]:
                rows.append({"source": name, "pool": pool, **load})
                print(
                    f"{name}, pool {pool}, {load['load']}: {load['swaps']} swaps,"
                    f" {load['copied_out']} copied out, {load['new_buffers']} new buffers,"
                    f" {load['pool_buffers']} in the pool",
                    flush=True,
                )
    date = datetime.date.today().isoformat()
    rerun = rerun_command(__file__, args.against)
    rerun += f" --models {args.models} --holds {args.holds} --swaps {args.swaps}"
    rerun += f" --zipf {args.zipf:g}"
    if args.pool_buffers:
        rerun += " --pool-buffers " + " ".join(map(str, args.pool_buffers))
    lines = [
        f"# Copies out of the host tier's swaps, {date}",
        "",
        f"{args.models} models under a budget that holds {args.holds}, least recently used"
        f" evicted, through the real `HostCopy` and `PinnedPool` on CPU tensors (CUDA's"
        f" page-locking stood in): a round robin, then Zipf({args.zipf:g}), {args.swaps}"
        " swaps each, after each model's first load from files. Copied out: evictions that"
        " copied the weights to page-locked memory (on the H200 2.15 ms a MiniLM); copied"
        " nothing: those whose buffer, kept from the model's restore, still held them."
        f" Rerun: `.venv/bin/python {rerun}`.",
        "",
        "| source | pool bound | load | requests | swaps | copied out | copied nothing |"
        " new buffers | left in the pool |",
        "|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['source']} | {r['pool']} | {r['load']} | {r['requests']} | {r['swaps']} |"
            f" {r['copied_out']} | {r['copied_nothing']} | {r['new_buffers']} |"
            f" {r['pool_buffers']} |"
            for r in rows
        ),
    ]
    figures = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    write_report(args.out, date, "host-pool", figures, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
