"""KServe v2 / Open Inference Protocol over HTTP: infer and Triton's generate
extension, as ``tritonclient[http]`` speaks them (the tensors' encoding is
``kserve_tensor``; metadata, repository and statistics ``kserve_repository``).

``infer`` is served for every task: embedding models (a BYTES input of texts, an FP32
``[N, D]`` output), classification models (a BYTES ``LABEL`` and an FP32
``SCORE`` output per text), translation models (a BYTES ``TRANSLATION`` per
text), rerankers (a BYTES ``QUERY`` of one element and a BYTES ``TEXT``
of documents in, an FP32 ``SCORE`` per document out) and generate models
(Triton's LLM backends' tensors: a BYTES ``text_input`` of prompts, their
parameters as scalar tensors, ``sampling_parameters`` or the request's
``parameters``, a BYTES ``text_output`` in ``text_input``'s shape; see
``triton_llm``). A model of one input takes it under any name, as before; a
reranker's and a generation's are named. OCR models read ``IMAGE``: image
files in a BYTES tensor (binary data, or base64 in JSON) or UINT8 pixels
([H, W, C] or [N, H, W, C], RGB or gray), and answer each page's ``TEXT`` and
its lines one after another (``LINE_TEXT``, ``LINE_SCORE``, ``LINE_BOX`` of
four corners, ``LINE_IMAGE``: whose); the OCR route's fields (``mode``, a
vision-language model's ``prompt``...) come as the request's parameters.
Speech models read one ``TEXT`` (``speed`` a parameter) and answer ``AUDIO``
(INT16 samples) and ``SAMPLE_RATE``. Input tensors are any of KServe's
datatypes but BF16, in JSON or binary data; a model reads those it takes.

Triton's generate extension (``.../generate``, ``.../generate_stream``): a
JSON body of ``text_input`` and parameters, a JSON answer of ``text_output``,
or server-sent events of them (a piece each where ``stream`` is true).

A generation with ``stream`` true over infer is answered as server-sent
events to a caller that accepts them (``Accept: text/event-stream``; gRPC's
``ModelStreamInfer`` asks so), one prompt only: an infer response a piece,
each with ``parameters.triton_final_response`` false, then a final one with
the extras asked for (or none, where the request's parameter
``triton_enable_empty_final_response`` asks for it). Otherwise it is a 400
that says where to stream, as Triton's HTTP infer answers a decoupled model.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tessera.errors import (
    InvalidInputError,
    PayloadTooLargeError,
    TesseraError,
)
from tessera.gateway.common import (
    caller_of,
    engine_of,
    run_task,
    started_task,
)
from tessera.gateway.errors import reject_reason
from tessera.gateway.kserve_repository import io_metadata, kserve_error, versioned
from tessera.gateway.kserve_tensor import (
    HEADER_LENGTH,
    NUMERIC_DTYPES,
    InferRequest,
    Tensor,
    encode_output,
    is_number,
    json_object,
    parse_request,
)
from tessera.gateway.openai_embeddings import texts_of
from tessera.gateway.openai_stream import Pieces
from tessera.gateway.tasks_api import OcrOptions, ocr_item, rerank_inputs
from tessera.gateway.triton_llm import (
    PROMPT,
    SAMPLING_PARAMETERS,
    TEXT,
    GenerateParameters,
    asked_extras,
    extras_of,
    generate_items,
    generation_pieces,
    parameters_of,
    text_of,
)
from tessera.repository.spec import ModelSpec
from tessera.tasks.image import MAX_IMAGE_PIXELS, EncodedImage, read_image
from tessera.tasks.types import (
    ChatOutput,
    ClassifyOutput,
    OcrLine,
    OcrOutput,
    SpeechInput,
    SpeechOutput,
    Task,
    TextInput,
    TranslateInput,
)

router = APIRouter()

Arrays = list[tuple[str, np.ndarray[Any, Any], str]]  # output tensors: name, values, datatype
# A request's items, and how their outputs become output tensors.
Work = tuple[list[Any], Callable[[list[Any]], Arrays]]


def _work(spec: ModelSpec, parsed: InferRequest) -> Work:
    """The model's items of a request's inputs, and how their outputs become
    output tensors."""
    if spec.task is Task.OCR:
        return _pages(spec, parsed)
    if spec.task is Task.RERANK:
        unexpected = sorted(set(parsed.inputs) - {"QUERY", "TEXT"})
        if unexpected:
            raise InvalidInputError(f"a reranker takes inputs QUERY and TEXT, not {unexpected}")
        queries, documents = parsed.named("QUERY"), parsed.named("TEXT")
        if len(queries) != 1:
            raise InvalidInputError(f"QUERY holds one query, not {len(queries)}")
        if not documents:
            raise InvalidInputError("TEXT must hold at least one document")
        return rerank_inputs(queries[0], documents), _scores  # as /v1/rerank checks them
    texts = parsed.texts
    if spec.task is Task.TTS:
        return _speech(parsed, texts)
    texts = texts_of(texts, "TEXT")  # none blank, as the HTTP routes refuse them
    if spec.task is Task.TRANSLATE:
        return [TranslateInput(t) for t in texts], _translations
    if spec.task is Task.EMBEDDING:
        return [TextInput(t) for t in texts], _embeddings
    if spec.task is Task.CLASSIFY:
        return [TextInput(t) for t in texts], _labels
    raise InvalidInputError(f"infer does not serve {spec.task} models")


def _own_parameters(parsed: InferRequest) -> dict[str, Any]:
    """The request's parameters but Triton's own: the model's to read."""
    return {k: v for k, v in parsed.parameters.items() if k not in _RESERVED_PARAMETERS}


def _pages(
    spec: ModelSpec, parsed: InferRequest
) -> tuple[list[Any], Callable[[list[Any]], Arrays]]:
    """A page an image of ``IMAGE`` (or a model's one input, whatever its
    name): encoded image files in a BYTES tensor (binary data, or base64 in
    JSON), or pixels in a UINT8 one, [H, W, C] or [N, H, W, C] (RGB, or gray
    with C 1). A vision-language model's prompt fields and ``mode`` come as
    the request's parameters, as the OCR route's form fields."""
    if "IMAGE" in parsed.inputs:
        if len(parsed.inputs) > 1:
            others = sorted(set(parsed.inputs) - {"IMAGE"})
            raise InvalidInputError(f"an OCR model takes input IMAGE alone, not {others} too")
        tensor = parsed.inputs["IMAGE"]
    elif len(parsed.inputs) == 1:
        (tensor,) = parsed.inputs.values()
    else:
        raise InvalidInputError(f"input 'IMAGE' is missing; given {sorted(parsed.inputs)}")
    given = _own_parameters(parsed)
    mode = given.pop("mode", "page")
    if mode not in ("page", "line"):
        raise InvalidInputError(f"mode is page or line, not {mode!r:.20}")
    if isinstance(given.get("fields"), str):
        try:
            given["fields"] = json.loads(given["fields"])
        except (ValueError, RecursionError) as e:
            raise InvalidInputError("parameter 'fields' must be JSON") from e
    try:
        ask = OcrOptions.model_validate(given)
    except ValueError as e:
        raise InvalidInputError(f"invalid parameters: {e}") from e
    if ask.model_extra:
        raise InvalidInputError(f"an OCR model takes no parameter {sorted(ask.model_extra)}")
    images = _images(tensor)
    if not images:
        raise InvalidInputError("IMAGE must hold at least one image")
    return [ocr_item(spec, image, mode, ask) for image in images], _read


def _images(tensor: Tensor) -> list[EncodedImage] | list[np.ndarray[Any, Any]]:
    """The pages of an image tensor: image files, their headers read (decoded
    when they run), or pixels, each H x W x 3 BGR (as ``decode_image``)."""
    if tensor.datatype == "BYTES":
        return [read_image(blob) for blob in tensor.blobs()]
    if tensor.datatype != "UINT8" or len(tensor.shape) not in (3, 4):
        raise InvalidInputError(
            "IMAGE is BYTES (image files) or UINT8 pixels [H, W, C] or [N, H, W, C],"
            f" not {tensor.datatype} {list(tensor.shape)}"
        )
    pixels = tensor.array()
    pages = pixels[None] if pixels.ndim == 3 else pixels
    _count, height, width, channels = pages.shape
    if channels not in (1, 3) or not height or not width:
        raise InvalidInputError(f"IMAGE's pages are H x W x 1 or 3, not {list(pages.shape[1:])}")
    if height * width > MAX_IMAGE_PIXELS:
        raise PayloadTooLargeError(
            f"image of {width} x {height} pixels is over the limit of {MAX_IMAGE_PIXELS:,} pixels"
        )
    return [
        np.ascontiguousarray(np.repeat(page, 3 // channels, axis=2)[:, :, ::-1]) for page in pages
    ]


def _quad(box: tuple[tuple[float, float], ...]) -> list[tuple[float, float]]:
    """A line's box as four corners: its own, or its bounds where it has other."""
    if len(box) == 4:
        return list(box)
    xs, ys = [p[0] for p in box] or [0.0], [p[1] for p in box] or [0.0]
    return [(min(xs), min(ys)), (max(xs), min(ys)), (max(xs), max(ys)), (min(xs), max(ys))]


def _read(outputs: list[OcrOutput | ChatOutput]) -> Arrays:
    """Each page's ``TEXT``, and its lines one after another (``LINE_IMAGE``
    says whose): ``LINE_TEXT``, ``LINE_SCORE``, ``LINE_BOX`` (four corners,
    pixels). A vision-language model's answer is its text, with no lines."""
    texts: list[str] = []
    lines: list[tuple[int, OcrLine]] = []
    for index, output in enumerate(outputs):
        if isinstance(output, ChatOutput):
            texts.append(output.text)
            continue
        texts.append("\n".join(line.text for line in output.lines))
        lines.extend((index, line) for line in output.lines)
    boxes = np.array([_quad(line.box) for _, line in lines], dtype=np.float32).reshape(-1, 4, 2)
    return [
        ("TEXT", np.array(texts, dtype=object), "BYTES"),
        ("LINE_TEXT", np.array([line.text for _, line in lines], dtype=object), "BYTES"),
        ("LINE_SCORE", np.array([line.score for _, line in lines], dtype=np.float32), "FP32"),
        ("LINE_BOX", boxes, "FP32"),
        ("LINE_IMAGE", np.array([index for index, _ in lines], dtype=np.int32), "INT32"),
    ]


def _speech(
    parsed: InferRequest, texts: list[str]
) -> tuple[list[Any], Callable[[list[Any]], Arrays]]:
    """One text's speech: ``AUDIO`` (16-bit samples) and its ``SAMPLE_RATE``;
    ``speed`` (1.0) as a parameter."""
    if len(texts) != 1:
        raise InvalidInputError(f"a speech model reads one text a request, not {len(texts)}")
    given = _own_parameters(parsed)
    speed = given.pop("speed", 1.0)
    if given:
        raise InvalidInputError(f"a speech model takes speed alone, not {sorted(given)}")
    if not is_number(speed) or not 0.25 <= speed <= 4.0:
        raise InvalidInputError(f"speed is a number from 0.25 to 4, not {speed!r:.20}")
    if not texts[0].strip():
        raise InvalidInputError("the text must not be blank")
    return [SpeechInput(texts[0], float(speed))], _audio


def _audio(outputs: list[SpeechOutput]) -> Arrays:
    (speech,) = outputs
    return [
        ("AUDIO", np.asarray(speech.samples, dtype=np.int16), "INT16"),
        ("SAMPLE_RATE", np.array([speech.sample_rate], dtype=np.int32), "INT32"),
    ]


def _embeddings(outputs: list[Any]) -> Arrays:
    return [("EMBEDDING", np.stack([np.asarray(v, np.float32) for v in outputs]), "FP32")]


def _translations(outputs: list[Any]) -> Arrays:
    return [("TRANSLATION", np.array(outputs, dtype=object), "BYTES")]


def _scores(outputs: list[Any]) -> Arrays:
    return [("SCORE", np.asarray(outputs, dtype=np.float32), "FP32")]


def _labels(outputs: list[ClassifyOutput]) -> Arrays:
    labels = np.array([r.labels[0].label for r in outputs], dtype=object)
    scores = np.array([r.labels[0].score for r in outputs], dtype=np.float32)
    return [("LABEL", labels, "BYTES"), ("SCORE", scores, "FP32")]


# Triton's own request parameters, which are not a generation's.
_RESERVED_PARAMETERS = frozenset(
    {
        "binary_data_output",
        "priority",
        "timeout",
        "sequence_id",
        "sequence_start",
        "sequence_end",
        "headers",
        "triton_enable_empty_final_response",
    }
)
_WORD_LISTS = frozenset({"stop", "stop_words", "bad_words"})  # every element, not one


def _generation_request(parsed: InferRequest) -> tuple[list[str], GenerateParameters]:
    """The prompts of ``text_input`` and their parameters, gathered as
    ``triton_llm`` says."""
    prompts = parsed.named(PROMPT)
    given = _own_parameters(parsed)
    if SAMPLING_PARAMETERS in parsed.inputs:
        raw = parsed.named(SAMPLING_PARAMETERS)
        try:
            sampling = json.loads(raw[0]) if len(raw) == 1 else None
        except ValueError:
            sampling = None
        if not isinstance(sampling, dict):
            raise InvalidInputError(f"{SAMPLING_PARAMETERS} must hold one JSON object")
        given.update(sampling)
    for name, tensor in parsed.inputs.items():
        if name in (PROMPT, SAMPLING_PARAMETERS):
            continue
        if name in _WORD_LISTS:
            given[name] = parsed.named(name)
        elif len(tensor.values) != 1:
            raise InvalidInputError(f"input {name!r} holds one value, not {len(tensor.values)}")
        else:
            given[name] = tensor.tolist()[0]
    given.update(asked_extras(parsed.outputs))
    return prompts, parameters_of(given)


def _generation(parsed: InferRequest, prompts: list[str], parameters: GenerateParameters) -> Work:
    """A prompt's item per ``text_input`` element; ``text_output`` (and the
    extras asked for) in ``text_input``'s shape."""
    shape = parsed.inputs[PROMPT].shape
    items = generate_items(prompts, parameters)

    def arrays(outputs: list[ChatOutput]) -> Arrays:
        texts = [text_of(parameters, p, o) for p, o in zip(prompts, outputs, strict=True)]
        tensors = [(TEXT, np.array(texts, dtype=object).reshape(shape), "BYTES")]
        for extra in extras_of(parameters):
            values = [extra.value(output) for output in outputs]
            dtype = object if extra.datatype == "BYTES" else NUMERIC_DTYPES[extra.datatype]
            tensors.append(
                (extra.name, np.array(values, dtype=dtype).reshape(shape), extra.datatype)
            )
        return tensors

    return items, arrays


@router.post("/v2/models/{name}/infer", response_model=None)
@router.post("/v2/models/{name}/versions/{version}/infer", response_model=None)
async def infer(name: str, request: Request, version: str | None = None) -> Response:
    engine = engine_of(request)
    served_as = versioned(name, version)
    try:
        caller_of(request, served_as)  # a model the caller may not use: 404 before any check
        spec = engine.spec(served_as)
        parsed = parse_request(await request.body(), request.headers.get(HEADER_LENGTH))
        known = {output["name"] for output in io_metadata(spec)[1]}
        if not parsed.outputs <= known:
            raise InvalidInputError(
                f"model {name!r} has no output {sorted(parsed.outputs - known)};"
                f" its outputs are {sorted(known)}"
            )
        if spec.task is Task.GENERATE:
            prompts, parameters = _generation_request(parsed)
            if parameters.stream:
                return await _infer_events(request, name, served_as, parsed, prompts, parameters)
            items, arrays_of = _generation(parsed, prompts, parameters)
        else:
            items, arrays_of = _work(spec, parsed)
        outputs_raw = await run_task(request, served_as, spec.task, items)
    except TesseraError as e:
        request.state.audit.reason = reject_reason(e) or type(e).__name__
        return kserve_error(e)
    arrays = arrays_of(outputs_raw)
    if parsed.outputs:  # only those asked for, as Triton answers
        arrays = [entry for entry in arrays if entry[0] in parsed.outputs]
    outputs, blobs = [], []
    for out_name, array, datatype in arrays:
        out, blob = encode_output(parsed, out_name, array, datatype)
        outputs.append(out)
        blobs.append(blob)
    response_header: dict[str, Any] = {
        "model_name": name,
        "model_version": request.state.model_version,  # the version that answered
        "outputs": outputs,
    }
    if parsed.request_id is not None:
        response_header["id"] = parsed.request_id
    head = json.dumps(response_header).encode()
    binary = b"".join(blobs)
    if not binary:
        return Response(head, media_type="application/json")
    return Response(
        head + binary,
        media_type="application/octet-stream",
        headers={"Inference-Header-Content-Length": str(len(head))},
    )


@router.post("/v2/models/{name}/generate", response_model=None)
@router.post("/v2/models/{name}/versions/{version}/generate", response_model=None)
async def generate(name: str, request: Request, version: str | None = None) -> Response:
    """Triton's generate extension: one JSON answer (``triton_llm`` notes)."""
    return await _generate(name, request, version, streamed=False)


@router.post("/v2/models/{name}/generate_stream", response_model=None)
@router.post("/v2/models/{name}/versions/{version}/generate_stream", response_model=None)
async def generate_stream(name: str, request: Request, version: str | None = None) -> Response:
    """Triton's generate extension as server-sent events: the text as it
    comes where ``stream`` is true, else whole in one event."""
    return await _generate(name, request, version, streamed=True)


def _generate_request(body: bytes) -> tuple[str, GenerateParameters]:
    """A generate body's prompt and parameters (``parameters`` and any other
    field but ``text_input``)."""
    try:
        given = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise InvalidInputError("the body is not valid JSON") from e
    if not isinstance(given, dict):
        raise InvalidInputError("the body must be a JSON object")
    prompt = given.pop(PROMPT, None)
    if not isinstance(prompt, str):
        raise InvalidInputError(f"{PROMPT} must be a string, the prompt")
    parameters = json_object(given.pop("parameters", None), "parameters")
    return prompt, parameters_of({**given, **parameters})


async def _generate(name: str, request: Request, version: str | None, streamed: bool) -> Response:
    served_as = versioned(name, version)
    try:
        prompt, parameters = _generate_request(await request.body())
        if parameters.stream and not streamed:
            raise InvalidInputError("generate answers once: stream with .../generate_stream")
        if parameters.stream:
            pieces: Pieces = asyncio.Queue()
            items = generate_items([prompt], parameters, pieces)
            work = await started_task(request, served_as, Task.GENERATE, items)
            events = _generated_events(name, request, prompt, parameters, work, pieces)
            return _event_stream(events)
        outputs = await run_task(
            request, served_as, Task.GENERATE, generate_items([prompt], parameters)
        )
    except TesseraError as e:
        request.state.audit.reason = reject_reason(e) or type(e).__name__
        return kserve_error(e)
    body = _generated(
        name, request, text_of(parameters, prompt, outputs[0]), parameters, outputs[0]
    )
    if streamed:
        return _event_stream(_one(body))
    return JSONResponse(body)


def _generated(
    name: str,
    request: Request,
    text: str,
    parameters: GenerateParameters,
    output: ChatOutput | None = None,
) -> dict[str, Any]:
    """A generate response: ``text``, and (with the output) the extras asked for."""
    body = {"model_name": name, "model_version": request.state.model_version, TEXT: text}
    if output is not None:
        body.update((extra.name, extra.value(output)) for extra in extras_of(parameters))
    return body


def _event_stream(bodies: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        async for body in bodies:
            yield f"data: {json.dumps(body)}\n\n"

    return StreamingResponse(
        events(), media_type=EVENT_STREAM, headers={"Cache-Control": "no-cache"}
    )


async def _one(body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    yield body


async def _generated_events(
    name: str,
    request: Request,
    prompt: str,
    parameters: GenerateParameters,
    work: asyncio.Future[list[Any]],
    pieces: Pieces,
) -> AsyncIterator[dict[str, Any]]:
    """Each text ``generation_pieces`` gives, then the extras asked for (with
    no text); an error as ``{"error": ...}``."""
    try:
        async for got in generation_pieces(prompt, parameters, work, pieces):
            if isinstance(got, str):
                yield _generated(name, request, got, parameters)
            elif extras_of(parameters):
                yield _generated(name, request, "", parameters, got)
    except TesseraError as e:
        yield {"error": str(e)}


EVENT_STREAM = "text/event-stream"


async def _infer_events(
    request: Request,
    name: str,
    served_as: str,
    parsed: InferRequest,
    prompts: list[str],
    parameters: GenerateParameters,
) -> Response:
    """A streamed generation over infer, for a caller that accepts server-sent
    events (gRPC's ``ModelStreamInfer`` is one): an infer response an event,
    each with ``triton_final_response`` among its parameters (module notes)."""
    if EVENT_STREAM not in request.headers.get("accept", ""):
        raise InvalidInputError(
            "infer answers once: stream with .../generate_stream, gRPC's ModelStreamInfer,"
            f" or infer with Accept: {EVENT_STREAM}"
        )
    if len(prompts) != 1:
        raise InvalidInputError(f"a streamed generation takes one prompt, not {len(prompts)}")
    pieces: Pieces = asyncio.Queue()
    items = generate_items(prompts, parameters, pieces)
    work = await started_task(request, served_as, Task.GENERATE, items)
    shape = list(parsed.inputs[PROMPT].shape)
    empty_final = parsed.parameters.get("triton_enable_empty_final_response") is True

    def response(outputs: list[dict[str, Any]], final: bool) -> dict[str, Any]:
        body = {
            "model_name": name,
            "model_version": request.state.model_version,
            "outputs": outputs,
            "parameters": {"triton_final_response": final},
        }
        if parsed.request_id is not None:
            body["id"] = parsed.request_id
        return body

    def tensor(name: str, datatype: str, value: Any) -> dict[str, Any]:
        return {"name": name, "datatype": datatype, "shape": shape, "data": [value]}

    async def events() -> AsyncIterator[dict[str, Any]]:
        try:
            async for got in generation_pieces(prompts[0], parameters, work, pieces):
                if isinstance(got, str):
                    yield response([tensor(TEXT, "BYTES", got)], final=False)
                    continue
                extras = [
                    tensor(extra.name, extra.datatype, extra.value(got))
                    for extra in extras_of(parameters)
                ]
                if extras or empty_final:
                    yield response(extras, final=True)
        except TesseraError as e:
            yield {"error": str(e)}

    return _event_stream(events())
