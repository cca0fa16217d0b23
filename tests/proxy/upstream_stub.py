"""A small real OpenAI-compatible server for forwarding tests: it records what it receives and
answers by model name ("...-500" fails, "...-slow" stalls, anything else answers)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


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


class StubServer:
    def __init__(self):
        self.app, self.received = build_stub()
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="error"))
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
