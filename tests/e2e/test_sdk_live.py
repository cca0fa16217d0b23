"""The SDK against a real ``foretell serve`` on 127.0.0.1 with the embedded model.

Exactness, not quality: the embedded 270M base model edits poorly, but whatever it writes with a
prediction must be what it writes without one (greedy, prompt lookup off, no prediction).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from foretell.sdk import AsyncClient, Client, NotFoundError, build_edit_prompt, edit, edit_stream

pytestmark = pytest.mark.embedded

MODEL = "gemma-3-270m"
# A file and instruction the embedded model copies back in a fenced block (checked by hand).
FILE = ("def area(width, height):\n    return width * height\n\n\n"
        "def perimeter(width, height):\n    return 2 * (width + height)\n")
INSTRUCTION = "Rename width to w."


@pytest.fixture(scope="module")
def client(embedded_server):
    with Client(embedded_server, max_retries=0, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def plain_edit_answer(client):
    """The edit request answered without speculation: no prediction, prompt lookup off."""
    prompt = build_edit_prompt(FILE, INSTRUCTION, filename="shapes.py")
    response = client.chat.completions.create(model=MODEL, messages=prompt.messages, temperature=0,
                                              max_tokens=prompt.max_tokens, stop=prompt.stop,
                                              prompt_lookup=False, draft_cache=False)
    assert response.speculation.drafted_tokens == 0
    return response


def test_chat_with_a_prediction_equals_plain_greedy_and_accepts_prediction_tokens(client, plain_edit_answer):
    prompt = build_edit_prompt(FILE, INSTRUCTION, filename="shapes.py")
    response = client.chat.completions.create(model=MODEL, messages=prompt.messages, temperature=0,
                                              max_tokens=prompt.max_tokens, stop=prompt.stop,
                                              prediction=prompt.prediction, prompt_lookup=False)
    assert response.text == plain_edit_answer.text
    assert response.usage.completion_tokens == plain_edit_answer.usage.completion_tokens
    assert response.usage.accepted_prediction_tokens > 0
    assert response.speculation.target_passes < response.usage.completion_tokens
    assert response.speculation.per_source["prediction"].accepted > 0
    assert response.request_id.startswith("req-")
    assert client.server_kind == "foretell"


def test_sampled_chat_with_a_prediction_replays_its_seed(client):
    prompt = build_edit_prompt(FILE, INSTRUCTION, filename="shapes.py")
    kwargs = dict(model=MODEL, messages=prompt.messages, max_tokens=12, temperature=0.7, seed=42,
                  prediction=prompt.prediction, logprobs=True, top_logprobs=2)
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    assert again.text == first.text and first.speculation.seed == 42
    assert first.speculation.drafted_tokens > 0
    assert len(first.choices[0].logprobs["content"]) == first.usage.completion_tokens


def test_edit_round_trip_equals_the_plain_answer(client, plain_edit_answer):
    result = edit(client, FILE, INSTRUCTION, model=MODEL, filename="shapes.py")
    assert result.output == plain_edit_answer.text
    assert result.finish_reason == plain_edit_answer.choices[0].finish_reason
    assert result.accepted_prediction_tokens > 0 and result.tokens_per_second > 0
    assert result.text.strip()  # something was extracted from the fenced answer
    streamed = edit_stream(client, FILE, INSTRUCTION, model=MODEL, filename="shapes.py")
    steps = list(streamed)
    assert steps and "".join(s.delta for s in steps) == plain_edit_answer.text
    assert streamed.result.text == result.text and streamed.result.diff == result.diff
    assert streamed.result.usage.completion_tokens == plain_edit_answer.usage.completion_tokens


def test_completions_streaming_equals_non_streaming(client):
    kwargs = dict(model=MODEL, prompt="def add(a, b):\n", max_tokens=12, prompt_lookup=True)
    plain = client.completions.create(**kwargs)
    with client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}) as stream:
        chunks = list(stream)
    assert "".join(c.text for c in chunks) == plain.text and plain.text
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens == 12
    assert chunks[-1].speculation is not None and "prompt_lookup" in chunks[-1].speculation.per_source
    assert plain.choices[0].finish_reason == "length"


def test_chat_streaming_equals_non_streaming(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Count: one, two, three,"}],
                  max_tokens=10)
    plain = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert "".join(c.text for c in chunks) == plain.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is None  # include_usage not asked for


def test_async_client_runs_concurrent_requests(embedded_server, client):
    prompts = ["x = 1\ny = 2\n", "import os\n", "class A:\n"]
    expected = [client.completions.create(model=MODEL, prompt=p, max_tokens=6).text for p in prompts]

    async def run():
        async with AsyncClient(embedded_server, max_retries=0, timeout=300) as aclient:
            results = await asyncio.gather(*(aclient.completions.create(model=MODEL, prompt=p, max_tokens=6)
                                             for p in prompts))
            stream = await aclient.completions.create(model=MODEL, prompt=prompts[0], max_tokens=6, stream=True)
            streamed = "".join([c.text async for c in stream])
            return [r.text for r in results], streamed

    texts, streamed = asyncio.run(run())
    assert texts == expected and streamed == expected[0]


def test_stopping_a_stream_early_cancels_and_leaves_the_server_healthy(embedded_server, client):
    base = embedded_server.removesuffix("/v1")
    with client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=400,
                                   stream=True) as stream:
        for index, _ in enumerate(stream):
            if index == 1:
                break
    assert stream.response.is_closed
    started = time.monotonic()
    after = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=3)
    assert after.usage.completion_tokens == 3
    assert time.monotonic() - started < 60  # not stuck behind 400 tokens
    assert httpx.get(base + "/health", timeout=10).status_code == 200
    # The server sees the hang-up on its next write and the engine then drops the sequence: on
    # its own clock, not necessarily before the next request has finished.
    deadline = time.monotonic() + 60
    while 'finish_reason="cancelled"' not in httpx.get(base + "/metrics", timeout=10).text:
        assert time.monotonic() < deadline, "the abandoned stream was never cancelled"
        time.sleep(0.1)


def test_errors_from_the_live_server_are_typed(client):
    with pytest.raises(NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert caught.value.request_id.startswith("req-") and "no-such-model" in caught.value.message
    assert [m.id for m in client.models.list().data][0] == MODEL
