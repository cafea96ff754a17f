"""DeepL's translation API (``POST /v2/translate``, ``GET /v2/languages``,
``GET /v2/usage``), for DeepL's own clients (``deepl.Translator(key,
server_url=...)``).

DeepL names languages, not models: a request's ``target_lang`` (and
``source_lang``, if given) pick the translate model among those the caller
may use whose card's ``direction`` option is ``source-target`` (``en-pt``);
regional variants read as their language (``PT-BR`` is ``pt``, ``EN-US``
``en``). Without ``source_lang`` the one model into the target language
answers (its source is the ``detected_source_language``), and a 400 asks for
``source_lang`` where several would; a ``model`` field (tessera's own) names
the model instead. The key comes as DeepL sends it (``Authorization:
DeepL-Auth-Key KEY``) or as a bearer token. Bodies are JSON or form-encoded
(``text`` repeated), as DeepL takes both; answers are DeepL's
(``translations`` with ``text``, ``detected_source_language`` and
``billed_characters``) and so are errors (``{"message": ...}``,
``gateway/errors.py``). Glossaries and tag handling are refused (400); the
other options (formality, context, sentence splitting) are taken and
ignored: the models have none of them. The usage is the caller's tenant's
day (UTC, from the audit log, as its daily quota counts it): the work units
charged to it today on every model (a translation's are its characters), and
its daily quota (10^12 where it has none, as DeepL writes no limit).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tessera.errors import InvalidInputError, TaskMismatchError
from tessera.gateway.common import (
    caller_of,
    engine_of,
    parsed,
    principal_of,
    run_task,
    visible_models,
)
from tessera.gateway.openai_embeddings import texts_of
from tessera.repository import ModelSpec
from tessera.tasks.types import Task, TranslateInput
from tessera.tenants.audit import AuditLog, start_of_day_utc

router = APIRouter()

# Names of the languages a direction may name (others are named by their code).
_NAMES = {
    "ar": "Arabic",
    "cs": "Czech",
    "de": "German",
    "en": "English",
    "es": "Spanish",
    "fr": "French",
    "it": "Italian",
    "ja": "Japanese",
    "nl": "Dutch",
    "pl": "Polish",
    "pt": "Portuguese",
    "ru": "Russian",
    "uk": "Ukrainian",
    "zh": "Chinese",
}


class DeepLRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    text: Annotated[list[str], Field(min_length=1)]
    target_lang: Annotated[str, Field(min_length=2)]
    source_lang: str | None = None
    model: str | None = None  # tessera's own: a translate model by name
    glossary_id: str | None = None
    tag_handling: str | None = None


def direction(spec: ModelSpec) -> tuple[str, str] | None:
    """A translate model's (source, target) languages, from its card's
    ``direction`` option; None for any other model."""
    pair = spec.options.get("direction")
    if spec.task != Task.TRANSLATE or not isinstance(pair, str):
        return None
    source, _, target = pair.lower().partition("-")
    return (source, target) if source and target else None


def _language(code: str) -> str:
    return code.strip().lower().partition("-")[0]


async def _read(request: Request) -> DeepLRequest:
    """The body, JSON or form-encoded (``text`` may repeat there)."""
    if request.headers.get("content-type", "").startswith("application/x-www-form-urlencoded"):
        form = await request.form()
        data: Any = {key: form.get(key) for key in form if key != "text"}
        data["text"] = [str(t) for t in form.getlist("text")]
    else:
        data = await request.body()
    body = parsed(DeepLRequest, data)
    if body.glossary_id is not None:
        raise InvalidInputError("glossary_id: glossaries are not served")
    if body.tag_handling is not None:
        raise InvalidInputError("tag_handling: the models translate plain text only")
    return body


def _choose(request: Request, body: DeepLRequest) -> tuple[str, str]:
    """The model that answers, and the language it reads."""
    engine = engine_of(request)
    if body.model is not None:
        caller_of(request, body.model)
        pair = direction(engine.spec(body.model))
        if pair is None:
            raise TaskMismatchError(f"model {body.model!r} does not translate between languages")
        return body.model, pair[0]
    target = _language(body.target_lang)
    source = None if body.source_lang is None else _language(body.source_lang)
    found = [
        (name, pair)
        for name in visible_models(request)
        if (pair := direction(engine.spec(name))) is not None
        and pair[1] == target
        and source in (None, pair[0])
    ]
    if not found:
        origin = f"from {source}" if source else "from any language"
        raise InvalidInputError(f"no model translates {origin} into {target}")
    if len(found) > 1:
        sources = ", ".join(sorted(pair[0] for _, pair in found))
        raise InvalidInputError(
            f"several models translate into {target} ({sources}): give source_lang"
        )
    ((name, pair),) = found
    return name, pair[0]


@router.post("/v2/translate")
async def translate(request: Request) -> JSONResponse:
    body = await _read(request)
    model, source = _choose(request, body)
    texts = texts_of(body.text, "text")
    outputs = await run_task(request, model, Task.TRANSLATE, [TranslateInput(t) for t in texts])
    return JSONResponse(
        {
            "translations": [
                {
                    "detected_source_language": source.upper(),
                    "text": str(output),
                    "billed_characters": len(text),
                }
                for text, output in zip(texts, outputs, strict=True)
            ]
        }
    )


NO_LIMIT = 10**12  # DeepL's character_limit for a key without one


@router.get("/v2/usage")
async def usage(request: Request) -> JSONResponse:
    """The caller's tenant's units today and its daily quota (module notes)."""
    principal = principal_of(request)
    audit: AuditLog | None = getattr(request.app.state, "audit_log", None)
    count, limit = 0.0, None
    if principal is not None:
        limit = principal.tenant.daily_units
        if audit is not None:
            today = start_of_day_utc(time.time())
            count = await asyncio.to_thread(audit.units_since, principal.tenant.name, today)
    return JSONResponse(
        {
            "character_count": math.ceil(count),
            "character_limit": NO_LIMIT if limit is None else math.floor(limit),
        }
    )


@router.get("/v2/languages")
async def languages(request: Request, type: str | None = None) -> JSONResponse:
    """The languages the caller's translate models read (``type=source``, the
    default) or write (``type=target``); DeepL's client sends the type in a
    form body, curl in the query."""
    kind = type
    if kind is None and request.headers.get("content-type", "").startswith(
        "application/x-www-form-urlencoded"
    ):
        kind = str((await request.form()).get("type") or "") or None
    if kind not in (None, "source", "target"):
        raise InvalidInputError(f"type must be source or target, got {kind!r}")
    engine = engine_of(request)
    side = 1 if kind == "target" else 0
    codes = sorted(
        {pair[side] for name in visible_models(request) if (pair := direction(engine.spec(name)))}
    )
    answer: list[dict[str, Any]] = []
    for code in codes:
        language: dict[str, Any] = {"language": code.upper(), "name": _NAMES.get(code, code)}
        if kind == "target":
            language["supports_formality"] = False
        answer.append(language)
    return JSONResponse(answer)
