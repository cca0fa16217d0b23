"""``Client`` and ``AsyncClient``: one httpx connection pool each, closed by ``close()`` or by
leaving the ``with`` block."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Awaitable, Callable

import httpx

from foretell.sdk._config import resolve_config
from foretell.sdk._deadline import check_seconds
from foretell.sdk._transport import DEFAULT_TIMEOUT, AsyncTransport, RetryPolicy, SyncTransport
from foretell.sdk.errors import ForetellWarning
from foretell.sdk.resources import (
    AsyncChat,
    AsyncCompletions,
    AsyncModels,
    Chat,
    Completions,
    Models,
    RawResources,
)


class _NotGiven:
    def __repr__(self) -> str:
        return "NOT_GIVEN"


NOT_GIVEN: Any = _NotGiven()  # with_options: "keep this setting" (None is a value for some)


class _ClientBase:
    def __init__(self, base_url: str | None, api_key: str | None, server: str,
                 timeout: Any, deadline: float | None, max_retries: int,
                 retry_policy: RetryPolicy | None, default_headers: dict[str, str] | None):
        self._config = resolve_config(base_url, api_key, server)
        self._policy = retry_policy or RetryPolicy(max_retries=max_retries)
        self._timeout = timeout
        self._deadline = None if deadline is None else check_seconds(deadline)
        self._default_headers = dict(default_headers or {})
        self._warned: set[str] = set()

    @property
    def base_url(self) -> str:
        return self._config.base_url

    @property
    def max_retries(self) -> int:
        return self._policy.max_retries

    @property
    def timeout(self) -> Any:
        return self._transport.timeout

    @property
    def deadline(self) -> float | None:
        return self._deadline

    @property
    def server_kind(self) -> str | None:
        """'foretell' or 'openai-compatible' once known (from the ``server=`` argument, the host,
        or the headers of a response), else None."""
        return self._transport.kind

    def _options(self, base_url, api_key, server, timeout, deadline, max_retries, retry_policy,
                 default_headers) -> dict:
        """The constructor arguments of a copy: each given one replaces this client's."""
        def pick(value, current):
            return current if value is NOT_GIVEN else value

        policy = pick(retry_policy, self._policy)
        if max_retries is not NOT_GIVEN:
            policy = dataclasses.replace(policy, max_retries=max_retries)
        return dict(base_url=pick(base_url, self._config.base_url),
                    api_key=pick(api_key, self._config.api_key), server=pick(server, self._config.server),
                    timeout=pick(timeout, self._timeout), deadline=pick(deadline, self._deadline),
                    retry_policy=policy, default_headers=pick(default_headers, self._default_headers))

    def _adopt(self, original: "_ClientBase") -> None:
        """A copy talking to the same server keeps what the original learned about it."""
        if self._config.base_url == original._config.base_url and self._config.server == "auto":
            self._transport.kind = original._transport.kind

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
    "openai-compatible". ``timeout``: seconds or an ``httpx.Timeout`` for each network wait
    (connecting, sending, each read; default 600 s, connect 10 s): a stream that keeps sending
    runs past it. ``deadline``: seconds a whole call may take, retries and the reading of a
    stream included (default: none). ``http_client``: your own ``httpx.Client`` (not closed by
    this client). ``sleep``: how retries wait (tests pass a recorder).
    """

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *,
                 server: str = "auto", timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
                 deadline: float | None = None,
                 max_retries: int = 2, retry_policy: RetryPolicy | None = None,
                 default_headers: dict[str, str] | None = None,
                 http_client: httpx.Client | None = None,
                 sleep: Callable[[float], None] | None = None):
        super().__init__(base_url, api_key, server, timeout, deadline, max_retries, retry_policy,
                         default_headers)
        self._owns_http = http_client is None
        self._http = http_client or httpx.Client()
        self._transport = SyncTransport(self._config, self._policy, timeout, default_headers,
                                        self._http, sleep)
        self.chat = Chat(self)
        self.completions = Completions(self)
        self.models = Models(self)

    @property
    def with_raw_response(self) -> RawResources:
        """``client.with_raw_response.chat.completions.create(...)`` returns a ``RawResponse``
        (status, headers, ``.parse()``) instead of the parsed object."""
        return RawResources(self, Chat, Completions, Models)

    def with_options(self, *, base_url: str = NOT_GIVEN, api_key: str | None = NOT_GIVEN,
                     server: str = NOT_GIVEN, timeout: float | httpx.Timeout = NOT_GIVEN,
                     deadline: float | None = NOT_GIVEN, max_retries: int = NOT_GIVEN,
                     retry_policy: RetryPolicy = NOT_GIVEN,
                     default_headers: dict[str, str] = NOT_GIVEN) -> "Client":
        """A copy of this client with the given settings changed, e.g.
        ``client.with_options(timeout=30, max_retries=0).chat.completions.create(...)``. The copy
        shares this client's connection pool (closing the copy does not close it)."""
        copy = Client(**self._options(base_url, api_key, server, timeout, deadline, max_retries,
                                      retry_policy, default_headers),
                      http_client=self._http, sleep=self._transport.sleep)
        copy._adopt(self)
        return copy

    copy = with_options

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
                 deadline: float | None = None,
                 max_retries: int = 2, retry_policy: RetryPolicy | None = None,
                 default_headers: dict[str, str] | None = None,
                 http_client: httpx.AsyncClient | None = None,
                 sleep: Callable[[float], Awaitable[None]] | None = None):
        super().__init__(base_url, api_key, server, timeout, deadline, max_retries, retry_policy,
                         default_headers)
        self._owns_http = http_client is None
        self._http = http_client or httpx.AsyncClient()
        self._transport = AsyncTransport(self._config, self._policy, timeout, default_headers,
                                         self._http, sleep)
        self.chat = AsyncChat(self)
        self.completions = AsyncCompletions(self)
        self.models = AsyncModels(self)

    @property
    def with_raw_response(self) -> RawResources:
        """As ``Client.with_raw_response``; the calls are awaited, ``parse()`` is not."""
        return RawResources(self, AsyncChat, AsyncCompletions, AsyncModels)

    def with_options(self, *, base_url: str = NOT_GIVEN, api_key: str | None = NOT_GIVEN,
                     server: str = NOT_GIVEN, timeout: float | httpx.Timeout = NOT_GIVEN,
                     deadline: float | None = NOT_GIVEN, max_retries: int = NOT_GIVEN,
                     retry_policy: RetryPolicy = NOT_GIVEN,
                     default_headers: dict[str, str] = NOT_GIVEN) -> "AsyncClient":
        """As ``Client.with_options`` (not awaited)."""
        copy = AsyncClient(**self._options(base_url, api_key, server, timeout, deadline, max_retries,
                                           retry_policy, default_headers),
                           http_client=self._http, sleep=self._transport.sleep)
        copy._adopt(self)
        return copy

    copy = with_options

    async def detect_server(self) -> str:
        return await self._transport.server_kind()

    async def close(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()
