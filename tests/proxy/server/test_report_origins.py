"""The ``report_origins`` stream extension over HTTP, on the shared in-process tiny server
(tests/conftest.py): spans that rebuild each chunk's text, only when asked, a boolean. (The
playground page that draws them is tests/e2e/test_playground.py.)"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers import GREEDY_PROMPT, GREEDY_TOKENS

PROMPT, TOKENS = GREEDY_PROMPT, GREEDY_TOKENS  # the greedy fixture's request


@pytest.fixture(scope="module")
def served(tiny_server):
    return tiny_server


def events(base: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", base + path, json=body, timeout=120) as response:
        assert response.status_code == 200
        data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(item) for item in data[:-1]]


@pytest.mark.parametrize("path, request_body, text_of", [
    ("/v1/completions", {"prompt": PROMPT}, lambda c: c["choices"][0]["text"] if c["choices"] else ""),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]},
     lambda c: (c["choices"][0]["delta"].get("content") or "") if c["choices"] else ""),
])
def test_report_origins_adds_spans_that_rebuild_each_chunk(served, greedy, path, request_body, text_of):
    body = {"model": "tiny", "max_tokens": TOKENS, "stream": True, **request_body,
            "prediction": {"type": "content", "content": greedy}}
    plain = events(served.base, path, body)
    assert all("foretell" not in chunk for chunk in plain)  # plain OpenAI clients: unchanged chunks
    reported = events(served.base, path, {**body, "speculation": {"report_origins": True}})
    assert "".join(map(text_of, reported)) == "".join(map(text_of, plain))
    seen = set()
    for chunk in reported:
        text = text_of(chunk)
        if not text:
            assert "foretell" not in chunk
            continue
        report = chunk["foretell"]
        assert "".join(span["text"] for span in report["origins"]) == text
        assert report["tokens"] >= 1 and report["passes"] >= 1
        seen |= {span["origin"] for span in report["origins"]}
    if path == "/v1/completions":  # the prediction is the completion's own greedy text
        assert seen == {"prediction", None}
    # The same chunks otherwise (where they split depends on the draft lengths chosen, which
    # follow the measured pass cost): only the extension field is added.
    shapes = {(frozenset(c) - {"foretell"}, frozenset(c["choices"][0]) if c["choices"] else None)
              for c in reported}
    assert shapes == {(frozenset(c), frozenset(c["choices"][0]) if c["choices"] else None) for c in plain}


def test_report_origins_must_be_a_boolean(served):
    response = httpx.post(served.base + "/v1/completions", json={
        "model": "tiny", "prompt": "x", "speculation": {"report_origins": "yes"}})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "speculation.report_origins"
