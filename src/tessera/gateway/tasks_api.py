"""Task endpoints outside OpenAI's API: rerank (Cohere/Jina shape), classify,
OCR and translate."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tessera.errors import InvalidInputError
from tessera.gateway.common import engine_of, run_task
from tessera.gateway.openai_api import texts_of
from tessera.tasks.image import decode_base64, decode_image
from tessera.tasks.types import (
    ClassifyOutput,
    OcrInput,
    OcrOutput,
    RerankInput,
    Task,
    TextInput,
    TranslateInput,
)

router = APIRouter()


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
async def rerank(body: RerankRequest, request: Request) -> JSONResponse:
    if not body.query.strip():
        raise InvalidInputError("query must not be blank")
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    items = [RerankInput(body.query, text) for text in texts]
    scores = await run_task(request, body.model, Task.RERANK, items)
    ranked = sorted(range(len(texts)), key=lambda i: float(scores[i]), reverse=True)
    results: list[dict[str, Any]] = []
    for index in ranked[: body.top_n or len(ranked)]:
        result: dict[str, Any] = {"index": index, "relevance_score": float(scores[index])}
        if body.return_documents:
            result["document"] = {"text": texts[index]}
        results.append(result)
    return JSONResponse(
        {"id": str(uuid.uuid4()), "model": body.model, "results": results, "meta": {}}
    )


class ClassifyRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[str]
    top_k: int = Field(default=5, ge=1, le=100)


@router.post("/v1/classify")
async def classify(body: ClassifyRequest, request: Request) -> JSONResponse:
    items = [TextInput(t) for t in texts_of(body.input)]
    outputs: list[ClassifyOutput] = await run_task(request, body.model, Task.CLASSIFY, items)
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
    return JSONResponse({"object": "list", "model": body.model, "data": data})


class OcrRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    image: Annotated[str, Field(min_length=1, description="base64 or a data: URL")]
    mode: Literal["page", "line"] = "page"


def _ocr_body(model: str, output: OcrOutput) -> dict[str, Any]:
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
    request: Request, model: str, raw: bytes, mode: Literal["page", "line"]
) -> JSONResponse:
    engine_of(request).spec_for(model, Task.OCR)
    item = OcrInput(decode_image(raw), mode)
    (output,) = await run_task(request, model, Task.OCR, [item])
    return JSONResponse(_ocr_body(model, output))


@router.post("/v1/ocr")
async def ocr(request: Request) -> JSONResponse:
    """JSON ``{model, image: base64, mode}`` or multipart ``file``, ``model``, ``mode``."""
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
            raw = await upload.read()
        return await _ocr(request, model, raw, "line" if mode == "line" else "page")
    try:
        payload = await request.json()
    except ValueError as e:
        raise InvalidInputError("body is not valid JSON") from e
    try:
        body = OcrRequest.model_validate(payload)
    except ValueError as e:
        raise InvalidInputError(f"invalid request: {e}") from e
    return await _ocr(request, body.model, decode_base64(body.image), body.mode)


class TranslateRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[str]


@router.post("/v1/translate")
async def translate(body: TranslateRequest, request: Request) -> JSONResponse:
    items = [TranslateInput(t) for t in texts_of(body.input)]
    outputs = await run_task(request, body.model, Task.TRANSLATE, items)
    data = [{"index": i, "translation": str(text)} for i, text in enumerate(outputs)]
    return JSONResponse({"object": "list", "model": body.model, "data": data})
