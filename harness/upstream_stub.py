"""A small real OpenAI-compatible server for forwarding tests: it records what it receives and
answers by model name ("...-500" fails, "...-slow" stalls, anything else answers).

Misbehaving upstreams, by model name: "leak-4xx", "leak-5xx", "leak-stream" and "leak-redirect"
echo the Authorization header they received (in a JSON error, a text error, a stream event split
across two network chunks, a Location header); "gzip-stream" compresses its event stream whatever
was asked; "die-stream" breaks the connection after its first event.

An echo model for remote verification, by model names starting with "echo-": a word-level model
whose greedy output after the prompt ``ECHO_PROMPT`` is ``ECHO_GOLD``, then the end (tokens are
words with their leading space; a ``<s>`` BOS starts every prompt and, as in vLLM, counts in
``text_offset``). It answers echo requests with prompt logprobs (token strings, no token ids),
plain requests and plain streams. Misbehaving variants: "echo-shifted" (text_offset shifted by
one from the middle), "echo-no-top" (no top_logprobs), "echo-500-mid" (every second echo
request gets a 500: a request's first verify is answered, its second fails), "echo-drop" (echo answers break off mid-body), "echo-all-fail"
(every echo request gets a 500 and every stream breaks off after two tokens).

Model names starting with "gate-" reach a real server (``app.state.relay_base``) through an
upstream that refuses prompts of token ids."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import threading
import time
import zlib

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_stub() -> tuple[FastAPI, list]:
    app = FastAPI()
    received: list[dict] = []
    echo_calls: dict[str, int] = {}  # echo requests answered, per model

    async def answer(request: Request, kind: str):
        body = await request.json()
        received.append({"path": request.url.path, "headers": dict(request.headers), "body": body})
        model = body.get("model", "")
        misbehaving = _misbehave(model, request.headers.get("authorization", ""))
        if misbehaving is not None:
            return misbehaving
        if model.startswith("echo-") and kind == "completion":
            return _echo_model(model, body, echo_calls)
        if model.startswith("gate-") and kind == "completion":
            return await _text_prompts_only(request.app.state.relay_base, body)
        if model.endswith("-500"):
            return JSONResponse({"error": {"message": "upstream exploded"}}, status_code=500)
        if model.endswith("-slow"):
            await asyncio.sleep(5)
        if model.endswith("-400"):
            return JSONResponse({"error": {"message": "bad thing", "type": "invalid_request_error",
                                           "param": None, "code": None}}, status_code=400)
        if body.get("stream"):
            async def events():
                for word in ["Hello", " from", " upstream"]:
                    chunk = {"id": "up-1", "object": "chat.completion.chunk", "created": 0, "model": model,
                             "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                    await asyncio.sleep(0.05)
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        if kind == "chat":
            return {"id": "up-1", "object": "chat.completion", "created": 0, "model": model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello from upstream"},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}
        return {"id": "up-1", "object": "text_completion", "created": 0, "model": model,
                "choices": [{"index": 0, "text": "Hello from upstream", "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await answer(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, "completion")

    return app, received


def _event(model: str, text: str) -> str:
    chunk = {"id": "up-1", "object": "chat.completion.chunk", "created": 0, "model": model,
             "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return f"data: {json.dumps(chunk)}\n\n"


def _misbehave(model: str, authorization: str):
    key = authorization.removeprefix("Bearer ")
    if model == "leak-4xx":
        return JSONResponse({"error": {"message": f"rejected header {authorization!r}", "type": "invalid_request_error",
                                       "param": None, "code": None}}, status_code=401)
    if model == "leak-5xx":
        return PlainTextResponse(f"crashed while handling Authorization: {authorization}", status_code=503)
    if model == "leak-redirect":
        return Response(status_code=307, headers={"location": f"https://elsewhere.example/v1?key={key}",
                                                  "x-echo-authorization": authorization})
    if model == "leak-stream":
        head, tail = _event(model, f"you sent {authorization}").split(key[: len(key) // 2], 1)

        async def split_events():
            yield head + key[: len(key) // 2]  # the key split between two network chunks
            await asyncio.sleep(0.1)
            yield tail
            yield "data: [DONE]\n\n"
        return StreamingResponse(split_events(), media_type="text/event-stream")
    if model == "gzip-stream":
        async def gzipped():
            compressor = zlib.compressobj(wbits=31)  # gzip framing
            for word in ["Hello", " from", " upstream"]:
                yield compressor.compress(_event(model, word).encode()) + compressor.flush(zlib.Z_SYNC_FLUSH)
                await asyncio.sleep(0.05)
            yield compressor.compress(b"data: [DONE]\n\n") + compressor.flush()
        return StreamingResponse(gzipped(), media_type="text/event-stream", headers={"content-encoding": "gzip"})
    if model == "die-stream":
        async def dying():
            yield _event(model, "Hello")
            await asyncio.sleep(0.05)
            yield 'data: {"id": "up-1", "choi'  # half an event, then the connection drops
            await asyncio.sleep(0.05)
            raise ConnectionAbortedError("the upstream died")
        return StreamingResponse(dying(), media_type="text/event-stream")
    return None


# ---- an upstream that takes only text prompts ---------------------------------------------------------

async def _text_prompts_only(base: str, body: dict):
    """Refuse a prompt of token ids (400, as an OpenAI-compatible server without them would);
    relay anything else to the real server at ``base`` (``app.state.relay_base``) as the model
    named after "gate-", streams included."""
    if isinstance(body.get("prompt"), list):
        return JSONResponse({"error": {"message": "prompt must be a string", "type": "invalid_request_error",
                                       "param": "prompt", "code": None}}, status_code=400)
    client = httpx.AsyncClient(timeout=120)
    response = await client.send(client.build_request(
        "POST", base + "/completions", json={**body, "model": body["model"][len("gate-"):]}), stream=True)

    async def relay():
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        finally:
            await response.aclose()
            await client.aclose()

    return StreamingResponse(relay(), status_code=response.status_code,
                             media_type=response.headers.get("content-type"))


# ---- the echo model ---------------------------------------------------------------------------------

ECHO_PROMPT = "List:"
ECHO_GOLD = (" alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho"
             " sigma tau upsilon phi chi psi omega")
ECHO_BOS = "<s>"
_ECHO_TOKEN = re.compile(r"\s*\S+|\s+")
_GOLD_ENDS = {m.end() for m in _ECHO_TOKEN.finditer(ECHO_GOLD)}


def echo_tokens(text: str) -> list[str]:
    return _ECHO_TOKEN.findall(text)


def echo_next(text: str) -> str:
    """The echo model's greedy next token after ``text`` (without the BOS); "" is the end."""
    if not text.startswith(ECHO_PROMPT):
        return ""
    written = text[len(ECHO_PROMPT):]
    if not ECHO_GOLD.startswith(written) or (written and len(written) not in _GOLD_ENDS):
        return ""
    rest = ECHO_GOLD[len(written):]
    return _ECHO_TOKEN.match(rest).group() if rest else ""


def echo_greedy(prompt: str, max_tokens: int) -> tuple[list[str], str]:
    """(tokens, finish_reason) of the echo model's greedy output; the end token is ""."""
    tokens, text = [], prompt
    while len(tokens) < max_tokens:
        token = echo_next(text)
        tokens.append(token)
        if not token:
            return tokens, "stop"
        text += token
    return tokens, "length"


def _echo_model(model: str, body: dict, calls: dict):
    prompt = body.get("prompt", "")
    max_tokens = body.get("max_tokens") if body.get("max_tokens") is not None else 16
    if body.get("echo"):
        calls[model] = calls.get(model, 0) + 1
        if model == "echo-all-fail" or (model == "echo-500-mid" and calls[model] % 2 == 0):
            return JSONResponse({"error": {"message": "echo exploded"}}, status_code=500)
        answer = _echo_answer(model, prompt)
        if model == "echo-drop":
            raw = json.dumps(answer)

            async def breaking():
                yield raw[: len(raw) // 2]
                await asyncio.sleep(0.05)
                raise ConnectionAbortedError("the upstream died")
            return StreamingResponse(breaking(), media_type="application/json")
        return answer
    tokens, finish = echo_greedy(prompt, max_tokens)
    if not body.get("stream"):
        return {"id": "up-echo", "object": "text_completion", "created": 0, "model": model,
                "choices": [{"index": 0, "text": "".join(tokens), "logprobs": None, "finish_reason": finish}],
                "usage": {"prompt_tokens": len(echo_tokens(prompt)) + 1, "completion_tokens": len(tokens),
                          "total_tokens": len(echo_tokens(prompt)) + 1 + len(tokens)}}

    async def events():
        for index, token in enumerate(tokens):
            if model == "echo-all-fail" and index == 2:
                yield 'data: {"id": "up-echo", "choi'
                await asyncio.sleep(0.05)
                raise ConnectionAbortedError("the upstream died")
            choice = {"index": 0, "text": token, "logprobs": {"tokens": [token], "token_logprobs": [-0.5],
                                                              "top_logprobs": [None], "text_offset": [0]},
                      "finish_reason": finish if index == len(tokens) - 1 else None}
            yield "data: " + json.dumps({"id": "up-echo", "object": "text_completion", "created": 0,
                                         "model": model, "choices": [choice]}) + "\n\n"
            await asyncio.sleep(0.005)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(echo_tokens(prompt)) + 1, "completion_tokens": len(tokens),
                     "total_tokens": len(echo_tokens(prompt)) + 1 + len(tokens)}
            yield "data: " + json.dumps({"id": "up-echo", "object": "text_completion", "created": 0,
                                         "model": model, "choices": [], "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")


def _echo_answer(model: str, prompt: str) -> dict:
    """An echo answer over ``prompt`` (max_tokens 1, logprobs 1), vLLM's shape, token strings."""
    tokens = [ECHO_BOS] + echo_tokens(prompt)
    logprobs, tops, offsets, at = [None], [None], [], 0
    for index, token in enumerate(tokens):
        offsets.append(at)
        at += len(token)
        if index == 0:
            continue
        before = "".join(tokens[1:index])
        # Inside the prompt the model follows the prompt; after it, its greedy choice ("" ends).
        best = echo_next(before) if before.startswith(ECHO_PROMPT) else token
        top = {best: -0.5}
        if token != best:
            top[token] = -3.0
        logprobs.append(top[token])
        tops.append(top)
    generated = echo_next(prompt)
    tokens.append(generated)
    logprobs.append(-0.5)
    tops.append({generated: -0.5})
    offsets.append(at)
    if model == "echo-shifted":
        offsets = [o + 1 if i >= len(offsets) // 2 else o for i, o in enumerate(offsets)]
    if model == "echo-no-top":
        tops = [None] * len(tops)
    return {"id": "up-echo", "object": "text_completion", "created": 0, "model": model,
            "choices": [{"index": 0, "text": prompt + generated, "finish_reason": "length" if generated else "stop",
                         "logprobs": {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops,
                                      "text_offset": offsets}}],
            "usage": {"prompt_tokens": len(tokens) - 1, "completion_tokens": 1, "total_tokens": len(tokens)}}


class StubServer:
    def __init__(self, log_level: str = "error"):
        self.app, self.received = build_stub()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))  # held from here: no other server can take the port
        self.port = self.sock.getsockname()[1]
        # No log_config: uvicorn's dictConfig would set its loggers' levels for every server in
        # the process (the tests' in-process foretell servers too). Its records come from the
        # "stub-upstream" thread, which tests/serving.py's LogRecords leaves out of a server's log.
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_config=None, timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="stub-upstream", daemon=True)
        self.quiet = _QuietBelow(logging.getLevelName(log_level.upper()), self.thread.name)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self):
        logging.getLogger("uvicorn.error").addFilter(self.quiet)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("stub upstream did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
        logging.getLogger("uvicorn.error").removeFilter(self.quiet)


class _QuietBelow(logging.Filter):
    """Drops the stub's own uvicorn records below ``level`` ("die-stream" fails on purpose)."""

    def __init__(self, level: int, thread_name: str):
        super().__init__()
        self.level, self.thread_name = level, thread_name

    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName != self.thread_name or record.levelno >= self.level
