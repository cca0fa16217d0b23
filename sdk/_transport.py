"""HTTP requests with retries, shared by the sync and the async client.

The policy and everything that decides (headers, which failures retry, how long to wait, which
error to raise, whether the server is foretell) live in ``_Transport``; ``SyncTransport`` and
``AsyncTransport`` only add the sending and the sleeping.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import math
import random as _random
import re
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import httpx

from foretell import __version__
from foretell.sdk._config import ClientConfig
from foretell.sdk._deadline import Deadline, within
from foretell.sdk._logs import logger
from foretell.sdk.errors import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    error_from_body,
    redact,
)

FORETELL_HEADER = "x-foretell-version"
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)  # generations can take minutes on a CPU
CONNECT_TIMEOUT = 10.0


def as_timeout(timeout: Any) -> Any:
    """A number of seconds bounds each network wait (connecting, sending, and each read: a
    stream may run longer as long as events keep coming; ``deadline`` bounds the whole call), but
    connecting never waits longer than ``CONNECT_TIMEOUT`` (an unreachable host should fail fast,
    not after the generation budget). An ``httpx.Timeout`` (or None) is taken as it is."""
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        return httpx.Timeout(float(timeout), connect=min(float(timeout), CONNECT_TIMEOUT))
    return timeout


@dataclass
class RetryPolicy:
    """Retries on connection errors and 408, 409, 429, 5xx answers, never once a stream has
    delivered its first chunk. Waits ``Retry-After`` (seconds or an HTTP date, capped at
    ``max_retry_after``) when the server sends it, else full jitter: a uniform draw in
    ``[0, min(max_delay, base_delay * 2**attempt)]``."""

    max_retries: int = 2
    base_delay: float = 0.5
    max_delay: float = 8.0
    max_retry_after: float = 60.0
    random: Callable[[], float] = field(default=_random.random, repr=False)

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.max_retry_after)
        return min(self.max_delay, self.base_delay * 2 ** attempt) * self.random()


# A base URL path that names an API version (/v1, /openai/v1, /v1beta/openai).
_VERSIONED_PATH = re.compile(r"/v\d")


def retryable_status(status: int) -> bool:
    return status in (408, 409, 429) or status >= 500


def _finite(text: str | None) -> float | None:
    """A finite number from a header, else None ('nan' and 'inf' parse as floats too)."""
    try:
        number = float(text)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def parse_retry_after(headers: httpx.Headers, now: float | None = None) -> float | None:
    """Seconds to wait from ``retry-after-ms`` or ``Retry-After`` (seconds or an HTTP date)."""
    millis = _finite(headers.get("retry-after-ms"))
    if millis is not None:
        return millis / 1000.0
    value = headers.get("retry-after")
    if not value:
        return None
    seconds = _finite(value)
    if seconds is not None:
        return seconds
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class _Transport:
    def __init__(self, config: ClientConfig, policy: RetryPolicy, timeout: Any,
                 default_headers: dict[str, str] | None):
        self.config, self.policy, self.timeout = config, policy, as_timeout(timeout)
        self.default_headers = dict(default_headers or {})
        self.kind: str | None = config.known_kind()  # 'foretell' / 'openai-compatible' once known

    @property
    def secrets(self) -> tuple[str, ...]:
        return (self.config.api_key,) if self.config.api_key else ()

    def build(self, http, method: str, path: str, body: dict | None, stream: bool,
              extra_headers: dict | None, timeout: Any) -> httpx.Request:
        headers = {"user-agent": f"foretell-sdk/{__version__}",
                   "accept": "text/event-stream" if stream else "application/json"}
        if self.config.api_key:
            headers["authorization"] = f"Bearer {self.config.api_key}"
        headers.update(self.default_headers)
        headers.update(extra_headers or {})
        return http.build_request(method, self.config.url(path), json=body, headers=headers,
                                  timeout=self.timeout if timeout is None else as_timeout(timeout))

    def learn_kind(self, response: httpx.Response) -> None:
        if self.config.server != "auto":
            return  # the caller said what the server is
        if FORETELL_HEADER in response.headers:
            self.kind = "foretell"
        elif response.status_code < 500:  # a 5xx may come from a gateway in front: proves nothing
            self.kind = "openai-compatible"

    def connection_error(self, error: Exception, request: httpx.Request) -> APIConnectionError:
        detail = redact(str(error) or type(error).__name__, self.secrets)
        url = str(request.url)
        if isinstance(error, httpx.TimeoutException):
            return APITimeoutError(f"request to {url} timed out: {detail}", method=request.method,
                                   url=url)
        if isinstance(error, httpx.ConnectError):
            # Nothing answered at all: most often the local proxy is simply not started.
            who = "the server" if self.config.known_kind() == "openai-compatible" else "`foretell serve`"
            return APIConnectionError(f"could not connect to {self.config.base_url}: is {who} running "
                                      f"there? ({detail})", method=request.method, url=url)
        return APIConnectionError(f"request to {url} failed: {detail}", method=request.method, url=url)

    def status_error(self, response: httpx.Response) -> APIStatusError:
        text = response.text
        try:
            body: Any = json.loads(text)
        except ValueError:
            body = None
        error = error_from_body(response.status_code, body,
                                request_id=response.headers.get("x-request-id"),
                                secrets=self.secrets, fallback_text=text)
        if response.status_code == 404 and not _VERSIONED_PATH.search(self.config.path):
            # http://127.0.0.1:8000 instead of http://127.0.0.1:8000/v1 gives 404 on every call.
            error.message += (f" (the base URL usually ends in /v1; this one is "
                              f"{self.config.base_url})")
            error.args = (error.message,)
        return error

    def stream_error(self, payload: Any, response: httpx.Response) -> APIStatusError:
        return error_from_body(None, payload, request_id=response.headers.get("x-request-id"),
                               secrets=self.secrets, during_stream=True)

    def retry_delay(self, attempt: int, error: Exception, response: httpx.Response | None,
                    request: httpx.Request, deadline: Deadline | None) -> float | None:
        """Seconds to wait before the next try (logged), or None to give up and raise ``error``."""
        if attempt >= self.policy.max_retries:
            return None
        if isinstance(error, APIConnectionError):
            delay = self.policy.delay(attempt)
        elif isinstance(error, APIStatusError) and retryable_status(error.status_code):
            delay = self.policy.delay(attempt, parse_retry_after(response.headers) if response else None)
        else:
            return None
        why = describe(error)
        if deadline is not None and delay >= deadline.remaining():
            logger.info("not retrying %s %s after %s: the deadline would pass first",
                        request.method, self.safe_url(request), why)
            return None
        logger.info("retrying %s %s in %.2f s (retry %d of %d) after %s", request.method,
                    self.safe_url(request), delay, attempt + 1, self.policy.max_retries, why)
        return delay

    def safe_url(self, request: httpx.Request) -> str:
        return redact(str(request.url), self.secrets)

    def prepare_attempt(self, request: httpx.Request, timeout: Any, deadline: Deadline | None) -> None:
        """Raises the deadline's error when no time is left, else cuts the timeouts to it."""
        if deadline is None:
            return
        if deadline.expired():
            raise deadline.error(request)
        request.extensions["timeout"] = deadline.clip(timeout)

    def log_response(self, request: httpx.Request, response: httpx.Response) -> None:
        logger.debug("%s %s -> %d (request %s)", request.method, self.safe_url(request),
                     response.status_code, response.headers.get("x-request-id") or "-")


def describe(error: Exception) -> str:
    """For the logs: the status and request id of an error answer, else the error's class and
    its message (already redacted)."""
    if isinstance(error, APIStatusError):
        return (f"{error.status_code} {type(error).__name__} "
                f"(request {error.request_id or '-'})")
    return f"{type(error).__name__}: {error}"


class SyncTransport(_Transport):
    def __init__(self, config, policy, timeout, default_headers, http: httpx.Client,
                 sleep: Callable[[float], None] | None = None):
        super().__init__(config, policy, timeout, default_headers)
        self.http = http
        self.sleep = sleep or time.sleep

    def send(self, method: str, path: str, body: dict | None = None, *, stream: bool = False,
             extra_headers: dict | None = None, timeout: Any = None,
             raise_status: bool = True, deadline: Deadline | None = None) -> httpx.Response:
        """The response, read unless ``stream`` (a streaming response is open: the caller
        closes it, and releases ``deadline``'s guard first). Errors are raised once the retries
        are spent; with ``raise_status`` False an error status is returned instead (after the
        same retries)."""
        request = self.build(self.http, method, path, body, stream, extra_headers, timeout)
        timeout = self.timeout if timeout is None else as_timeout(timeout)
        attempt = 0
        while True:
            self.prepare_attempt(request, timeout, deadline)
            response = None
            try:
                logger.debug("%s %s", method, self.safe_url(request))
                response = self.http.send(request, stream=True)
                self.log_response(request, response)
                self.learn_kind(response)
                if deadline is not None:
                    deadline.guard(response)
                if stream and response.status_code < 400:
                    return response
                try:
                    response.read()
                finally:
                    if deadline is not None:
                        deadline.release()
                    response.close()
                if response.status_code < 400:
                    return response
                error: Exception = self.status_error(response)
            except httpx.TransportError as exc:
                if deadline is not None and deadline.expired():
                    raise deadline.error(request) from None
                error = self.connection_error(exc, request)
            delay = self.retry_delay(attempt, error, response, request, deadline)
            if delay is None:
                if isinstance(error, APIStatusError) and not raise_status:
                    return response  # the caller reads the status itself (the probe)
                raise error
            self.sleep(delay)
            attempt += 1

    def server_kind(self, deadline: Deadline | None = None) -> str:
        """'foretell' or 'openai-compatible'; asks the server once (GET /models) if unknown."""
        if self.kind is None:
            self.send("GET", "/models", raise_status=False, deadline=deadline)
        return self.kind or "openai-compatible"


class AsyncTransport(_Transport):
    def __init__(self, config, policy, timeout, default_headers, http: httpx.AsyncClient,
                 sleep: Callable[[float], Awaitable[None]] | None = None):
        super().__init__(config, policy, timeout, default_headers)
        self.http = http
        self.sleep = sleep or asyncio.sleep

    async def send(self, method: str, path: str, body: dict | None = None, *, stream: bool = False,
                   extra_headers: dict | None = None, timeout: Any = None,
                   raise_status: bool = True, deadline: Deadline | None = None) -> httpx.Response:
        request = self.build(self.http, method, path, body, stream, extra_headers, timeout)
        timeout = self.timeout if timeout is None else as_timeout(timeout)
        attempt = 0
        while True:
            self.prepare_attempt(request, timeout, deadline)
            response = None
            try:
                logger.debug("%s %s", method, self.safe_url(request))
                response = await within(deadline, request, self.http.send(request, stream=True))
                self.log_response(request, response)
                self.learn_kind(response)
                if stream and response.status_code < 400:
                    return response
                try:
                    await within(deadline, request, response.aread())
                finally:
                    await response.aclose()
                if response.status_code < 400:
                    return response
                error: Exception = self.status_error(response)
            except httpx.TransportError as exc:
                if deadline is not None and deadline.expired():
                    raise deadline.error(request) from None
                error = self.connection_error(exc, request)
            delay = self.retry_delay(attempt, error, response, request, deadline)
            if delay is None:
                if isinstance(error, APIStatusError) and not raise_status:
                    return response  # the caller reads the status itself (the probe)
                raise error
            await self.sleep(delay)
            attempt += 1

    async def server_kind(self, deadline: Deadline | None = None) -> str:
        if self.kind is None:
            await self.send("GET", "/models", raise_status=False, deadline=deadline)
        return self.kind or "openai-compatible"
