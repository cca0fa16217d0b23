"""The server's logs (issue 11, item 6) and its routing errors (item 5), in process: 404 with a
hint when ``/v1`` is missing, 405, a bug's 500 in the envelope with its traceback logged once
under its request id, and the two log formats. The log of ``foretell serve --log-format json``
as a process (every stderr line JSON, one access line per request, nothing secret) is
tests/e2e/test_serve_process.py.
"""

from __future__ import annotations

import io
import json
import logging
import time
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from foretell.proxy.server import ServerSettings, create_app
from foretell.proxy.server.logs import configure_logging

PROMPT_TEXT = "zebra crossing seventeen"



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
                               batch_invariant=False, native_loops=[], cpu={}, draft_model=None,
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
