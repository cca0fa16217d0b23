"""The server's hardening (issue 10), over real HTTP: the server on the tiny model in process
(tests/serving.py) and a stub upstream that misbehaves on purpose
(harness/upstream_stub.py); plus the pure pieces (redaction across chunks, the Host
check, the sampling filters, prediction usage). What only a process shows (its memory under a
chunked body, /health while a huge prompt is handled) is tests/e2e/test_serve_process.py."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import time

import httpx
import pytest
import torch

from foretell.proxy.prediction_usage import prediction_token_usage
from foretell.proxy.engine.sampling import target_probs
from foretell.proxy.server import upstream as upstream_module
from foretell.proxy.server.guard import KNOWN_PATHS, allowed_hosts, host_allowed
from foretell.proxy.server.redact import Redactor
from tests.helpers import assert_envelope
from harness.upstream_stub import StubServer
from tests.serving import LogRecords, route_table, serve, tiny_app

API_KEY = "sk-hardening"
UPSTREAM_KEY = "route-key-0123456789abcdef"
MODEL = "tiny"
LIMIT = 4_000_000  # --max-body-bytes: room for a 3.5 MB prompt
AUTH = {"authorization": f"Bearer {API_KEY}"}
MISBEHAVING = ("leak-4xx", "leak-5xx", "leak-stream", "leak-redirect", "gzip-stream", "die-stream")


@pytest.fixture(scope="module")
def upstream():
    with StubServer(log_level="critical") as stub:  # "die-stream" fails on purpose: no traceback
        yield stub


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_folder, upstream):
    """The server ``foretell serve --api-key --config --max-body-bytes 4000000`` builds, with
    FORETELL_ALLOWED_HOSTS=proxy.example, in process; ``server.log()`` is its log."""
    routes = route_table(
        f'[upstreams.stub]\nbase_url = "{upstream.base_url}"\napi_key_env = "STUB_KEY"\nmax_retries = 0\n'
        + "".join(f'[models."{model}"]\nupstream = "stub"\n' for model in MISBEHAVING),
        tmp_path_factory.mktemp("hardening"))
    with pytest.MonkeyPatch.context() as patch, LogRecords() as log:
        patch.setenv("STUB_KEY", UPSTREAM_KEY)
        app = tiny_app(tiny_model_folder, served_model_name=MODEL, api_keys=(API_KEY,), routes=routes,
                       max_body_bytes=LIMIT, allowed_hosts=("proxy.example",))
        with serve(app, "hardening") as served:
            served.log = log.text
            yield served


def post(server, path: str, body=None, *, content: bytes | None = None, headers=None, timeout=60):
    headers = {**AUTH, "content-type": "application/json", **(headers or {})}
    if content is None:
        content = json.dumps(body).encode()
    return httpx.post(server.base + path, content=content, headers=headers, timeout=timeout)


def requests_counted(server, status: int) -> float:
    text = httpx.get(server.base + "/metrics", headers=AUTH).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("foretell_requests_total") and f'status="{status}"' in line)


def log_lines(server, needle: str, timeout: float = 5.0) -> list[str]:
    """The server's log lines holding ``needle`` (waiting a little for them to be written), but
    for the access line every request has."""
    deadline = time.time() + timeout
    while True:
        lines = [line for line in server.log().splitlines() if needle in line and "foretell.access" not in line]
        if lines or time.time() > deadline:
            return lines
        time.sleep(0.1)


# ---- 1. the body limit holds on a chunked body ---------------------------------------------------

def test_a_chunked_body_over_the_limit_is_refused_before_it_ends(server):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n")
    chunk = b" " * 65536
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        sock.sendall(head.encode())
        for _ in range(LIMIT // len(chunk) + 16):  # 1 MB past the limit, and never the last chunk
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        sock.settimeout(10)
        answer = sock.recv(65536)  # a server waiting for the end of the body never answers
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"body_too_large" in answer or b"x-request-id" in answer


def test_a_declared_length_one_byte_over_the_limit_is_refused_before_the_body(server):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {LIMIT + 1}\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        sock.sendall(head.encode())  # and not one byte of the body: the header alone must do
        sock.settimeout(10)
        answer = sock.recv(65536)  # a server that reads the body first never answers
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


# ---- 3. the event loop never waits for tokenisation ------------------------------------------------

# ---- 4. bad input is a 400, never a 500 --------------------------------------------------------------

@pytest.mark.parametrize("depth", [100, 1000, 100_000])
def test_deeply_nested_json_is_a_400(server, depth):
    counted = requests_counted(server, 400)
    content = ('{"model": "tiny", "prompt": "x", "junk": ' + "[" * depth + "]" * depth + "}").encode()
    assert_envelope(post(server, "/v1/completions", content=content), 400)
    assert requests_counted(server, 400) == counted + 1
    assert httpx.get(server.base + "/health").status_code == 200


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}',
     "messages.0.content"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "prediction": {"type": "content", "content": "\\ud800"}}',
     "prediction.content"),
])
def test_lone_surrogates_are_a_400_naming_the_field(server, path, body, param):
    error = assert_envelope(post(server, path, content=body.encode()), 400, param=param)
    assert "surrogate" in error["message"]


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_seeds_outside_64_bits_are_refused(server, seed):
    assert_envelope(post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 0.8,
                                                     "seed": seed}), 400, param="seed")


def test_the_largest_seed_with_two_choices_does_not_overflow(server):
    body = {"model": MODEL, "prompt": "def f(", "max_tokens": 4, "temperature": 0.8, "seed": 2**64 - 1, "n": 2}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 2
    assert response.json()["speculation"]["seed"] == 2**64 - 1
    negative = post(server, "/v1/completions", {**body, "seed": -(2**63), "n": 1})
    assert negative.status_code == 200, negative.text


def test_a_vanishing_top_p_samples_the_top_token(server):
    body = {"model": MODEL, "prompt": "def f(", "max_tokens": 4, "temperature": 1.0, "top_p": 1e-300}
    sampled = post(server, "/v1/completions", {**body, "seed": 5})
    greedy = post(server, "/v1/completions", {**body, "temperature": 0})
    assert sampled.status_code == 200, sampled.text
    assert sampled.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_target_probs_keeps_the_top_token_under_any_top_p():
    probs = target_probs(torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]), 0.7, top_p=1e-300)
    assert probs[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


# ---- 5. route keys never reach the client -----------------------------------------------------------

def chat(model: str, stream: bool = False) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}


def assert_no_key(response_text: str, headers: httpx.Headers) -> None:
    assert UPSTREAM_KEY not in response_text
    assert UPSTREAM_KEY[: len(UPSTREAM_KEY) // 2] not in response_text  # not even half of it
    assert all(UPSTREAM_KEY not in value for value in headers.values())


def test_an_upstream_4xx_echoing_its_key_is_redacted(server):
    response = post(server, "/v1/chat/completions", chat("leak-4xx"))
    assert response.status_code == 401
    assert_no_key(response.text, response.headers)
    assert "Bearer [redacted]" in response.json()["error"]["message"]


def test_an_upstream_5xx_echoing_its_key_is_redacted_in_the_502_and_the_log(server):
    response = post(server, "/v1/chat/completions", chat("leak-5xx"), headers={"x-request-id": "leak-5xx-1"})
    error = assert_envelope(response, 502)
    assert_no_key(response.text, response.headers)
    assert "Bearer [redacted]" in error["message"]
    lines = log_lines(server, "leak-5xx-1")
    assert len(lines) == 1 and UPSTREAM_KEY not in server.log()


def test_an_upstream_stream_echoing_its_key_across_chunks_is_redacted(server):
    with httpx.stream("POST", server.base + "/v1/chat/completions", json=chat("leak-stream", stream=True),
                      headers=AUTH, timeout=30) as response:
        text = response.read().decode()
    assert response.status_code == 200
    assert_no_key(text, response.headers)
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[0])["choices"][0]["delta"]["content"] == "you sent Bearer [redacted]"


def test_an_upstream_redirect_is_relayed_with_its_location_redacted(server):
    response = post(server, "/v1/chat/completions", chat("leak-redirect"))
    assert response.status_code == 307
    assert response.headers["location"] == "https://elsewhere.example/v1?key=[redacted]"
    assert "x-echo-authorization" not in response.headers
    assert_no_key(response.text, response.headers)


async def _relayed(chunks: list[bytes], keys: list[str]) -> list[bytes]:
    async def body():
        for chunk in chunks:
            yield chunk

    response = httpx.Response(200, content=body())
    return [piece async for piece in upstream_module.relay_events(response, "stub", Redactor(keys), "req-1")]


def test_relay_redacts_a_key_split_at_any_byte(monkeypatch):
    key = "sk-route-secret"
    stream = f'data: {{"echo": "Bearer {key}"}}\n\ndata: [DONE]\n\n'.encode()
    expected = stream.replace(key.encode(), b"[redacted]")
    for max_held in (64 * 1024, 4):  # whole events, and events too long to hold (key-prefix tail)
        monkeypatch.setattr(upstream_module, "MAX_HELD_EVENT", max_held)
        for split in range(1, len(stream)):
            pieces = asyncio.run(_relayed([stream[:split], stream[split:]], [key, "other-key"]))
            assert b"".join(pieces) == expected, (max_held, split)


def test_redactor_holds_back_only_what_could_start_a_key():
    redactor = Redactor(["abcdef"])
    assert redactor.held_back(b"data: x\n\n") == 0
    assert redactor.held_back(b"data: xabc") == 3
    assert redactor.held_back(b"abcde") == 5
    assert Redactor([None, ""]).bytes(b"anything") == b"anything"


# ---- 6. compressed upstream streams -------------------------------------------------------------------

def test_a_compressed_upstream_stream_reaches_the_client_decoded(server, upstream):
    with httpx.stream("POST", server.base + "/v1/chat/completions", json=chat("gzip-stream", stream=True),
                      headers=AUTH, timeout=30) as response:
        raw = b"".join(response.iter_raw())  # as sent, whatever httpx would decode
    assert response.status_code == 200 and "content-encoding" not in response.headers
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1]) == "Hello from upstream"
    assert upstream.received[-1]["headers"]["accept-encoding"] == "identity"


# ---- 7. the smaller ones ----------------------------------------------------------------------------

def test_an_upstream_dying_mid_stream_ends_with_an_error_event(server):
    with httpx.stream("POST", server.base + "/v1/chat/completions", json=chat("die-stream", stream=True),
                      headers={**AUTH, "x-request-id": "die-stream-1"}, timeout=30) as response:
        text = response.read().decode()
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["delta"]["content"] == "Hello"
    assert json.loads(events[1])["error"]["type"] == "upstream_error"  # not the half event
    assert events[2:] == ["[DONE]"]
    lines = log_lines(server, "die-stream-1")
    assert len(lines) == 1, lines
    assert "Traceback" not in server.log()


def test_a_client_hanging_up_mid_body_is_one_log_line(server):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
            "x-request-id: gone-mid-body\r\nContent-Length: 100000\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head.encode() + b'{"model": "tiny", "pro')
        time.sleep(0.3)
    lines = log_lines(server, "gone-mid-body")
    assert len(lines) == 1, lines
    assert "Traceback" not in server.log()


@pytest.mark.parametrize("field,value", [("temperature", "0.5"), ("temperature", True), ("top_p", "0.5"),
                                         ("top_p", True)])
def test_sampling_numbers_must_be_numbers(server, field, value):
    assert_envelope(post(server, "/v1/completions", {"model": MODEL, "prompt": "x", field: value}), 400,
                    param=field)


def test_integers_are_numbers_too(server):
    response = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                "temperature": 1, "top_p": 1, "seed": 3})
    assert response.status_code == 200, response.text


def test_null_optional_fields_mean_the_default(server):
    nulls = dict.fromkeys(["n", "stream", "temperature", "top_p", "top_k", "seed", "stop", "user", "logprobs",
                           "prediction", "stream_options", "speculation"])
    completion = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, **nulls})
    assert completion.status_code == 200, completion.text
    assert len(completion.json()["choices"]) == 1
    chat_body = {**chat(MODEL), "max_tokens": None, "max_completion_tokens": 2, "top_logprobs": None, **nulls}
    answer = post(server, "/v1/chat/completions", chat_body)
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL, "prompt": 5}, "prompt"),
    ({"model": MODEL, "prompt": "x", "stop": 5}, "stop"),
    ({"model": MODEL, "prompt": "x", "stop": ["a", 5]}, "stop.1"),
])
def test_error_params_name_the_field(server, body, param):
    assert_envelope(post(server, "/v1/completions", body), 400, param=param)


@pytest.mark.parametrize("path,field", [("/v1/completions", "max_tokens"),
                                        ("/v1/chat/completions", "max_tokens"),
                                        ("/v1/chat/completions", "max_completion_tokens")])
def test_zero_max_tokens_is_refused(server, path, field):
    body = {"model": MODEL, "prompt": "x"} if path == "/v1/completions" else chat(MODEL)
    assert_envelope(post(server, path, {**body, field: 0}), 400, param=field)


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonp"])
def test_post_bodies_must_be_json(server, content_type):
    headers = {**AUTH} if content_type is None else {**AUTH, "content-type": content_type}
    response = httpx.post(server.base + "/v1/completions", headers=headers, timeout=30,
                          content=json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode())
    assert_envelope(response, 415)


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON"])
def test_json_with_parameters_or_capitals_is_json(server, content_type):
    response = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2},
                    headers={"content-type": content_type})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("host,status", [("evil.example:{port}", 421), ("evil.example", 421),
                                         ("127.0.0.1.evil.example:{port}", 421), ("localhost:{port}", 200),
                                         ("[::1]:{port}", 200), ("proxy.example:{port}", 200),
                                         ("PROXY.example", 200)])
def test_the_host_header_must_name_this_server(server, host, status):
    response = httpx.get(server.base + "/v1/models", headers={**AUTH, "host": host.format(port=server.port)})
    if status == 200:
        assert response.status_code == 200, response.text
    else:
        assert_envelope(response, status)
    assert httpx.get(server.base + "/health", headers={"host": "evil.example"}).status_code == 421


def test_metrics_need_the_key(server):
    assert_envelope(httpx.get(server.base + "/metrics"), 401)
    assert httpx.get(server.base + "/metrics", headers=AUTH).status_code == 200


def test_unknown_paths_and_methods_answer_in_the_envelope(server):
    assert_envelope(httpx.get(server.base + "/v1/nothing-here", headers=AUTH), 404)
    assert_envelope(httpx.get(server.base + "/v1/completions", headers=AUTH), 405)


# ---- options, in process ---------------------------------------------------------------------------

def _app(**settings):
    from starlette.testclient import TestClient

    from foretell.proxy.server import ServerSettings, create_app

    def no_model(metrics):
        raise RuntimeError("no model in this test")

    return TestClient(create_app(ServerSettings(**settings), load_local=no_model), base_url="http://somewhere")


def test_metrics_public_opens_metrics_only():
    client = _app(api_keys=("k",), metrics_public=True, allowed_hosts=("somewhere",))
    assert client.get("/metrics").status_code == 200
    assert client.get("/v1/models").status_code == 401


def test_every_served_path_has_its_own_label_in_the_metrics():
    from foretell.proxy.server.routes import ROUTERS

    assert {route.path for router in ROUTERS for route in router.routes} <= KNOWN_PATHS
    client = _app(allowed_hosts=("somewhere",))
    pages = ("/", "/static/playground.css", "/static/playground.js")
    for path in pages:
        assert client.get(path).status_code == 200
    for path in ("/tokenize", "/detokenize"):  # 503: no model here, counted all the same
        client.post(path, json={"prompt": "x", "tokens": [1]})
    client.get("/nothing-here")
    labels = {line.partition('endpoint="')[2].partition('"')[0]
              for line in client.get("/metrics").text.splitlines() if line.startswith("foretell_requests_total")}
    assert labels == {*pages, "/tokenize", "/detokenize", "other"}


def test_allowed_hosts_star_allows_any_host():
    assert _app(allowed_hosts=("*",)).get("/v1/models").status_code == 200
    assert _app().get("/v1/models").status_code == 421


def test_host_matching():
    hosts = allowed_hosts("192.168.1.5", ("api.example", "only.example:9000"))
    for good in ("127.0.0.1:8000", "localhost", "[::1]:1", "192.168.1.5:8000", "api.example:443",
                 "only.example:9000"):
        assert host_allowed(good, hosts), good
    for bad in ("only.example:9001", "only.example", "example", "localhost.evil:80", "[::2]:8000", ""):
        assert not host_allowed(bad, hosts), bad
    assert allowed_hosts("::", ()) >= {"[::]"} and allowed_hosts("x", ("*",)) is None


# ---- tests that once let real bugs through -------------------------------------------------------

def _softmax(logits: list[float]) -> list[float]:
    weights = [math.exp(x) for x in logits]
    return [w / sum(weights) for w in weights]


def test_temperature_is_applied_before_top_p():
    # T = 0.5 sharpens [2, 1, 0.5, 0, -1] to p = [0.829, 0.112, ...]: the top token alone reaches
    # top_p = 0.7. Filtering the T = 1 distribution first would keep two tokens (0.563 < 0.7).
    logits = [2.0, 1.0, 0.5, 0.0, -1.0]
    sharpened = _softmax([x / 0.5 for x in logits])
    assert sharpened[0] > 0.7 > _softmax(logits)[0]
    probs = target_probs(torch.tensor([logits]), 0.5, top_p=0.7)[0]
    assert probs.tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0, 0.0])


def test_temperature_applies_with_top_k():
    logits = [2.0, 1.0, 0.5, 0.0, -1.0]
    kept = _softmax([2.0 / 0.5, 1.0 / 0.5])  # the two best, then temperature 0.5
    probs = target_probs(torch.tensor([logits]), 0.5, top_k=2)[0]
    assert probs.tolist() == pytest.approx(kept + [0.0, 0.0, 0.0], abs=1e-6)
    assert probs[0].item() == pytest.approx(math.exp(4) / (math.exp(4) + math.exp(2)))


def test_prediction_usage_on_a_changed_character():
    # "foo bar\n" -> "foo baz\n", tokens "foo" | " bar" | "\n". The characters kept are "foo ba"
    # and "\n": "foo" and "\n" are accepted; " bar" lost its "r", so it is rejected, although
    # three of its four characters match.
    assert prediction_token_usage("foo bar\n", [0, 3, 7], "foo baz\n") == (2, 1)
