"""The edit helper without a model: the prompt, the extraction of the new file, the diff, and a
round trip against a scripted server that answers with the prediction."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from foretell.sdk import (
    AsyncClient,
    Client,
    EditTruncatedError,
    aedit,
    aedit_stream,
    build_edit_prompt,
    edit,
    edit_stream,
    unified_diff,
)
from foretell.sdk.edit import extract_edited_text
from tests.sdk.conftest import Script
from tests.sdk.fakes import Body, answer, chunk, completion, sse, streamed

FILE = "def area(w, h):\n    return w * h\n"


def test_prompt_shows_the_file_and_predicts_the_answers_opening():
    prompt = build_edit_prompt(FILE, "Rename w to width.", filename="geo/shapes.py")
    content = prompt.messages[0]["content"]
    assert "Rename w to width." in content and "```python\n" + FILE + "```" in content
    assert prompt.prediction == "```python\n" + FILE
    assert prompt.stop == ["\n```\n"]
    # Room for the whole answer: (characters / 3 + 1) * 1.5 + 64, as docs/sdk.md says.
    answer_chars = len("```python\n" + FILE)
    assert prompt.max_tokens == int((answer_chars // 3 + 1) * 1.5) + 64


def test_the_fence_outgrows_backticks_in_the_file_and_unknown_types_are_text():
    text = "# Doc\n\n```python\nx = 1\n```\n"
    prompt = build_edit_prompt(text, "Fix it.", filename="README.unknownext")
    assert prompt.fence == "````" and prompt.prediction.startswith("````text\n")
    # A file without a final newline still sits on its own lines inside the fence.
    assert build_edit_prompt("x = 1", "i").prediction == "```text\nx = 1\n"


@pytest.mark.parametrize("output,finish,expected,complete", [
    ("\n```python\na\nb\n```\nSome chatter after.", "stop", "a\nb\n", True),      # closing fence
    ("```python\na\nb", "stop", "a\nb\n", True),                                  # cut by the stop string
    (" ```python\na\nb\n```", "length", "a\nb\n", True),                          # fence closed, then the limit
    ("Sure!\n```py\na\n```", "stop", "a\n", True),                                # preamble before the fence
    ("a\nb\n", "stop", "a\nb\n", True),                                           # no fence at all
    ("```python\na\nb", "length", "a\nb\n", False),                               # truncated
    ("```python\n```", "stop", "", True),                                         # an emptied file
])
def test_extracting_the_new_file(output, finish, expected, complete):
    assert extract_edited_text(output, "```", finish, keep_final_newline=True) == (expected, complete)


def test_a_missing_final_newline_is_kept_missing():
    assert extract_edited_text("```python\nx = 2\n```", "```", "stop", keep_final_newline=False) == ("x = 2", True)


def test_unified_diff_marks_a_missing_final_newline():
    diff = unified_diff("a\nb", "a\nc", "f.txt")
    assert diff.startswith("--- a/f.txt\n+++ b/f.txt\n")
    assert "-b\n\\ No newline at end of file\n+c\n\\ No newline at end of file\n" in diff
    assert unified_diff("same\n", "same\n") == ""


def echo_prediction():
    """A server that answers with the request's prediction (an unchanged copy), cut like a stop
    string would cut it, and records the request body."""
    def handler(request: httpx.Request):
        body = json.loads(request.content)
        return answer(body=completion(body["prediction"]["content"][:-1]))(request)
    return handler


def test_edit_round_trip_returns_text_stats_and_diff():
    script = Script(echo_prediction())
    client = Client("http://test.local/v1", http_client=httpx.Client(transport=script.transport()),
                    server="foretell")
    result = edit(client, FILE, "Keep it.", model="m", filename="shapes.py", prompt_lookup=True)
    body = json.loads(script.requests[0].content)
    assert body["prediction"]["content"] == "```python\n" + FILE
    assert body["temperature"] == 0 and body["stop"] == ["\n```\n"]
    assert body["speculation"] == {"prompt_lookup": True}
    assert result.text == FILE and not result.changed and result.diff == ""
    assert result.accepted_prediction_tokens == 2 and result.rejected_prediction_tokens == 1
    assert result.tokens_per_second > 0 and result.request_id == "req-abc"


def test_edit_raises_on_a_truncated_answer_and_keeps_the_partial_result():
    script = Script(lambda r: httpx.Response(200, json={
        "choices": [{"message": {"content": "```python\ndef area(w,"}, "finish_reason": "length"}]}))
    client = Client("http://test.local/v1", http_client=httpx.Client(transport=script.transport()))
    with pytest.raises(EditTruncatedError, match="max_tokens") as caught:
        edit(client, FILE, "x", model="m", max_tokens=5)
    assert caught.value.result.finish_reason == "length" and not caught.value.result.complete


def test_edit_stream_reports_progress_then_the_result():
    parts = [sse(chunk("```python\n")), sse(chunk("def area(w, h):\n")), sse(chunk("    return w * h")),
             sse(chunk(None, "stop")),
             sse(chunk(None, usage={"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21,
                                    "completion_tokens_details": {"accepted_prediction_tokens": 11,
                                                                  "rejected_prediction_tokens": 0}},
                       speculation={"target_passes": 2})),
             b"data: [DONE]\n\n"]
    script = Script(streamed(Body(parts)))
    client = Client("http://test.local/v1", http_client=httpx.Client(transport=script.transport()))
    stream = edit_stream(client, FILE, "Keep it.", model="m", filename="a.py")
    steps = list(stream)
    assert [s.delta for s in steps] == ["```python\n", "def area(w, h):\n", "    return w * h"]
    assert steps[-1].approx_tokens > steps[0].approx_tokens
    assert stream.result.text == FILE and stream.result.accepted_prediction_tokens == 11
    assert stream.result.speculation.target_passes == 2
    body = json.loads(script.requests[0].content)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_an_edit_stream_runs_once():
    parts = [sse(chunk("```python\n" + FILE)), sse(chunk(None, "stop")), b"data: [DONE]\n\n"]
    script = Script(streamed(Body(parts)))
    client = Client("http://test.local/v1", http_client=httpx.Client(transport=script.transport()))
    stream = edit_stream(client, FILE, "Keep it.", model="m")
    result = stream.until_done()
    assert stream.until_done() is result and result.text == FILE  # no second request
    with pytest.raises(RuntimeError, match="runs once"):
        list(stream)
    assert len(script.requests) == 1


def test_async_edit_and_async_edit_stream():
    script = Script(echo_prediction(), streamed(Body([sse(chunk("```text\nnew\n```\n")), sse(chunk(None, "stop"))])))

    async def run():
        async with AsyncClient("http://test.local/v1",
                               http_client=httpx.AsyncClient(transport=script.transport())) as client:
            first = await aedit(client, "old\n", "Change old to new.", model="m")
            stream = aedit_stream(client, "old\n", "Change old to new.", model="m")
            second = await stream.until_done()
            return first, second

    first, second = asyncio.run(run())
    assert first.text == "old\n" and not first.changed
    assert second.text == "new\n" and second.changed and "-old\n+new\n" in second.diff
