"""Parity with the openai package: with_raw_response, with_options, model_dump(_json)."""

from __future__ import annotations

import asyncio
import inspect
import json

import httpx
import pytest

from foretell.sdk import (
    AsyncClient,
    AsyncStream,
    ChatCompletion,
    Client,
    Completion,
    InternalServerError,
    ModelList,
    RawResponse,
    RetryPolicy,
    Stream,
    types,
)
from tests.sdk.conftest import Script
from tests.sdk.fakes import CHAT, KEY, Body, answer, chunk, completion, error, sse, streamed


def client_for(script: Script, **kwargs) -> Client:
    return Client("http://test.local/v1", KEY, http_client=httpx.Client(transport=script.transport()),
                  **kwargs)


# ---- with_raw_response --------------------------------------------------------------------------

def test_raw_chat_response_has_the_http_side_and_parses_to_the_typed_object():
    script = Script(answer(x_ratelimit_remaining_requests="59"))
    raw = client_for(script).with_raw_response.chat.completions.create(**CHAT)
    assert isinstance(raw, RawResponse)
    assert raw.status_code == 200
    assert raw.headers["x-ratelimit-remaining-requests"] == "59"
    assert raw.request_id == "req-abc"
    assert raw.http_request is script.requests[0]
    assert (raw.method, str(raw.url)) == ("POST", "http://test.local/v1/chat/completions")
    assert raw.json() == completion()
    parsed = raw.parse()
    assert isinstance(parsed, ChatCompletion) and parsed.text == "hello"
    assert parsed.request_id == "req-abc"
    assert raw.parse() is parsed  # made once
    assert KEY not in repr(raw)


def test_raw_completions_models_and_the_resource_level_form():
    legacy = {"id": "cmpl-1", "object": "text_completion",
              "choices": [{"index": 0, "text": " world", "finish_reason": "length"}]}
    script = Script(answer(body=legacy), answer(body={"object": "list", "data": [{"id": "m"}]}),
                    answer())
    client = client_for(script)
    raw = client.with_raw_response.completions.create(model="m", prompt="hello")
    assert isinstance(raw.parse(), Completion) and raw.parse().text == " world"
    models = client.with_raw_response.models.list().parse()
    assert isinstance(models, ModelList) and models.data[0].id == "m"
    # openai's other spelling: the resource's own with_raw_response.
    raw = client.chat.completions.with_raw_response.create(**CHAT)
    assert raw.parse().text == "hello"
    assert script.paths() == ["POST /v1/completions", "GET /v1/models", "POST /v1/chat/completions"]


def test_a_raw_stream_gives_headers_first_then_the_stream():
    body = Body([sse(chunk("a")), sse(chunk("b", finish="stop")), sse("[DONE]")])
    raw = client_for(Script(streamed(body))).with_raw_response.chat.completions.create(
        **CHAT, stream=True)
    assert raw.status_code == 200 and raw.headers["content-type"] == "text/event-stream"
    assert body.sent == 0  # nothing read yet
    stream = raw.parse()
    assert isinstance(stream, Stream)
    assert "".join(c.text for c in stream) == "ab"
    assert body.closed


def test_errors_are_raised_from_raw_calls_too():
    with pytest.raises(InternalServerError):
        client_for(Script(error(500)), max_retries=0).with_raw_response.chat.completions.create(**CHAT)


def test_async_raw_response():
    body = Body([sse(chunk("x", finish="stop")), sse("[DONE]")])
    script = Script(answer(), streamed(body))

    async def run():
        async with AsyncClient("http://test.local/v1",
                               http_client=httpx.AsyncClient(transport=script.transport())) as client:
            raw = await client.with_raw_response.chat.completions.create(**CHAT)
            streamed_raw = await client.chat.completions.with_raw_response.create(**CHAT, stream=True)
            stream = streamed_raw.parse()
            assert isinstance(stream, AsyncStream)
            return raw, [c.text async for c in stream]

    raw, texts = asyncio.run(run())
    assert raw.request_id == "req-abc" and raw.parse().text == "hello"
    assert texts == ["x"]


# ---- with_options -------------------------------------------------------------------------------

def test_with_options_changes_only_the_copy_and_shares_the_pool():
    script = Script(error(503), answer())
    http = httpx.Client(transport=script.transport())
    sleeps: list[float] = []
    client = Client("http://test.local/v1", KEY, http_client=http, sleep=sleeps.append,
                    retry_policy=RetryPolicy(max_retries=3, random=lambda: 1.0),
                    default_headers={"x-team": "a"})
    copy = client.with_options(timeout=30, max_retries=0)
    assert copy.timeout.read == 30.0 and copy.timeout.connect == 10.0
    assert copy.max_retries == 0 and client.max_retries == 3
    assert client.timeout.read == 600.0
    assert copy._http is http and copy.base_url == client.base_url
    with pytest.raises(InternalServerError):  # no retry on the copy
        copy.chat.completions.create(**CHAT)
    assert len(script.requests) == 1
    # The copy keeps the key, the headers and the retry policy's other settings.
    assert script.requests[0].headers["authorization"] == f"Bearer {KEY}"
    assert script.requests[0].headers["x-team"] == "a"
    assert copy._policy.random() == 1.0
    copy.close()
    assert not http.is_closed  # the pool belongs to the original's owner
    # The original still retries.
    script.answers[:] = [error(503), answer()]
    assert client.chat.completions.create(**CHAT).text == "hello" and sleeps == [0.5]


def test_with_options_keeps_what_was_learned_about_the_server():
    script = Script(answer())
    client = client_for(script)
    client.chat.completions.create(**CHAT)
    assert client.server_kind == "foretell"
    assert client.with_options(max_retries=1).server_kind == "foretell"
    assert client.with_options(base_url="http://other.local/v1").server_kind is None
    assert client.copy(timeout=5).timeout.read == 5.0  # openai's other name


def test_async_with_options():
    script = Script(error(503), answer())

    async def run():
        http = httpx.AsyncClient(transport=script.transport())
        async with AsyncClient("http://test.local/v1", http_client=http, max_retries=2) as client:
            copy = client.with_options(max_retries=0, deadline=30)
            assert isinstance(copy, AsyncClient) and copy.deadline == 30.0
            with pytest.raises(InternalServerError):
                await copy.chat.completions.create(**CHAT)
            return client.max_retries

    assert asyncio.run(run()) == 2
    assert len(script.requests) == 1


def test_with_options_refuses_unknown_settings():
    with pytest.raises(TypeError):
        Client("http://test.local/v1").with_options(retries=3)


# ---- model_dump ---------------------------------------------------------------------------------

RESPONSE_TYPES = [cls for _, cls in inspect.getmembers(types, inspect.isclass)
                  if issubclass(cls, types._Object) and cls is not types._Object]


def test_every_response_type_is_covered():
    names = {cls.__name__ for cls in RESPONSE_TYPES}
    assert {"ChatCompletion", "ChatCompletionChunk", "Completion", "ModelList", "Usage",
            "SpeculationReport", "ChatChoice", "ChoiceDelta"} <= names


@pytest.mark.parametrize("cls", RESPONSE_TYPES, ids=lambda c: c.__name__)
def test_model_dump_is_the_json_the_server_sent_unknown_fields_included(cls):
    data = {"vendor_field": {"nested": [1, 2]}, "note": "café ☕", "id": None}
    obj = cls.from_dict(data)
    dumped = obj.model_dump()
    assert dumped == data  # no fields added (no None defaults), none lost
    dumped["vendor_field"]["nested"].append(3)
    assert obj.model_dump() == data  # a copy
    text = obj.model_dump_json()
    assert json.loads(text) == data
    assert "café ☕" in text and ", " not in text  # compact, non-ASCII kept, as pydantic's
    assert json.loads(obj.model_dump_json(indent=2)) == data
    assert "\n  " in obj.model_dump_json(indent=2)


def test_a_full_response_dumps_whole_with_its_nested_parts():
    body = completion(speculation={"target_passes": 3, "per_source": {"prediction": {"rounds": 1}}},
                      foretell={"notes": ["x"]})
    response = client_for(Script(answer(body=body))).chat.completions.create(**CHAT)
    assert response.model_dump() == body
    assert response.usage.model_dump() == body["usage"]
    assert response.speculation.per_source["prediction"].model_dump() == {"rounds": 1}
    assert json.loads(response.model_dump_json()) == body
