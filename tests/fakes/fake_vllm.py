"""A fake vLLM OpenAI server for the external runtime's tests (vLLM cannot be
installed here): ``python tests/fakes/fake_vllm.py MODEL --port P ...``.

It takes ``vllm serve``'s command line as tessera writes it (``--host``,
``--port``, ``--served-model-name``, ``--gpu-memory-utilization``,
``--enable-sleep-mode``, ``--max-num-seqs``), its API key from
``VLLM_API_KEY``, and serves vLLM's endpoints: ``/health``, ``/v1/models``,
``/v1/chat/completions`` (streamed or not, usage per chunk with
``continuous_usage_stats``), ``/metrics`` (``vllm:*`` families), and, with
``VLLM_SERVER_DEV_MODE=1``, ``/sleep``, ``/wake_up`` and ``/is_sleeping``.

Its "weights" are ``--weights-mib`` of written (resident) host memory: sleep
level 1 frees them, so its resident set drops, as a real engine's device
bytes do (vLLM moves them to host memory; the fake rebuilds them on wake).
A completion is ``max_tokens`` tokens ("w0 w1 ..."), one every
``--token-delay-s``. A chat with ``image_url`` parts (base64 ``data:`` URLs
only, as tessera sends them) is answered with a JSON echo of what arrived, a
token a word, cut at ``max_tokens`` (finish ``length``, else ``stop``):
``{"prompt": its texts, "images": [{"bytes": N, "width": W, "height": H}]}``
(the size read from a PNG's header), its prompt tokens counting one more per
32 x 32 block of each image. The port opens after ``--load-delay-s``, and
chats are answered 503 (while ``/health`` answers 200) for
``--chat-ready-after-s`` more, as a server that listens before its model is
ready does. A streamed chat with ``tools`` and a ``tool_choice`` of
``required`` or a named function is answered with one call of that function
(or of the first tool), as vLLM streams calls: its id, type and name in the
first ``delta.tool_calls`` fragment, its arguments ``{"echo": the last
message's text}`` in two, finish ``tool_calls``; a ``tool`` message without
``tool_call_id`` is a 400, as vLLM's. Logprobs are -0.5 a token, its
alternatives lower: a chat's as ``logprobs.content``, a completion's (an
integer ``logprobs``, the token itself among them) in the legacy form. With
``--engine-core-child`` it starts a child process, as vLLM's API server starts
its engine core, to show that stopping or killing it reaches its group.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import struct
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class State:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.lock = threading.Lock()
        self.weights: bytearray | None = None
        self.running = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.chat_ready_at = 0.0  # time.monotonic() from which chats are answered
        self.load()

    def load(self) -> None:
        self.weights = bytearray(b"\x01") * (self.args.weights_mib * 2**20)

    def metrics(self) -> str:
        name = self.args.served_model_name
        usage = self.running / self.args.max_num_seqs
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f'vllm:num_requests_running{{model_name="{name}"}} {self.running}',
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f'vllm:num_requests_waiting{{model_name="{name}"}} 0',
            "# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:gpu_cache_usage_perc gauge",
            f'vllm:gpu_cache_usage_perc{{model_name="{name}"}} {usage}',
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            f'vllm:prompt_tokens_total{{model_name="{name}"}} {self.prompt_tokens}',
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f'vllm:generation_tokens_total{{model_name="{name}"}} {self.generation_tokens}',
        ]
        return "\n".join(lines) + "\n"


class Handler(BaseHTTPRequestHandler):
    state: State

    def log_message(self, format: str, *args: Any) -> None:
        return

    def _json(self, status: int, body: Any) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _error(self, status: int, message: str) -> None:
        self._json(status, {"error": {"message": message, "code": status}})

    def _authorised(self) -> bool:
        key = os.environ.get("VLLM_API_KEY")
        given = self.headers.get("Authorization")
        if key and self.path.startswith("/v1") and given != f"Bearer {key}":
            self._error(401, "Unauthorized")
            return False
        return True

    def _dev(self) -> bool:
        if os.environ.get("VLLM_SERVER_DEV_MODE") != "1":
            self._error(404, "Not Found")
            return False
        return True

    def do_GET(self) -> None:
        state = self.state
        if not self._authorised():
            return
        if self.path == "/health":
            self._json(200, {})
        elif self.path == "/v1/models":
            name = state.args.served_model_name
            self._json(200, {"object": "list", "data": [{"id": name, "object": "model"}]})
        elif self.path == "/metrics":
            raw = state.metrics().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)
        elif self.path == "/is_sleeping" and self._dev():
            self._json(200, {"is_sleeping": state.weights is None})
        else:
            self._error(404, "Not Found")

    def do_POST(self) -> None:
        state = self.state
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not self._authorised():
            return
        if self.path.startswith("/sleep") and self._dev():
            if not state.args.enable_sleep_mode:
                self._error(500, "Sleep mode is not enabled (--enable-sleep-mode)")
                return
            with state.lock:
                state.weights = None
            self._json(200, {})
        elif self.path == "/wake_up" and self._dev():
            with state.lock:
                if state.weights is None:
                    state.load()
            self._json(200, {})
        elif self.path in ("/v1/chat/completions", "/v1/completions"):
            self._chat(json.loads(raw or b"{}"))
        elif not self.path.startswith(("/sleep", "/wake_up")):
            self._error(404, "Not Found")

    def _chat(self, body: dict[str, Any]) -> None:
        state = self.state
        if body.get("model") != state.args.served_model_name:
            self._error(404, f"The model `{body.get('model')}` does not exist.")
            return
        if state.weights is None:
            self._error(503, "the engine is sleeping")
            return
        if time.monotonic() < state.chat_ready_at:
            self._error(503, "the model is loading")
            return
        raw_prompt = self.path == "/v1/completions"  # a prompt, continued as it is
        try:
            if raw_prompt:
                texts, images = [str(body.get("prompt", ""))], []
            else:
                texts, images = _read_messages(body.get("messages") or [])
        except ValueError as e:
            self._error(400, str(e))
            return
        template = 0 if raw_prompt else 4  # a chat's template adds four tokens
        prompt = len(" ".join(texts).split()) + template + sum(image_tokens(i) for i in images)
        max_tokens = int(body.get("max_tokens") or 16)
        if images:  # an echo of what arrived, cut at max_tokens
            echo = json.dumps({"prompt": "\n".join(texts), "images": images})
            words = echo.split(" ")
            pieces = [w + " " for w in words[:-1]] + [words[-1]]
            finish = "length" if len(pieces) > max_tokens else "stop"
            pieces = pieces[:max_tokens]
        else:
            pieces = [f"w{i} " if i < max_tokens - 1 else f"w{i}" for i in range(max_tokens)]
            finish = "length"
        tool = None if raw_prompt else _called_tool(body)
        if tool is not None:  # the arguments, in two pieces
            arguments = json.dumps({"echo": texts[-1] if texts else ""})
            pieces = [arguments[:10], arguments[10:]]
            finish = "tool_calls"
        with state.lock:
            state.running += 1
            state.prompt_tokens += prompt
        if body.get("stream"):
            self._stream(body, prompt, pieces, finish, tool)
            return
        text = self._generate(pieces, lambda _i, _piece: None)
        usage = {"prompt_tokens": prompt, "completion_tokens": len(pieces)}
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "finish_reason": finish}
        self._json(200, {"object": "chat.completion", "choices": [choice], "usage": usage})

    def _generate(self, pieces: list[str], emit: Any) -> str:
        """The tokens, one every --token-delay-s; the request stops running
        before its last chunk is sent (as a scrape after the answer sees)."""
        sent = []
        try:
            for i, piece in enumerate(pieces):
                time.sleep(self.state.args.token_delay_s)
                sent.append(piece)
                with self.state.lock:
                    self.state.generation_tokens += 1
                    if i == len(pieces) - 1:
                        self.state.running -= 1
                emit(i, piece)
        except OSError:  # the client left
            with self.state.lock:
                self.state.running -= 1
        return "".join(sent)

    def _stream(
        self, body: dict[str, Any], prompt: int, pieces: list[str], finish: str, tool: str | None
    ) -> None:
        options = body.get("stream_options") or {}
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def send(event: dict[str, Any] | str) -> None:
            data = event if isinstance(event, str) else json.dumps(event)
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()

        def usage(done: int) -> dict[str, int]:
            return {
                "prompt_tokens": prompt,
                "completion_tokens": done,
                "total_tokens": prompt + done,
            }

        raw_prompt = self.path == "/v1/completions"

        def emit(i: int, piece: str) -> None:
            last = i == len(pieces) - 1
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish if last else None}
            if raw_prompt:  # a completion's chunks carry text, a chat's a delta
                choice["text"] = piece
            elif tool is not None:
                call: dict[str, Any] = {"index": 0, "function": {"arguments": piece}}
                if i == 0:
                    call |= {"id": "chatcmpl-tool-1", "type": "function"}
                    call["function"]["name"] = tool
                choice["delta"] = {"tool_calls": [call]}
            else:
                choice["delta"] = {"content": piece}
            if body.get("logprobs") and not raw_prompt:  # -0.5 each; alternatives lower
                token = {"token": piece, "logprob": -0.5, "bytes": list(piece.encode())}
                alternatives = [
                    {"token": f"x{k}", "logprob": -1.0 - k, "bytes": list(f"x{k}".encode())}
                    for k in range(int(body.get("top_logprobs") or 0))
                ]
                choice["logprobs"] = {"content": [{**token, "top_logprobs": alternatives}]}
            elif body.get("logprobs") is not None and raw_prompt:  # the legacy form, as vLLM's
                tops = {piece: -0.5} | {f"x{k}": -1.0 - k for k in range(body["logprobs"] - 1)}
                choice["logprobs"] = {
                    "tokens": [piece],
                    "token_logprobs": [-0.5],
                    "top_logprobs": [tops],
                    "text_offset": [0],
                }
            kind = "text_completion" if raw_prompt else "chat.completion.chunk"
            chunk: dict[str, Any] = {"object": kind, "choices": [choice]}
            if options.get("continuous_usage_stats"):
                chunk["usage"] = usage(i + 1)
            send(chunk)

        self._generate(pieces, emit)
        if options.get("include_usage"):
            send({"object": "chat.completion.chunk", "choices": [], "usage": usage(len(pieces))})
        send("[DONE]")


def _called_tool(body: dict[str, Any]) -> str | None:
    """The function a chat must call: the one named, or the first tool's where
    the choice is ``required``; None where none must be called."""
    tools, choice = body.get("tools") or [], body.get("tool_choice")
    if isinstance(choice, dict):
        return str(choice["function"]["name"])
    if choice == "required" and tools:
        return str(tools[0]["function"]["name"])
    return None


def _read_messages(messages: list[Any]) -> tuple[list[str], list[dict[str, int]]]:
    """The messages' texts, and what each image part carried: its bytes and,
    for a PNG, its size. Content is a string or OpenAI's parts; an image
    must be a base64 ``data:`` URL (the fake fetches nothing)."""
    texts: list[str] = []
    images: list[dict[str, int]] = []
    for message in messages:
        if message.get("role") == "tool" and not message.get("tool_call_id"):
            raise ValueError("a tool message needs its tool_call_id")
        content = message.get("content")
        if not isinstance(content, list):
            texts.append(str(content or ""))
            continue
        for part in content:
            if part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            elif part.get("type") == "image_url":
                url = str((part.get("image_url") or {}).get("url", ""))
                header, _, data = url.partition(",")
                if not (header.startswith("data:") and header.endswith(";base64")):
                    raise ValueError(f"image_url must be a base64 data: URL, got {url[:40]!r}")
                images.append(_image_facts(base64.b64decode(data)))
            else:
                raise ValueError(f"unknown content part {part.get('type')!r}")
    return texts, images


def _image_facts(raw: bytes) -> dict[str, int]:
    """An image's byte size, and its width and height when it is a PNG."""
    facts = {"bytes": len(raw)}
    if raw.startswith(b"\x89PNG\r\n\x1a\n") and raw[12:16] == b"IHDR":
        facts["width"], facts["height"] = struct.unpack(">II", raw[16:24])
    return facts


def image_tokens(facts: dict[str, int]) -> int:
    """The fake's prompt tokens of an image: one per 32 x 32 block, at least one."""
    return max(1, (facts.get("width", 0) // 32) * (facts.get("height", 0) // 32))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enable-sleep-mode", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--weights-mib", type=int, default=48)
    parser.add_argument("--token-delay-s", type=float, default=0.005)
    parser.add_argument("--load-delay-s", type=float, default=0.0)
    parser.add_argument("--chat-ready-after-s", type=float, default=0.0)
    parser.add_argument("--engine-core-child", action="store_true")
    args = parser.parse_args()
    if not 0 < args.gpu_memory_utilization <= 1:
        parser.error("--gpu-memory-utilization must be in (0, 1]")
    args.served_model_name = args.served_model_name or args.model
    if args.engine_core_child:
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    Handler.state = State(args)
    time.sleep(args.load_delay_s)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    Handler.state.chat_ready_at = time.monotonic() + args.chat_ready_after_s
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
