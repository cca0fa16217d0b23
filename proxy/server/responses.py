"""What the generation routes write: OpenAI's completion and chat bodies and stream chunks, usage,
foretell's ``speculation`` report, server-sent-event framing, the error event and ``[DONE]``.

The local engine's path (``local_generation.py``), the echo path (``echo.py``) and remote
verification (``remote_verify/``) all shape their answers here, so a field means the same
whichever path answered.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from typing import AsyncIterator

from fastapi.responses import Response, StreamingResponse

from foretell.proxy.server.api_error import APIError

DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client hung up mid-generation: nobody reads the rest, so nothing more is written."""


def sse(payload) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


class ClientWatch:
    """Whether a request's client is still there, asked of the server at most every
    ``CLIENT_CHECK_SECONDS`` however often the generation asks (local and remote alike)."""

    CLIENT_CHECK_SECONDS = 0.25

    def __init__(self, request):
        self.request = request
        self.checked_at = 0.0

    async def check(self) -> None:
        """Raise ClientGone once the client has hung up."""
        if time.monotonic() - self.checked_at < self.CLIENT_CHECK_SECONDS:
            return
        self.checked_at = time.monotonic()
        if await self.request.is_disconnected():
            raise ClientGone


def client_gone() -> Response:
    """The answer to a request whose client went away before its body was ready."""
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


# ---- usage and the speculation report --------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int, *, cached_tokens: int = 0, accepted: int = 0,
          rejected: int = 0) -> dict:
    """OpenAI's usage object; ``accepted`` and ``rejected`` are prediction tokens as OpenAI counts them."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "completion_tokens_details": {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": rejected,
            "reasoning_tokens": 0,
        },
    }


def engine_usage(stats, completion_tokens: int | None = None) -> dict:
    """The usage of a local generation from its ``GenerationStats`` (``completion_tokens``: the
    sum over ``n`` choices, where there are several)."""
    return usage(stats.prompt_tokens, stats.completion_tokens if completion_tokens is None else completion_tokens,
                 cached_tokens=stats.cached_tokens, accepted=stats.accepted_prediction_tokens,
                 rejected=stats.rejected_prediction_tokens)


def speculation_report(result) -> dict:
    """foretell's per-request speculation report (an extension field of the response), with the
    seed a sampled request ran with (its own, or a fresh one to replay it with)."""
    return {**result.stats.speculation_report(), "seed": result.seed}


def finish_reason(result, called: bool = False) -> str:
    """OpenAI's finish reason of a result; ``called``: the answer made tool calls."""
    if result.finish_reason == "length":
        return "length"
    return "tool_calls" if called else "stop"


# ---- bodies and chunks ------------------------------------------------------------------------

class Shape:
    """The bodies and stream chunks of one request: its id, creation time and model, in the chat
    or the completion shape."""

    def __init__(self, model: str, is_chat: bool):
        self.model, self.is_chat = model, is_chat
        self.id = ("chatcmpl-" if is_chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def choice(self, index: int, text: str, finish: str, logprobs=None, tool_calls: list | None = None) -> dict:
        """A choice of the whole body; ``tool_calls``: a chat answer's calls (its content is then
        null unless it has text besides)."""
        if self.is_chat:
            message = {"role": "assistant", "content": text}
            if tool_calls:
                message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def body(self, choices: list[dict], usage: dict, speculation: dict) -> dict:
        return {"id": self.id, "object": "chat.completion" if self.is_chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": usage,
                "speculation": speculation}

    def chunk(self, text: str | dict | None, logprobs=None, finish: str | None = None,
              extra: dict | None = None) -> bytes:
        """A stream chunk of the (only) choice; ``text`` None is an empty chat delta, a dict a
        chat delta of its own (a tool call's, ``tool_calls/parser.py``)."""
        if self.is_chat:
            delta = text if isinstance(text, dict) else {"content": text} if text is not None else {}
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return self._event([choice], extra)

    def role_chunk(self) -> bytes:
        """A chat stream's first chunk: the assistant's role, no text yet."""
        return self._event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def finish_chunk(self, finish: str) -> bytes:
        return self.chunk(None, finish=finish)

    def usage_chunk(self, usage: dict, speculation: dict) -> bytes:
        """The chunk ``stream_options.include_usage`` asks for: no choices, the usage."""
        return self._event([], {"usage": usage, "speculation": speculation})

    def _event(self, choices: list[dict], extra: dict | None = None) -> bytes:
        payload = {"id": self.id, "object": "chat.completion.chunk" if self.is_chat else "text_completion",
                   "created": self.created, "model": self.model, "choices": choices}
        if extra:
            payload.update(extra)
        return sse(payload)


# ---- streams ----------------------------------------------------------------------------------

async def text_chunks(shape: Shape, pieces: AsyncIterator[tuple], ending, include_usage: bool
                      ) -> AsyncIterator[bytes]:
    """A generation's stream, whichever path generates it: the role (chat), a chunk for each of
    ``pieces`` (``(text, logprobs, extra)`` as they are confirmed; text a dict for a chat delta
    other than content) that has text or logprobs, then
    the finish and, where asked, the usage. ``await ending()`` gives ``(finish_reason, usage,
    report)`` once the pieces are done; it is awaited whether the usage was asked for or not
    (it also reports the request's figures)."""
    async with contextlib.aclosing(pieces):
        if shape.is_chat:
            yield shape.role_chunk()
        async for text, logprobs, extra in pieces:
            if text or logprobs:
                yield shape.chunk(text, logprobs, extra=extra)
    finish, usage_body, report = await ending()
    yield shape.finish_chunk(finish)
    if include_usage:
        yield shape.usage_chunk(usage_body, report)


async def event_stream(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A response's chunks as an event stream ending with ``[DONE]``. The status line is long sent
    when a stream fails, so an ``APIError`` raised by ``chunks`` becomes an error event (then
    ``[DONE]``); ``ClientGone`` ends the stream with nothing more."""
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                yield chunk
        except APIError as error:
            yield sse(error.body())
            yield DONE
            return
        except ClientGone:
            return
    yield DONE


def stream_response(chunks: AsyncIterator[bytes], headers: dict | None = None) -> StreamingResponse:
    return StreamingResponse(event_stream(chunks), media_type="text/event-stream", headers=headers)
