"""Chat generation with a causal language model (adapter ``hf-causal-lm``).

The model comes from a Hugging Face folder, or from a GGUF file inside the
source folder (option ``gguf_file``), which transformers dequantizes to a
torch model (the default SmolLM2-135M-Instruct Q4_1 GGUF becomes an fp32
``LlamaForCausalLM`` of ~538 MB).

Every generated token of every row passes through one hook, a stopping
criterion called in the generating thread after each step: it decodes the
row's tokens so far, cuts at the first stop string, streams the new text to
``on_text`` and tells ``generate`` which rows are done. One hook serves
streaming, stop strings and per-row ``max_tokens`` alike, for a batch as for
one item, with no second thread (transformers' ``TextIteratorStreamer`` needs
one, and its streamers take batch size 1 only). The same hook reads each
row's stop flag (``request.item_stops``): a row whose caller has gone ends at
the next step, and when every row has, ``generate`` returns. Between two
steps the hook is a step boundary (``step.step_boundary``), where the batch
may step aside while short batches of other models run.

Greedy items of a batch run as one left-padded ``generate``; sampling items
are grouped by (temperature, top_p), and seeded items run alone so that a
seed gives the same text whatever else is in the batch. OpenAI's presence and
frequency penalties and logit bias are each row's own, applied to the logits
before temperature and top-p (``sampling_options``): rows that differ in them
share a ``generate``.

Options (model.yaml ``options``):

- ``gguf_file``: the GGUF file's name inside the source folder.
- ``chat_template``: a Jinja chat template, where the tokenizer has none.
- ``dtype``: ``float32``, ``float16``, ``bfloat16`` or ``auto`` (default: what
  transformers picks; fp32 for a dequantized GGUF).
- ``stop_tokens``: extra end-of-turn token strings that end generation, for
  models whose turn ends with something other than the EOS token.
- ``max_tokens_limit``: refuse items whose ``max_tokens`` is larger.

In the host tier (``runtimes.base.OffloadingModel``, ``runtimes/hostcopy.py``)
when evicted: on CUDA its weights wait in pinned memory; on the CPU only
weights that map their files leave (a model read into process memory, as a
GGUF's conversion is, would free nothing there: it is not offloaded).

Dequantizing a GGUF takes ~20 s on a small CPU, so when the load context has a
``cache_dir`` the converted model and tokenizer are kept there as safetensors,
in ``<cache_dir>/causal-lm/<key>`` (the key hashes the GGUF's path, size and
mtime, the ``dtype`` option and the transformers version), and later loads
read that instead (well under a second). An entry is written in a temporary
folder beside it and renamed into place complete, its marker file last; a
folder without the marker is ignored and rebuilt. Failing to write the cache
only logs a warning.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import logging
import os
import shutil
import struct
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Literal

from tessera.errors import InvalidInputError, ModelUnavailableError
from tessera.footprint import Footprint
from tessera.request import StopFlag, item_stops
from tessera.runtimes.base import LoadContext
from tessera.runtimes.cache import CAUSAL_LM, PRIVATE_DIR_MODE, private_dirs, used
from tessera.runtimes.hostcopy import HostSlot
from tessera.runtimes.memory import files_bytes, torch_module_bytes
from tessera.step import holding, step_boundary
from tessera.tasks.types import ChatInput, ChatOutput, refuse_engine_only

if TYPE_CHECKING:
    from tessera.repository.spec import ModelSpec

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

# Converted GGUF models live in <cache_dir>/causal-lm/<key>/; an entry is
# complete when this marker is in it (written last, renamed into place with it).
_CACHE_MARKER = "tessera-complete.json"

# torch's sampling RNG is process-global: a seeded run holds this lock from
# seeding to its last token, and so does every sampling run of this adapter,
# so that none draws from the stream a seeded run is replaying.
_SAMPLING_LOCK = threading.Lock()

# A decoded sequence that ends in an incomplete UTF-8 character ends in this.
_REPLACEMENT = "\ufffd"


class CausalLmLoader:
    """Loads a causal LM (a Hugging Face folder, or a GGUF file in it) for chat."""

    def estimate_bytes(self, spec: ModelSpec) -> int:
        source = spec.resolve_source()
        folder, gguf_file = _locate(spec, source)
        dtype = _dtype_option(spec)
        if gguf_file is not None:
            # The tensors are dequantized: count elements, not file bytes.
            path = folder / gguf_file
            num_elements = _gguf_num_elements(path)
            if num_elements is None:
                return files_bytes(path) * 8  # ~4 bits a weight to fp32, if unreadable
            return num_elements * _DTYPE_BYTES.get(dtype or "float32", 4)
        weights = files_bytes(folder, (".safetensors",)) or files_bytes(folder, (".bin",))
        return weights

    def shared_keys(self, spec: ModelSpec) -> tuple[str, ...]:
        return ()

    def load(self, spec: ModelSpec, ctx: LoadContext) -> CausalLm:
        source = spec.resolve_source()
        folder, gguf_file = _locate(spec, source)
        try:
            model, tokenizer = _load_weights(spec, folder, gguf_file, ctx.cache_dir)
            _configure_tokenizer(spec, tokenizer)
            model = model.to(ctx.device.torch_device())
        except ModelUnavailableError:
            raise
        except Exception as e:  # any load failure is this model's, reported as such
            raise ModelUnavailableError(spec.name, f"cannot load {source}: {e}") from e
        return CausalLm(spec, model, tokenizer, ctx.device.torch_device())


def _locate(spec: ModelSpec, source: Path) -> tuple[Path, str | None]:
    """The folder to load from and the GGUF file name in it (None: a HF folder)."""
    gguf_file = spec.options.get("gguf_file")
    if source.is_file():
        if source.suffix != ".gguf":
            raise ModelUnavailableError(spec.name, f"{source} is neither a folder nor a .gguf")
        return source.parent, source.name
    if gguf_file is None:
        return source, None
    if not isinstance(gguf_file, str) or not (source / gguf_file).is_file():
        raise ModelUnavailableError(spec.name, f"gguf_file {gguf_file!r} not found in {source}")
    return source, gguf_file


def _dtype_option(spec: ModelSpec) -> str | None:
    dtype = spec.options.get("dtype")
    if dtype is not None and dtype != "auto" and dtype not in _DTYPE_BYTES:
        raise ModelUnavailableError(spec.name, f"unknown dtype {dtype!r}")
    return None if dtype is None else str(dtype)


def _load_weights(
    spec: ModelSpec, folder: Path, gguf_file: str | None, cache_dir: Path | None
) -> tuple[Any, Any]:
    """The model (on the CPU, in eval mode) and its tokenizer as saved: from the
    cache entry when one is complete, else from the source (a GGUF's then cached)."""
    if gguf_file is None or cache_dir is None:
        return _from_pretrained(spec, folder, gguf_file)
    key, identity = _cache_key(folder / gguf_file, _dtype_option(spec))
    entry = cache_dir / CAUSAL_LM / key
    if (entry / _CACHE_MARKER).is_file():
        used(entry)
        try:
            return _from_pretrained(spec, entry, None, in_memory=True)
        except Exception as e:  # a damaged entry: fall back to the GGUF and rebuild it
            logger.warning("cannot load the cached %s (%s); converting %s", entry, e, gguf_file)
            with contextlib.suppress(OSError):
                (entry / _CACHE_MARKER).unlink()  # incomplete now: rebuilt below
    model, tokenizer = _from_pretrained(spec, folder, gguf_file)
    _write_cache_entry(entry, model, tokenizer, identity)
    return model, tokenizer


def _from_pretrained(
    spec: ModelSpec, folder: Path, gguf_file: str | None, *, in_memory: bool = False
) -> tuple[Any, Any]:
    """Model and tokenizer from a Hugging Face folder, or from a GGUF file in it.

    ``in_memory``: read the safetensors into process memory rather than map
    them, as a GGUF's conversion is; mapped weights would be paged in by the
    first batch, which the engine would count as that batch's activations.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, local_files_only=True)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    load_options = inspect.signature(PreTrainedModel.from_pretrained).parameters
    if in_memory and "disable_mmap" in load_options:  # transformers 5; older ones map
        kwargs["disable_mmap"] = True
    dtype = _dtype_option(spec)
    if dtype is not None:
        import torch

        kwargs["dtype"] = dtype if dtype == "auto" else getattr(torch, dtype)
    model: Any = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    model.eval()
    return model, tokenizer


def _configure_tokenizer(spec: ModelSpec, tokenizer: Any) -> None:
    """The chat template option and left padding (after loading, from either place,
    so that the cache holds the tokenizer as the source has it)."""
    template = spec.options.get("chat_template")
    if template is not None:
        tokenizer.chat_template = str(template)
    if not getattr(tokenizer, "chat_template", None):
        raise ModelUnavailableError(
            spec.name, "the tokenizer has no chat template; set options.chat_template"
        )
    # Batched generation appends on the right, so prompts are padded on the left.
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token


def _cache_key(gguf: Path, dtype: str | None) -> tuple[str, dict[str, Any]]:
    """The cache entry's name for a GGUF file and dtype option, and what it hashes."""
    from importlib.metadata import version

    path = gguf.resolve()
    stat = path.stat()
    identity: dict[str, Any] = {
        "gguf": str(path),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "dtype": dtype,
        "transformers": version("transformers"),
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return digest[:16], identity


def _write_cache_entry(entry: Path, model: Any, tokenizer: Any, identity: dict[str, Any]) -> None:
    """Save the converted model into ``entry``, complete or not at all; a failure
    is logged, never raised (the model is served either way)."""
    if not all(t.is_floating_point() for t in model.state_dict().values()):
        # transformers kept the GGUF blocks packed (a kernel for them is installed):
        # there is nothing converted to keep.
        logger.info("not caching %s: its weights stay quantized", identity["gguf"])
        return
    tmp = entry.with_name(f".{entry.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        private_dirs(tmp.parent)
        tmp.mkdir(mode=PRIVATE_DIR_MODE)
        # transformers refuses to save a model loaded through its GGUF quantizer,
        # though the weights are plain tensors now; drop the quantizer as its
        # dequantize() does, which leaves the model as if loaded from safetensors.
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            quantizer.remove_quantization_config(model)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for path in tmp.iterdir():
            _fsync(path)  # the data is on disk before the marker that vouches for it
        marker = tmp / _CACHE_MARKER
        marker.write_text(json.dumps(identity, indent=2), encoding="utf-8")
        _fsync(marker)
        _publish(tmp, entry)
    except Exception as e:  # a full disk, a read-only folder, a transformers refusal
        logger.warning("cannot cache the converted %s in %s: %s", identity["gguf"], entry, e)
    finally:
        _remove(tmp)  # gone already if published


def _publish(tmp: Path, entry: Path) -> None:
    """Rename the finished ``tmp`` to ``entry``: atomic, so readers see all or nothing."""
    try:
        tmp.rename(entry)  # replaces an empty folder, refuses a non-empty one
        return
    except OSError:
        if (entry / _CACHE_MARKER).is_file():
            return  # another server published it first; its entry is as good as this one
        if not entry.exists():
            raise
    # A partial entry (a crash, a damaged entry) is in the way: move it aside in
    # one step, so that no reader sees it half removed, then try once more.
    stale = entry.with_name(f".{entry.name}.{uuid.uuid4().hex[:8]}.stale")
    entry.rename(stale)
    _remove(stale)
    try:
        tmp.rename(entry)
    except OSError:
        if not (entry / _CACHE_MARKER).is_file():
            raise


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _gguf_num_elements(path: Path) -> int | None:
    """Elements of all tensors in a GGUF file, from its header alone (None if unreadable).

    gguf's own reader parses every metadata value (a 49k-token vocabulary takes
    seconds); this skips over them.
    """
    try:
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                return None
            version, num_tensors, num_kv = struct.unpack("<IQQ", f.read(20))
            if version not in (2, 3):
                return None
            for _ in range(num_kv):
                _skip_string(f)
                (value_type,) = struct.unpack("<I", f.read(4))
                _skip_value(f, value_type)
            total = 0
            for _ in range(num_tensors):
                _skip_string(f)
                (num_dims,) = struct.unpack("<I", f.read(4))
                dims = struct.unpack(f"<{num_dims}Q", f.read(8 * num_dims))
                f.seek(12, 1)  # type (u32) and offset (u64)
                total += functools.reduce(int.__mul__, dims, 1)
            return total
    except (OSError, struct.error, ValueError):
        return None


# GGUF metadata value types -> byte size (8 string, 9 array are variable).
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _skip_string(f: BinaryIO) -> None:
    (length,) = struct.unpack("<Q", f.read(8))
    f.seek(length, 1)


def _skip_value(f: BinaryIO, value_type: int) -> None:
    if value_type == 8:
        _skip_string(f)
    elif value_type == 9:
        item_type, count = struct.unpack("<IQ", f.read(12))
        if item_type in _GGUF_SIZES:
            f.seek(_GGUF_SIZES[item_type] * count, 1)
        else:
            for _ in range(count):
                _skip_value(f, item_type)
    elif value_type in _GGUF_SIZES:
        f.seek(_GGUF_SIZES[value_type], 1)
    else:
        raise ValueError(f"unknown GGUF value type {value_type}")


@dataclass(frozen=True, slots=True)
class _Prepared:
    """One validated item, its prompt text and prompt length."""

    item: ChatInput
    prompt: str
    num_prompt_tokens: int


class CausalLm:
    """A loaded causal LM that continues chats; see the module docstring."""

    def __init__(self, spec: ModelSpec, model: Any, tokenizer: Any, device: str) -> None:
        self._spec = spec
        self._model: Any = model
        self._tokenizer: Any = tokenizer
        self._device = device
        self._bytes = torch_module_bytes(model)
        self._eos_ids = _eos_ids(spec, model, tokenizer)
        self._context_tokens = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        limit = spec.options.get("max_tokens_limit")
        self._max_tokens_limit = int(limit) if limit is not None else None
        # Fast tokenizers are not safe to share between threads (padding state).
        self._lock = threading.Lock()
        self._host = HostSlot(spec.name, device, self._lock)

    def run(self, items: Sequence[Any]) -> list[ChatOutput]:
        # Held across step boundaries: taken with ``holding`` (see step.py).
        with holding(self._lock):
            model, tokenizer = self._require()
            prepared = [self._prepare(tokenizer, item) for item in items]
            stops = item_stops(len(items))
            return generate_in_groups(
                [p.item for p in prepared],
                lambda group: self._generate(
                    model, tokenizer, [prepared[i] for i in group], [stops[i] for i in group]
                ),
            )

    def memory(self) -> Footprint:
        return Footprint(own_bytes=self._bytes, method="torch tensors")

    def offload(self) -> Footprint | None:
        """Move the weights to the host tier (module and tokenizer stay built);
        None where that would free nothing (see the module docstring)."""
        return self._host.offload(self._model)

    def restore(self) -> None:
        """Bring the weights back from the host tier."""
        self._host.restore()

    def unload(self) -> None:
        self._model = None
        self._tokenizer = None
        self._host.close()
        if self._device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()

    def _require(self) -> tuple[Any, Any]:
        if self._model is None or self._tokenizer is None:
            raise ModelUnavailableError(self._spec.name, "the model was unloaded")
        if self._host.waiting:
            raise ModelUnavailableError(self._spec.name, "the model waits in the host tier")
        return self._model, self._tokenizer

    def _prepare(self, tokenizer: Any, item: Any) -> _Prepared:
        if not isinstance(item, ChatInput):
            raise InvalidInputError(f"expected a chat item, got {type(item).__name__}")
        _validate(item, self._max_tokens_limit)
        refuse_engine_only(item, "transformers' generate")
        check_logit_bias(item, len(tokenizer))
        if item.prompt is not None:
            prompt = _raw_prompt(tokenizer, item.prompt)
        else:
            messages = [{"role": m.role, "content": m.content} for m in item.messages]
            try:
                prompt = tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=False
                )
            except Exception as e:  # the template raises on what it cannot render
                raise InvalidInputError(f"the chat cannot be formatted for this model: {e}") from e
        num_prompt_tokens = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if self._context_tokens and num_prompt_tokens + item.max_tokens > self._context_tokens:
            raise InvalidInputError(
                f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({item.max_tokens}) "
                f"exceeds the model's context of {self._context_tokens} tokens"
            )
        return _Prepared(item, prompt, num_prompt_tokens)

    def _generate(
        self,
        model: Any,
        tokenizer: Any,
        group: list[_Prepared],
        stops: list[StopFlag],
    ) -> list[ChatOutput]:
        import torch
        from transformers import StoppingCriteriaList

        first = group[0].item
        encoded = tokenizer(
            [p.prompt for p in group], add_special_tokens=False, padding=True, return_tensors="pt"
        ).to(self._device)
        decode = functools.partial(
            tokenizer.decode, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        rows = [
            _RowStream(p.item, decode, self._eos_ids, stop)
            for p, stop in zip(group, stops, strict=True)
        ]
        options: dict[str, Any] = {
            "max_new_tokens": max(p.item.max_tokens for p in group),
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": sorted(self._eos_ids),
            "stopping_criteria": StoppingCriteriaList([_row_criteria_class()(rows)]),
            **sampling_options([p.item for p in group], encoded["input_ids"].shape[1]),
        }
        sampling = first.temperature > 0
        with (
            holding(_SAMPLING_LOCK) if sampling else contextlib.nullcontext(),
            torch.inference_mode(),
        ):
            if first.seed is not None:
                torch.manual_seed(first.seed)
            # Only ids and mask: some tokenizers add token_type_ids, which generate refuses.
            model.generate(
                input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"], **options
            )
        for row in rows:
            row.finish()
        return [row.output(p.num_prompt_tokens) for row, p in zip(rows, group, strict=True)]


def _raw_prompt(tokenizer: Any, text: str) -> str:
    """A completion's prompt as the model reads it: after the BOS token where
    the tokenizer puts one in front of a text (as transformers' and vLLM's
    completions do); prompts are tokenized without special tokens."""
    bos = getattr(tokenizer, "bos_token", None)
    if not bos or text.startswith(bos):
        return text
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    return bos + text if ids and ids[0] == tokenizer.bos_token_id else text


def _validate(item: ChatInput, max_tokens_limit: int | None) -> None:
    if item.prompt is not None and item.messages:
        raise InvalidInputError("a completion's prompt and a chat's messages do not go together")
    if item.prompt is None and not item.messages:
        raise InvalidInputError("a chat needs at least one message")
    if item.max_tokens < 1:
        raise InvalidInputError(f"max_tokens must be at least 1, got {item.max_tokens}")
    if max_tokens_limit is not None and item.max_tokens > max_tokens_limit:
        raise InvalidInputError(
            f"max_tokens {item.max_tokens} is over this model's limit of {max_tokens_limit}"
        )
    if item.temperature < 0:
        raise InvalidInputError(f"temperature must be >= 0, got {item.temperature}")
    if not 0 < item.top_p <= 1:
        raise InvalidInputError(f"top_p must be in (0, 1], got {item.top_p}")
    if any(not s for s in item.stop):
        raise InvalidInputError("stop strings must not be empty")


def _eos_ids(spec: ModelSpec, model: Any, tokenizer: Any) -> frozenset[int]:
    """Token ids that end a turn: the tokenizer's and generation config's EOS, and
    the ``stop_tokens`` option."""
    ids: set[int] = set()
    for value in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    for token in spec.options.get("stop_tokens") or ():
        token_id = tokenizer.convert_tokens_to_ids(str(token))
        if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
            raise ModelUnavailableError(spec.name, f"stop token {token!r} is not in the vocabulary")
        ids.add(token_id)
    if not ids:
        raise ModelUnavailableError(spec.name, "the model has no EOS token; set stop_tokens")
    return frozenset(ids)


def generate_in_groups(
    chats: Sequence[ChatInput], generate: Callable[[list[int]], list[ChatOutput]]
) -> list[ChatOutput]:
    """One output per chat, in their order: ``generate`` runs once for each
    group of chats (by index) that can share one ``generate`` call."""
    outputs: list[ChatOutput | None] = [None] * len(chats)
    for group in _groups(chats):
        for index, output in zip(group, generate(group), strict=True):
            outputs[index] = output
    return [o for o in outputs if o is not None]


def check_logit_bias(item: ChatInput, vocab_size: int) -> None:
    """Refuse a logit bias on a token id the model's vocabulary does not have."""
    for token, _ in item.logit_bias:
        if token >= vocab_size:
            raise InvalidInputError(
                f"logit_bias: token id {token} is not in this model's vocabulary"
                f" of {vocab_size} tokens"
            )


def sampling_options(chats: Sequence[ChatInput], prompt_length: int) -> dict[str, Any]:
    """``generate``'s options for one group of chats (one temperature and
    top-p: ``_groups``) whose prompts take ``prompt_length`` columns: OpenAI's
    sampling (no top-k), with each row's penalties and logit bias where any
    row asks for them."""
    first = chats[0]
    sampling = first.temperature > 0
    if not any(c.presence_penalty or c.frequency_penalty or c.logit_bias for c in chats):
        if not sampling:
            return {"do_sample": False}
        return {
            "do_sample": True,
            "temperature": first.temperature,
            "top_p": first.top_p,
            "top_k": 0,  # OpenAI semantics: no top-k unless asked
        }
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    # generate puts processors of its own before those it is given: it is
    # given them all, so that penalties and bias come before temperature and top-p.
    chain: list[Any] = [_penalties_class()(chats, prompt_length)]
    if not sampling:
        return {"do_sample": False, "logits_processor": LogitsProcessorList(chain)}
    if first.temperature != 1.0:
        chain.append(TemperatureLogitsWarper(first.temperature))
    if first.top_p < 1.0:
        chain.append(TopPLogitsWarper(first.top_p))
    return {
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "logits_processor": LogitsProcessorList(chain),
    }


@functools.cache
def _penalties_class() -> type[Any]:
    """A transformers ``LogitsProcessor`` of each row's presence and frequency
    penalties (over the tokens it has generated) and logit bias (built on first
    use, so that importing this module does not import transformers)."""
    import torch
    from transformers import LogitsProcessor

    class Penalties(LogitsProcessor):
        def __init__(self, chats: Sequence[ChatInput], prompt_length: int) -> None:
            self._chats = chats
            self._prompt_length = prompt_length
            self._presence = torch.tensor([c.presence_penalty for c in chats])
            self._frequency = torch.tensor([c.frequency_penalty for c in chats])
            self._penalised = bool(self._presence.any() or self._frequency.any())
            self._bias: torch.Tensor | None = None

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            generated = input_ids[:, self._prompt_length :]
            if self._penalised and generated.shape[1]:
                counts = torch.zeros_like(scores).scatter_add_(
                    1, generated, torch.ones_like(generated, dtype=scores.dtype)
                )
                presence = self._presence.to(scores)[:, None]
                frequency = self._frequency.to(scores)[:, None]
                scores = scores - presence * (counts > 0) - frequency * counts
            return scores + self._bias_like(scores)

        def _bias_like(self, scores: torch.Tensor) -> torch.Tensor:
            """Each row's bias over the logits' width (made once; ids past the
            width, which the model cannot give, are left out)."""
            if self._bias is None:
                bias = torch.zeros(scores.shape, dtype=scores.dtype)
                for row, chat in enumerate(self._chats):
                    for token, value in chat.logit_bias:
                        if token < scores.shape[1]:
                            bias[row, token] = value
                self._bias = bias.to(scores.device)
            return self._bias

    return Penalties


def _groups(items: Sequence[ChatInput]) -> list[list[int]]:
    """Indices of items that can share one ``generate`` call.

    Greedy items all share one; unseeded sampling items share one per
    (temperature, top_p); a seeded item runs alone, so its seed alone decides it.
    """
    by_key: dict[tuple[float, float] | int, list[int]] = {}
    for index, item in enumerate(items):
        key: tuple[float, float] | int
        if item.temperature == 0:
            key = (0.0, 1.0)
        elif item.seed is None:
            key = (item.temperature, item.top_p)
        else:
            key = -1 - index  # unique: alone
        by_key.setdefault(key, []).append(index)
    return list(by_key.values())


class _RowStream:
    """The generated text of one row: stop strings, max_tokens and streaming.

    ``push`` takes each new token and returns whether the row is done (also
    once ``stop`` is set: its caller has gone, and nothing more is decoded or
    streamed; the tokens made so far are counted). The text
    is the decoding of all the row's tokens so far (decoding the running
    sequence, not token by token, gets multi-byte characters and word joins
    right); what has been streamed is always a prefix of the final text, and
    never includes a stop string nor a piece that may be the start of one.
    """

    def __init__(
        self,
        item: ChatInput,
        decode: Callable[[list[int]], str],
        eos_ids: frozenset[int],
        stop: StopFlag | None = None,
    ) -> None:
        self._decode = decode
        self._stop = stop
        self._eos_ids = eos_ids
        self._stops = item.stop
        self._max_tokens = item.max_tokens
        self._on_text = item.on_text
        self._token_ids: list[int] = []
        self._emitted = 0
        self.text = ""
        self.num_generated = 0
        self.done = False
        self.finish_reason: Literal["stop", "length"] = "length"

    def push(self, token_id: int) -> bool:
        if self.done:
            return True
        self.num_generated += 1
        if self._stop is not None and self._stop.is_set():
            self.done = True  # the caller has gone: stop here, emit nothing more
            return True
        if token_id in self._eos_ids:
            self._end("stop")
            return True
        self._token_ids.append(token_id)
        text = self._decode(self._token_ids)
        cut = _first_stop(text, self._stops)
        if cut is not None:
            self.text = text[:cut]
            self._end("stop")
        elif self.num_generated >= self._max_tokens:
            self.text = text
            self._end("length")
        else:
            self.text = text
            self._emit(_safe_end(text, self._stops))
        return self.done

    def finish(self) -> None:
        """End the row if ``generate`` stopped first (its own length limit)."""
        if not self.done:
            self._end("length")

    def output(self, num_prompt_tokens: int) -> ChatOutput:
        return ChatOutput(
            text=self.text,
            prompt_tokens=num_prompt_tokens,
            completion_tokens=self.num_generated,
            finish_reason=self.finish_reason,
        )

    def _end(self, reason: Literal["stop", "length"]) -> None:
        self.done = True
        self.finish_reason = reason
        self._emit(len(self.text))

    def _emit(self, end: int) -> None:
        if self._on_text is None or end <= self._emitted:
            return
        piece = self.text[self._emitted : end]
        self._emitted = end
        try:
            self._on_text(piece)
        except Exception:  # a failing listener must not fail the other rows of the batch
            logger.exception("on_text raised; streaming to it stops")
            self._on_text = None


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the earliest stop string starts in ``text``, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _safe_end(text: str, stops: tuple[str, ...]) -> int:
    """How much of ``text`` can be streamed now: not a trailing incomplete
    character, nor a tail that a stop string may start with."""
    end = len(text.rstrip(_REPLACEMENT))
    held = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, end), held, -1):
            if text.endswith(stop[:size], 0, end):
                held = size
                break
    return end - held


@functools.cache
def _row_criteria_class() -> type[Any]:
    """A transformers ``StoppingCriteria`` over ``_RowStream`` rows (built on first
    use, so that importing this module does not import transformers)."""
    import torch
    from transformers import StoppingCriteria

    class RowCriteria(StoppingCriteria):
        def __init__(self, rows: list[_RowStream]) -> None:
            self._rows = rows

        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            last = input_ids[:, -1].tolist()
            done = [row.push(token) for row, token in zip(self._rows, last, strict=True)]
            if not all(done):
                step_boundary()  # between two decode steps: it may step aside here
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return RowCriteria
