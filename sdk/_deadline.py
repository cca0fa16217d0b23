"""A deadline for a whole call: connecting, every retry and its wait, and reading the answer (a
stream until its last event).

httpx's timeouts bound each network operation on its own (one connect, one write, one read), so a
stream that keeps sending never times out. A ``Deadline`` bounds the sum:

- each attempt's httpx timeouts are cut to the time left, so a stalled wait ends at the deadline;
- a retry that would wait past the deadline is not made;
- readers check it between chunks;
- a read already waiting when the deadline passes is ended too: the sync client shuts the
  response's socket from a timer (httpx fixes a body's read timeout when the body starts), the
  async client wraps each wait in ``asyncio.wait_for``.
"""

from __future__ import annotations

import asyncio
import math
import socket
import threading
import time
from typing import Any, Awaitable, Callable

import httpx

from foretell.sdk.errors import APITimeoutError


def check_seconds(seconds: Any) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or \
            not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"deadline must be a positive number of seconds; got {seconds!r}")
    return float(seconds)


class Deadline:
    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic):
        self.seconds = check_seconds(seconds)
        self._clock = clock
        self._at = clock() + self.seconds
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def remaining(self) -> float:
        return max(0.0, self._at - self._clock())

    def expired(self) -> bool:
        return self.remaining() <= 0.0

    def clip(self, timeout: Any) -> dict:
        """httpx's timeout extension for the next attempt: every limit at most the time left."""
        left = self.remaining()
        limits = (timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)).as_dict()
        return {name: left if value is None else min(value, left) for name, value in limits.items()}

    def error(self, request: httpx.Request) -> APITimeoutError:
        url = str(request.url)
        return APITimeoutError(f"request to {url} passed its deadline of {self.seconds:g} s",
                               method=request.method, url=url)

    # ---- sync only: end a read that is already waiting ------------------------------------------

    def guard(self, response: httpx.Response) -> None:
        """Shut ``response``'s socket when the deadline passes (a blocked read then fails at
        once). Without a socket (a mock transport) only the checks between reads remain."""
        stream = response.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if sock is None:
            return

        def fire() -> None:
            with self._lock:
                # Released meanwhile, or the body is read and the connection back in the pool.
                if self._timer is not timer or response.is_closed:
                    return
                try:
                    # socket.socket's own shutdown, also for TLS: end the connection, not the session.
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)
                except OSError:
                    pass

        timer = threading.Timer(self.remaining(), fire)
        timer.daemon = True
        with self._lock:
            self._timer = timer
        timer.start()

    def release(self) -> None:
        """Call before the guarded response is closed (its connection may then be reused)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None


async def within(deadline: Deadline | None, request: httpx.Request, awaitable: Awaitable[Any]) -> Any:
    """Await, ending the wait (and raising the deadline's error) when the deadline passes."""
    if deadline is None:
        return await awaitable
    try:
        return await asyncio.wait_for(awaitable, deadline.remaining())
    except asyncio.TimeoutError:
        raise deadline.error(request) from None
