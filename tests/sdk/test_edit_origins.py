"""``edit_stream(..., report_origins=True)``: each step's ``origins`` from the server's
``foretell.origins`` runs; the field is asked of foretell servers only."""

from __future__ import annotations

import asyncio
import json

import httpx

from foretell.sdk import AsyncClient, Client, edit_stream
from foretell.sdk.edit import aedit_stream
from tests.sdk.conftest import Script
from tests.sdk.fakes import Body, answer, chunk, sse, streamed

FILE = "x = 1\n"
MODELS = {"object": "list", "data": [{"id": "m"}]}


def parts() -> list[bytes]:
    return [sse(chunk("```python\n", foretell={"origins": [{"text": "```python\n", "origin": "prediction"}]})),
            sse(chunk("x = 1", foretell={"origins": [{"text": "x = ", "origin": "prediction"},
                                                     {"text": "1", "origin": None}]})),
            sse(chunk(None, "stop")), b"data: [DONE]\n\n"]


def test_a_foretell_server_is_asked_and_steps_carry_the_runs():
    script = Script(answer(body=MODELS), streamed(Body(parts())))
    client = Client("http://test.local/v1", http_client=httpx.Client(transport=script.transport()))
    stream = edit_stream(client, FILE, "Keep it.", model="m", report_origins=True, prompt_lookup=False)
    steps = list(stream)
    assert script.paths() == ["GET /v1/models", "POST /v1/chat/completions"]  # the server's kind first
    body = json.loads(script.requests[1].content)
    assert body["speculation"] == {"prompt_lookup": False, "report_origins": True}
    assert [s.origins for s in steps] == [[("```python\n", "prediction")],
                                          [("x = ", "prediction"), ("1", None)]]
    assert stream.result.text == FILE


def test_other_servers_are_not_asked_and_steps_have_no_origins():
    plain = [sse(chunk("```python\nx = 1")), sse(chunk(None, "stop")), b"data: [DONE]\n\n"]
    script = Script(answer(body=MODELS, foretell=False), streamed(Body(plain), foretell=False))
    client = Client("http://test.local/v1", http_client=httpx.Client(transport=script.transport()))
    steps = list(edit_stream(client, FILE, "Keep it.", model="m", report_origins=True))
    assert "speculation" not in json.loads(script.requests[-1].content)
    assert [s.origins for s in steps] == [None]


def test_without_report_origins_nothing_is_asked():
    script = Script(streamed(Body(parts())))
    client = Client("http://test.local/v1", http_client=httpx.Client(transport=script.transport()),
                    server="foretell")
    list(edit_stream(client, FILE, "Keep it.", model="m"))
    assert script.paths() == ["POST /v1/chat/completions"]
    assert "speculation" not in json.loads(script.requests[0].content)


def test_the_async_stream_asks_too():
    async def main():
        script = Script(streamed(Body(parts())))
        async with AsyncClient("http://test.local/v1", server="foretell",
                               http_client=httpx.AsyncClient(transport=script.transport())) as client:
            steps = [s async for s in aedit_stream(client, FILE, "Keep it.", model="m", report_origins=True)]
        assert json.loads(script.requests[0].content)["speculation"] == {"report_origins": True}
        return steps

    steps = asyncio.run(main())
    assert steps[1].origins == [("x = ", "prediction"), ("1", None)]
