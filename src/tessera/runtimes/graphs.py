"""Small encoders on a GPU: reduced precision checked against float32, and
CUDA graphs per shape bucket (issue 15, item 2).

Precision. A card's ``dtype`` option (``auto``, ``float32``, ``float16``,
``bfloat16``) says what the weights run in; ``auto`` is float16 on CUDA and
float32 on the CPU. A reduced precision is kept only if the model's outputs
on ``CHECK_TEXTS`` stay within ``MIN_COSINE`` of float32's, row by row
(pooled token vectors for an encoder, logits for a classifier); otherwise
the model goes back to float32 and the load says why in the log.

Graphs. One forward of MiniLM at batch 1 is 3.4 ms of kernel launches on an
H200 and 0.57 ms as a CUDA graph (shared/GPU.md). ``GraphForward`` runs a
Hugging Face encoder at bucketed shapes: a batch is padded up to the
smallest (batch, length) bucket that holds it (``BATCH_BUCKETS`` x
``LENGTH_BUCKETS``), run by that bucket's runner, and its rows and
positions cut back; a larger batch runs eager (it is compute, not launches).
The attention mask goes in as a 4-D additive mask built outside the graph,
which transformers passes through as it is: built inside, the mask's
"is there padding" test reads the device, which a graph capture forbids.
Padding with a masked position changes no real position's vector (tested on
the CPU against the plain forward). On CUDA a bucket's runner is a graph
captured from static inputs (``cuda_graph_runner``), all of one model's in
one memory pool, replayed one at a time (a lock); they are captured at the
model's first load, inside its measurement, so their memory is counted as
the model's, and again after a return from the host tier (its weights are
new tensors then), each on its bucket's second use. A bucket whose capture fails runs eager from
then on. On the CPU there are no graphs and no padding.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tessera.errors import ModelUnavailableError

if TYPE_CHECKING:
    import torch

    from tessera.repository.spec import ModelSpec

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "float16", "bfloat16")
MIN_COSINE = 0.999
# Up to a card's usual max_batch_size: on an H200 a MiniLM forward of 32
# sentences took as long eager as one of 1 (3.4 ms of launches, GPU.md), so a
# batch of 32 is still launches, not compute, and a graph is what shortens it.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
LENGTH_BUCKETS = (16, 32, 64)
# After a reset (a return from the host tier), a bucket's graph is captured on
# its second use: a capture costs about three eager forwards.
CAPTURE_ON_USE = 2
# The most models a stacked forward holds where a card says ``stack: true``.
DEFAULT_STACK = 16
# What a reduced precision is checked on: short and long, plain and odd.
CHECK_TEXTS = (
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    "Quarterly revenue rose 12% to $4.1 billion, beating estimates.",
    "¿Dónde está la estación de tren más cercana?",
    "ERROR 503: upstream timed out after 30000 ms (retry in 5 s)",
    "A receipt: 2 x coffee 3.50, 1 x bagel 2.25, total 9.25 EUR",
    "def add(a, b):\n    return a + b",
    "Une phrase en français, pour voir ce que devient la précision.",
)

Inputs = dict[str, "torch.Tensor"]
Runner = Callable[[Inputs], "torch.Tensor"]
MakeRunner = Callable[[Any, str, Inputs], Runner]


@dataclass(frozen=True, slots=True)
class DeviceOptions:
    """A card's ``dtype`` (``DTYPES``), ``cuda_graphs`` (true) and ``stack``
    (``runtimes/stacking.py``: the most models a stacked forward holds; 0, off)."""

    dtype: str = "auto"
    graphs: bool = True
    stack: int = 0


def stack_option(spec: ModelSpec) -> int:
    """How many models a stacked forward of ``spec``'s group may hold (0: off)."""
    value = spec.options.get("stack", False)
    if value is True:
        return DEFAULT_STACK
    if value is False:
        return 0
    if not isinstance(value, int) or value < 2:
        raise ModelUnavailableError(
            spec.name, "option stack must be true, false or a whole number from 2"
        )
    return value


def device_options(spec: ModelSpec) -> DeviceOptions:
    dtype = spec.options.get("dtype", "auto")
    if dtype not in DTYPES:
        raise ModelUnavailableError(spec.name, f"option dtype must be one of {', '.join(DTYPES)}")
    graphs = spec.options.get("cuda_graphs", True)
    if not isinstance(graphs, bool):
        raise ModelUnavailableError(spec.name, "option cuda_graphs must be true or false")
    return DeviceOptions(str(dtype), graphs, stack_option(spec))


def encoder_variant(spec: ModelSpec) -> str:
    """What tells apart the copies of one encoder that cards' options make
    (empty for the defaults): part of its shared-component key."""
    options = device_options(spec)
    if options == DeviceOptions():
        return ""
    variant = f":{options.dtype}" + ("" if options.graphs else ":eager")
    return variant + (f":stack{options.stack}" if options.stack else "")


def wanted_dtype(option: str, device: str) -> str:
    """The dtype ``option`` asks for on ``device`` (``auto``: float16 on CUDA)."""
    if option == "auto":
        return "float16" if device.startswith("cuda") else "float32"
    return option


def bucket_of(size: int, buckets: Sequence[int]) -> int | None:
    for bucket in buckets:
        if size <= bucket:
            return bucket
    return None


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A (batch, length) 0/1 mask as the (batch, 1, 1, length) additive mask
    attention adds to its scores: 0 where attended, the dtype's lowest where not."""
    import torch

    keep = mask[:, None, None, :].to(dtype)
    return (1.0 - keep) * torch.finfo(dtype).min


def padded_inputs(
    batch: Mapping[str, torch.Tensor],
    rows: int,
    columns: int,
    pad_id: int,
    dtype: torch.dtype,
    keys: Sequence[str] = (),
) -> Inputs:
    """A tokenized ``batch`` padded to (rows, columns), ``input_ids`` with
    ``pad_id`` and the rest with 0 (``keys`` it lacks made of zeros), its
    attention mask made the additive mask of ``dtype``: padding is masked,
    and changes no real position's vector."""
    import torch

    size, length = batch["input_ids"].shape
    inputs: Inputs = {}
    for key in dict.fromkeys([*batch, *keys]):
        fill = pad_id if key == "input_ids" else 0
        value = batch.get(key)
        if value is None:
            value = torch.zeros_like(batch["input_ids"])
        value = torch.nn.functional.pad(value, (0, columns - length), value=fill)
        if rows > size:
            value = torch.cat([value, value.new_full((rows - size, columns), fill)])
        inputs[key] = value
    inputs["attention_mask"] = additive_mask(inputs["attention_mask"], dtype)
    return inputs


def primary(outputs: Any, output: str) -> torch.Tensor:
    tensor: torch.Tensor = getattr(outputs, output)
    return tensor


def pooled(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Rows to compare: token vectors mean-pooled over the mask, or logits as they are."""
    if values.dim() == 2:
        return values.float()
    weights = mask.unsqueeze(-1).to(values.dtype)
    return ((values * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)).float()


def reduce_precision(
    model: Any, batch: Mapping[str, torch.Tensor], dtype: str, output: str, min_cosine: float
) -> float:
    """Turn ``model`` to ``dtype`` if its outputs on ``batch`` keep a cosine of
    at least ``min_cosine`` to float32's, row by row; else leave it float32.
    Returns the lowest cosine."""
    import torch

    with torch.inference_mode():
        reference = pooled(primary(model(**batch), output), batch["attention_mask"])
        model.to(getattr(torch, dtype))
        trial = pooled(primary(model(**batch), output), batch["attention_mask"])
    cosine = float(torch.nn.functional.cosine_similarity(reference, trial, dim=-1).min())
    if cosine < min_cosine:
        model.to(torch.float32)
    return cosine


def choose_precision(
    model: Any, tokenizer: Any, device: str, option: str, output: str, name: str
) -> str:
    """Run ``model`` in the dtype ``option`` asks for on ``device`` if it passes
    the check (module notes); the dtype it runs in."""
    wanted = wanted_dtype(option, device)
    if wanted == "float32":
        return wanted
    batch = tokenizer(list(CHECK_TEXTS), padding=True, truncation=True, return_tensors="pt")
    batch = batch.to(device)
    cosine = reduce_precision(model, batch, wanted, output, MIN_COSINE)
    if cosine < MIN_COSINE:
        log.warning(
            "%s stays float32: in %s its outputs' cosine to float32's fell to %.5f (< %g)",
            name,
            wanted,
            cosine,
            MIN_COSINE,
        )
        return "float32"
    log.info("%s runs in %s (cosine to float32 >= %.5f)", name, wanted, cosine)
    return wanted


def run_eager(model: Any, output: str, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``model``'s ``output`` for ``inputs``, in inference mode."""
    import torch

    with torch.inference_mode():
        return primary(model(**inputs), output)


def eager_runner(model: Any, output: str, example: Inputs) -> Runner:
    """A bucket run as it is, padded (what a graph replays; the CPU tests' runner)."""
    return functools.partial(run_eager, model, output)


def cuda_graph_runner(model: Any, output: str, example: Inputs, pool: Any = None) -> Runner:
    """A bucket as a CUDA graph over static copies of ``example``: a run copies
    its inputs in and replays; the result is the graph's own output tensor,
    valid until the next replay."""
    import torch

    static = {key: value.clone() for key, value in example.items()}
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # untyped upstream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(2):  # kernels chosen and workspaces allocated before capture
            model(**static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with (
        torch.inference_mode(),
        torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"),
    ):
        out = primary(model(**static), output)

    def run(inputs: Inputs) -> torch.Tensor:
        for key, value in inputs.items():
            static[key].copy_(value)
        graph.replay()
        return out

    return run


class GraphForward:
    """An encoder's forward at bucketed shapes (module notes). ``output`` is
    the attribute of the model's outputs wanted (``last_hidden_state`` or
    ``logits``); ``make_runner(model, output, example)`` builds a bucket's
    runner from an example of its padded inputs."""

    def __init__(
        self,
        model: Any,
        output: str,
        pad_id: int,
        make_runner: MakeRunner,
        *,
        batch_buckets: Sequence[int] = BATCH_BUCKETS,
        length_buckets: Sequence[int] = LENGTH_BUCKETS,
        max_length: int | None = None,
        input_keys: Sequence[str] = ("input_ids", "attention_mask"),
    ) -> None:
        self.model = model
        self.input_keys = tuple(input_keys)
        self.output = output
        self.pad_id = pad_id
        self.make_runner = make_runner
        self.batch_buckets = tuple(batch_buckets)
        self.length_buckets = tuple(
            b for b in length_buckets if max_length is None or b <= max_length
        )
        self._runners: dict[tuple[int, int], Runner | None] = {}
        self._uses: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()

    @property
    def num_runners(self) -> int:
        """Buckets with a runner built (a failed one counts as none)."""
        return sum(r is not None for r in self._runners.values())

    def __call__(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The wanted output of ``batch``, as the plain forward gives it."""
        size, length = batch["input_ids"].shape
        rows = bucket_of(size, self.batch_buckets)
        columns = bucket_of(length, self.length_buckets)
        if rows is None or columns is None:
            return self.eager(batch)
        key = (rows, columns)
        if key not in self._runners:
            # A bucket is built on its second use since the last reset: a model
            # back from the host tier for one request does not pay a capture.
            self._uses[key] = self._uses.get(key, 0) + 1
            if self._uses[key] < CAPTURE_ON_USE:
                return self.eager(batch)
        inputs = self.padded(batch, rows, columns)
        with self._lock:
            runner = self._runner(key, inputs)
            if runner is not None:
                out = runner(inputs)
                return out[:size, :length].clone() if out.dim() == 3 else out[:size].clone()
        return self.eager(batch)

    def eager(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return run_eager(self.model, self.output, batch)

    def padded(self, batch: Mapping[str, torch.Tensor], rows: int, columns: int) -> Inputs:
        """``batch`` padded to (rows, columns), its mask made additive."""
        dtype = next(self.model.parameters()).dtype
        return padded_inputs(batch, rows, columns, self.pad_id, dtype)

    def _runner(self, key: tuple[int, int], example: Inputs) -> Runner | None:
        if key in self._runners:
            return self._runners[key]
        try:
            runner: Runner | None = self.make_runner(self.model, self.output, example)
        except Exception as e:  # a model that cannot be captured runs eager
            log.warning("bucket %s runs eager: building its runner failed: %s", key, e)
            runner = None
        self._runners[key] = runner
        return runner

    def prepare(self, device: str) -> None:
        """Build every bucket's runner now (a first load: inside its measurement)."""
        import torch

        for rows in self.batch_buckets:
            for columns in self.length_buckets:
                ids = torch.full((rows, columns), self.pad_id, dtype=torch.long, device=device)
                batch = {key: torch.zeros_like(ids) for key in self.input_keys}
                batch.update(input_ids=ids, attention_mask=torch.ones_like(ids))
                example = self.padded(batch, rows, columns)
                with self._lock:
                    self._runner((rows, columns), example)

    def reset(self) -> None:
        """Drop the runners (the weights they read are leaving the device)."""
        with self._lock:
            self._runners.clear()
            self._uses.clear()


def cuda_graph_forward(model: Any, tokenizer: Any, output: str) -> GraphForward:
    """``model``'s forward as CUDA graphs, one memory pool for all of them."""
    import torch

    runner = functools.partial(cuda_graph_runner, pool=torch.cuda.graph_pool_handle())
    positions = getattr(model.config, "max_position_embeddings", None)
    return GraphForward(
        model,
        output,
        tokenizer.pad_token_id or 0,
        runner,
        max_length=positions if isinstance(positions, int) else None,
        input_keys=tuple(tokenizer.model_input_names),
    )


def graphs_bytes(graphs: GraphForward, device: str) -> int:
    """Capture every bucket of ``graphs`` now; the device bytes they hold."""
    import torch

    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    graphs.prepare(device)
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.memory_allocated(device) - before)
