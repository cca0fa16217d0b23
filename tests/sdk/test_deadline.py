"""``timeout`` bounds each network wait; ``deadline`` bounds the whole call. Against a real
server on 127.0.0.1 that streams slowly, since both act on sockets."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from foretell.sdk import APITimeoutError, AsyncClient, Client, InternalServerError, RetryPolicy
from foretell.sdk._deadline import Deadline
from tests.sdk.conftest import Script
from tests.sdk.fakes import CHAT, answer, error
from tests.sdk.slow_server import SlowServer

# A 2.4 s stream (an event every 0.2 s); the stall scenario goes quiet after 1.3 s.
DEADLINE = 1.5
SLACK = 0.9  # scheduling on a busy 2-core machine


@pytest.fixture(scope="module")
def server():
    with SlowServer(interval=0.2, chunks=12, stall_after=1.3, delay=6.0) as running:
        yield running


def read_sync(base_url: str, stream: bool = True, **options) -> tuple[int, float]:
    """(chunks read, seconds) of one call."""
    start = time.monotonic()
    with Client(base_url, max_retries=0, **options) as client:
        result = client.chat.completions.create(**CHAT, stream=stream)
        count = sum(1 for _ in result) if stream else 1
    return count, time.monotonic() - start


def read_async(base_url: str, stream: bool = True, **options) -> tuple[int, float]:
    async def run():
        async with AsyncClient(base_url, max_retries=0, **options) as client:
            result = await client.chat.completions.create(**CHAT, stream=stream)
            if not stream:
                return 1
            return len([c async for c in result])

    start = time.monotonic()
    count = asyncio.run(run())
    return count, time.monotonic() - start


READERS = [pytest.param(read_sync, id="sync"), pytest.param(read_async, id="async")]


@pytest.mark.parametrize("read", READERS)
def test_timeout_is_per_read_so_a_steady_stream_outlasts_it(server, read):
    chunks, seconds = read(server.base_url("trickle"), timeout=0.8)
    assert chunks == 13  # 12 text events and the finish event: the stream completed
    assert seconds > 2.2  # almost three times the timeout


@pytest.mark.parametrize("read", READERS)
def test_the_deadline_ends_a_steady_stream(server, read):
    start = time.monotonic()
    with pytest.raises(APITimeoutError, match="deadline of 1.5 s") as caught:
        read(server.base_url("trickle"), timeout=0.8, deadline=DEADLINE)
    assert DEADLINE <= time.monotonic() - start < DEADLINE + SLACK
    assert "/trickle/v1/chat/completions" in caught.value.url


@pytest.mark.parametrize("read", READERS)
def test_the_deadline_ends_a_read_already_waiting(server, read):
    # The last event comes just before the deadline and the next never does: the read waiting
    # then must end at the deadline, not one read timeout later (httpx cut that one to 1.5 s
    # when the body started, so without the sync client's timer it would end near 2.8 s).
    start = time.monotonic()
    with pytest.raises(APITimeoutError, match="deadline"):
        read(server.base_url("stall"), deadline=DEADLINE)
    assert DEADLINE <= time.monotonic() - start < DEADLINE + SLACK


@pytest.mark.parametrize("read", READERS)
def test_the_deadline_ends_the_wait_for_a_slow_plain_answer(server, read):
    start = time.monotonic()
    with pytest.raises(APITimeoutError, match="deadline"):
        read(server.base_url("late"), stream=False, deadline=DEADLINE)
    assert DEADLINE <= time.monotonic() - start < DEADLINE + SLACK


def test_a_call_deadline_overrides_the_clients_and_with_options_sets_one(server):
    start = time.monotonic()
    with Client(server.base_url("trickle"), max_retries=0, deadline=60) as client:
        with pytest.raises(APITimeoutError):
            list(client.chat.completions.create(**CHAT, stream=True, deadline=1.0))
        assert time.monotonic() - start < 1.0 + SLACK
        start = time.monotonic()
        with pytest.raises(APITimeoutError):
            list(client.with_options(deadline=1.0).chat.completions.create(**CHAT, stream=True))
        assert time.monotonic() - start < 1.0 + SLACK
        assert client.deadline == 60  # the original is unchanged


def test_a_stream_within_its_deadline_completes(server):
    chunks, seconds = read_sync(server.base_url("trickle"), deadline=30)
    assert chunks == 13


def test_no_retry_waits_past_the_deadline():
    script = Script(error(503, retry_after="5"), answer())
    sleeps: list[float] = []
    client = Client("http://test.local/v1", http_client=httpx.Client(transport=script.transport()),
                    sleep=sleeps.append, deadline=2.0)
    with pytest.raises(InternalServerError):  # the real failure, not a deadline error
        client.chat.completions.create(**CHAT)
    assert sleeps == [] and len(script.requests) == 1
    # A retry that fits is made.
    script = Script(error(503, retry_after="1"), answer())
    client = Client("http://test.local/v1", http_client=httpx.Client(transport=script.transport()),
                    sleep=sleeps.append, deadline=2.0)
    assert client.chat.completions.create(**CHAT).text == "hello"
    assert sleeps == [1.0]


def test_an_expired_deadline_sends_nothing_more():
    now = [0.0]
    deadline = Deadline(1.0, clock=lambda: now[0])
    assert deadline.clip(httpx.Timeout(600.0, connect=10.0)) == \
        {"connect": 1.0, "read": 1.0, "write": 1.0, "pool": 1.0}
    now[0] = 0.25
    assert deadline.clip(httpx.Timeout(0.5))["read"] == 0.5
    assert deadline.clip(None)["read"] == 0.75  # no limit of its own: the deadline's
    now[0] = 1.0
    assert deadline.expired()

    script = Script(httpx.ConnectError("refused"), answer())
    client = Client("http://test.local/v1", http_client=httpx.Client(transport=script.transport()),
                    retry_policy=RetryPolicy(random=lambda: 0.0), sleep=lambda s: time.sleep(0.3),
                    deadline=0.2)
    with pytest.raises(APITimeoutError, match="deadline of 0.2 s"):
        client.chat.completions.create(**CHAT)
    assert len(script.requests) == 1  # the retry found no time left


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), "5", True])
def test_a_deadline_must_be_a_positive_number(bad):
    with pytest.raises(ValueError, match="deadline"):
        Client("http://test.local/v1", deadline=bad)
