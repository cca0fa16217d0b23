"""Errors and retries, offline: a scripted server at httpx's transport edge."""

from __future__ import annotations

import asyncio
import email.utils
import time

import httpx
import pytest

from foretell.sdk import (
    APIConnectionError,
    APIStatusError,
    ForetellError,
    APITimeoutError,
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    Client,
    ConflictError,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RequestTooLargeError,
    RetryPolicy,
    UnprocessableEntityError,
)
from foretell.sdk._transport import parse_retry_after
from tests.sdk.conftest import Script
from tests.sdk.fakes import CHAT, KEY, answer, error


def make_client(script: Script, *, max_retries: int = 2, jitter: float = 1.0, **kwargs):
    sleeps: list[float] = []
    client = Client("http://test.local/v1", KEY, http_client=httpx.Client(transport=script.transport()),
                    retry_policy=RetryPolicy(max_retries=max_retries, random=lambda: jitter),
                    sleep=sleeps.append, **kwargs)
    return client, sleeps


@pytest.mark.parametrize("status,cls", [
    (400, BadRequestError), (401, AuthenticationError), (403, PermissionDeniedError),
    (404, NotFoundError), (409, ConflictError), (413, RequestTooLargeError),
    (422, UnprocessableEntityError), (429, RateLimitError), (500, InternalServerError),
    (502, InternalServerError), (503, InternalServerError), (418, APIStatusError),
])
def test_each_status_raises_its_class_with_the_servers_details(status, cls):
    script = Script(error(status, "the model is busy", type="some_type", code="some_code", param="model"))
    client, _ = make_client(script, max_retries=0)
    with pytest.raises(cls) as caught:
        client.chat.completions.create(**CHAT)
    err = caught.value
    assert type(err) is cls
    assert err.status_code == status
    assert err.request_id == "req-abc"
    assert err.message == "the model is busy"
    assert (err.type, err.code, err.param) == ("some_type", "some_code", "model")
    assert err.body["error"]["message"] == "the model is busy"
    assert "req-abc" in str(err) and "the model is busy" in str(err)


def test_a_body_that_is_not_json_still_gives_a_message():
    script = Script(lambda r: httpx.Response(502, text="Bad Gateway from nginx"))
    client, _ = make_client(script, max_retries=0)
    with pytest.raises(InternalServerError, match="Bad Gateway from nginx"):
        client.chat.completions.create(**CHAT)


def test_the_api_key_never_shows_even_when_the_server_echoes_it():
    script = Script(error(401, f"invalid API key {KEY} (Bearer {KEY})"))
    client, _ = make_client(script, max_retries=0)
    assert KEY not in repr(client) and KEY not in str(client)
    with pytest.raises(AuthenticationError) as caught:
        client.chat.completions.create(**CHAT)
    err = caught.value
    for text in (str(err), repr(err), err.message, repr(err.body), repr(err.args)):
        assert KEY not in text
    assert "[redacted]" in err.message
    # The key did go out, in the header only.
    assert script.requests[0].headers["authorization"] == f"Bearer {KEY}"


def test_connection_errors_do_not_show_the_key_either():
    script = Script(httpx.ConnectError(f"refused while sending {KEY}"))
    client, _ = make_client(script, max_retries=0)
    with pytest.raises(APIConnectionError) as caught:
        client.chat.completions.create(**CHAT)
    assert KEY not in str(caught.value) and KEY not in repr(caught.value)


@pytest.mark.parametrize("status", [408, 409, 429, 500, 503])
def test_retryable_statuses_are_retried_with_exponential_backoff(status):
    script = Script(error(status), error(status), answer())
    client, sleeps = make_client(script, max_retries=2, jitter=1.0)
    response = client.chat.completions.create(**CHAT)
    assert response.text == "hello"
    assert len(script.requests) == 3
    assert sleeps == [0.5, 1.0]  # base 0.5 s, doubled; jitter drew its maximum


def test_jitter_scales_the_delay_and_the_delay_is_capped():
    policy = RetryPolicy(base_delay=0.5, max_delay=8.0, random=lambda: 0.25)
    assert [policy.delay(a) for a in range(6)] == [0.125, 0.25, 0.5, 1.0, 2.0, 2.0]
    real = RetryPolicy()
    assert all(0.0 <= real.delay(3) <= 4.0 for _ in range(200))


def test_retries_stop_after_max_retries_and_raise_the_last_error():
    script = Script(error(503, "down"))
    client, sleeps = make_client(script, max_retries=3)
    with pytest.raises(InternalServerError, match="down"):
        client.chat.completions.create(**CHAT)
    assert len(script.requests) == 4
    assert sleeps == [0.5, 1.0, 2.0]


@pytest.mark.parametrize("exc,cls", [
    (httpx.ConnectError("refused"), APIConnectionError),
    (httpx.ReadTimeout("slow"), APITimeoutError),
    (httpx.RemoteProtocolError("closed without response"), APIConnectionError),
])
def test_connection_errors_are_retried_then_raised(exc, cls):
    script = Script(exc)
    client, sleeps = make_client(script, max_retries=2)
    with pytest.raises(cls) as caught:
        client.chat.completions.create(**CHAT)
    assert type(caught.value) is cls
    assert "test.local" in str(caught.value)
    assert len(script.requests) == 3 and sleeps == [0.5, 1.0]


def test_a_connection_error_then_success_returns_the_answer():
    script = Script(httpx.ConnectError("refused"), answer(body={"choices": [{"message": {"content": "ok"}}]}))
    client, sleeps = make_client(script)
    assert client.chat.completions.create(**CHAT).text == "ok"
    assert sleeps == [0.5]


@pytest.mark.parametrize("status", [400, 401, 403, 404, 413, 422])
def test_client_errors_are_not_retried(status):
    script = Script(error(status))
    client, sleeps = make_client(script)
    with pytest.raises(APIStatusError):
        client.chat.completions.create(**CHAT)
    assert len(script.requests) == 1 and sleeps == []


def test_retry_after_seconds_wins_over_backoff():
    script = Script(error(429, type="rate_limit_error", retry_after="3"), answer())
    client, sleeps = make_client(script)
    client.chat.completions.create(**CHAT)
    assert sleeps == [3.0]


def test_retry_after_http_date_and_the_cap():
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    script = Script(error(503, retry_after=later), error(503, retry_after="3600"), answer())
    client, sleeps = make_client(script)
    client.chat.completions.create(**CHAT)
    assert 27.0 < sleeps[0] <= 30.0
    assert sleeps[1] == 60.0  # capped by max_retry_after


def test_parse_retry_after_forms():
    assert parse_retry_after(httpx.Headers({"retry-after-ms": "250"})) == 0.25
    assert parse_retry_after(httpx.Headers({"retry-after": "2.5"})) == 2.5
    assert parse_retry_after(httpx.Headers({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}),
                             now=email.utils.parsedate_to_datetime("Wed, 21 Oct 2015 07:27:50 GMT").timestamp()) == 10.0
    assert parse_retry_after(httpx.Headers({"retry-after": "soon"})) is None
    assert parse_retry_after(httpx.Headers({})) is None


def test_async_client_retries_with_its_own_sleep_and_maps_errors():
    script = Script(error(500), httpx.ConnectError("refused"), error(404, "no such model"))
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    async def run():
        async with AsyncClient("http://test.local/v1", KEY, sleep=sleep,
                               http_client=httpx.AsyncClient(transport=script.transport()),
                               retry_policy=RetryPolicy(max_retries=2, random=lambda: 1.0)) as client:
            with pytest.raises(NotFoundError) as caught:
                await client.chat.completions.create(**CHAT)
            return caught.value

    err = asyncio.run(run())
    assert err.message == "no such model" and err.request_id == "req-abc"
    assert len(script.requests) == 3 and sleeps == [0.5, 1.0]


def test_async_client_returns_typed_response_after_a_retry():
    script = Script(error(429, retry_after="0"), answer())
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    async def run():
        async with AsyncClient("http://test.local/v1", sleep=sleep,
                               http_client=httpx.AsyncClient(transport=script.transport())) as client:
            return await client.chat.completions.create(**CHAT)

    response = asyncio.run(run())
    assert response.text == "hello" and response.usage.accepted_prediction_tokens == 2
    assert sleeps == [0.0]


def test_a_non_json_success_body_does_not_show_the_key():
    script = Script(lambda r: httpx.Response(200, text=f"oops, your key {KEY} was wrong" + " " * 300 + KEY))
    client, _ = make_client(script, max_retries=0)
    with pytest.raises(ForetellError, match="not JSON") as caught:
        client.chat.completions.create(**CHAT)
    assert KEY not in str(caught.value) and KEY[:8] not in str(caught.value)


def test_a_key_across_the_message_cut_leaves_no_prefix():
    text = "x" * 490 + KEY  # the 500-character cut falls inside the key
    script = Script(lambda r: httpx.Response(502, text=text))
    client, _ = make_client(script, max_retries=0)
    with pytest.raises(InternalServerError) as caught:
        client.chat.completions.create(**CHAT)
    assert KEY[:10] not in str(caught.value)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_retry_after_that_is_not_a_finite_number_falls_back_to_backoff(value):
    script = Script(error(503, retry_after=value), answer())
    client, sleeps = make_client(script, max_retries=1, jitter=1.0)
    assert client.chat.completions.create(**CHAT).text == "hello"
    assert sleeps == [0.5]


def test_a_number_timeout_keeps_a_short_connect_timeout():
    client = Client("http://test.local/v1", KEY, timeout=30)
    timeout = client._transport.timeout
    assert (timeout.read, timeout.connect) == (30.0, 10.0)
    assert Client("http://test.local/v1", KEY, timeout=2)._transport.timeout.connect == 2.0
    exact = httpx.Timeout(5.0, connect=60.0)
    assert Client("http://test.local/v1", KEY, timeout=exact)._transport.timeout is exact


# ---- hints in the messages ----------------------------------------------------------------------

def test_nothing_listening_asks_whether_foretell_serve_runs_there():
    from tests.sdk.conftest import free_port

    base = f"http://127.0.0.1:{free_port()}/v1"
    with Client(base, max_retries=0) as client:
        with pytest.raises(APIConnectionError) as caught:
            client.chat.completions.create(**CHAT)
    assert type(caught.value) is APIConnectionError
    assert str(caught.value).startswith(f"could not connect to {base}: is `foretell serve` running "
                                        "there? (")
    assert "refused" in str(caught.value).lower()


def test_a_hosted_api_that_cannot_be_reached_gets_no_foretell_hint():
    script = Script(httpx.ConnectError("no route to host"))
    client = Client("https://api.openai.com/v1", KEY, max_retries=0,
                    http_client=httpx.Client(transport=script.transport()))
    with pytest.raises(APIConnectionError, match="is the server running there") as caught:
        client.chat.completions.create(**CHAT)
    assert "foretell serve" not in str(caught.value)


@pytest.mark.parametrize("base,hinted", [
    ("http://test.local", True), ("http://test.local/api", True),
    ("http://test.local/v1", False), ("https://gateway.local/openai/v1", False),
])
def test_a_404_from_a_base_url_without_v1_says_it_usually_ends_in_v1(base, hinted):
    script = Script(error(404, "Not Found"))
    client = Client(base, KEY, max_retries=0, http_client=httpx.Client(transport=script.transport()))
    with pytest.raises(NotFoundError) as caught:
        client.chat.completions.create(**CHAT)
    err = caught.value
    assert ("the base URL usually ends in /v1" in str(err)) is hinted
    assert err.message.startswith("Not Found") and err.status_code == 404
    if hinted:
        assert base in err.message


def test_other_statuses_get_no_v1_hint():
    script = Script(error(400, "bad"))
    client = Client("http://test.local", KEY, max_retries=0,
                    http_client=httpx.Client(transport=script.transport()))
    with pytest.raises(BadRequestError) as caught:
        client.chat.completions.create(**CHAT)
    assert caught.value.message == "bad"
