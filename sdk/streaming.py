"""Server-sent events into typed chunks.

``Stream`` / ``AsyncStream`` are plain (async) iterators over one open HTTP response. The
response is closed when the events end, when an error is raised, when the caller calls
``close()`` / leaves a ``with`` block, or when a sync ``Stream`` is garbage-collected (an
``AsyncStream`` cannot close itself there: use ``async with`` or ``await close()``); closing
early drops the connection, which makes the foretell proxy cancel the generation.

An ``error`` event after the stream started raises the typed error (``APIStatusError`` subclass
with ``during_stream=True``) after the chunks before it were delivered. A connection that breaks
mid-stream raises ``APIConnectionError``; nothing is retried once a chunk was delivered. A call's
``deadline`` runs on while the stream is read: past it, ``APITimeoutError``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Generic, Iterator, TypeVar

import httpx

from foretell.sdk._deadline import Deadline, within
from foretell.sdk.errors import APIConnectionError, ForetellError, redact

T = TypeVar("T")


@dataclass
class ServerSentEvent:
    data: str
    event: str | None = None
    id: str | None = None


class SSEDecoder:
    """Feed it lines without their line ending; it returns an event at each blank line that
    ends one. Comments (``:``) are skipped; several ``data:`` lines join with newlines."""

    def __init__(self) -> None:
        self._data: list[str] = []
        self._event: str | None = None
        self._id: str | None = None

    def feed(self, line: str) -> ServerSentEvent | None:
        line = line.rstrip("\r")
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            self._id = value
        return None  # "retry" and unknown fields are ignored, as the SSE spec says

    def flush(self) -> ServerSentEvent | None:
        """The pending event, if any (also used at the end of the body)."""
        if not self._data and self._event is None:
            return None
        event = ServerSentEvent("\n".join(self._data), self._event, self._id)
        self._data, self._event = [], None
        return event


class _Events:
    """What to do with each event, shared by the sync and the async stream."""

    DONE = object()

    def __init__(self, response: httpx.Response, chunk_type: type, transport,
                 deadline: Deadline | None = None) -> None:
        self.response, self.chunk_type, self.transport = response, chunk_type, transport
        self.deadline = deadline
        self.finished = False  # [DONE] or a finish_reason seen

    def handle(self, event: ServerSentEvent | None):
        """A chunk, None (nothing to deliver), or DONE; raises the typed error events."""
        if self.deadline is not None and self.deadline.expired():
            raise self.deadline.error(self.response.request)
        if event is None or not event.data:
            return None
        if event.data.strip() == "[DONE]":
            self.finished = True
            return self.DONE
        try:
            payload = json.loads(event.data)
        except ValueError:
            text = redact(event.data, self.transport.secrets)[:200]
            raise ForetellError(f"the server sent an event that is not JSON: {text!r}") from None
        if event.event == "error" or (isinstance(payload, dict) and payload.get("error") is not None):
            raise self.transport.stream_error(payload, self.response)
        chunk = self.chunk_type.from_dict(payload)
        if any(getattr(c, "finish_reason", None) for c in chunk.choices):
            self.finished = True
        return chunk

    def at_end(self) -> None:
        # A body that simply stops, without [DONE] or any finish_reason, was cut short.
        if not self.finished:
            raise APIConnectionError("the stream ended before it was complete",
                                     method=self.response.request.method, url=str(self.response.request.url))

    def broken(self, error: httpx.TransportError) -> APIConnectionError:
        if self.deadline is not None and self.deadline.expired():
            # The deadline's timer shut the socket, or a read's cut timeout ran out.
            return self.deadline.error(self.response.request)
        return self.transport.connection_error(error, self.response.request)

    def release(self) -> None:
        if self.deadline is not None:
            self.deadline.release()


class Stream(Generic[T]):
    """An iterator of typed chunks; usable as a context manager."""

    def __init__(self, response: httpx.Response, chunk_type: type, transport,
                 deadline: Deadline | None = None) -> None:
        self.response = response
        self._events = _Events(response, chunk_type, transport, deadline)
        self._iterator = self._iterate()

    @property
    def request_id(self) -> str | None:
        return self.response.headers.get("x-request-id")

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        return next(self._iterator)

    def _iterate(self) -> Iterator[T]:
        events = self._events
        decoder = SSEDecoder()
        try:
            try:
                for line in self.response.iter_lines():
                    item = events.handle(decoder.feed(line))
                    if item is events.DONE:
                        return
                    if item is not None:
                        yield item
                item = events.handle(decoder.flush())
                if item is not None and item is not events.DONE:
                    yield item
            except httpx.TransportError as error:
                raise events.broken(error) from None
            events.at_end()
        finally:
            events.release()
            self.response.close()

    def close(self) -> None:
        """Stop early: closes the generator and the connection."""
        self._iterator.close()
        self._events.release()
        self.response.close()

    def __del__(self) -> None:
        # A stream dropped before (or while) it was read: its generator's ``finally`` may never
        # run, so close the response here rather than leave the proxy generating.
        response = self.__dict__.get("response")
        if response is not None:
            response.close()

    def __enter__(self) -> "Stream[T]":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class AsyncStream(Generic[T]):
    """An async iterator of typed chunks; usable as an async context manager."""

    def __init__(self, response: httpx.Response, chunk_type: type, transport,
                 deadline: Deadline | None = None) -> None:
        self.response = response
        self._events = _Events(response, chunk_type, transport, deadline)
        self._iterator = self._iterate()

    @property
    def request_id(self) -> str | None:
        return self.response.headers.get("x-request-id")

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        return await self._iterator.__anext__()

    async def _iterate(self) -> AsyncIterator[T]:
        events = self._events
        decoder = SSEDecoder()
        lines = self.response.aiter_lines()
        try:
            try:
                while True:
                    try:
                        # Each wait ends at the deadline, if the call has one.
                        line = await within(events.deadline, self.response.request, lines.__anext__())
                    except StopAsyncIteration:
                        break
                    item = events.handle(decoder.feed(line))
                    if item is events.DONE:
                        return
                    if item is not None:
                        yield item
                item = events.handle(decoder.flush())
                if item is not None and item is not events.DONE:
                    yield item
            except httpx.TransportError as error:
                raise events.broken(error) from None
            events.at_end()
        finally:
            await self.response.aclose()

    async def close(self) -> None:
        await self._iterator.aclose()
        await self.response.aclose()

    async def __aenter__(self) -> "AsyncStream[T]":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()
