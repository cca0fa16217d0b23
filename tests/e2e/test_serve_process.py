"""``foretell serve`` as a process, for what only the process shows (tests/e2e/conftest.py's
``serve_process``, shared with the probe):

- its logs (issue 11, item 6) with ``--log-format json``: every line on stderr is a JSON object,
  each request has exactly one ``foretell.access`` line with its fields (local, upstream, failed),
  and no prompt, prediction or key ever appears;
- its memory: a chunked body is never held whole (issue 10);
- its event loop never waits for tokenisation: ``/health`` answers while a huge prompt is handled
  (issue 10), with nothing else in the process competing for it.

The server's logs and hardening in process are tests/proxy/server/test_logs.py and
test_hardening.py."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from foretell.proxy.server.logs import ACCESS_FIELDS
from tests.e2e.conftest import KEY, UPSTREAM_KEY, WRONG_KEY
from tests.helpers import assert_envelope

API_KEY = KEY
MODEL = "tiny"
AUTH = {"authorization": f"Bearer {API_KEY}"}
PROMPT_TEXT = "zebra crossing seventeen"
PREDICTION_TEXT = "purple elephant marmalade"
SECRETS = (API_KEY, WRONG_KEY, UPSTREAM_KEY, PROMPT_TEXT, PREDICTION_TEXT, "zebra", "marmalade")


@pytest.fixture(scope="module")
def server(serve_process):
    return serve_process


# ---- logs ---------------------------------------------------------------------------------------------

def send(server, request_id: str, path: str, body: dict | None = None, key: str = API_KEY,
         method: str = "POST") -> httpx.Response:
    headers = {"x-request-id": request_id, "authorization": f"Bearer {key}"}
    return httpx.request(method, server.base + path, json=body, headers=headers, timeout=60)


def log_entries(server) -> list[dict]:
    entries = []
    for line in server.log().splitlines():
        if line.strip():
            entries.append(json.loads(line))  # every line is JSON, uvicorn's and the loader's too
    return entries


def access_line(server, request_id: str) -> dict:
    deadline = time.time() + 10
    while True:
        lines = [e for e in log_entries(server) if e["logger"] == "foretell.access"
                 and e.get("request_id") == request_id]
        if lines or time.time() > deadline:
            assert len(lines) == 1, lines
            return lines[0]
        time.sleep(0.1)


def test_every_line_is_json_with_time_level_logger_and_message(server):
    entries = log_entries(server)
    assert entries
    for entry in entries:
        assert {"time", "level", "logger", "message"} <= set(entry), entry
        assert entry["level"] in ("debug", "info", "warning", "error", "critical")
    loggers = {entry["logger"] for entry in entries}
    assert "foretell.server" in loggers  # "serving on ..."
    assert any(name.startswith("uvicorn") for name in loggers)  # uvicorn's start-up, in our format
    assert "uvicorn.access" not in loggers  # replaced by foretell.access


def test_a_local_chat_has_one_access_line_with_its_counts(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT_TEXT}], "max_tokens": 8,
            "prediction": {"type": "content", "content": PREDICTION_TEXT}}
    response = send(server, "req-log-chat", "/v1/chat/completions", body)
    assert response.status_code == 200
    usage = response.json()["usage"]
    line = access_line(server, "req-log-chat")
    assert set(ACCESS_FIELDS) <= set(line)
    assert line["method"] == "POST" and line["path"] == "/v1/chat/completions" and line["status"] == 200
    assert line["model"] == "tiny" and line["route"] == "local"
    assert line["prompt_tokens"] == usage["prompt_tokens"]
    assert line["completion_tokens"] == usage["completion_tokens"]
    assert line["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    details = usage["completion_tokens_details"]
    assert line["accepted_prediction_tokens"] == details["accepted_prediction_tokens"]
    assert line["rejected_prediction_tokens"] == details["rejected_prediction_tokens"]
    assert line["target_passes"] == response.json()["speculation"]["target_passes"] >= 1
    assert line["tokens_per_second"] > 0 and line["duration_ms"] > 0
    assert line["level"] == "info" and "req-log-chat" in line["message"]


def test_a_stream_is_logged_when_it_ends_with_its_counts(server):
    body = {"model": "tiny", "prompt": PROMPT_TEXT, "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=60,
                      headers={"x-request-id": "req-log-stream", "authorization": f"Bearer {API_KEY}"}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    usage = events[-1]["usage"]
    line = access_line(server, "req-log-stream")
    assert line["status"] == 200 and line["route"] == "local"
    assert line["completion_tokens"] == usage["completion_tokens"] == 6


def test_upstream_routes_are_named(server):
    ok = send(server, "req-log-up", "/v1/chat/completions",
              {"model": "up-ok", "messages": [{"role": "user", "content": PROMPT_TEXT}]})
    assert ok.status_code == 200
    line = access_line(server, "req-log-up")
    assert line["model"] == "up-ok" and line["route"] == "stub" and line["status"] == 200
    down = send(server, "req-log-down", "/v1/chat/completions",
                {"model": "up-down", "messages": [{"role": "user", "content": PROMPT_TEXT}]})
    assert down.status_code == 502
    line = access_line(server, "req-log-down")
    assert line["route"] == "down" and line["status"] == 502 and line["completion_tokens"] is None
    # The failure's own line names the request too.
    assert any(e["logger"] == "foretell.server" and "req-log-down" in e["message"] for e in log_entries(server))


def test_failed_requests_have_access_lines(server):
    assert send(server, "req-log-401", "/v1/chat/completions", {"model": "tiny"}, key=WRONG_KEY).status_code == 401
    assert access_line(server, "req-log-401")["status"] == 401
    assert send(server, "req-log-nomodel", "/v1/completions",
                {"model": "nope", "prompt": PROMPT_TEXT}).status_code == 404
    line = access_line(server, "req-log-nomodel")
    assert line["status"] == 404 and line["model"] == "nope" and line["route"] is None
    missing_v1 = send(server, "req-log-nov1", "/chat/completions", {"model": "tiny"})
    assert missing_v1.status_code == 404
    assert "did you mean /v1/chat/completions?" in missing_v1.json()["error"]["message"]
    assert access_line(server, "req-log-nov1")["path"] == "/chat/completions"


def test_no_prompt_prediction_or_key_is_ever_logged(server):
    # After the other tests (and once more here) have sent them all.
    send(server, "req-log-last", "/v1/completions",
         {"model": "tiny", "prompt": PROMPT_TEXT, "max_tokens": 2, "prediction": PREDICTION_TEXT})
    access_line(server, "req-log-last")
    text = server.log()
    for secret in SECRETS:
        assert secret not in text, secret



# ---- memory: the body limit holds on a chunked body ------------------------------------------------

def post(server, path: str, body=None, *, content: bytes | None = None, headers=None, timeout=60):
    headers = {**AUTH, "content-type": "application/json", **(headers or {})}
    if content is None:
        content = json.dumps(body).encode()
    return httpx.post(server.base + path, content=content, headers=headers, timeout=timeout)


def test_a_chunked_body_is_never_held_whole(server):
    Path(f"/proc/{server.process.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = server.status("VmRSS")

    def fifty_megabytes():  # no length: httpx sends it chunked
        for _ in range(50):
            yield b" " * (1 << 20)

    response = httpx.post(server.base + "/v1/completions", content=fifty_megabytes(),
                          headers={**AUTH, "content-type": "application/json"}, timeout=60)
    assert_envelope(response, 413)
    grown_mb = (server.status("VmHWM") - before) / 1024
    assert grown_mb < 30, f"the server's peak memory grew by {grown_mb:.0f} MB for a refused body"


# ---- the event loop never waits for tokenisation ----------------------------------------------------

@pytest.mark.parametrize("kind", ["code", "spaces", "messages"])
def test_health_answers_while_a_huge_prompt_is_handled(server, kind):
    # Spaces tokenise 16 to a token: a prefix rule that assumed ordinary text would miss them,
    # and tokenising 3.5 MB of them whole takes about ten seconds. 100k chat messages take a
    # second to validate, and their objects set off a full garbage collection.
    # On the event loop, each would hold /health up for a second or more (tokenising the 3.5 MB of
    # code takes 3 s here, the spaces ten, validating the messages one); off it, an answer takes
    # milliseconds, or ~0.1 s while json.loads holds the GIL on the messages (0.07 s here). 0.5 s
    # tells the two apart and leaves room for a busy machine, which 0.1 s (0.2 s for the
    # messages) did not: a single answer the OS scheduled late would fail it.
    bound = 0.5
    if kind == "messages":
        path, param = "/v1/chat/completions", "messages"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 100_000, "max_tokens": 1}
    else:
        text = "def total(items):\n    result = 0\n" if kind == "code" else " "
        path, param = "/v1/completions", "prompt"
        body = {"model": MODEL, "prompt": (text * (3_500_000 // len(text) + 1))[:3_500_000], "max_tokens": 1}
    outcome = {}

    def send():
        started = time.perf_counter()
        outcome["response"] = post(server, path, body, timeout=120)
        outcome["seconds"] = time.perf_counter() - started

    latencies = []
    with httpx.Client(base_url=server.base, timeout=10) as client:
        client.get("/health")  # connected before the clock starts
        sender = threading.Thread(target=send)
        sender.start()
        while sender.is_alive():
            started = time.perf_counter()
            assert client.get("/health").status_code == 200
            latencies.append(time.perf_counter() - started)
            time.sleep(0.01)
    sender.join()
    error = assert_envelope(outcome["response"], 400, param=param)
    assert error["code"] == "context_length_exceeded"
    assert latencies and max(latencies) < bound, sorted(latencies)[-5:]
    assert outcome["seconds"] < 5, "refusing a prompt over the context should not tokenise all of it"
