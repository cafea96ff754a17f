"""Task endpoints outside OpenAI's API: rerank (Cohere/Jina shape), Cohere's
embed, classify, OCR (a prompt and a task for vision-language models) and
translate.

Cohere's clients call ``/v1/rerank`` and ``/v1/embed`` (``cohere.Client``) or
``/v2/rerank`` and ``/v2/embed`` (``cohere.ClientV2``); both shapes are served.
``/v1/classify`` answers Cohere's classify (``inputs``, a classifier model:
its few-shot ``examples`` are not served) in Cohere's shape, and tessera's own
(``input``, ``top_k``) in a list of labels.
"""

from __future__ import annotations

import base64
import json
import uuid
from typing import Annotated, Any, Literal

import numpy as np
import numpy.typing as npt
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tessera.errors import InvalidInputError, TaskMismatchError
from tessera.gateway.common import JsonBodyRoute, engine_of, parsed, run_task
from tessera.gateway.openai_embeddings import shortened, texts_of
from tessera.gateway.openai_stream import usage_of
from tessera.repository import ModelSpec
from tessera.tasks.image import decode_base64, read_image
from tessera.tasks.prompts import OcrTask, ocr_prompt, parse_fields
from tessera.tasks.types import (
    ChatOutput,
    ClassifyOutput,
    OcrInput,
    OcrOutput,
    RerankInput,
    Task,
    TextInput,
    TranslateInput,
)

# Bodies are JSON whatever their content type (``JsonBodyRoute``).
router = APIRouter(route_class=JsonBodyRoute)


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="allow")
    text: str


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    query: Annotated[str, Field(min_length=1)]
    documents: Annotated[list[str | RerankDocument], Field(min_length=1)]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = False


@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(body: RerankRequest, request: Request) -> JSONResponse:
    items = rerank_items(body)
    scores = await run_task(request, body.model, Task.RERANK, items)
    return JSONResponse(rerank_body(body, scores))


def rerank_items(body: RerankRequest) -> list[RerankInput]:
    return rerank_inputs(body.query, _documents(body))


def rerank_inputs(query: str, documents: list[str]) -> list[RerankInput]:
    """A (query, document) item a document; ``InvalidInputError`` for a blank query."""
    if not query.strip():
        raise InvalidInputError("query must not be blank")
    return [RerankInput(query, text) for text in documents]


def best_first(scores: list[float]) -> list[int]:
    """The documents' indices, the highest score first."""
    return sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)


def _documents(body: RerankRequest) -> list[str]:
    return [d if isinstance(d, str) else d.text for d in body.documents]


def rerank_body(body: RerankRequest, scores: list[Any]) -> dict[str, Any]:
    texts = _documents(body)
    ranked = best_first([float(s) for s in scores])
    results: list[dict[str, Any]] = []
    for index in ranked[: body.top_n or len(ranked)]:
        result: dict[str, Any] = {"index": index, "relevance_score": float(scores[index])}
        if body.return_documents:
            result["document"] = {"text": texts[index]}
        results.append(result)
    return {"id": str(uuid.uuid4()), "model": body.model, "results": results, "meta": {}}


class CohereEmbedRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    texts: Annotated[list[str], Field(min_length=1)]
    input_type: str | None = None  # a symmetric model embeds queries and documents alike
    embedding_types: list[str] | None = None
    # Cohere's Matryoshka sizes; here any size up to the model's, as OpenAI's ``dimensions``.
    output_dimension: int | None = Field(default=None, ge=1)


# Cohere's embedding types served: its int8 and uint8 scale each dimension by
# ranges its models were trained with, which a model here does not have (vLLM's
# Cohere embed serves the same four).
EMBEDDING_TYPES = ("float", "binary", "ubinary", "base64")


@router.post("/v1/embed")
@router.post("/v2/embed")
async def cohere_embed(body: CohereEmbedRequest, request: Request) -> JSONResponse:
    """Cohere's embed, each of ``embedding_types`` as Cohere writes it:
    ``float``; ``ubinary``, a bit a dimension (1 where it is not negative)
    packed 8 to a byte from the highest bit, and ``binary``, those bytes less
    128; ``base64``, each vector's float32 bytes (little-endian). v1 answers a
    plain list of floats unless types were asked for, v2 by type."""
    kinds = body.embedding_types
    if kinds is not None and (not kinds or not set(kinds) <= set(EMBEDDING_TYPES)):
        raise InvalidInputError(
            f"embedding_types {kinds}: served are {', '.join(EMBEDDING_TYPES)} (int8 and uint8"
            " scale by ranges a model's own training sets, which these models do not have)"
        )
    items = [TextInput(t) for t in texts_of(body.texts, "texts")]
    vectors = await run_task(request, body.model, Task.EMBEDDING, items)
    matrix = np.stack([np.asarray(v, dtype=np.float32) for v in vectors])
    if body.output_dimension is not None:
        matrix = shortened(matrix, body.output_dimension)
    by_type = kinds is not None or request.url.path.startswith("/v2/")
    embeddings: Any = matrix.tolist()
    if by_type:
        embeddings = {kind: _embedding_type(matrix, kind) for kind in kinds or ["float"]}
    return JSONResponse(
        {
            "id": str(uuid.uuid4()),
            "texts": body.texts,
            "embeddings": embeddings,
            "meta": {"api_version": {"version": "2" if by_type else "1"}},
            "response_type": "embeddings_by_type" if by_type else "embeddings_floats",
        }
    )


def _embedding_type(matrix: npt.NDArray[np.float32], kind: str) -> list[Any]:
    """``matrix``'s rows (one vector each) as Cohere's embedding type ``kind``."""
    if kind == "float":
        rows: list[Any] = matrix.tolist()
        return rows
    if kind == "base64":
        little = matrix.astype("<f4")
        return [base64.b64encode(row.tobytes()).decode("ascii") for row in little]
    if matrix.shape[1] % 8:
        raise InvalidInputError(
            f"{kind} embeddings pack 8 dimensions a byte; this model gives {matrix.shape[1]}"
        )
    packed = np.packbits(matrix >= 0, axis=1)
    if kind == "binary":
        signed: list[Any] = (packed.astype(np.int16) - 128).tolist()
        return signed
    unsigned: list[Any] = packed.tolist()
    return unsigned


class ClassifyRequest(BaseModel):
    """tessera's classify (``input``), or Cohere's (``inputs``)."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[str] | None = None
    top_k: int = Field(default=5, ge=1, le=100)
    inputs: list[str] | None = None
    examples: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> ClassifyRequest:
        if (self.input is None) == (self.inputs is None):
            raise ValueError("give input (or Cohere's inputs), one of them")
        if self.examples:
            raise ValueError("examples (few-shot classification) are not served: name a classifier")
        return self

    def texts(self) -> list[str]:
        if self.inputs is not None:
            return texts_of(self.inputs, "inputs")
        return texts_of(self.input if self.input is not None else "")


@router.post("/v1/classify")
async def classify(body: ClassifyRequest, request: Request) -> JSONResponse:
    items = [TextInput(t) for t in body.texts()]
    outputs: list[ClassifyOutput] = await run_task(request, body.model, Task.CLASSIFY, items)
    return JSONResponse(classify_body(body, outputs))


def classify_body(body: ClassifyRequest, outputs: list[ClassifyOutput]) -> dict[str, Any]:
    if body.inputs is not None:
        return _cohere_classify_body(body.texts(), outputs)
    data = []
    for index, output in enumerate(outputs):
        top = output.labels[: body.top_k]
        data.append(
            {
                "index": index,
                "label": top[0].label if top else None,
                "score": top[0].score if top else None,
                "labels": [{"label": ls.label, "score": ls.score} for ls in top],
            }
        )
    return {"object": "list", "model": body.model, "data": data}


def _cohere_classify_body(texts: list[str], outputs: list[ClassifyOutput]) -> dict[str, Any]:
    """Cohere's: each input's best label and its confidence, and every label's
    (a single-label classifier's: they add up to 1)."""
    classifications = []
    for text, output in zip(texts, outputs, strict=True):
        best = output.labels[0] if output.labels else None
        classifications.append(
            {
                "id": str(uuid.uuid4()),
                "input": text,
                "prediction": best.label if best else None,
                "predictions": [best.label] if best else [],
                "confidence": best.score if best else None,
                "confidences": [best.score] if best else [],
                "labels": {ls.label: {"confidence": ls.score} for ls in output.labels},
                "classification_type": "single-label",
            }
        )
    return {
        "id": str(uuid.uuid4()),
        "classifications": classifications,
        "meta": {"api_version": {"version": "1"}},
    }


class OcrOptions(BaseModel):
    """What a vision-language OCR model is asked: a ``prompt`` of the caller's,
    or a ``task`` (``fields`` takes names or a JSON schema, ``translate`` a
    ``language``), and at most ``max_tokens``. Other OCR models take none."""

    model_config = ConfigDict(extra="allow")

    prompt: Annotated[str, Field(min_length=1)] | None = None
    task: OcrTask | None = None
    fields: list[str] | dict[str, Any] | None = None
    language: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)

    def asks(self) -> bool:
        asked = (self.prompt, self.task, self.fields, self.language, self.max_tokens)
        return any(value is not None for value in asked)


class OcrRequest(OcrOptions):
    model: str
    image: Annotated[str, Field(min_length=1, description="base64 or a data: URL")]
    mode: Literal["page", "line"] = "page"


def ocr_item(
    spec: ModelSpec, image: Any, mode: Literal["page", "line"], ask: OcrOptions
) -> OcrInput:
    """The OCR item for ``spec``'s model: a page and its prompt for a
    vision-language model, the page alone for any other."""
    if spec.inputs.vision is None:
        if ask.asks():
            raise TaskMismatchError(
                f"model {spec.name!r} reads pages without a prompt:"
                " prompt, task, fields, language and max_tokens need a vision-language model"
            )
        return OcrInput(image, mode)
    if ask.prompt is not None and ask.task is not None:
        raise InvalidInputError("give a prompt or a task, not both")
    prompt = ask.prompt
    if ask.task is not None:
        options = spec.options.get("prompts")
        prompt = ocr_prompt(options, ask.task, fields=ask.fields, language=ask.language)
    return OcrInput(image, mode, prompt=prompt, max_tokens=ask.max_tokens)


def ocr_body(model: str, output: OcrOutput | ChatOutput, task: OcrTask | None) -> dict[str, Any]:
    """The answer: a vision-language model's text, usage and (for ``fields``)
    the JSON it wrote, or None where it wrote none; other models' lines."""
    if isinstance(output, ChatOutput):
        body: dict[str, Any] = {
            "model": model,
            "text": output.text,
            "finish_reason": output.finish_reason,
            "usage": usage_of(output),
        }
        if task == "fields":
            body["fields"] = parse_fields(output.text)
        return body
    lines = [
        {"text": line.text, "score": line.score, "box": [list(p) for p in line.box]}
        for line in output.lines
    ]
    return {
        "model": model,
        "text": "\n".join(line.text for line in output.lines),
        "lines": lines,
    }


async def _ocr(
    request: Request, model: str, raw: bytes, mode: Literal["page", "line"], ask: OcrOptions
) -> JSONResponse:
    spec = engine_of(request).spec_for(model, Task.OCR)
    item = ocr_item(spec, read_image(raw), mode, ask)
    (output,) = await run_task(request, model, Task.OCR, [item])
    return JSONResponse(ocr_body(model, output, ask.task))


def _form_options(form: Any) -> OcrOptions:
    """A multipart body's prompt fields (``fields`` as a JSON string)."""
    raw: dict[str, Any] = {}
    for key in ("prompt", "task", "fields", "language", "max_tokens"):
        value = form.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise InvalidInputError(f"multipart field {key!r} must be text")
        raw[key] = value
    if "fields" in raw:
        try:
            raw["fields"] = json.loads(raw["fields"])
        except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
            raise InvalidInputError("multipart field 'fields' must be JSON") from e
    return parsed(OcrOptions, raw)


@router.post("/v1/ocr")
async def ocr(request: Request) -> JSONResponse:
    """JSON ``{model, image: base64, mode}`` or multipart ``file``, ``model``, ``mode``;
    for a vision-language model also ``prompt`` or ``task`` (with ``fields`` or
    ``language``) and ``max_tokens``."""
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        async with request.form() as form:
            upload = form.get("file")
            model = form.get("model")
            mode = form.get("mode", "page")
            if upload is None or isinstance(upload, str):
                raise InvalidInputError("multipart body needs a 'file' part")
            if not isinstance(model, str) or not model:
                raise InvalidInputError("multipart body needs a 'model' field")
            if mode not in ("page", "line"):
                raise InvalidInputError("mode must be 'page' or 'line'")
            ask = _form_options(form)
            raw = await upload.read()
        return await _ocr(request, model, raw, "line" if mode == "line" else "page", ask)
    try:
        payload = await request.json()
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise InvalidInputError("body is not valid JSON") from e
    body = parsed(OcrRequest, payload)  # as for a body FastAPI reads itself
    return await _ocr(request, body.model, decode_base64(body.image), body.mode, body)


class TranslateRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[str]


@router.post("/v1/translate")
async def translate(body: TranslateRequest, request: Request) -> JSONResponse:
    items = [TranslateInput(t) for t in texts_of(body.input)]
    outputs = await run_task(request, body.model, Task.TRANSLATE, items)
    return JSONResponse(translate_body(body, outputs))


def translate_body(body: TranslateRequest, outputs: list[Any]) -> dict[str, Any]:
    data = [{"index": i, "translation": str(text)} for i, text in enumerate(outputs)]
    return {"object": "list", "model": body.model, "data": data}
