"""Retries are logged under "foretell.sdk" (never with the API key); FORETELL_LOG=info|debug
sends them to stderr."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys

import httpx
import pytest

from foretell.sdk import AsyncClient, Client, RetryPolicy
from foretell.sdk._logs import _EnvHandler, logger, setup_logging
from tests.sdk.conftest import Script
from tests.sdk.fakes import CHAT, KEY, answer, error


def client_for(script: Script, **kwargs) -> Client:
    return Client("http://test.local/v1", KEY, http_client=httpx.Client(transport=script.transport()),
                  retry_policy=RetryPolicy(max_retries=2, random=lambda: 1.0), sleep=lambda s: None,
                  **kwargs)


def sdk_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "foretell.sdk"]


def test_each_retry_is_logged_with_attempt_wait_status_and_request_id(caplog):
    caplog.set_level(logging.INFO, logger="foretell.sdk")
    script = Script(error(503, f"overloaded, key {KEY}"), error(429, retry_after="2"), answer())
    client_for(script).chat.completions.create(**CHAT)
    messages = [r.getMessage() for r in sdk_records(caplog)]
    assert messages == [
        "retrying POST http://test.local/v1/chat/completions in 0.50 s (retry 1 of 2) after "
        "503 InternalServerError (request req-abc)",
        "retrying POST http://test.local/v1/chat/completions in 2.00 s (retry 2 of 2) after "
        "429 RateLimitError (request req-abc)",
    ]
    assert all(r.levelno == logging.INFO for r in sdk_records(caplog))


def test_a_connection_error_retry_names_the_error_class(caplog):
    caplog.set_level(logging.INFO, logger="foretell.sdk")
    script = Script(httpx.ConnectError(f"refused {KEY}"), answer())
    client_for(script).chat.completions.create(**CHAT)
    (record,) = sdk_records(caplog)
    assert "retry 1 of 2" in record.getMessage()
    assert "APIConnectionError: could not connect to http://test.local/v1" in record.getMessage()


def test_no_log_record_holds_the_api_key(caplog):
    caplog.set_level(logging.DEBUG, logger="foretell.sdk")
    script = Script(httpx.ConnectError(f"refused while sending {KEY}"),
                    error(500, f"bad key {KEY}"), error(401, f"bad key {KEY}"))
    with pytest.raises(Exception):
        client_for(script).chat.completions.create(**CHAT)
    records = sdk_records(caplog)
    assert len(records) >= 5  # requests and answers at DEBUG, two retries at INFO
    for record in records:
        assert KEY not in record.getMessage()
        assert KEY not in repr(record.args) and KEY not in repr(record.__dict__)


def test_debug_logs_each_request_and_answer(caplog):
    caplog.set_level(logging.DEBUG, logger="foretell.sdk")
    client_for(Script(answer())).chat.completions.create(**CHAT)
    messages = [r.getMessage() for r in sdk_records(caplog)]
    assert messages == ["POST http://test.local/v1/chat/completions",
                        "POST http://test.local/v1/chat/completions -> 200 (request req-abc)"]


def test_the_async_client_logs_retries_too(caplog):
    caplog.set_level(logging.INFO, logger="foretell.sdk")
    script = Script(error(502), answer())

    async def no_sleep(seconds: float) -> None:
        pass

    async def run():
        async with AsyncClient("http://test.local/v1", sleep=no_sleep,
                               http_client=httpx.AsyncClient(transport=script.transport()),
                               retry_policy=RetryPolicy(random=lambda: 1.0)) as client:
            await client.chat.completions.create(**CHAT)

    asyncio.run(run())
    (record,) = sdk_records(caplog)
    assert "retry 1 of 2" in record.getMessage() and "502" in record.getMessage()


def test_nothing_is_logged_without_retries_at_info(caplog):
    caplog.set_level(logging.INFO, logger="foretell.sdk")
    client_for(Script(answer())).chat.completions.create(**CHAT)
    assert sdk_records(caplog) == []


@pytest.fixture
def clean_logger():
    handlers, level = list(logger.handlers), logger.level
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)


def test_foretell_log_adds_one_stderr_handler_at_its_level(clean_logger):
    setup_logging({"FORETELL_LOG": "Debug"})
    setup_logging({"FORETELL_LOG": "info"})
    env_handlers = [h for h in logger.handlers if isinstance(h, _EnvHandler)]
    assert len(env_handlers) == 1 and env_handlers[0].stream is sys.stderr
    assert logger.level == logging.INFO


@pytest.mark.parametrize("value", ["", "verbose"])
def test_foretell_log_unset_or_unknown_changes_nothing(clean_logger, value):
    before = list(logger.handlers)
    setup_logging({"FORETELL_LOG": value} if value else {})
    assert logger.handlers == before


RETRY_SCRIPT = f"""
import httpx
from foretell.sdk import Client, RetryPolicy
answers = [httpx.Response(503, json={{"error": {{"message": "busy"}}}}, headers={{"x-request-id": "r-1"}}),
           httpx.Response(200, json={{"choices": [{{"message": {{"content": "ok"}}}}]}})]
http = httpx.Client(transport=httpx.MockTransport(lambda request: answers.pop(0)))
client = Client("http://test.local/v1", {KEY!r}, http_client=http, sleep=lambda s: None)
print(client.chat.completions.create(model="m", messages=[]).text)
"""


@pytest.mark.parametrize("level,expect", [("info", True), ("debug", True), (None, False)])
def test_foretell_log_in_a_fresh_process_prints_retries_to_stderr(level, expect):
    env = {k: v for k, v in os.environ.items() if k != "FORETELL_LOG"}
    if level:
        env["FORETELL_LOG"] = level
    result = subprocess.run([sys.executable, "-c", RETRY_SCRIPT], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    assert ("retrying POST http://test.local/v1/chat/completions" in result.stderr) is expect
    assert ("503 InternalServerError (request r-1)" in result.stderr) is expect
    assert ("-> 200" in result.stderr) is (level == "debug")
    assert KEY not in result.stderr
