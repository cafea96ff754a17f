"""Triton's conventions for text generation (its vLLM and TensorRT-LLM
backends'), shared by KServe infer and Triton's generate extension: a prompt
is ``text_input``, the generated text ``text_output``, and how to sample comes
as parameters. An infer request gathers them from its ``parameters``, then the
vLLM backend's ``sampling_parameters`` (a JSON object in a BYTES tensor), then
scalar input tensors (TensorRT-LLM's ``max_tokens``, ``temperature``...), each
over the one before; the generate extension from its ``parameters`` and any
other field of its body.

Parameters: ``max_tokens`` (16 unless given, as vLLM's), ``temperature``,
``top_p``, ``stop`` (or ``stop_words``), ``seed`` (or ``random_seed``),
``presence_penalty``, ``frequency_penalty``, ``stream``,
``exclude_input_in_output``, and the vLLM backend's ``return_finish_reason``,
``return_num_input_tokens``, ``return_num_output_tokens``, which add the
outputs ``finish_reason``, ``num_input_tokens``, ``num_output_tokens``.
TensorRT-LLM's ``bad_words`` and ``top_k`` are taken where they ask for
nothing (empty; 0 or -1), ``beam_width`` where 1; anything else is refused
with its name, never ignored. Values may be strings of numbers, as the vLLM
backend's examples write them.

The prompt goes to the model as it is (no chat template), as those backends
send it. The answer is the generated text alone unless
``exclude_input_in_output`` is false (the vLLM backend's default is to repeat
the prompt first; tessera's is not to, as TensorRT-LLM's ensemble).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from tessera.errors import InvalidInputError
from tessera.gateway.openai_chat import Sampling
from tessera.gateway.openai_stream import Pieces, listeners, pieces_of
from tessera.tasks.types import ChatInput, ChatOutput

PROMPT, TEXT = "text_input", "text_output"
SAMPLING_PARAMETERS = "sampling_parameters"  # the vLLM backend's JSON object of them
# Other names the backends give a parameter, and tessera's.
_ALIASES = {"stop_words": "stop", "random_seed": "seed"}


class GenerateParameters(Sampling):
    """How a generation samples (module notes); an unknown name is refused."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(default=16, ge=1, le=4096)
    stream: bool = False
    exclude_input_in_output: bool = True
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    bad_words: str | list[str] | None = None
    top_k: int = 0  # off (0 or -1): tessera samples with top_p alone
    beam_width: int = 1

    @model_validator(mode="before")
    @classmethod
    def _one_name_each(cls, value: object) -> object:
        if not isinstance(value, dict):
            return value
        named = dict(value)
        for alias, name in _ALIASES.items():
            if alias in named:
                if name in named:
                    raise ValueError(f"give {name} or {alias}, not both")
                named[name] = named.pop(alias)
        return named

    @field_validator("stop", mode="after")
    @classmethod
    def _without_empty(cls, value: str | list[str] | None) -> list[str]:
        """TensorRT-LLM's clients send ``[""]`` for no stop words."""
        words = [value] if isinstance(value, str) else (value or [])
        return [word for word in words if word]

    @field_validator("top_k", mode="after")
    @classmethod
    def _top_k_off(cls, value: int) -> int:
        if value not in (0, -1):
            raise ValueError("top-k sampling is not served here (0 or -1: off; top_p is)")
        return value

    @field_validator("beam_width", mode="after")
    @classmethod
    def _no_beams(cls, value: int) -> int:
        if value != 1:
            raise ValueError("beam search is not served here (beam_width 1)")
        return value

    @field_validator("bad_words", mode="after")
    @classmethod
    def _none_banned(cls, value: str | list[str] | None) -> None:
        words = [value] if isinstance(value, str) else (value or [])
        if any(words):
            raise ValueError("banning words is not served here (send none, or empty ones)")


def parameters_of(given: dict[str, Any]) -> GenerateParameters:
    """``given`` as parameters, or ``InvalidInputError`` naming each problem."""
    try:
        return GenerateParameters.model_validate(given)
    except ValidationError as e:
        problems = []
        for error in e.errors():
            where = ".".join(str(p) for p in error["loc"])
            problems.append(f"{where}: {error['msg']}" if where else error["msg"])
        raise InvalidInputError("invalid parameters: " + "; ".join(problems)) from e


def generate_items(
    prompts: list[str],
    parameters: GenerateParameters,
    pieces: Pieces | None = None,
) -> list[ChatInput]:
    """A raw-prompt item a prompt; with ``pieces``, each streams its text there."""
    for index, prompt in enumerate(prompts):
        if not prompt:
            raise InvalidInputError(f"{PROMPT}[{index}] must not be empty")
    return [
        ChatInput(
            messages=(),
            prompt=prompt,
            max_tokens=parameters.max_tokens,
            **parameters.sampling(),
            **stream,
        )
        for prompt, stream in zip(prompts, listeners(pieces, len(prompts)), strict=True)
    ]


@dataclass(frozen=True, slots=True)
class Extra:
    """An output a generation adds where asked for: its name, its KServe
    datatype, and its value from an output."""

    name: str
    datatype: str
    value: Callable[[ChatOutput], Any]


_EXTRAS = (
    ("return_finish_reason", Extra("finish_reason", "BYTES", lambda o: o.finish_reason)),
    ("return_num_input_tokens", Extra("num_input_tokens", "UINT32", lambda o: o.prompt_tokens)),
    (
        "return_num_output_tokens",
        Extra("num_output_tokens", "UINT32", lambda o: o.completion_tokens),
    ),
)
EXTRA_OUTPUTS = tuple(extra for _, extra in _EXTRAS)


def asked_extras(outputs: Iterable[str]) -> dict[str, bool]:
    """The flags of the extras among requested ``outputs``: naming one asks for it."""
    named = set(outputs)
    return {flag: True for flag, extra in _EXTRAS if extra.name in named}


def extras_of(parameters: GenerateParameters) -> list[Extra]:
    """The outputs ``parameters`` ask for beside the text."""
    return [extra for flag, extra in _EXTRAS if getattr(parameters, flag)]


async def generation_pieces(
    prompt: str,
    parameters: GenerateParameters,
    work: asyncio.Future[list[Any]],
    pieces: Pieces,
) -> AsyncIterator[str | ChatOutput]:
    """A streamed generation of one prompt: the prompt first where it is not
    excluded, each piece as it comes, then its output (or the error it
    failed with, raised); the work is cancelled if the reader stops first."""
    try:
        if not parameters.exclude_input_in_output:
            yield prompt
        async for piece in pieces_of(work, pieces):
            yield piece.text
        (output,) = work.result()
        yield output
    finally:
        if not work.done():
            work.cancel()


def text_of(parameters: GenerateParameters, prompt: str, output: ChatOutput) -> str:
    """The answer's ``text_output``: the prompt first where it is not excluded."""
    return output.text if parameters.exclude_input_in_output else prompt + output.text
