"""Keeps the upstream keys out of everything the proxy relays to clients or writes to logs.

An upstream may echo the request's ``Authorization`` header back: in an error body, in a stream
event, in a header. Every configured route key is replaced by ``[redacted]`` wherever the proxy
relays or quotes upstream text. A stream arrives in network chunks that may split a key in two,
so a relay holds back the end of each chunk that could be the start of a key until the next chunk
shows whether it is (``held_back``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from urllib.parse import quote

MARKER = "[redacted]"


class Redactor:
    def __init__(self, keys: Iterable[str | None]):
        forms = set()
        for key in keys:
            if key:
                # As sent, and as it reads once quoted into a URL or escaped into JSON.
                forms |= {key, quote(key, safe=""), json.dumps(key)[1:-1]}
        # Longest first, so that a key holding another key is replaced whole.
        self._texts = sorted(forms, key=len, reverse=True)
        self._bytes = [form.encode() for form in self._texts]

    def bytes(self, data: bytes) -> bytes:
        for key in self._bytes:
            data = data.replace(key, MARKER.encode())
        return data

    def text(self, text: str) -> str:
        for key in self._texts:
            text = text.replace(key, MARKER)
        return text

    def held_back(self, data: bytes) -> int:
        """How many bytes at the end of ``data`` could be the beginning of a key (at most the
        longest key's length - 1): a relay keeps them until more data arrives."""
        longest = len(self._bytes[0]) if self._bytes else 0
        for size in range(min(len(data), longest - 1), 0, -1):
            end = data[-size:]
            if any(key.startswith(end) for key in self._bytes):
                return size
        return 0
