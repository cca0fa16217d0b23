"""Response factories for the scripted servers of the offline tests."""

from __future__ import annotations

import json

import httpx

KEY = "sk-secret-test-key-0123456789"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def headers(foretell: bool = True, **extra: str) -> dict:
    base = {"x-request-id": "req-abc"}
    if foretell:
        base["x-foretell-version"] = "0.1.0"
    return {**base, **{k.replace("_", "-"): v for k, v in extra.items()}}


def answer(status: int = 200, body=None, *, foretell: bool = True, **extra_headers: str):
    body = completion() if body is None else body
    return lambda request: httpx.Response(status, json=body, headers=headers(foretell, **extra_headers))


def error(status: int, message: str = "nope", *, type: str = "invalid_request_error",
          code=None, param=None, foretell: bool = True, **extra_headers: str):
    return answer(status, {"error": {"message": message, "type": type, "code": code, "param": param}},
                  foretell=foretell, **extra_headers)


def completion(text: str = "hello", **extra) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                      "completion_tokens_details": {"accepted_prediction_tokens": 2,
                                                    "rejected_prediction_tokens": 1}},
            **extra}


def chunk(text: str | None = None, finish: str | None = None, **extra) -> dict:
    delta = {"content": text} if text is not None else {}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}


def sse(payload) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


class Body(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A response body sent in parts, that can fail after them and records being closed."""

    def __init__(self, parts: list[bytes], fail: Exception | None = None):
        self.parts, self.fail, self.closed, self.sent = parts, fail, False, 0

    def __iter__(self):
        for part in self.parts:
            self.sent += 1
            yield part
        if self.fail is not None:
            raise self.fail

    async def __aiter__(self):
        for part in self.__iter__():
            yield part

    def close(self) -> None:
        self.closed = True

    async def aclose(self) -> None:
        self.closed = True


def streamed(body: Body, *, foretell: bool = True):
    return lambda request: httpx.Response(
        200, stream=body, headers={**headers(foretell), "content-type": "text/event-stream"})
