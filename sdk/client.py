"""``Client`` and ``AsyncClient``: one httpx connection pool each, closed by ``close()`` or by
leaving the ``with`` block."""

from __future__ import annotations

import warnings
from typing import Any, Awaitable, Callable

import httpx

from foretell.sdk._config import resolve_config
from foretell.sdk._transport import DEFAULT_TIMEOUT, AsyncTransport, RetryPolicy, SyncTransport
from foretell.sdk.errors import ForetellWarning
from foretell.sdk.resources import AsyncChat, AsyncCompletions, AsyncModels, Chat, Completions, Models


class _ClientBase:
    def __init__(self, base_url: str | None, api_key: str | None, server: str,
                 max_retries: int, retry_policy: RetryPolicy | None):
        self._config = resolve_config(base_url, api_key, server)
        self._policy = retry_policy or RetryPolicy(max_retries=max_retries)
        self._warned: set[str] = set()

    @property
    def base_url(self) -> str:
        return self._config.base_url

    @property
    def server_kind(self) -> str | None:
        """'foretell' or 'openai-compatible' once known (from the ``server=`` argument, the host,
        or the headers of a response), else None."""
        return self._transport.kind

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, ForetellWarning, stacklevel=5)

    def __repr__(self) -> str:  # never the API key
        return (f"{type(self).__name__}(base_url={self.base_url!r}, server={self._config.server!r}, "
                f"max_retries={self._policy.max_retries})")


class Client(_ClientBase):
    """A synchronous client for the foretell proxy, OpenAI, or any OpenAI-compatible server.

    ``base_url`` / ``api_key``: arguments, else ``FORETELL_BASE_URL`` / ``FORETELL_API_KEY``, else
    ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``, else ``http://127.0.0.1:8000/v1`` and no key.
    ``server``: "auto" (learn from the ``x-foretell-version`` header), "foretell" or
    "openai-compatible". ``timeout``: seconds or an ``httpx.Timeout`` (default 600 s, connect
    10 s). ``http_client``: your own ``httpx.Client`` (not closed by this client). ``sleep``:
    how retries wait (tests pass a recorder).
    """

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *,
                 server: str = "auto", timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
                 max_retries: int = 2, retry_policy: RetryPolicy | None = None,
                 default_headers: dict[str, str] | None = None,
                 http_client: httpx.Client | None = None,
                 sleep: Callable[[float], None] | None = None):
        super().__init__(base_url, api_key, server, max_retries, retry_policy)
        self._owns_http = http_client is None
        self._http = http_client or httpx.Client()
        self._transport = SyncTransport(self._config, self._policy, timeout, default_headers,
                                        self._http, sleep)
        self.chat = Chat(self)
        self.completions = Completions(self)
        self.models = Models(self)

    def detect_server(self) -> str:
        """'foretell' or 'openai-compatible' (asks the server once when not yet known)."""
        return self._transport.server_kind()

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class AsyncClient(_ClientBase):
    """The asyncio twin of ``Client``: the same arguments, ``await`` on every call, streams are
    ``async for`` iterators; ``http_client`` is an ``httpx.AsyncClient`` and ``sleep`` a
    coroutine function."""

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *,
                 server: str = "auto", timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
                 max_retries: int = 2, retry_policy: RetryPolicy | None = None,
                 default_headers: dict[str, str] | None = None,
                 http_client: httpx.AsyncClient | None = None,
                 sleep: Callable[[float], Awaitable[None]] | None = None):
        super().__init__(base_url, api_key, server, max_retries, retry_policy)
        self._owns_http = http_client is None
        self._http = http_client or httpx.AsyncClient()
        self._transport = AsyncTransport(self._config, self._policy, timeout, default_headers,
                                         self._http, sleep)
        self.chat = AsyncChat(self)
        self.completions = AsyncCompletions(self)
        self.models = AsyncModels(self)

    async def detect_server(self) -> str:
        return await self._transport.server_kind()

    async def close(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()
