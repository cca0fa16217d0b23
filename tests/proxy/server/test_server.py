"""The proxy over real HTTP: the server ``foretell serve`` builds, in process on 127.0.0.1 (the
tiny model; tests/serving.py), the official ``openai`` package as the client, and a real stub
upstream for forwarding."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from foretell.proxy.engine import GenerationRequest, SpeculativeEngine
from harness.upstream_stub import free_port
from tests.serving import route_table, serve, tiny_app

API_KEY = "sk-test-key"
UPSTREAM_KEY = "upstream-secret-key"
MODEL = "tiny"
PROMPT = "def total(items):\n    result = 0\n"


@pytest.fixture(scope="module")
def upstream(stub_upstream):
    return stub_upstream  # the session's stub (tests/conftest.py); tests read its latest requests


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_folder, upstream):
    """``foretell serve --api-key --config ... --max-queue 1 --max-running 1 --max-body-bytes
    200000 --max-prediction-chars 5000`` in process; the model's load is held until the test has
    seen /health answer 503 and asked for a model name meanwhile."""
    from foretell.proxy.engine import model_loader

    routes = route_table(f"""
[upstreams.stub]
base_url = "{upstream.base_url}"
api_key_env = "STUB_KEY"
supports_prediction = true
max_retries = 0

[upstreams.stub-nopred]
base_url = "{upstream.base_url}"
api_key_env = "STUB_KEY"

[upstreams.down]
base_url = "http://127.0.0.1:{free_port()}/v1"
max_retries = 1

[upstreams.slow]
base_url = "{upstream.base_url}"
timeout_seconds = 1.0
max_retries = 0

[models.up-ok]
upstream = "stub"
[models.up-500]
upstream = "stub"
[models.up-400]
upstream = "stub"
[models.up-nopred]
upstream = "stub-nopred"
[models.up-down]
upstream = "down"
[models.up-slow]
upstream = "slow"
[models.tiny-with-fallback]
local = true
fallback = "stub"
""", tmp_path_factory.mktemp("config"))
    loading = {"saw": False, "answer": None}
    released = threading.Event()
    load_model = model_loader.load_model

    def held_load(*args, **kwargs):
        released.wait(60)
        return load_model(*args, **kwargs)

    def while_loading(served):
        # Meanwhile, a model name not configured: the local name is known only once loaded.
        loading["saw"] = True
        answer = httpx.post(served.base + "/v1/completions", json={"model": "maybe-local", "prompt": "x",
                                                                   "max_tokens": 1},
                            headers={"authorization": f"Bearer {API_KEY}"}, timeout=10)
        loading["answer"] = (answer.status_code, (answer.json().get("error") or {}).get("code"),
                             answer.headers.get("retry-after"))
        released.set()

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STUB_KEY", UPSTREAM_KEY)
        patch.setattr(model_loader, "load_model", held_load)
        app = tiny_app(tiny_model_folder, served_model_name=MODEL, api_keys=(API_KEY,), routes=routes,
                       max_queue=1, max_running=1, max_body_bytes=200000, max_prediction_chars=5000)
        with serve(app, "test-server", healthy=False) as served:
            try:
                served.wait_healthy(while_loading=while_loading)
            finally:
                released.set()
            patch.setattr(model_loader, "load_model", load_model)
            yield {"base": served.base, "saw_loading": loading["saw"], "loading_answer": loading["answer"]}


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine_plain(tiny_model, tokenizer):
    engine = SpeculativeEngine(tiny_model, tokenizer)

    def plain(prompt_ids, max_tokens):
        return engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=max_tokens))

    return plain


def raw(server, path, body=None, *, content=None, key=API_KEY, method="POST"):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if content is None and body is not None:
        content = json.dumps(body).encode()
    if content is not None:
        headers["content-type"] = "application/json"  # the server takes nothing else on POST /v1/*
    return httpx.request(method, server["base"] + path, content=content, headers=headers, timeout=60)


# ---- basics ---------------------------------------------------------------------------------

def test_health_answers_503_while_loading_then_200(server):
    assert server["saw_loading"], "the port should open before the model is loaded"
    assert httpx.get(server["base"] + "/health").status_code == 200


def test_health_names_the_precision(server):
    # FORETELL_DTYPE=float32 (tests/conftest.py): the suite's oracle is the float32 model.
    health = httpx.get(server["base"] + "/health").json()
    assert health["precision"] == "float32" and health["batch_invariant"] is False
    assert health["native_loops"] == []  # float32 keeps transformers' norms and torch's attention
    assert health["cpu"]["threads"] >= 1 and isinstance(health["cpu"]["features"], list)


def test_a_model_name_asked_for_while_loading_is_told_to_retry(server):
    # Not "model does not exist": the local model's own name is known only once it has loaded.
    assert server["loading_answer"] == (503, "model_loading", "5")
    missing = raw(server, "/v1/completions", {"model": "maybe-local", "prompt": "x", "max_tokens": 1})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_models_lists_the_local_model(client):
    names = [m.id for m in client.models.list().data]
    assert MODEL in names and "up-ok" in names


def test_completion_equals_engine_greedy(client, engine_plain, tokenizer):
    expected = engine_plain(tokenizer(PROMPT)["input_ids"], 40)
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0)
    assert response.choices[0].text == expected.text
    assert response.usage.completion_tokens == len(expected.token_ids)


def test_add_special_tokens_false_leaves_the_bos_out(client, engine_plain, tokenizer):
    # vLLM's field, honoured rather than ignored: the prompt without its BOS is another prompt.
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert ids != tokenizer(PROMPT)["input_ids"]
    expected = engine_plain(ids, 12)
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                         extra_body={"add_special_tokens": False})
    assert response.choices[0].text == expected.text and response.usage.prompt_tokens == len(ids)
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0,
                                       extra_body={"add_special_tokens": False})
    assert echoed.choices[0].text == PROMPT and len(echoed.choices[0].logprobs.tokens) == len(ids)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                          extra_body={"add_special_tokens": False})
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert chat.usage.prompt_tokens == plain.usage.prompt_tokens - 1  # the plain transcript's BOS


def test_completion_with_prediction_is_exact_and_reports_usage(client, engine_plain, tokenizer):
    expected = engine_plain(tokenizer(PROMPT)["input_ids"], 40)
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
        extra_body={"prediction": {"type": "content", "content": expected.text}})
    assert response.choices[0].text == expected.text
    details = response.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens == 0
    speculation = response.model_extra["speculation"]
    assert speculation["per_source"]["prediction"]["accepted"] > 0
    assert speculation["target_passes"] < 40


def test_chat_with_prediction_parts_matches_plain_chat(client):
    messages = [{"role": "user", "content": "Write a loop."}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=30,
                                           temperature=0)
    text = plain.choices[0].message.content
    predicted = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=30, temperature=0,
        prediction={"type": "content", "content": [{"type": "text", "text": text[:20]},
                                                   {"type": "text", "text": text[20:]}]})
    assert predicted.choices[0].message.content == text
    assert predicted.usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_stream_with_usage_equals_non_stream(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0)
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"prediction": {"type": "content", "content": full.choices[0].text}}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert len([c for c in chunks if c.choices]) > 1  # streamed in pieces, not one blob
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_chat_stream(client):
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=20, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=20, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == plain.choices[0].message.content


def test_prompt_lookup_through_extra_body(client):
    response = client.completions.create(model=MODEL, prompt=PROMPT * 4, max_tokens=30, temperature=0,
                                         extra_body={"speculation": {"prompt_lookup": True}})
    assert "prompt_lookup" in response.model_extra["speculation"]["per_source"]


def test_sampling_works_and_seed_reproduces(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0.9, top_p=0.9, seed=7)
    first = client.completions.create(**kwargs).choices[0].text
    second = client.completions.create(**kwargs).choices[0].text
    assert first == second and first


def test_sampling_with_a_prediction_speculates_and_seeds_replay_under_load(client, engine_plain, tokenizer):
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    prediction = engine_plain(prompt_ids, 40).text  # the greedy text: often what sampling picks too
    # A low temperature: the random tiny model is nearly uniform, drafts need a sharper target.
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0.02, seed=5,
                  extra_body={"top_k": 40, "prediction": {"type": "content", "content": prediction}})
    first = client.completions.create(**kwargs)
    # The same seed again while another sampled request is in flight on the same engine. The
    # server's queue holds one request: whichever of the two finds it full retries its 429.
    with openai.OpenAI(base_url=client.base_url, api_key=API_KEY, max_retries=5) as other:
        background = threading.Thread(target=lambda: other.completions.create(
            model=MODEL, prompt="x = 1\n", max_tokens=20, temperature=1.0))
        background.start()
        again = other.completions.create(**kwargs)
        background.join()
    assert again.choices[0].text == first.choices[0].text
    report = first.model_extra["speculation"]
    assert report["seed"] == 5 and report["drafted_tokens"] > 0 and report["accepted_tokens"] > 0
    unseeded = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=1.0)
    assert isinstance(unseeded.model_extra["speculation"]["seed"], int)


def test_seeded_n_choices_differ_and_replay(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=21, n=3)
    first = [c.text for c in client.completions.create(**kwargs).choices]
    assert first == [c.text for c in client.completions.create(**kwargs).choices]
    assert len(set(first)) > 1


def test_logprobs_with_a_prediction(client, tokenizer):
    prediction = {"type": "content", "content": "    for item in items:\n        result += item\n"}
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                         logprobs=2, extra_body={"prediction": prediction})
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == response.usage.completion_tokens
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert logprobs.text_offset[0] == 0 and all(lp <= 0 for lp in logprobs.token_logprobs)
    for token, chosen, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 2 and max(top.values()) == pytest.approx(chosen)  # greedy took the best
    # Streamed, the same request's logprobs arrive over several chunks; each token's text_offset
    # still indexes the whole text (it runs on from the previous token's end, across chunks).
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                       logprobs=2, extra_body={"prediction": prediction}, stream=True)
    parts = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert len(parts) > 1
    assert [t for part in parts for t in part.tokens] == logprobs.tokens
    assert [o for part in parts for o in part.text_offset] == logprobs.text_offset
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_completion_tokens=8,
        temperature=0.8, seed=3, logprobs=True, top_logprobs=3, prediction=prediction)
    content = chat.choices[0].logprobs.content
    assert "".join(item.token for item in content) == chat.choices[0].message.content
    assert all(len(item.top_logprobs) == 3 and item.bytes == list(item.token.encode()) for item in content)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_completion_tokens=8,
        temperature=0.8, seed=3, logprobs=True, top_logprobs=3, prediction=prediction, stream=True)
    streamed = [item for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for item in chunk.choices[0].logprobs.content]
    assert [(i.token, i.logprob) for i in streamed] == [(i.token, i.logprob) for i in content]


def test_n_choices(client):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in response.choices] == [0, 1]
    assert response.choices[0].text == response.choices[1].text  # greedy: the same text twice


def test_chat_fallback_template_without_a_chat_template():
    from foretell.proxy.server.schema import ChatMessage
    from foretell.proxy.server.prompts import chat_prompt

    class NoTemplate:
        chat_template = None

    messages = [ChatMessage(role="system", content="Be brief."),
                ChatMessage(role="user", content=[{"type": "text", "text": "Hi"}])]
    assert chat_prompt(NoTemplate(), messages) == "System: Be brief.\nUser: Hi\nAssistant:"


def test_unknown_fields_are_ignored(server):
    response = raw(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                               "temperature": 0, "frequency_penalty_v9": 1})
    assert response.status_code == 200


# ---- errors ---------------------------------------------------------------------------------

def test_errors_raise_the_right_openai_exceptions(server, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-3)
    assert "max_tokens" in bad.value.message
    anonymous = openai.OpenAI(base_url=server["base"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.completions.create(model=MODEL, prompt="x")


BAD_INPUTS = [
    ("malformed json", "/v1/completions", None, b'{"model": "tiny", "prompt": ', 400),
    ("not an object", "/v1/completions", [1, 2], None, 400),
    ("wrong type", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "ten"}, None, 400),
    ("negative max_tokens", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, None, 400),
    ("huge max_tokens", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**9}, None, 400),
    ("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, None, 400),
    ("image prediction part", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
      "prediction": {"type": "content", "content": [{"type": "image_url", "image_url": "x"}]}}, None, 400),
    ("prediction over limit", "/v1/completions",
     {"model": MODEL, "prompt": "x", "prediction": {"type": "content", "content": "y" * 6000}}, None, 413),
    ("body over limit", "/v1/completions", {"model": MODEL, "prompt": "x" * 300000}, None, 413),
    ("invalid utf-8", "/v1/completions", None, b'{"model": "tiny", "prompt": "\xff\xfe"}', 400),
    ("prompt over context", "/v1/completions", {"model": MODEL, "prompt": " word" * 5000}, None, 400),
    ("temperature out of range", "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 9}, None, 400),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, None, 400),
    ("logprobs over 5", "/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 6}, None, 400),
    ("negative top_k", "/v1/completions", {"model": MODEL, "prompt": "x", "top_k": -1}, None, 400),
    ("missing model", "/v1/completions", {"prompt": "x"}, None, 400),
]


@pytest.mark.parametrize("name,path,body,content,status", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_a_clear_4xx(server, name, path, body, content, status):
    response = raw(server, path, body, content=content)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_server_still_serves_after_bad_input(server, client):
    for name, path, body, content, status in BAD_INPUTS:
        raw(server, path, body, content=content)
    assert httpx.get(server["base"] + "/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0).choices[0].text


def test_health_needs_no_key_but_v1_does(server):
    assert httpx.get(server["base"] + "/health").status_code == 200
    assert raw(server, "/v1/models", method="GET", key=None).status_code == 401


def test_every_response_carries_a_request_id(server):
    ok = httpx.get(server["base"] + "/health")
    refused = raw(server, "/v1/models", method="GET", key=None)
    ids = {ok.headers["x-request-id"], refused.headers["x-request-id"]}
    assert len(ids) == 2 and all(i.startswith("req-") for i in ids)
    assert ok.headers["x-foretell-version"] == refused.headers["x-foretell-version"] != ""
    echoed = httpx.get(server["base"] + "/health", headers={"x-request-id": "trace-42"})
    assert echoed.headers["x-request-id"] == "trace-42"


# ---- load: disconnects and the bounded queue --------------------------------------------------

def _metric(server, name: str, **labels) -> float:
    text = httpx.get(server["base"] + "/metrics", headers={"authorization": f"Bearer {API_KEY}"}).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_disconnect_mid_stream_frees_the_engine(server, client):
    cancelled_before = _metric(server, "foretell_request_success_total", finish_reason="cancelled")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3000, "temperature": 0, "stream": True}
    with httpx.stream("POST", server["base"] + "/v1/completions", json=body,
                      headers={"authorization": f"Bearer {API_KEY}"}, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    # The next request is served, and the abandoned one ended as cancelled, well short of 3000.
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=5, temperature=0).choices
    deadline = time.time() + 30
    while _metric(server, "foretell_request_success_total", finish_reason="cancelled") <= cancelled_before:
        assert time.time() < deadline, "the abandoned generation was never cancelled"
        time.sleep(0.1)


def test_disconnect_without_streaming_cancels_too(server, client):
    cancelled_before = _metric(server, "foretell_request_success_total", finish_reason="cancelled")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and hangs up
        httpx.post(server["base"] + "/v1/completions", json=body,
                   headers={"authorization": f"Bearer {API_KEY}"}, timeout=1.5)
    deadline = time.time() + 30
    while _metric(server, "foretell_request_success_total", finish_reason="cancelled") <= cancelled_before:
        assert time.time() < deadline, "the abandoned generation was never cancelled"
        time.sleep(0.1)
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0).choices


def test_full_queue_answers_429_with_retry_after(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3000, "temperature": 0, "stream": True}
    headers = {"authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", server["base"] + "/v1/completions", json=body, headers=headers,
                      timeout=60) as running:
        # Keep the line iterator referenced: closing it would close the stream (a disconnect).
        lines = running.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # this one holds the engine
        with httpx.stream("POST", server["base"] + "/v1/completions", json=body, headers=headers,
                          timeout=60):  # waits in the queue (size 1)
            # Until it is queued (a fixed sleep lost this race on a busy machine: the next
            # request took the free slot and waited behind a 3000-token stream).
            deadline = time.time() + 30
            while _metric(server, "foretell_num_requests_waiting") < 1:
                assert time.time() < deadline, "the second stream never reached the queue"
                time.sleep(0.02)
            # The same signals under vLLM's names, which routers built for vLLM pods read.
            assert _metric(server, "vllm:num_requests_waiting", model_name=MODEL) == 1
            assert _metric(server, "vllm:num_requests_running", model_name=MODEL) == 1
            assert 0 < _metric(server, "vllm:kv_cache_usage_perc", model_name=MODEL) <= 1
            refused = raw(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
            # A route with a fallback upstream is forwarded instead of refused.
            diverted = raw(server, "/v1/completions",
                           {"model": "tiny-with-fallback", "prompt": "x", "max_tokens": 2})
    assert diverted.status_code == 200 and diverted.json()["choices"][0]["text"] == "Hello from upstream"
    assert diverted.headers["x-foretell-upstream"] == "stub"
    assert refused.status_code == 429
    assert refused.headers["retry-after"]
    assert refused.json()["error"]["code"] == "queue_full"
    # Both streams are closed now: the queue must drain (the waiting job is dropped unstarted).
    deadline = time.time() + 30
    while _metric(server, "foretell_num_requests_waiting") > 0:
        assert time.time() < deadline, "the abandoned queued request was never dropped"
        time.sleep(0.1)


def test_metrics_expose_speculation_counters(server, client):
    client.completions.create(model=MODEL, prompt=PROMPT * 3, max_tokens=20, temperature=0,
                              extra_body={"speculation": {"prompt_lookup": True}})
    text = httpx.get(server["base"] + "/metrics", headers={"authorization": f"Bearer {API_KEY}"}).text
    for name in ("foretell_spec_decode_num_draft_tokens_total", "foretell_spec_decode_num_accepted_tokens_total",
                 "foretell_spec_decode_num_accepted_tokens_per_pos_total", "foretell_time_to_first_token_seconds",
                 "foretell_inter_token_latency_seconds", "foretell_generation_tokens_total",
                 "foretell_requests_total"):
        assert name in text, name


# ---- upstream forwarding --------------------------------------------------------------------

def test_routes_by_model_name_and_replaces_the_key(client, upstream):
    response = client.chat.completions.create(model="up-ok", messages=[{"role": "user", "content": "hi"}])
    assert response.choices[0].message.content == "Hello from upstream"
    seen = upstream.received[-1]
    assert seen["headers"]["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert API_KEY not in json.dumps(seen)


def test_prediction_passes_to_upstreams_that_support_it(client, upstream):
    prediction = {"type": "content", "content": "Hello"}
    client.chat.completions.create(model="up-ok", messages=[{"role": "user", "content": "hi"}],
                                   prediction=prediction, extra_body={"speculation": {"prompt_lookup": True}})
    assert upstream.received[-1]["body"]["prediction"] == prediction
    assert "speculation" not in upstream.received[-1]["body"]  # foretell's own extension stays here


def test_prediction_is_dropped_with_a_note_elsewhere(client, upstream):
    response = client.chat.completions.with_raw_response.create(
        model="up-nopred", messages=[{"role": "user", "content": "hi"}],
        prediction={"type": "content", "content": "Hello"})
    assert "prediction" not in upstream.received[-1]["body"]
    assert "prediction dropped" in response.headers["x-foretell-note"]
    assert "prediction dropped" in response.parse().model_extra["foretell"]["notes"][0]


def test_streaming_passes_through(client):
    stream = client.chat.completions.create(model="up-ok", messages=[{"role": "user", "content": "hi"}],
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == "Hello from upstream"


@pytest.mark.parametrize("model,status", [("up-down", 502), ("up-slow", 504), ("up-500", 502), ("up-400", 400)])
def test_upstream_failures_map_to_openai_errors(server, model, status):
    response = raw(server, "/v1/chat/completions",
                   {"model": model, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and UPSTREAM_KEY not in response.text


def test_a_closed_app_gives_its_model_back(tiny_model_folder):
    """The server freezes what it loaded out of the garbage collector's passes (state.py); closing
    it must unfreeze them, or the model, held in reference cycles, outlives the app for the rest of
    the process (each in-process embedded server kept ~1.25 GiB in a test worker)."""
    import gc
    import weakref

    app = tiny_app(tiny_model_folder)
    with serve(app, "closed-app") as served:
        answer = httpx.post(served.base + "/v1/completions",
                            json={"model": "tiny", "prompt": "def f(", "max_tokens": 4}, timeout=60)
        assert answer.status_code == 200, answer.text
        model = weakref.ref(app.state.foretell.local.loaded.model)
    del app, served
    gc.collect()
    assert model() is None, "the closed app's model is still alive"
