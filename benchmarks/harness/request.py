"""The request a tessera gets for a model of each task: real work, not a ping."""

from __future__ import annotations

import base64
import io
from typing import Any

from tessera.tasks.samples import SENTENCE, sample_page


def _png_base64() -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(sample_page()[:, :, ::-1]).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def request_for(
    task: str, model: str, n: int, *, pages: int = 1, max_tokens: int | None = None
) -> tuple[str, dict[str, Any]]:
    """The path and JSON body of the ``n``-th request for a model of ``task``:
    ``pages`` pages of OCR (over KServe v2, which takes several a request), a
    chat of ``max_tokens`` (8 by default)."""
    sentence = f"{SENTENCE} ({n})"
    match task:
        case "embedding":
            return "/v1/embeddings", {"model": model, "input": sentence}
        case "classify":
            return "/v1/classify", {"model": model, "input": sentence}
        case "rerank":
            documents = [sentence, "Paris is the capital of France.", "Bread needs flour."]
            return "/v1/rerank", {
                "model": model,
                "query": "Where does the fox jump?",
                "documents": documents,
            }
        case "translate":
            return "/v1/translate", {"model": model, "input": f"The weather is nice today ({n})."}
        case "tts":
            return "/v1/audio/speech", {"model": model, "input": "Hello from tessera."}
        case "ocr" if pages > 1:
            image = {"name": "IMAGE", "datatype": "BYTES", "shape": [pages]}
            return f"/v2/models/{model}/infer", {
                "inputs": [{**image, "data": [_png_base64()] * pages}]
            }
        case "ocr":
            return "/v1/ocr", {"model": model, "image": _png_base64()}
        case "generate":
            messages = [{"role": "user", "content": f"Say a word about number {n}."}]
            return "/v1/chat/completions", {
                "model": model,
                "messages": messages,
                "max_tokens": 8 if max_tokens is None else max_tokens,
            }
    raise ValueError(f"tessera bench does not know task {task!r}")
