"""OCR by a vision-language model in transformers (adapter ``hf-vision-ocr``).

An image-text-to-text model (HunyuanOCR's ``HunYuanVLForConditionalGeneration``
and any model that ``AutoModelForImageTextToText`` and ``AutoProcessor`` load
from a folder) reads a page and writes what its prompt asks for: the text,
fields as JSON, a translation. It serves the ``ocr`` task: an ``OcrInput``
(a page and its prompt, from ``/v1/ocr``) and a ``ChatInput`` whose messages
carry images (OpenAI chat with ``image_url`` parts) both come back as a
``ChatOutput``, whose ``prompt_tokens`` count the image's tokens as the
processor made them.

Generation shares ``causal_lm``'s row hook (``_RowStream``): stop strings,
per-row ``max_tokens``, streaming to ``on_text`` and the callers' stop flags
alike. Greedy items of a batch run as one left-padded ``generate``; sampling
items are grouped as the causal LM's are.

The card's ``vision`` options must be the processor's own (patch and merge
sizes, pixel bounds): work units count an image's tokens from them before
the model is resident, so a card that disagrees is refused at load.

Options (model.yaml ``options``): ``vision`` (see ``repository.spec``),
``max_tokens_default``, ``max_tokens_limit``, ``dtype`` (``float32``,
``float16``, ``bfloat16`` or ``auto``), ``prompts.text`` (the instruction for
a page without a prompt), ``stop_tokens``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tessera.errors import InvalidInputError, ModelUnavailableError
from tessera.footprint import Footprint
from tessera.request import StopFlag, item_stops
from tessera.runtimes.base import LoadContext
from tessera.runtimes.causal_lm import (
    _SAMPLING_LOCK,
    _eos_ids,
    _row_criteria_class,
    _RowStream,
    check_logit_bias,
    generate_in_groups,
    sampling_options,
)
from tessera.runtimes.hostcopy import HostSlot
from tessera.runtimes.memory import files_bytes, torch_module_bytes
from tessera.step import holding
from tessera.tasks.image import pixels
from tessera.tasks.prompts import page_chat
from tessera.tasks.types import (
    ChatInput,
    ChatOutput,
    OcrInput,
    VisionLimits,
    refuse_engine_only,
)

if TYPE_CHECKING:
    from tessera.repository.spec import ModelSpec

_DTYPES = ("float32", "float16", "bfloat16", "auto")


class VisionOcrLoader:
    """Loads an image-text-to-text model and its processor from a folder."""

    def estimate_bytes(self, spec: ModelSpec) -> int:
        folder = spec.resolve_source()
        return files_bytes(folder, (".safetensors",)) or files_bytes(folder, (".bin",))

    def shared_keys(self, spec: ModelSpec) -> tuple[str, ...]:
        return ()

    def load(self, spec: ModelSpec, ctx: LoadContext) -> VisionOcr:
        folder = spec.resolve_source()
        vision = spec.inputs.vision
        if vision is None:
            raise ModelUnavailableError(spec.name, "hf-vision-ocr needs the card's vision options")
        try:
            from transformers import AutoModelForImageTextToText, AutoProcessor

            processor = AutoProcessor.from_pretrained(  # type: ignore[no-untyped-call]
                folder, local_files_only=True
            )
            kwargs: dict[str, Any] = {"local_files_only": True}
            dtype = spec.options.get("dtype")
            if dtype is not None:
                if dtype not in _DTYPES:
                    raise ModelUnavailableError(spec.name, f"unknown dtype {dtype!r}")
                import torch

                kwargs["dtype"] = dtype if dtype == "auto" else getattr(torch, dtype)
            model: Any = AutoModelForImageTextToText.from_pretrained(folder, **kwargs)
            model.eval()
            model = model.to(ctx.device.torch_device())
        except ModelUnavailableError:
            raise
        except Exception as e:  # any load failure is this model's, reported as such
            raise ModelUnavailableError(spec.name, f"cannot load {folder}: {e}") from e
        _check_vision(spec.name, vision, processor)
        processor.tokenizer.padding_side = "left"  # generation appends on the right
        return VisionOcr(spec, model, processor, ctx.device.torch_device())


def _check_vision(name: str, vision: VisionLimits, processor: Any) -> None:
    """The card's image-token arithmetic must be the processor's."""
    images = processor.image_processor
    size = getattr(images, "size", None) or {}
    found = {
        "patch_size": getattr(images, "patch_size", None),
        "merge_size": getattr(images, "merge_size", None),
        "min_pixels": size.get("shortest_edge", getattr(images, "min_pixels", None)),
        "max_pixels": size.get("longest_edge", getattr(images, "max_pixels", None)),
    }
    wrong = {k: v for k, v in found.items() if v != getattr(vision, k)}
    if wrong:
        raise ModelUnavailableError(
            name,
            f"the card's vision options disagree with the processor's {wrong}:"
            " image tokens would be miscounted",
        )


class VisionOcr:
    """A loaded vision-language model answering pages and chats with images."""

    def __init__(self, spec: ModelSpec, model: Any, processor: Any, device: str) -> None:
        self._spec = spec
        self._model: Any = model
        self._processor: Any = processor
        self._device = device
        self._bytes = torch_module_bytes(model)
        self._eos_ids = _eos_ids(spec, model, processor.tokenizer)
        text_config = getattr(model.config, "text_config", model.config)
        self._context_tokens = int(getattr(text_config, "max_position_embeddings", 0) or 0)
        self._lock = threading.Lock()  # the processor's tokenizer is not thread-safe
        self._host = HostSlot(spec.name, device, self._lock)

    def run(self, items: Sequence[Any]) -> list[ChatOutput]:
        # Held across step boundaries: taken with ``holding`` (see step.py).
        with holding(self._lock):
            if self._model is None:
                raise ModelUnavailableError(self._spec.name, "the model was unloaded")
            if self._host.waiting:
                raise ModelUnavailableError(self._spec.name, "the model waits in the host tier")
            chats = [self._chat(item) for item in items]
            stops = item_stops(len(items))
            return generate_in_groups(
                chats,
                lambda group: self._generate([chats[i] for i in group], [stops[i] for i in group]),
            )

    def memory(self) -> Footprint:
        return Footprint(own_bytes=self._bytes, method="torch tensors")

    def offload(self) -> Footprint | None:
        """Move the weights to the host tier (as ``causal_lm.CausalLm`` does)."""
        return self._host.offload(self._model)

    def restore(self) -> None:
        self._host.restore()

    def unload(self) -> None:
        self._model = None
        self._processor = None
        self._host.close()
        if self._device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()

    def _chat(self, item: Any) -> ChatInput:
        match item:
            case OcrInput():
                return page_chat(item, self._spec.options.get("prompts"), self._spec.inputs)
            case ChatInput(prompt=None):
                refuse_engine_only(item, "transformers' generate")
                check_logit_bias(item, len(self._processor.tokenizer))
                return item
            case ChatInput():
                raise InvalidInputError("this model answers chats, not a raw prompt to continue")
        raise InvalidInputError(f"expected an OCR page or a chat, got {type(item).__name__}")

    def _encode(self, chats: list[ChatInput]) -> Any:
        from PIL import Image

        processor = self._processor
        prompts: list[str] = []
        images: list[Any] = []
        for chat in chats:
            conversation = []
            for m in chat.messages:
                parts: list[dict[str, Any]] = [{"type": "image"} for _ in m.images]
                parts.append({"type": "text", "text": m.content})
                conversation.append({"role": m.role, "content": parts})
                # BGR arrays (as OCR decodes them, here if still encoded) to RGB images.
                images.extend(Image.fromarray(pixels(i)[:, :, ::-1]) for i in m.images)
            try:
                prompts.append(
                    processor.apply_chat_template(
                        conversation, add_generation_prompt=True, tokenize=False
                    )
                )
            except Exception as e:  # the template raises on what it cannot render
                raise InvalidInputError(f"the chat cannot be formatted for this model: {e}") from e
        try:
            return processor(
                text=prompts, images=images or None, padding=True, return_tensors="pt"
            ).to(self._device)
        except ValueError as e:  # an image the processor refuses
            raise InvalidInputError(f"the model's processor refused the input: {e}") from e

    def _generate(self, chats: list[ChatInput], stops: list[StopFlag]) -> list[ChatOutput]:
        import torch
        from transformers import StoppingCriteriaList

        tokenizer = self._processor.tokenizer
        encoded = self._encode(chats)
        prompt_tokens = encoded["attention_mask"].sum(dim=1).tolist()
        for num_tokens, chat in zip(prompt_tokens, chats, strict=True):
            if self._context_tokens and num_tokens + chat.max_tokens > self._context_tokens:
                raise InvalidInputError(
                    f"prompt ({num_tokens} tokens, the image's included) plus max_tokens"
                    f" ({chat.max_tokens}) exceeds the model's context of"
                    f" {self._context_tokens} tokens"
                )
        decode = functools.partial(
            tokenizer.decode, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        rows = [
            _RowStream(chat, decode, self._eos_ids, stop)
            for chat, stop in zip(chats, stops, strict=True)
        ]
        first = chats[0]
        options: dict[str, Any] = {
            "max_new_tokens": max(chat.max_tokens for chat in chats),
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": sorted(self._eos_ids),
            "stopping_criteria": StoppingCriteriaList([_row_criteria_class()(rows)]),
            **sampling_options(chats, encoded["input_ids"].shape[1]),
        }
        sampling = first.temperature > 0
        with (
            holding(_SAMPLING_LOCK) if sampling else contextlib.nullcontext(),
            torch.inference_mode(),
        ):
            if first.seed is not None:
                torch.manual_seed(first.seed)
            self._model.generate(**encoded, **options)
        for row in rows:
            row.finish()
        return [row.output(int(n)) for row, n in zip(rows, prompt_tokens, strict=True)]
