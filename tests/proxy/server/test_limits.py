"""A limit means the same on every route: a prediction over ``max_prediction_chars`` is a 413
(``prediction_too_large``) whether the model runs locally, is verified remotely by an upstream
(``verify_predictions``) or is forwarded plainly, and never reaches an upstream. One in-process
server on the tiny model, routing two models to the stub upstream (``harness/upstream_stub.py``)."""

from __future__ import annotations

import time

import pytest
from starlette.testclient import TestClient

from foretell.proxy.engine import SpeculativeEngine
from foretell.proxy.engine.scheduler import Scheduler
from foretell.proxy.server import ServerSettings, create_app
from foretell.proxy.server.app import LocalModel
from foretell.proxy.server.upstream import ModelRoute, RouteTable, Upstream
from harness.upstream_stub import ECHO_GOLD, ECHO_PROMPT, StubServer

LIMIT = 200
WITHIN = ECHO_GOLD[:LIMIT]
OVER = ECHO_GOLD[:LIMIT] + " " * (LIMIT + 1 - len(ECHO_GOLD[:LIMIT]))
ROUTES = {"tiny": "local", "echo-ok": "verified remotely", "up-ok": "forwarded"}


class _Loaded:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer


@pytest.fixture(scope="module")
def served(tiny_model, tokenizer):
    def load(metrics):
        return LocalModel(_Loaded(tokenizer), Scheduler(SpeculativeEngine(tiny_model, tokenizer, kv_cache_tokens=1024)),
                          "tiny")

    with StubServer() as stub:
        routes = RouteTable(
            upstreams={"verifying": Upstream(name="verifying", base_url=stub.base_url, verify_predictions="echo",
                                             verify_always=True, max_retries=0),
                       "plain": Upstream(name="plain", base_url=stub.base_url, max_retries=0)},
            models={"echo-ok": ModelRoute(upstream="verifying"), "up-ok": ModelRoute(upstream="plain")})
        app = create_app(ServerSettings(max_prediction_chars=LIMIT, routes=routes), load_local=load)
        with TestClient(app, base_url="http://127.0.0.1") as client:
            deadline = time.time() + 120
            while client.get("/health").status_code != 200:
                assert time.time() < deadline, client.get("/health").text
                time.sleep(0.05)
            yield client, stub


def _completion(client, model: str, prediction: str, stream: bool = False):
    return client.post("/v1/completions", json={
        "model": model, "prompt": ECHO_PROMPT, "max_tokens": 4, "temperature": 0, "stream": stream,
        "prediction": {"type": "content", "content": prediction}})


@pytest.mark.parametrize("model", ROUTES, ids=list(ROUTES.values()))
def test_a_prediction_within_the_limit_is_answered(served, model):
    client, _ = served
    response = _completion(client, model, WITHIN)
    assert response.status_code == 200, response.text
    if model == "echo-ok":  # the loop ran here: the route under test is remote verification
        assert response.headers["x-foretell-note"].startswith("prediction verified remotely")


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
@pytest.mark.parametrize("model", ROUTES, ids=list(ROUTES.values()))
def test_the_same_oversize_prediction_is_413_on_every_route(served, model, stream):
    client, stub = served
    assert len(OVER) == LIMIT + 1
    response = _completion(client, model, OVER, stream)
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["code"] == "prediction_too_large" and error["param"] == "prediction"
    assert not any(OVER in str(seen["body"]) for seen in stub.received)  # refused before any upstream


def test_chat_is_refused_alike(served):
    client, _ = served
    for model in ROUTES:
        response = client.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
            "prediction": {"type": "content", "content": [{"type": "text", "text": OVER}]}})
        assert response.status_code == 413, (model, response.text)
        assert response.json()["error"]["code"] == "prediction_too_large"
