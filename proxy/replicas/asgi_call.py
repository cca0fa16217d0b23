"""An HTTP request carried from the ingress to a replica, and answered there by calling the
replica's ``foretell serve`` app in-process (ASGI), so every route, check and error of a single
server holds unchanged behind the ingress. The answer comes back as a ``ResponseStart`` and then
the body's chunks, so streams stay streams."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


@dataclass
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None
    server: tuple[str, int] | None = None
    block_hashes: list[int] = field(default_factory=list)  # the prefix-affinity hint (routing.py)


@dataclass
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]]


def _scope(request: ForwardedRequest) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": request.method, "scheme": "http", "path": request.path,
            "raw_path": request.path.encode(), "query_string": request.query_string, "root_path": "",
            "headers": request.headers, "client": request.client, "server": request.server, "state": {}}


async def call_app(app, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
    """Run ``request`` through the ASGI ``app``: its ``ResponseStart``, then its body chunks. If
    the consumer stops early (its client went away), the app sees a disconnect and is cancelled."""
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()  # an app polling for a disconnect waits here until there is one
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    task = asyncio.create_task(app(_scope(request), receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    finished = False
    try:
        while True:
            message = await messages.get()
            if message is None:  # the app returned (or raised) without finishing its body
                task.result()
                return
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], list(message.get("headers", [])))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    finished = True
                    return
    finally:
        gone.set()
        if not finished:  # the consumer left mid-answer: stop the work behind it
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task  # a finished answer's app returns at once (its logging and metrics done)
