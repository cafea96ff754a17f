"""OpenAI's speech: text to a clip, whole or as server-sent events."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from tessera.errors import InvalidInputError
from tessera.gateway.common import (
    JsonBodyRoute,
    run_task,
)
from tessera.tasks.audio import AudioFormat, check_format, encoded
from tessera.tasks.types import (
    SpeechInput,
    Task,
)

# Bodies are JSON whatever their content type (``JsonBodyRoute``).
router = APIRouter(route_class=JsonBodyRoute)


class SpeechRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: Annotated[str, Field(min_length=1, max_length=4096)]
    voice: str | None = None
    response_format: AudioFormat = "wav"
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = "audio"

    @field_validator("response_format")
    @classmethod
    def _written(cls, value: str) -> str:
        return check_format(value)


@router.post("/v1/audio/speech", response_model=None)
async def speech(body: SpeechRequest, request: Request) -> Response:
    if not body.input.strip():
        raise InvalidInputError("input must not be blank")
    (output,) = await run_task(request, body.model, Task.TTS, [SpeechInput(body.input, body.speed)])
    # mp3, flac and opus take milliseconds a second of speech: off the event loop.
    audio = await asyncio.to_thread(encoded, output, body.response_format)
    headers = {"x-sample-rate": str(audio.sample_rate)} if body.response_format == "pcm" else {}
    if body.stream_format == "sse":
        events = _speech_events(audio.data, max(1, len(body.input)))
        headers["Cache-Control"] = "no-cache"
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    return Response(audio.data, media_type=audio.media_type, headers=headers)


# Bytes of encoded audio a ``speech.audio.delta`` event carries (an even count:
# pcm's 16-bit samples are never split).
SPEECH_EVENT_BYTES = 32 * 1024


def _speech_events(audio: bytes, characters: int) -> Iterator[str]:
    """``stream_format: "sse"``, as OpenAI's: the clip (in ``response_format``)
    in ``speech.audio.delta`` events of base64 pieces, then
    ``speech.audio.done`` with the usage. The clip is made whole first (a
    voice speaks each item in one batch), so the events come at once; the
    usage's input is what the request was charged, its characters (tessera
    meters speech by them), and it counts no output tokens."""
    for start in range(0, len(audio), SPEECH_EVENT_BYTES):
        piece = base64.b64encode(audio[start : start + SPEECH_EVENT_BYTES]).decode("ascii")
        yield f"data: {json.dumps({'type': 'speech.audio.delta', 'audio': piece})}\n\n"
    usage = {"input_tokens": characters, "output_tokens": 0, "total_tokens": characters}
    yield f"data: {json.dumps({'type': 'speech.audio.done', 'usage': usage})}\n\n"
