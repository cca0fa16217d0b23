"""The server's logs (issue 11, item 6) and its routing errors (item 5).

``foretell serve --log-format json`` as a subprocess: every line on stderr is a JSON object, each
request has exactly one ``foretell.access`` line with its fields (local, upstream, failed), and
no prompt, prediction or key ever appears. In process: 404 with a hint when ``/v1`` is missing,
405, and a bug's 500 in the envelope with its traceback logged once under its request id.
"""

from __future__ import annotations

import io
import json
import logging
import time
from types import SimpleNamespace

import httpx
import pytest
from starlette.testclient import TestClient

from foretell.proxy.server import ServerSettings, create_app
from foretell.proxy.server.logs import ACCESS_FIELDS, configure_logging
from tests.e2e.live_server import live_server
from tests.proxy.server.upstream_stub import StubServer, free_port

API_KEY = "sk-log-test-key-3141"
WRONG_KEY = "sk-wrong-key-2718"
UPSTREAM_KEY = "upstream-log-secret-1618"
PROMPT_TEXT = "zebra crossing seventeen"
PREDICTION_TEXT = "purple elephant marmalade"
SECRETS = (API_KEY, WRONG_KEY, UPSTREAM_KEY, PROMPT_TEXT, PREDICTION_TEXT, "zebra", "marmalade")


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_folder):
    folder = tmp_path_factory.mktemp("logs")
    config = folder / "foretell.toml"
    with StubServer() as stub:
        config.write_text(f"""
[upstreams.stub]
base_url = "{stub.base_url}"
api_key_env = "LOG_TEST_UPSTREAM_KEY"
max_retries = 0

[upstreams.down]
base_url = "http://127.0.0.1:{free_port()}/v1"
max_retries = 0

[models.up-ok]
upstream = "stub"
[models.up-down]
upstream = "down"
""")
        with live_server(tiny_model_folder, folder / "server.log", "--served-model-name", "tiny",
                         "--log-format", "json", "--api-key", API_KEY, "--config", str(config),
                         env={"LOG_TEST_UPSTREAM_KEY": UPSTREAM_KEY}) as live:
            yield live


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


# ---- in process -----------------------------------------------------------------------------------

class _BrokenTokenizer:
    chat_template = None
    bos_token = None

    def __call__(self, text, **_):
        raise RuntimeError("tokenizer exploded")


def _client(load_local=None) -> TestClient:
    def no_model(metrics):
        raise RuntimeError("no model in this test")

    app = create_app(ServerSettings(served_model_name="fake"), load_local=load_local or no_model)
    return TestClient(app, base_url="http://127.0.0.1")


@pytest.mark.parametrize("method, path, hint", [
    ("POST", "/chat/completions", "/v1/chat/completions"),
    ("POST", "/completions", "/v1/completions"),
    ("GET", "/models", "/v1/models"),
    ("GET", "/v1/v1/models", "/v1/models"),
    ("GET", "/models/", "/v1/models"),
    ("GET", "/v1/nothing-here", None),
    ("POST", "/something", None),
])
def test_unknown_paths_are_404_envelopes_with_a_hint(method, path, hint):
    response = _client().request(method, path, json={"model": "x"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "unknown_url" and f"{method} {path}" in error["message"]
    if hint is None:
        assert "did you mean" not in error["message"]
    else:
        assert f"did you mean {hint}?" in error["message"]
    assert response.headers["x-request-id"]


def test_wrong_methods_are_405_envelopes_naming_the_method():
    response = _client().get("/v1/chat/completions")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    error = response.json()["error"]
    assert error["code"] == "method_not_allowed"
    assert error["message"] == "method GET is not allowed on /v1/chat/completions; use POST"


def test_a_bug_is_a_500_envelope_and_one_traceback_with_the_request_id(caplog):
    def broken(metrics):
        scheduler = SimpleNamespace(close=lambda: None, queued=0, running=0)
        return SimpleNamespace(name="fake", tokenizer=_BrokenTokenizer(), context=None, scheduler=scheduler,
                               chat_stops=(), chat_stop_token_ids=(), precision="float32",
                               kernels={"mode": "reference", "triton": [], "fallback": {}})

    caplog.set_level(logging.INFO)
    with _client(broken) as client:
        deadline = time.time() + 30
        while client.get("/health").status_code != 200:
            assert time.time() < deadline
            time.sleep(0.05)
        response = client.post("/v1/completions", json={"model": "fake", "prompt": PROMPT_TEXT},
                               headers={"x-request-id": "req-bug-1"})
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["type"] == "server_error" and "req-bug-1" in error["message"]
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1
    assert tracebacks[0].name == "foretell.server" and "req-bug-1" in tracebacks[0].getMessage()
    assert "tokenizer exploded" in caplog.text
    (access,) = [r for r in caplog.records if r.name == "foretell.access" and r.access["request_id"] == "req-bug-1"]
    assert access.access["status"] == 500 and access.access["route"] == "local"
    assert PROMPT_TEXT not in caplog.text


def test_text_and_json_formats():
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        for fmt in ("text", "json"):
            stream = io.StringIO()
            configure_logging("info", fmt, stream)
            logging.getLogger("foretell.server").debug("hidden at info")
            logging.getLogger("foretell.server").info("shown %s", 1)
            logging.getLogger("some.library").info("other libraries: warnings only")
            try:
                raise ValueError("traced")
            except ValueError:
                logging.getLogger("foretell.server").exception("failed")
            out = stream.getvalue()
            assert "hidden" not in out and "other libraries" not in out
            if fmt == "json":
                shown, failed = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
                assert shown["message"] == "shown 1" and shown["logger"] == "foretell.server"
                assert shown["level"] == "info" and shown["time"].endswith("Z")
                assert "ValueError: traced" in failed["exc_info"]
            else:
                assert "INFO    foretell.server: shown 1" in out and "ValueError: traced" in out
        stream = io.StringIO()
        configure_logging("warning", "text", stream)
        logging.getLogger("foretell.access").info("an access line")
        assert stream.getvalue() == ""
    finally:
        root.handlers[:] = [h for h in saved[0]]
        root.setLevel(saved[1])
        for name in ("foretell", "uvicorn", "uvicorn.error"):
            logging.getLogger(name).setLevel(logging.NOTSET)
        logging.getLogger("uvicorn.access").disabled = False
        logging.captureWarnings(False)
        from transformers.utils import logging as transformers_logging

        transformers_logging.enable_default_handler()
        transformers_logging.disable_propagation()
        transformers_logging.enable_progress_bar()
        from foretell.proxy.engine import model_loader

        model_loader.progress_logger = None
    with pytest.raises(ValueError):
        configure_logging("loud", "text")
