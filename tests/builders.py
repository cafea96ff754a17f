"""Builders for test objects (as vLLM's tests/v1/core/utils.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import yaml

from harness.fake_host import FakeModelHost
from harness.fake_models import FAKE_ADAPTERS
from tessera.admission import AdmissionController
from tessera.clock import FakeClock
from tessera.engine import Engine, EngineConfig
from tessera.engine.executor import ComputeExecutor
from tessera.repository import ModelRepository
from tessera.repository.spec import BatchingSpec, ModelSpec
from tessera.request import QueuedRequest, RequestResult
from tessera.residency import ModelResidency, ResidencyManager, make_eviction_policy
from tessera.runtimes.graph_runner import Runner, Step
from tessera.runtimes.padding import Inputs, Outputs
from tessera.tasks.types import Task


def make_spec(
    name: str,
    own_bytes: int = 100,
    *,
    task: Task = Task.EMBEDDING,
    shared: dict[str, int] | None = None,
    max_bytes: int | None = None,
    batching: BatchingSpec | None = None,
    **options: Any,
) -> ModelSpec:
    """A ``fake``-adapter model spec that reports ``own_bytes``."""
    return ModelSpec(
        name=name,
        task=task,
        runtime="torch",
        adapter="fake",
        folder=Path("/nonexistent"),
        batching=batching or BatchingSpec(),
        max_bytes=max_bytes,
        options={"own_bytes": own_bytes, "shared": shared or {}, **options},
    )


def write_fake_repository(
    root: Path, models: dict[str, dict[str, Any]], *, batching: dict[str, Any] | None = None
) -> Path:
    """A model repository of ``fake``-adapter models: ``{name: descriptor fields}``
    over defaults (a fake model's 1000 own bytes; ``batching`` for models that give none)."""
    for name, extra in models.items():
        folder = root / name
        folder.mkdir(parents=True)
        fake = extra.get("adapter", "fake") == "fake"
        descriptor = {
            "name": name,
            "runtime": "torch",
            "adapter": "fake",
            "batching": batching or {"max_batch_size": 16, "max_wait_ms": 20},
            **extra,
            "options": {**({"own_bytes": 1000} if fake else {}), **extra.get("options", {})},
        }
        (folder / "model.yaml").write_text(yaml.safe_dump(descriptor))
    return root


@contextlib.asynccontextmanager
async def fake_engine(
    root: Path, models: dict[str, dict[str, Any]], **config: Any
) -> AsyncIterator[Engine]:
    """An engine over a repository of ``models`` (fake runtime), with the models
    marked preload loaded and no other (no fill), on the CPU with 64 MiB and 2
    threads unless ``config`` says otherwise; closed
    after, when nothing may have leaked: no pins, no bytes held (every model
    unloaded, so none is a reserved activation, and no copy left in the host
    tier), no waiting request."""
    repository = ModelRepository.from_folders([write_fake_repository(root, models)])
    settings = {
        "memory_budget_bytes": 64 * 1024**2,
        "device": "cpu",
        "num_threads": 2,
        "fill": False,
        "adapters": FAKE_ADAPTERS,
        **config,
    }
    engine = Engine(repository, EngineConfig(**settings))
    await engine.preload()
    yield engine
    await engine.close()
    stats = engine.snapshot()
    assert stats.used_bytes == 0
    assert stats.host_used_bytes == 0
    assert all(m.pins == 0 and m.queue_depth == 0 for m in stats.models)


@contextlib.contextmanager
def wait_limits() -> Iterator[list[float | None]]:
    """The ``wait_limit_s`` of each batch any engine's executor runs meanwhile
    (the real run, spied on the class: the engine's parts stay its own)."""
    run = ComputeExecutor.run
    seen: list[float | None] = []

    async def spied(self: ComputeExecutor, *args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("wait_limit_s"))
        return await run(self, *args, **kwargs)

    ComputeExecutor.run = spied  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        ComputeExecutor.run = run  # type: ignore[method-assign]


# The metric families tessera promises to export (docs and dashboards rely on them).
ISSUE_FAMILIES = frozenset(
    {
        "tessera_requests_total",
        "tessera_request_duration_seconds",
        "tessera_queue_duration_seconds",
        "tessera_batch_size",
        "tessera_batch_duration_seconds",
        "tessera_queue_depth",
        "tessera_memory_budget_bytes",
        "tessera_memory_used_bytes",
        "tessera_memory_peak_used_bytes",
        "tessera_model_resident_bytes",
        "tessera_model_state",
        "tessera_model_loads_total",
        "tessera_model_evictions_total",
        "tessera_model_load_seconds",
        "tessera_rejected_requests_total",
        "tessera_slo_target_seconds",
        "tessera_slo_requests_total",
        "tessera_device_memory_used_bytes",
        "tessera_device_memory_total_bytes",
        "tessera_device_utilization_ratio",
        "tessera_process_resident_bytes",
        "tessera_process_cpu_seconds_total",
    }
)


CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def save_tiny_llama(folder: Path) -> None:
    """A 2-layer, 32-wide random Llama with a byte-level BPE tokenizer and a ChatML
    template, saved into ``folder``; its end token is never generated by itself."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    special = ["<pad>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["user assistant hello world", "the capital of France is Paris", "café naïve"] * 20
    bpe.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<pad>", eos_token="<|im_end|>", chat_template=CHATML
    )
    eos_id = tokenizer.eos_token_id
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.5,  # well-separated logits: greedy is stable under padding
        eos_token_id=eos_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[eos_id] = 0.0  # never ends by itself: lengths are predictable
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def make_queued(
    loop: asyncio.AbstractEventLoop,
    tenant: str,
    *,
    units: float = 10.0,
    items: int = 1,
    weight: float = 1.0,
    arrival: float = 0.0,
    latency_target_s: float | None = None,
) -> QueuedRequest:
    """A queued request of ``tenant``: ``items`` copies of its name, ``units`` in all."""
    future: asyncio.Future[RequestResult] = loop.create_future()
    return QueuedRequest(
        items=[tenant] * items,
        units=units,
        arrival=arrival,
        future=future,
        tenant=tenant,
        weight=weight,
        latency_target_s=latency_target_s,
    )


class WallClock:
    """A settable wall clock (seconds since the epoch) for daily quotas."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_admission(
    wall_start: float = 1_000_000.0,
) -> tuple[AdmissionController, FakeClock, WallClock]:
    """An admission controller on a fake monotonic clock and a settable wall clock."""
    clock, wall = FakeClock(), WallClock(wall_start)
    return AdmissionController(clock, wall), clock, wall


# HunyuanOCR's chat layout (an image as <img><image></img> before the turn's text).
VL_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<img><image></img>' }}"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# The tiny model's image processing: what its card's ``vision`` options must say.
TINY_VL_VISION = {"patch_size": 16, "merge_size": 2, "min_pixels": 32 * 32, "max_pixels": 128 * 128}


def save_tiny_hunyuan_vl(folder: Path) -> None:
    """A random HunYuanVL (HunyuanOCR's architecture: a 1-layer, 32-wide vision
    tower, a 2-layer, 32-wide text model, about 85k parameters), a byte-level
    BPE tokenizer with its image tokens and a processor, saved into ``folder``;
    its end token is never generated by itself."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        HunYuanVLConfig,
        HunYuanVLForConditionalGeneration,
        PreTrainedTokenizerFast,
    )
    from transformers.models.hunyuan_vl.image_processing_pil_hunyuan_vl import (
        HunYuanVLImageProcessorPil,
    )
    from transformers.models.hunyuan_vl.processing_hunyuan_vl import HunYuanVLProcessor

    special = ["<pad>", "<s>", "<|im_start|>", "<|im_end|>", "<img>", "<image>", "</img>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(["user assistant extract the text", "Total 12.50 EUR"] * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="<|im_end|>",
        extra_special_tokens={
            "image_token": "<image>",
            "image_start_token": "<img>",
            "image_end_token": "</img>",
        },
        chat_template=VL_TEMPLATE,
    )
    images = HunYuanVLImageProcessorPil(
        min_pixels=TINY_VL_VISION["min_pixels"], max_pixels=TINY_VL_VISION["max_pixels"]
    )
    processor = HunYuanVLProcessor(
        image_processor=images, tokenizer=tokenizer, chat_template=VL_TEMPLATE
    )
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 512,
        "initializer_range": 0.5,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [1, 1, 1, 1],
        },
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "out_hidden_size": 32,
        "patch_size": TINY_VL_VISION["patch_size"],
        "spatial_merge_size": TINY_VL_VISION["merge_size"],
    }
    config = HunYuanVLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=tokenizer.image_token_id,
        im_start_id=tokenizer.image_start_token_id,
        im_end_id=tokenizer.image_end_token_id,
        im_newline_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = HunYuanVLForConditionalGeneration(config)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] = 0.0  # lengths are predictable
    model.save_pretrained(folder)
    processor.save_pretrained(folder)


def write_tiny_vl_card(model_dir: Path, name: str = "tiny-vl-ocr") -> Path:
    """A model folder ``model_dir/name`` holding the tiny HunYuanVL and its card."""
    folder = model_dir / name
    (folder / "weights").mkdir(parents=True)
    save_tiny_hunyuan_vl(folder / "weights")
    card = {
        "name": name,
        "task": "ocr",
        "runtime": "torch",
        "adapter": "hf-vision-ocr",
        "source": {"path": "weights"},
        "batching": {"max_batch_size": 4, "max_batch_units": 4096, "max_wait_ms": 5},
        "options": {"vision": TINY_VL_VISION, "max_tokens_default": 8, "max_tokens_limit": 64},
    }
    (folder / "model.yaml").write_text(yaml.safe_dump(card))
    return folder


# An OpenAI function tool with one required argument (the tool-call tests).
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def replay_like(step: Step, example: Inputs) -> Runner:
    """A CUDA graph's ways on the CPU (a ``MakeRunner``): inputs copied into
    static tensors, and outputs that are the same tensors at every run,
    overwritten by the next."""
    import torch

    static = {key: value.clone() for key, value in example.items()}
    with torch.inference_mode():
        outputs = step(static)

    def run(inputs: Inputs) -> Outputs:
        for key, value in inputs.items():
            static[key].copy_(value)
        with torch.inference_mode():
            for key, value in step(static).items():
                outputs[key].copy_(value)
        return outputs

    return run


def make_lru_manager(
    budget: int = 1000, *, wait_s: float = 0.0, host_budget: int = 0
) -> tuple[ResidencyManager, FakeModelHost, FakeClock]:
    """A residency manager on a fake host and clock, least recently used first."""
    clock = FakeClock()
    host = FakeModelHost(clock)
    manager = ResidencyManager(
        budget,
        host,
        make_eviction_policy("lru"),
        clock,
        wait_s=wait_s,
        host_budget_bytes=host_budget,
    )
    return manager, host, clock


def residency_of(manager: ResidencyManager, name: str) -> ModelResidency:
    """``name``'s row of the manager's stats."""
    (found,) = [m for m in manager.stats().models if m.name == name]
    return found
