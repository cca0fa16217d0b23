"""Server-sent events into typed chunks, offline."""

from __future__ import annotations

import asyncio
import gc

import httpx
import pytest

from foretell.sdk import (
    APIConnectionError,
    AsyncClient,
    BadRequestError,
    Client,
    ForetellError,
    InternalServerError,
    RateLimitError,
    RetryPolicy,
)
from foretell.sdk.streaming import SSEDecoder
from foretell.sdk.types import Completion
from tests.sdk.conftest import Script
from tests.sdk.fakes import CHAT, KEY, Body, chunk, error, sse, streamed


def client_for(script: Script, sleeps: list | None = None) -> Client:
    return Client("http://test.local/v1", "k", http_client=httpx.Client(transport=script.transport()),
                  retry_policy=RetryPolicy(random=lambda: 1.0),
                  sleep=(sleeps if sleeps is not None else []).append)


def feed_all(text: str):
    decoder, events = SSEDecoder(), []
    for line in text.split("\n"):
        event = decoder.feed(line)
        if event is not None:
            events.append(event)
    last = decoder.flush()
    return events + ([last] if last else [])


def test_sse_decoder_joins_data_lines_skips_comments_and_handles_crlf():
    events = feed_all(": keep-alive\r\n\r\ndata: {\"a\":\r\ndata: 1}\r\n\r\nevent: error\r\n"
                      "data:x\r\nid: 7\r\n\r\ndata: tail-without-blank-line")
    assert [(e.data, e.event, e.id) for e in events] == [
        ('{"a":\n1}', None, None), ("x", "error", "7"), ("tail-without-blank-line", None, "7")]


def test_stream_yields_typed_chunks_until_done_and_closes():
    body = Body([b": ping\n\n", sse({"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
                 sse(chunk("Hel")), b"data: " + sse(chunk("lo"))[6:-2] + b"\r\n\r\n",
                 sse(chunk(None, "stop")),
                 sse(chunk(None, usage={"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
                           speculation={"target_passes": 1, "per_source": {"prediction": {"rounds": 1, "drafted": 2, "accepted": 2}}})),
                 b"data: [DONE]\n\n", sse(chunk("after done is ignored"))])
    client = client_for(Script(streamed(body)))
    stream = client.chat.completions.create(**CHAT, stream=True)
    chunks = list(stream)
    assert "".join(c.text for c in chunks) == "Hello"
    assert chunks[-1].usage.completion_tokens == 2
    assert chunks[-1].speculation.per_source["prediction"].accepted == 2
    assert stream.request_id == "req-abc"
    assert body.closed


def test_error_event_mid_stream_raises_the_typed_error_after_earlier_chunks():
    body = Body([sse(chunk("one ")), sse(chunk("two ")),
                 sse({"error": {"message": "generation failed: boom", "type": "server_error",
                                "param": None, "code": None}}), b"data: [DONE]\n\n"])
    client = client_for(Script(streamed(body)))
    delivered = []
    with pytest.raises(InternalServerError) as caught:
        for c in client.chat.completions.create(**CHAT, stream=True):
            delivered.append(c.text)
    assert delivered == ["one ", "two "]
    err = caught.value
    assert err.during_stream and err.status_code == 500 and err.request_id == "req-abc"
    assert "boom" in err.message
    assert body.closed


@pytest.mark.parametrize("detail,cls,status", [
    ({"message": "m", "type": "rate_limit_error"}, RateLimitError, 429),
    ({"message": "m", "type": "BadRequestError", "code": 400}, BadRequestError, 400),
    ("plain string error", InternalServerError, 500),
])
def test_error_events_map_by_type_or_integer_code(detail, cls, status):
    client = client_for(Script(streamed(Body([sse({"error": detail})]))))
    with pytest.raises(cls) as caught:
        list(client.chat.completions.create(**CHAT, stream=True))
    assert caught.value.status_code == status


def test_a_connection_drop_mid_stream_raises_and_is_not_retried():
    body = Body([sse(chunk("partial"))], fail=httpx.ReadError("connection reset"))
    script = Script(streamed(body))
    sleeps: list[float] = []
    client = client_for(script, sleeps)
    delivered = []
    with pytest.raises(APIConnectionError, match="connection reset"):
        for c in client.chat.completions.create(**CHAT, stream=True):
            delivered.append(c.text)
    assert delivered == ["partial"]
    assert len(script.requests) == 1 and sleeps == []


def test_a_stream_that_stops_without_done_or_finish_reason_is_an_error():
    client = client_for(Script(streamed(Body([sse(chunk("half a fi"))]))))
    with pytest.raises(APIConnectionError, match="ended before"):
        list(client.chat.completions.create(**CHAT, stream=True))
    # ... but a finish_reason without [DONE] is a complete stream.
    client = client_for(Script(streamed(Body([sse(chunk("all")), sse(chunk(None, "stop"))]))))
    assert [c.text for c in client.chat.completions.create(**CHAT, stream=True)] == ["all", ""]


def test_an_error_status_before_the_stream_starts_is_retried():
    body = Body([sse(chunk("ok")), b"data: [DONE]\n\n"])
    script = Script(error(503), streamed(body))
    sleeps: list[float] = []
    client = client_for(script, sleeps)
    assert [c.text for c in client.chat.completions.create(**CHAT, stream=True)] == ["ok"]
    assert sleeps == [0.5] and len(script.requests) == 2


def test_breaking_out_early_closes_the_response():
    body = Body([sse(chunk(str(i))) for i in range(100)] + [b"data: [DONE]\n\n"])
    client = client_for(Script(streamed(body)))
    with client.chat.completions.create(**CHAT, stream=True) as stream:
        for c in stream:
            if c.text == "2":
                break
    assert body.closed and body.sent < 100
    # Without a with block: garbage collection closes it.
    body3 = Body([sse(chunk(str(i))) for i in range(100)])
    client3 = client_for(Script(streamed(body3)))
    stream = client3.chat.completions.create(**CHAT, stream=True)
    next(stream)
    del stream
    gc.collect()
    assert body3.closed


def test_a_non_json_event_is_a_clear_error():
    client = client_for(Script(streamed(Body([b"data: {not json\n\n"]))))
    with pytest.raises(ForetellError, match="not JSON"):
        list(client.chat.completions.create(**CHAT, stream=True))


def test_completion_streams_yield_completion_chunks():
    parts = [sse({"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": t, "finish_reason": f}]})
             for t, f in (("a", None), ("b", None), ("", "length"))]
    client = client_for(Script(streamed(Body(parts + [b"data: [DONE]\n\n"]))))
    chunks = list(client.completions.create(model="m", prompt="p", stream=True))
    assert all(isinstance(c, Completion) for c in chunks)
    assert "".join(c.text for c in chunks) == "ab"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_async_stream_delivers_then_raises_and_closes_early():
    error_body = Body([sse(chunk("x")), sse({"error": {"message": "bad", "type": "server_error"}})])
    long_body = Body([sse(chunk(str(i))) for i in range(50)] + [b"data: [DONE]\n\n"])
    script = Script(streamed(error_body), streamed(long_body))

    async def run():
        async with AsyncClient("http://test.local/v1",
                               http_client=httpx.AsyncClient(transport=script.transport())) as client:
            got = []
            with pytest.raises(InternalServerError):
                async for c in await client.chat.completions.create(**CHAT, stream=True):
                    got.append(c.text)
            async with await client.chat.completions.create(**CHAT, stream=True) as stream:
                async for c in stream:
                    if c.text == "1":
                        break
            return got

    assert asyncio.run(run()) == ["x"]
    assert error_body.closed and long_body.closed and long_body.sent < 50


def test_a_stream_dropped_before_it_was_read_closes_its_response():
    body = Body([sse(chunk(str(i))) for i in range(10)])
    stream = client_for(Script(streamed(body))).chat.completions.create(**CHAT, stream=True)
    del stream  # never iterated: its generator never started
    gc.collect()
    assert body.closed and body.sent == 0


def test_a_non_json_event_does_not_show_the_key():
    client = Client("http://test.local/v1", KEY, http_client=httpx.Client(
        transport=Script(streamed(Body([f"data: {{echo {KEY}\n\n".encode()]))).transport()))
    with pytest.raises(ForetellError, match="not JSON") as caught:
        list(client.chat.completions.create(**CHAT, stream=True))
    assert KEY not in str(caught.value)
