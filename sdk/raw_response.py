"""``RawResponse``: what ``client.with_raw_response...`` returns.

As in the openai package: the HTTP side of an answer (status, headers, the request that was
sent) for callers that need a header such as ``x-request-id`` or a rate-limit count, and
``.parse()`` for the object the plain call would have returned. Errors are raised as usual, so a
``RawResponse`` always holds a success.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Generic, TypeVar

import httpx

T = TypeVar("T")
_UNPARSED = object()


class RawResponse(Generic[T]):
    def __init__(self, response: httpx.Response, parse: Callable[[], T]):
        self.http_response = response
        self._parse = parse
        self._parsed: Any = _UNPARSED

    def parse(self) -> T:
        """The typed object (``ChatCompletion``, ``Completion``, ``ModelList``) or, for
        ``stream=True``, the ``Stream`` / ``AsyncStream`` to iterate. Made once: later calls
        return the same object."""
        if self._parsed is _UNPARSED:
            self._parsed = self._parse()
        return self._parsed

    @property
    def headers(self) -> httpx.Headers:
        return self.http_response.headers

    @property
    def status_code(self) -> int:
        return self.http_response.status_code

    @property
    def http_request(self) -> httpx.Request:
        """The request as sent (its ``authorization`` header holds the API key)."""
        return self.http_response.request

    @property
    def url(self) -> httpx.URL:
        return self.http_response.request.url

    @property
    def method(self) -> str:
        return self.http_response.request.method

    @property
    def http_version(self) -> str:
        return self.http_response.http_version

    @property
    def request_id(self) -> str | None:
        return self.http_response.headers.get("x-request-id")

    @property
    def content(self) -> bytes:
        """The body (not for a stream, whose body is read by iterating ``parse()``)."""
        return self.http_response.content

    @property
    def text(self) -> str:
        return self.http_response.text

    def json(self) -> Any:
        return json.loads(self.content)

    def __repr__(self) -> str:
        return f"<RawResponse [{self.status_code}] {self.method} {self.url}>"
