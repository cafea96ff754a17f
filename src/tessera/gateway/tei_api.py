"""Hugging Face's Text Embeddings Inference (TEI) API, a model per base URL.

TEI serves one model a server; here each model is a TEI server of its own
under ``/tei/{model}``, so a TEI client is pointed at
``http://host:8000/tei/all-minilm-l6-v2`` (with a tenant's key as its bearer
token, as TEI's ``--api-key``):

- ``POST /embed`` (``inputs``: a text or a list; ``normalize``, default true;
  ``dimensions``): a list of vectors;
- ``POST /rerank`` (``query``, ``texts``; ``return_text``): the texts'
  ``index`` and ``score`` (the model's relevance score, as Cohere's shape
  gives it), best first;
- ``POST /predict`` (``inputs``: a text, or a batch ``[[text], ...]``): each
  text's labels and scores, best first;
- ``POST /`` (and ``/invocations``): the route of the model's task, as TEI
  serves the one of its model's type (what ``huggingface_hub``'s
  ``InferenceClient`` calls for a URL);
- ``POST /tokenize`` (``inputs``: a text or a list; ``add_special_tokens``,
  default true): each text's tokens as the model's ``tokenizer.json`` makes
  them, ``id``, ``text`` (a special token's own text, else the input's
  characters from ``start`` to ``stop``, character offsets), ``special``;
  ``POST /decode`` (``ids``: a list of ids, or of lists;
  ``skip_special_tokens``, default true): the texts. Neither runs the model
  or is metered; a model without a tokenizer file answers 422;
- ``GET /info``, ``GET /health``.

Errors read as TEI's, ``{"error": message, "error_type": kind}``
(``gateway/errors.py``). What TEI serves and this does not: text pairs to
``/predict``, ``prompt_name``, ``raw_scores`` (a score is what the model's
card makes of its output: a cross-encoder's sigmoid, a bi-encoder's cosine),
sparse and per-token embeddings; each is refused with a 422 that says so,
or not served at all.
``truncate`` is taken and left to the card: a text over the model's window is
cut or refused as the card's ``truncate`` says, whatever the request asks.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from tessera import __version__
from tessera.errors import InvalidInputError, TaskMismatchError
from tessera.gateway.common import JsonBodyRoute, caller_of, engine_of, parsed, run_task
from tessera.gateway.openai_embeddings import embedding_matrix, texts_of, unit_rows
from tessera.gateway.tasks_api import best_first, rerank_inputs
from tessera.runtimes.tokens import TOKENIZER_FILE, tokenizer_file, whole_tokenizer
from tessera.tasks.types import ClassifyOutput, Task, TextInput

# Bodies are JSON whatever their content type (``JsonBodyRoute``).
router = APIRouter(prefix="/tei/{model}", route_class=JsonBodyRoute)


class TeiEmbedRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    inputs: str | Annotated[list[str], Field(min_length=1)]
    normalize: bool = True
    truncate: bool = False
    prompt_name: str | None = None
    dimensions: int | None = Field(default=None, ge=1)


class TeiRerankRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    query: Annotated[str, Field(min_length=1)]
    texts: Annotated[list[str], Field(min_length=1)]
    truncate: bool = False
    raw_scores: bool = False
    return_text: bool = False


class TeiPredictRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    inputs: str | Annotated[list[str], Field(min_length=1, max_length=2)] | list[list[str]]
    truncate: bool = False
    raw_scores: bool = False


@router.post("/embed")
async def embed(model: str, body: TeiEmbedRequest, request: Request) -> Response:
    if body.prompt_name is not None:
        raise InvalidInputError("prompt_name: this model has no prompts")
    items = [TextInput(t) for t in texts_of(body.inputs, "inputs")]
    vectors = await run_task(request, model, Task.EMBEDDING, items)
    matrix = embedding_matrix(vectors, body.dimensions)
    return JSONResponse((unit_rows(matrix) if body.normalize else matrix).tolist())


@router.post("/rerank")
async def rerank(model: str, body: TeiRerankRequest, request: Request) -> Response:
    if body.raw_scores:
        raise InvalidInputError("raw_scores: a model's raw scores are not served")
    items = rerank_inputs(body.query, body.texts)
    scores = [float(s) for s in await run_task(request, model, Task.RERANK, items)]
    answer: list[dict[str, Any]] = []
    for index in best_first(scores):
        rank: dict[str, Any] = {"index": index, "score": scores[index]}
        if body.return_text:
            rank["text"] = body.texts[index]
        answer.append(rank)
    return JSONResponse(answer)


@router.post("/predict")
async def predict(model: str, body: TeiPredictRequest, request: Request) -> Response:
    if body.raw_scores:
        raise InvalidInputError("raw_scores: a model's raw scores are not served")
    inputs = body.inputs
    single = isinstance(inputs, str) or all(isinstance(i, str) for i in inputs)
    sequences: list[Any] = [inputs] if single else list(inputs)
    texts: list[str] = []
    for sequence in sequences:
        if isinstance(sequence, str):
            texts.append(sequence)
        elif len(sequence) == 1:
            texts.append(sequence[0])
        elif len(sequence) == 2:
            raise InvalidInputError("inputs: text pairs are not served, one text an input")
        else:
            raise InvalidInputError("inputs: a text, or a batch of [text] lists")
    items = [TextInput(t) for t in texts_of(texts, "inputs")]
    outputs: list[ClassifyOutput] = await run_task(request, model, Task.CLASSIFY, items)
    predictions = [[{"score": s.score, "label": s.label} for s in o.labels] for o in outputs]
    return JSONResponse(predictions[0] if single else predictions)


class TeiTokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    inputs: str | Annotated[list[str], Field(min_length=1)]
    add_special_tokens: bool = True
    prompt_name: str | None = None


class TeiDecodeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    ids: Annotated[list[int], Field(min_length=1)] | Annotated[list[list[int]], Field(min_length=1)]
    skip_special_tokens: bool = True


@router.post("/tokenize")
async def tokenize(model: str, body: TeiTokenizeRequest, request: Request) -> Response:
    if body.prompt_name is not None:
        raise InvalidInputError("prompt_name: this model has no prompts")
    tokenizer = _tokenizer(request, model)
    texts = texts_of(body.inputs, "inputs")
    encodings = await asyncio.to_thread(
        tokenizer.encode_batch, texts, add_special_tokens=body.add_special_tokens
    )
    return JSONResponse([_tokens(text, e) for text, e in zip(texts, encodings, strict=True)])


@router.post("/decode")
async def decode(model: str, body: TeiDecodeRequest, request: Request) -> Response:
    tokenizer = _tokenizer(request, model)
    batch = _id_lists(body.ids)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    for ids in batch:
        wrong = [i for i in ids if not 0 <= i < size]
        if wrong:
            raise InvalidInputError(f"ids: {wrong[:5]} are not in the model's {size:,} tokens")
    texts = await asyncio.to_thread(
        tokenizer.decode_batch, batch, skip_special_tokens=body.skip_special_tokens
    )
    return JSONResponse(list(texts))


def _id_lists(ids: list[int] | list[list[int]]) -> list[list[int]]:
    """``ids``, one text's or a list of them, as a list of them."""
    one = [i for i in ids if isinstance(i, int)]
    return [one] if len(one) == len(ids) else [i for i in ids if isinstance(i, list)]


def _tokenizer(request: Request, model: str) -> Any:
    """``model``'s tokenizer (the caller may use it), without truncation or padding."""
    caller_of(request, model)
    spec = engine_of(request).spec(model)
    path = tokenizer_file(spec)
    tokenizer = None if path is None else whole_tokenizer(str(path.resolve()))
    if tokenizer is None:
        raise InvalidInputError(f"model {model!r} has no {TOKENIZER_FILE} to tokenize with")
    return tokenizer


def _tokens(text: str, encoding: Any) -> list[dict[str, Any]]:
    """An encoding's tokens as TEI's ``SimpleToken``s."""
    tokens = []
    for token_id, token, (start, stop), special in zip(
        encoding.ids, encoding.tokens, encoding.offsets, encoding.special_tokens_mask, strict=True
    ):
        own = {"text": token, "start": None, "stop": None}
        read = {"text": text[start:stop], "start": start, "stop": stop}
        tokens.append({"id": token_id, "special": bool(special), **(own if special else read)})
    return tokens


@router.post("")
@router.post("/")
@router.post("/invocations")
async def by_task(model: str, request: Request) -> Response:
    """The route of the model's task, as TEI serves the one of its model's type."""
    caller_of(request, model)
    task = engine_of(request).spec(model).task
    raw = await request.body()
    if task == Task.EMBEDDING:
        return await embed(model, parsed(TeiEmbedRequest, raw), request)
    if task == Task.RERANK:
        return await rerank(model, parsed(TeiRerankRequest, raw), request)
    if task == Task.CLASSIFY:
        return await predict(model, parsed(TeiPredictRequest, raw), request)
    raise TaskMismatchError(f"model {model!r} serves {task.value!r}: not a TEI task")


@router.get("/info")
async def info(model: str, request: Request) -> JSONResponse:
    caller_of(request, model)
    spec = engine_of(request).spec(model)
    kinds = {
        Task.EMBEDDING: {"embedding": {"pooling": str(spec.options.get("pooling", "mean"))}},
        Task.RERANK: {"reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}},
        Task.CLASSIFY: {"classifier": {"id2label": {}, "label2id": {}}},
    }
    if spec.task not in kinds:
        raise TaskMismatchError(f"model {model!r} serves {spec.task.value!r}: not a TEI task")
    batch, window = spec.batching.max_batch_size, spec.inputs.text_window or 0
    return JSONResponse(
        {
            "model_id": spec.name,
            "model_sha": None,
            "model_dtype": "float32",
            "model_type": kinds[spec.task],
            # What one batch of the model runs: a request may send more texts.
            "max_concurrent_requests": batch * (spec.batching.max_concurrent_batches or 1),
            "max_input_length": window,
            "max_batch_tokens": window * batch,
            "max_batch_requests": batch,
            "max_client_batch_size": batch,
            "tokenization_workers": 1,
            "version": __version__,
        }
    )


@router.get("/health")
async def health(model: str, request: Request) -> JSONResponse:
    caller_of(request, model)
    engine_of(request).spec(model)  # 404 for a model that is not served
    return JSONResponse({})
