"""The host's work around a graph replay, for one encoder batch of texts
tokenised ahead, side by side with other source trees.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/graph_host_bench.py \
        [--against SRC ...] [--rows 1 8] [--models 1] [--seconds 3] [--rounds 3] \
        [--out benchmarks/results]

On a GPU, the compute workers' thread was the limit of 100 resident MiniLMs
round robin (the H200's second run: 0.88 of a thread, the engine's loop 0.32):
what a batch costs the host around its graph's replay bounds the requests a
second. Here, on the CPU, the packaged MiniLM gets its architecture's graphs
(``GraphsHold``, every bucket prepared) with a stand-in runner that replays
nothing: each bucket's outputs are computed once at its build, and a run
copies the inputs into the static tensors and returns those outputs, as a
CUDA graph's runner does less the replay. What is timed is then the rest:
``SentenceEncoder.encode_ids`` of ``--rows`` one-sentence texts (the
gateway's tokenised form), from the ids to the vectors in host memory. The
torch operators dispatched a batch (views included: each non-view is a
kernel launch on a GPU) are counted with a dispatch mode. With ``--models``
N > 1 the batches go to N copies of the model (other weights) in turn, as
in the 100-model round robin: each copies its weights into the
architecture's template first, and where the tree has
``hostcopy.gather_block`` each model is gathered into one block first, as
a load on CUDA does.

For each round, for each source tree in turn (this checkout's ``src``, then
each ``--against`` folder, put first on ``PYTHONPATH`` of a child process),
one child per rows figure, ``--seconds`` of calls after a warm-up. Reports
microseconds a batch (wall and thread CPU) and operators a batch. What it
does not measure: the device's own time and the host-device copies' (a
CPU copy stands in for each). Writes ``OUT/graph-host-DATE[-N].{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

TEXT = "A receipt: 2 x coffee 3.50, 1 x bagel 2.25, total 9.25 EUR"


def free_runner(*args: Any) -> Any:
    """A bucket's runner that replays nothing (module notes), for either
    signature: ``(step, example)`` (outputs by name) or the older
    ``(model, output, example)`` (the output tensor)."""
    import torch

    if len(args) == 2:
        step, example = args
        try:  # as CudaGraphRunners copies inputs in, where the tree has it
            from tessera.runtimes.graph_runner import copy_inputs, static_inputs
        except ImportError:
            try:
                from tessera.runtimes.graphs import (
                    copy_inputs,
                    static_inputs,
                )
            except ImportError:
                static_inputs = None
        if static_inputs is not None:
            static, packed = static_inputs(example)
            with torch.inference_mode():
                outputs = step(static)

            def run_packed(inputs: Any) -> Any:
                copy_inputs(static, packed, inputs)
                return outputs

            return run_packed
        static = {key: value.clone() for key, value in example.items()}
        with torch.inference_mode():
            outputs = step(static)
    else:
        model, output, example = args
        static = {key: value.clone() for key, value in example.items()}
        with torch.inference_mode():
            outputs = getattr(model(**static), output)

    def run(inputs: Any) -> Any:
        for key, value in inputs.items():
            static[key].copy_(value, non_blocking=True)
        return outputs

    return run


def child(rows: int, seconds: float, models: int = 1, stack: int = 0) -> dict[str, Any]:
    """This tree's figures for batches of ``rows`` texts to ``models`` models in turn
    (``stack``: in stacked rounds of that many models' batches, a figure a batch)."""
    import numpy as np
    import torch

    from tessera.repository import default_repository_path, read_spec
    from tessera.runtimes.base import SharedComponents
    from tessera.runtimes.graphs import GraphsHold
    from tessera.runtimes.hf import SentenceEncoder

    torch.set_num_threads(1)
    folder = read_spec(default_repository_path() / "all-minilm-l6-v2").resolve_source()
    encoder = SentenceEncoder.from_folder(folder, "cpu")
    copies = [encoder.model, *(other_weights(encoder.model, n) for n in range(1, models))]
    try:
        from tessera.runtimes.hostcopy import gather_block

        weight_tensors = weight_tensors_of_tree()
    except ImportError:  # a tree from before gathered blocks
        pass
    else:
        for model in copies:
            gather_block(weight_tensors(model))
    shared = SharedComponents()
    acquire = GraphsHold.acquire
    assert "make_runner" in inspect.signature(acquire).parameters
    ids = encoder.held_tokenizer([TEXT] * rows, truncation=True, max_length=256)["input_ids"]
    batch = [np.array(row, dtype=np.int32) for row in ids]
    if stack:
        return stacked_child(encoder, copies, batch, seconds, stack)
    hold = acquire(
        shared, encoder.model, encoder.held_tokenizer, "last_hidden_state", make_runner=free_runner
    )
    try:
        from tessera.runtimes.forward import graphs_path
    except ImportError:  # a tree from before forward paths: the encoder holds its graphs
        encoder.graphs_hold = hold
        runs = encoder
    else:
        runs = encoder.path = graphs_path(encoder.model, encoder.held_tokenizer, "cpu", hold)

    def call(n: int) -> None:
        runs.model = copies[n % models]  # the template takes this model's weights
        encoder.encode_ids(batch)

    return timed(call, rows, seconds, 1)


def timed(call: Any, rows: int, seconds: float, batches: int) -> dict[str, Any]:
    """``call(n)`` (``batches`` batches of ``rows`` texts) after a warm-up, for
    ``seconds``: per batch, wall and thread CPU microseconds and torch operators."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped upstream
        def __init__(self) -> None:
            super().__init__()  # type: ignore[no-untyped-call]  # untyped upstream
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops += 1
            return func(*args, **(kwargs or {}))

    for n in range(50):
        call(n)
    with Count() as count:
        call(50)
    calls, began, began_cpu = 0, time.perf_counter(), time.thread_time()
    stop = began + seconds
    while time.perf_counter() < stop:
        for _ in range(20):
            call(calls)
            calls += 1
    wall, cpu = time.perf_counter() - began, time.thread_time() - began_cpu
    return {
        "rows": rows,
        "calls": calls * batches,
        "us_per_batch": 1e6 * wall / (calls * batches),
        "cpu_us_per_batch": 1e6 * cpu / (calls * batches),
        "ops_per_batch": count.ops / batches,
    }


def stacked_child(
    encoder: Any, copies: list[Any], batch: list[Any], seconds: float, stack: int
) -> dict[str, Any]:
    """``child``'s figures for rounds of ``stack`` batches, one a model, the models
    in turn (``runtimes/stacking.py``): a round launched and its vectors taken back
    in this thread, as a round's leader does (the others' waits not counted)."""
    from tessera.runtimes.base import SharedComponents
    from tessera.runtimes.graphs import GraphsHold, Stacking
    from tessera.runtimes.stacking import StackedGraphs

    try:
        from tessera.runtimes.stacking import RoundCall
    except ImportError:  # a tree from before the name
        from tessera.runtimes.stacking import PooledCall as RoundCall

    hold = GraphsHold.acquire(
        SharedComponents(),
        encoder.model,
        encoder.held_tokenizer,
        "last_hidden_state",
        capture=False,  # every bucket of every round size is many forwards here: on use
        make_runner=free_runner,
        stacking=Stacking(stack, StackedGraphs),
    )
    stacked = hold.graphs.stacked
    assert isinstance(stacked, StackedGraphs)
    count = len(copies)

    def call(n: int) -> None:
        models = [copies[(n * stack + i) % count] for i in range(stack)]
        stacked.launch([RoundCall(m, batch, "mean", lambda: None) for m in models])()

    return timed(call, len(batch), seconds, stack)


def weight_tensors_of_tree() -> Any:
    """The tree's ``weight_tensors`` (where it has gathered blocks)."""
    try:
        from tessera.runtimes.template import weight_tensors
    except ImportError:  # a tree from before weight templates had a module
        from tessera.runtimes.graphs import weight_tensors
    return weight_tensors


def other_weights(model: Any, number: int) -> Any:
    """A copy of ``model`` with other weights (a fine-tune, as far as shapes go)."""
    import copy

    import torch

    other = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.mul_(1 + number / 100)
    return other


def run_child(
    source: Path | None, rows: int, seconds: float, models: int, stack: int = 0
) -> dict[str, Any]:
    from harness.trees import child_figures

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    arguments = [str(rows), "--seconds", str(seconds), "--models", str(models)]
    return child_figures(
        __file__, source, [*arguments, "--stack", str(stack)], env=env, timeout_s=300
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", type=Path, nargs="*", default=[])
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--models", type=int, default=1)
    parser.add_argument(
        "--stack", type=int, default=0, help="this checkout in stacked rounds of N models too"
    )
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.seconds, args.models, args.stack)))
        return
    from harness.report import write_report
    from harness.trees import rerun_command

    sources: list[tuple[str, Path | None, int]] = [("this checkout", None, 0)]
    if args.stack:
        sources.append((f"this checkout, rounds of {args.stack}", None, args.stack))
    sources += [(str(path), path.resolve(), 0) for path in args.against]
    runs: list[dict[str, Any]] = []
    for round_ in range(1, args.rounds + 1):
        for rows in args.rows:
            for name, source, stack in sources:
                run = run_child(source, rows, args.seconds, args.models, stack)
                run.update(round=round_, source=name)
                runs.append(run)
                print(
                    f"round {round_}, {rows} rows, {name}: {run['us_per_batch']:.0f} us,"
                    f" {run['cpu_us_per_batch']:.0f} CPU us, {run['ops_per_batch']} ops a batch",
                    flush=True,
                )
    keys = ("us_per_batch", "cpu_us_per_batch", "ops_per_batch")
    medians = {
        f"{name}, {rows} rows": {
            key: statistics.median(
                r[key] for r in runs if r["source"] == name and r["rows"] == rows
            )
            for key in keys
        }
        for rows in args.rows
        for name, _, _ in sources
    }
    date = datetime.date.today().isoformat()
    rerun = rerun_command(__file__, args.against)
    rerun += " --rows " + " ".join(map(str, args.rows))
    rerun += f" --models {args.models} --seconds {args.seconds:g}"
    if args.stack:
        rerun += f" --stack {args.stack}"
    lines = [
        f"# The host's work around a graph replay, {date}",
        "",
        "`SentenceEncoder.encode_ids` of one-sentence texts tokenised ahead, the packaged"
        " MiniLM on the CPU with its architecture's graphs and a runner that replays"
        " nothing (its outputs computed at the bucket's build): what the host does around"
        f" a replay, per batch, to {args.models} model(s) in turn (each other than the last"
        f" copies its weights in); with `--stack N`, this checkout in stacked rounds of"
        " N batches too, one a model, the models in turn (a round launched and its vectors"
        " taken back in one thread, as its leader does; the figures a batch: a round's"
        " over N; a model keeps its slot where there are no more models than N)."
        f" {args.seconds:g} s a run, one torch thread,"
        f" {os.cpu_count()} cores shared. Rerun: `HF_HUB_OFFLINE=1 .venv/bin/python {rerun}`.",
        "",
        "| round | rows | source | us a batch | CPU us a batch | torch ops a batch |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['round']} | {r['rows']} | {r['source']} | {r['us_per_batch']:.0f} |"
            f" {r['cpu_us_per_batch']:.0f} | {r['ops_per_batch']} |"
            for r in runs
        ),
        "",
        "Medians: "
        + "; ".join(
            f"{name}: {m['us_per_batch']:.0f} us, {m['cpu_us_per_batch']:.0f} CPU us,"
            f" {m['ops_per_batch']:.1f} ops"
            for name, m in medians.items()
        )
        + ".",
        "",
    ]
    figures = {
        "runs": runs,
        "medians": medians,
        "models": args.models,
        "stack": args.stack,
        "python": sys.version.split()[0],
    }
    write_report(args.out, date, "graph-host", figures, "\n".join(lines))


if __name__ == "__main__":
    main()
