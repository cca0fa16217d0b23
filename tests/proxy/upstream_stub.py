"""A small real OpenAI-compatible server for forwarding tests: it records what it receives and
answers by model name ("...-500" fails, "...-slow" stalls, anything else answers).

Misbehaving upstreams, by model name: "leak-4xx", "leak-5xx", "leak-stream" and "leak-redirect"
echo the Authorization header they received (in a JSON error, a text error, a stream event split
across two network chunks, a Location header); "gzip-stream" compresses its event stream whatever
was asked; "die-stream" breaks the connection after its first event."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import zlib

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

    async def answer(request: Request, kind: str):
        body = await request.json()
        received.append({"path": request.url.path, "headers": dict(request.headers), "body": body})
        model = body.get("model", "")
        misbehaving = _misbehave(model, request.headers.get("authorization", ""))
        if misbehaving is not None:
            return misbehaving
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


class StubServer:
    def __init__(self, log_level: str = "error"):
        self.app, self.received = build_stub()
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level=log_level))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self):
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
