"""Runners of a bucketed forward: what runs one bucket's padded inputs.

A bucket's ``Step`` (padded inputs, the attention mask 0/1, to named
outputs) is run by a ``Runner`` that ``MakeRunner`` builds from an example
of its inputs. On CUDA the runner is a graph captured over static copies of
the example (``CudaGraphRunners``): a run copies its inputs in and replays.
``eager_runner`` runs the step as it is (what a graph replays; the CPU
tests' runner). ``BucketRunners`` keeps one runner a bucket, built on a
bucket's ``CAPTURE_ON_USE``-th use since its last reset; a bucket whose
runner fails to build runs eager until the next reset.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from tessera.runtimes.padding import Inputs, Outputs, PackedInputs

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# After a reset (a return from the host tier), a bucket's graph is captured on
# its second use: a model back for one request does not pay a capture.
CAPTURE_ON_USE = 2

# What a bucket runs: padded inputs (the attention mask 0/1) to named outputs.
Step = Callable[[Inputs], Outputs]
Runner = Callable[[Inputs], Outputs]
MakeRunner = Callable[[Step, Inputs], Runner]


def model_output(outputs: Any, output: str) -> torch.Tensor:
    """The attribute ``output`` of a Hugging Face model's outputs."""
    tensor: torch.Tensor = getattr(outputs, output)
    return tensor


def run_eager(model: Any, output: str, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``model``'s ``output`` for ``inputs``, in inference mode."""
    import torch

    with torch.inference_mode():
        return model_output(model(**inputs), output)


def run_step(step: Step, device: torch.device, inputs: Inputs) -> Outputs:
    """``step`` of ``inputs`` (moved to ``device``), in inference mode."""
    import torch

    with torch.inference_mode():
        return step({key: value.to(device) for key, value in inputs.items()})


def eager_runner(step: Step, example: Inputs) -> Runner:
    """A bucket's step run as it is, padded (what a graph replays; the CPU
    tests' runner)."""
    return functools.partial(run_step, step, next(iter(example.values())).device)


class CudaGraphRunners:
    """Builds buckets' runners as CUDA graphs over static copies of an
    example: a run copies its inputs in and replays; the result is the
    graph's own output tensor, valid until the next replay.

    All of one ``GraphForward``'s graphs go in one memory pool, and ``renew``
    starts a new one once they are all dropped: the allocator forgets a pool
    whose graphs are gone, and a capture into its handle then fails an
    internal assert ("use_count > 0"). Every capture on a device warms up and
    records on one stream (``capture_stream``) under one lock: cuBLAS keeps a
    workspace for each stream it has run on, so a stream a bucket would hold
    a workspace a bucket. The capture is begun and ended by hand:
    ``torch.cuda.graph`` synchronises the whole device and empties the
    allocator's cache at each one, which stalls every other model's batch
    and returns the blocks the host tier keeps. Graphs that share the
    capture stream's workspace never run at once: every replay goes to the
    workers' one stream, the device's default.
    """

    def __init__(self) -> None:
        self._pool: Any = None

    def __call__(self, step: Step, example: Inputs) -> Runner:
        import torch

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        static, packed = static_inputs(example)
        device = static[next(iter(static))].device
        with _CAPTURE_LOCK:
            side = capture_stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side), torch.inference_mode():
                for _ in range(2):  # kernels chosen and workspaces allocated before capture
                    step(static)
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    outputs = step(static)
                finally:
                    graph.capture_end()
            torch.cuda.current_stream(device).wait_stream(side)

        def run(inputs: Inputs) -> Outputs:
            # From the host (``host_inputs``, page-locked) without blocking:
            # the stream orders the copy after the last replay.
            copy_inputs(static, packed, inputs)
            graph.replay()
            return outputs

        return run

    def renew(self) -> None:
        """A new pool for the next captures (the graphs of the last are gone)."""
        self._pool = None


_CAPTURE_LOCK = threading.Lock()
_capture_streams: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream every capture on ``device`` warms up and records on."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _capture_streams.get(index)
    if stream is None:
        stream = _capture_streams[index] = torch.cuda.Stream(index)  # type: ignore[no-untyped-call]  # untyped upstream
    return stream


class BucketRunners:
    """A step's runners by bucket (any key: ``GraphForward``'s (rows,
    columns), a stacked forward's (models, rows, columns)): built at
    ``build`` (a first load's capture) or on a bucket's ``CAPTURE_ON_USE``-th
    use since the last ``reset``; a bucket whose runner fails to build runs
    eager until the next reset. Not thread-safe: its owner's lock guards it."""

    def __init__(self, step: Step, device: torch.device, make_runner: MakeRunner) -> None:
        self.step = step
        self.device = device
        self.make_runner = make_runner
        self._runners: dict[tuple[int, ...], Runner | None] = {}
        self._uses: dict[tuple[int, ...], int] = {}

    @property
    def num_runners(self) -> int:
        """Buckets with a runner built (a failed one counts as none)."""
        return sum(r is not None for r in self._runners.values())

    def failed(self, key: tuple[int, ...]) -> bool:
        """Whether the bucket's runner failed to build (since the last reset)."""
        return key in self._runners and self._runners[key] is None

    def replay(self, key: tuple[int, ...], inputs: Inputs) -> Outputs | None:
        """The bucket's outputs for its padded ``inputs``; None where it runs
        eager: before its second use since the last reset (a model back from
        the host tier for one request does not pay a capture), or when its
        runner could not be built."""
        if key not in self._runners:
            self._uses[key] = self._uses.get(key, 0) + 1
            if self._uses[key] < CAPTURE_ON_USE:
                return None
        runner = self.build(key, inputs)
        return runner(inputs) if runner is not None else None

    def build(self, key: tuple[int, ...], example: Inputs) -> Runner | None:
        if key in self._runners:
            return self._runners[key]
        device = self.device
        on_device = {key: value.to(device) for key, value in example.items()}
        try:
            runner: Runner | None = self.make_runner(self.step, on_device)
        except Exception as e:  # a model that cannot be captured runs eager
            log.warning("bucket %s runs eager: building its runner failed: %s", key, e)
            runner = None
        self._runners[key] = runner
        return runner

    def reset(self) -> None:
        """Drop the runners (the weights they read are leaving the device)."""
        self._runners.clear()
        self._uses.clear()
        if isinstance(self.make_runner, CudaGraphRunners):
            self.make_runner.renew()


def static_inputs(example: Inputs) -> tuple[Inputs, torch.Tensor | None]:
    """A graph's static copies of ``example``'s inputs, as rows of one block
    (returned beside them) where they share a shape and dtype; else each its
    own (and None)."""
    import torch

    values = list(example.values())
    first = values[0]
    if all(v.shape == first.shape and v.dtype == first.dtype for v in values):
        packed = torch.stack(values)
        return dict(zip(example, packed.unbind(0), strict=True)), packed
    return {key: value.clone() for key, value in example.items()}, None


def copy_inputs(static: Inputs, packed: torch.Tensor | None, inputs: Inputs) -> None:
    """``inputs`` into a graph's ``static`` ones (``static_inputs``), without
    blocking: one copy where both are one block in one order, else one a key."""
    if (
        packed is not None
        and isinstance(inputs, PackedInputs)
        and tuple(inputs) == tuple(static)
        and inputs.block.shape == packed.shape
    ):
        packed.copy_(inputs.block, non_blocking=True)
        return
    for key, value in inputs.items():
        static[key].copy_(value, non_blocking=True)


def default_runner() -> MakeRunner:
    """A bucket's runner: a CUDA graph, all of one ``GraphForward``'s in one pool."""
    return CudaGraphRunners()
