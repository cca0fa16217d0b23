"""Remote verification (``proxy/server/remote_verify/``) and echo with prompt logprobs
(``proxy/server/echo.py``), over real HTTP.

Two servers on a tiny model, in process on real ports (tests/serving.py): the *upstream*, and the *proxy*, whose TOML
routes ``tiny`` to the upstream with ``verify_predictions = "echo"`` and the model's tokenizer
(token-id alignment), and ``tiny-text`` with ``"auto"`` and no tokenizer (text alignment); plus
the stub upstream's echo model (``harness/upstream_stub.py``) for echo answers that are wrong.

The tiny model writes only whole lowercase words (every other embedding row is zeroed), so its
greedy output is the tokenizer's own split of its text and remote verification can follow it
token for token; a random model that writes subword runs would send every request down the
plain path (still exact, but nothing to see)."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
import torch

from harness.upstream_stub import ECHO_GOLD, ECHO_PROMPT, StubServer, echo_greedy
from tests.serving import LogRecords, route_table, serve, tiny_app

PROMPT = "the quick brown fox jumps over the lazy dog and"
N = 40
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content']"
    " | trim + '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
STUB_MODELS = ["echo-ok", "echo-shifted", "echo-no-top", "echo-500-mid", "echo-drop", "echo-all-fail"]


# ---- servers ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def word_model(tokenizer, tmp_path_factory):
    """The tiny Gemma 3 of tests/helpers.py, restricted to whole lowercase words, saved."""
    from tests.helpers import build_tiny_gemma

    model = build_tiny_gemma(tokenizer, seed=1)
    words = re.compile(r"^▁[a-z]{2,9}$")
    keep = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    for token, index in tokenizer.get_vocab().items():
        if index < model.config.vocab_size and words.match(token):
            keep[index] = True
    keep[tokenizer.eos_token_id] = True
    with torch.no_grad():
        model.get_input_embeddings().weight[~keep] = 0.0
    folder = tmp_path_factory.mktemp("word-gemma")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # The embedded tokenizer has no chat template; Gemma 3's turn markup, for the chat tests.
    from transformers import AutoTokenizer

    templated = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    templated.chat_template = GEMMA_TEMPLATE
    templated.save_pretrained(folder)
    return model, folder


@pytest.fixture(scope="module")
def servers(word_model, tmp_path_factory):
    """The upstream ("tiny", and "tiny-text", "tiny-measured" local too) and the proxy (its own
    model "proxy-local", the routes below), both in process (tests/serving.py), and the stub."""
    _, folder = word_model
    work = tmp_path_factory.mktemp("remote")
    (work / "up").mkdir()
    (work / "proxy").mkdir()
    with StubServer() as stub, LogRecords() as log:
        up_app = tiny_app(folder, routes=route_table('[models.tiny-text]\nlocal = true\n'
                                                     '[models.tiny-measured]\nlocal = true\n', work / "up"))
        with serve(up_app, "upstream") as up:  # healthy before the proxy loads (tests/serving.py)
            stub_routes = "".join(
                f'[upstreams.stub-{m}]\nbase_url = "{stub.base_url}"\nverify_predictions = "echo"\nmax_retries = 0\n'
                # Every draft verified: what these tests check must not hang on measured timings.
                'verify_always = true\n'
                f'[models.{m}]\nupstream = "stub-{m}"\n' for m in STUB_MODELS)
            routes = route_table(f"""
[upstreams.up]
base_url = "{up.base}/v1"
verify_predictions = "echo"
tokenizer = "{folder}"
verify_always = true
max_retries = 0
timeout_seconds = 120

[upstreams.up-text]
base_url = "{up.base}/v1"
verify_predictions = "auto"
verify_always = true
max_retries = 0
timeout_seconds = 120

[upstreams.up-measured]
base_url = "{up.base}/v1"
verify_predictions = "echo"
tokenizer = "{folder}"
max_retries = 0
timeout_seconds = 120

[models.tiny]
upstream = "up"
[models.tiny-text]
upstream = "up-text"
[models.tiny-measured]
upstream = "up-measured"

[upstreams.gate]
base_url = "{stub.base_url}"
verify_predictions = "echo"
tokenizer = "{folder}"
verify_always = true
max_retries = 0
timeout_seconds = 120
[models.gate-tiny]
upstream = "gate"
""" + stub_routes, work / "proxy")
            stub.app.state.relay_base = f"{up.base}/v1"
            with serve(tiny_app(folder, served_model_name="proxy-local", routes=routes), "proxy") as proxy:
                yield {"up": up.base, "proxy": proxy.base, "log": log.text, "stub": stub}


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=300)


def complete(base: str, body: dict) -> dict:
    response = post(base, "/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


def stream(base: str, path: str, body: dict) -> tuple[list[dict], httpx.Response]:
    events = []
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return events, response


@pytest.fixture(scope="module")
def reference(servers) -> str:
    """The upstream's own greedy text for PROMPT."""
    text, _ = _own(servers, {"prompt": PROMPT, "max_tokens": N, "temperature": 0})
    assert len(text.split()) >= 30, text  # whole words, enough to edit
    return text


# ---- 1. echo and prompt logprobs on foretell's own /v1/completions ---------------------------------

def test_echo_scores_the_prompt_as_one_full_forward(servers, word_model, tokenizer):
    model, _ = word_model
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.inference_mode():
        oracle = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)  # [n, V]
    body = complete(servers["up"], {"model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 3,
                                    "max_tokens": 0, "return_tokens_as_token_ids": True})
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{i}" for i in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for j in range(1, len(ids)):
        expected = oracle[j - 1]
        assert logprobs["token_logprobs"][j] == pytest.approx(float(expected[ids[j]]), abs=1e-4)
        best = torch.topk(expected, 3)
        top = logprobs["top_logprobs"][j]
        for index, value in zip(best.indices.tolist(), best.values.tolist()):
            assert top[f"token_id:{index}"] == pytest.approx(value, abs=1e-4)
        assert f"token_id:{ids[j]}" in top and len(top) <= 4  # the token itself, besides the best 3
    spans = tokenizer(PROMPT, return_offsets_mapping=True)["offset_mapping"]
    assert logprobs["text_offset"] == [start for start, _ in spans]  # BOS at 0, spanning nothing


def test_echo_with_a_completion_and_token_texts(servers, tokenizer):
    plain = complete(servers["up"], {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                     "logprobs": 1})
    echoed = complete(servers["up"], {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                      "logprobs": 1, "echo": True})
    completion = plain["choices"][0]["text"]
    choice = echoed["choices"][0]
    assert choice["text"] == PROMPT + completion
    logprobs, tail = choice["logprobs"], plain["choices"][0]["logprobs"]
    ids = tokenizer(PROMPT)["input_ids"]
    assert logprobs["tokens"] == [tokenizer.decode([i]) for i in ids] + tail["tokens"]
    assert logprobs["tokens"][0] == "<bos>"
    assert logprobs["token_logprobs"][len(ids):] == pytest.approx(tail["token_logprobs"], abs=1e-4)
    offsets = logprobs["text_offset"][len(ids):]
    assert offsets[0] == len(PROMPT)
    for offset, token in zip(offsets, tail["tokens"]):
        assert choice["text"][offset:offset + len(token)] == token  # offsets index the echoed text


def test_echo_streams_the_prompt_first(servers):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "echo": True}
    whole = complete(servers["up"], body)["choices"][0]["text"]
    events, _ = stream(servers["up"], "/v1/completions", body)
    texts = [e["choices"][0]["text"] for e in events if e.get("choices")]
    assert texts[0] == PROMPT and "".join(texts) == whole
    events, _ = stream(servers["up"], "/v1/completions", {**body, "logprobs": 1})
    tokens = [t for e in events if e.get("choices") and e["choices"][0]["logprobs"]
              for t in e["choices"][0]["logprobs"]["tokens"]]
    assert tokens == complete(servers["up"], {**body, "logprobs": 1})["choices"][0]["logprobs"]["tokens"]


def test_max_tokens_zero_only_with_echo(servers):
    refused = post(servers["up"], "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    scored = complete(servers["up"], {"model": "tiny", "prompt": PROMPT, "max_tokens": 0, "echo": True})
    assert scored["choices"][0]["text"] == PROMPT and scored["choices"][0]["logprobs"] is None


def test_tokenize_and_detokenize_round_trip(servers, tokenizer):
    answer = post(servers["up"], "/tokenize", {"model": "tiny", "prompt": PROMPT}).json()
    ids = tokenizer(PROMPT)["input_ids"]
    assert answer["tokens"] == ids and answer["count"] == len(ids) and answer["max_model_len"] == 4096
    back = post(servers["up"], "/detokenize", {"model": "tiny", "tokens": answer["tokens"]}).json()
    assert back["prompt"] == "<bos>" + PROMPT
    messages = [{"role": "user", "content": "Hi there"}]
    chat = post(servers["up"], "/tokenize", {"model": "tiny", "messages": messages}).json()
    templated = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                              chat_template=GEMMA_TEMPLATE)
    assert templated.startswith("<bos><start_of_turn>user\n")
    assert chat["tokens"] == tokenizer(templated, add_special_tokens=False)["input_ids"]
    bad = post(servers["up"], "/detokenize", {"model": "tiny", "tokens": [1, -5]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens.1"
    assert post(servers["up"], "/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404


def test_a_prompt_of_token_ids_is_the_same_prompt(servers, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0}
    as_text = complete(servers["up"], {**body, "prompt": PROMPT})["choices"][0]["text"]
    as_ids = complete(servers["up"], {**body, "prompt": ids})
    assert as_ids["choices"][0]["text"] == as_text and as_ids["usage"]["prompt_tokens"] == len(ids)
    assert complete(servers["up"], {**body, "prompt": [ids]})["choices"][0]["text"] == as_text
    # Echoed: the ids' decoded text (the BOS left out), each token's offset laid end to end.
    echoed = complete(servers["up"], {**body, "prompt": ids, "echo": True, "logprobs": 1,
                                      "return_tokens_as_token_ids": True})["choices"][0]
    assert echoed["text"] == PROMPT + as_text
    assert echoed["logprobs"]["tokens"][:len(ids)] == [f"token_id:{i}" for i in ids]
    spans = tokenizer(PROMPT, return_offsets_mapping=True)["offset_mapping"]
    assert echoed["logprobs"]["text_offset"][:len(ids)] == [start for start, _ in spans]
    events, _ = stream(servers["up"], "/v1/completions", {**body, "prompt": ids, "echo": True})
    assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == PROMPT + as_text
    # Used as sent: ids without a BOS get none added.
    bare = complete(servers["up"], {**body, "prompt": ids[1:], "echo": True, "logprobs": 1, "max_tokens": 0})
    assert bare["usage"]["prompt_tokens"] == len(ids) - 1 and bare["choices"][0]["text"] == PROMPT
    refused = post(servers["up"], "/v1/completions", {**body, "prompt": [ids[0], len(tokenizer)]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt.1"


# ---- 2. remote verification against a foretell upstream -------------------------------------------

def _edit(text: str) -> str:
    """An insertion, a deletion and a replacement of whole words."""
    words = text.split(" ")
    return " ".join(words[:6] + ["inserted", "here"] + words[6:14] + words[16:24] + ["replaced"] + words[25:])


def _through(servers, model: str, body: dict, streamed: bool, pieces_at_least: int = 1) -> tuple[str, str, dict]:
    """(text, finish_reason, final body or usage chunk) of a request through the proxy."""
    if not streamed:
        answer = complete(servers["proxy"], {"model": model, **body})
        return answer["choices"][0]["text"], answer["choices"][0]["finish_reason"], answer
    events, response = stream(servers["proxy"], "/v1/completions",
                              {"model": model, **body, "stream_options": {"include_usage": True}})
    assert response.status_code == 200
    assert not any("error" in e for e in events), events
    pieces = [e["choices"][0] for e in events if e.get("choices")]
    assert len([p for p in pieces if p["text"]]) >= pieces_at_least  # streamed as it is confirmed
    return "".join(p["text"] for p in pieces), pieces[-1]["finish_reason"], events[-1]


_OWN: dict[str, tuple[str, str]] = {}


def _own(servers, body: dict) -> tuple[str, str]:
    """The upstream's own answer to the same request, without the prediction."""
    plain = {"model": "tiny", **{k: v for k, v in body.items() if k != "prediction"}}
    key = json.dumps(plain, sort_keys=True)
    if key not in _OWN:
        answer = complete(servers["up"], plain)
        _OWN[key] = answer["choices"][0]["text"], answer["choices"][0]["finish_reason"]
    return _OWN[key]


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "stream"])
def test_edits_equal_the_upstreams_own_greedy_text(servers, reference, streamed):
    prediction = _edit(reference)
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0,
            "prediction": {"type": "content", "content": prediction}}
    text, finish, final = _through(servers, "tiny", body, streamed, pieces_at_least=3)
    assert (text, finish) == _own(servers, body)
    assert text == reference
    report = final["speculation"]
    assert report["remote_verification"] == {"alignment": "token_ids", "prompts": "token_ids", "fallback": None}
    assert report["accepted_tokens"] >= N // 2 and report["per_source"]["prediction"]["accepted"] > 0
    # Three edits cost a few round trips, far fewer than one per token.
    assert 2 <= report["upstream_requests"] <= 12
    assert report["upstream_prompt_tokens"] > len(PROMPT.split())
    details = final["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 20 and details["rejected_prediction_tokens"] >= 1
    assert final["usage"]["completion_tokens"] == N


def _access_fields(servers, request_id: str) -> dict:
    """The access line's fields; a stream's line is written once the server has sent its end,
    which may be just after the client has read it: waited for."""
    deadline = time.monotonic() + 60
    while True:
        lines = [line for line in servers["log"]().splitlines()
                 if line.startswith("INFO foretell.access: " + request_id + " ")]
        if lines or time.monotonic() > deadline:
            (line,) = lines
            return dict(part.split("=", 1) for part in line.split() if "=" in part)
        time.sleep(0.05)


def _metric(base: str, name: str, labels: str) -> float:
    text = httpx.get(base + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and labels in line.split("}")[0])


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "stream"])
def test_a_remotely_verified_request_reports_its_counts(servers, reference, streamed):
    """The access line and the metrics carry a remotely verified request's figures as they do a
    local one's (they were null: issue 29), a stream's too when it did not ask for the usage."""
    before = {name: _metric(servers["proxy"], name, 'model="up"') for name in
              ("foretell_generation_tokens_total", "foretell_accepted_prediction_tokens_total",
               "foretell_spec_decode_num_target_passes_total", "foretell_request_success_total")}
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": N, "temperature": 0,
            "prediction": {"type": "content", "content": _edit(reference)}}
    request_id = f"rv-counts-{'stream' if streamed else 'json'}"
    headers = {"x-request-id": request_id}
    if streamed:
        with httpx.stream("POST", servers["proxy"] + "/v1/completions", json={**body, "stream": True},
                          headers=headers, timeout=300) as response:
            assert response.status_code == 200
            text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in response.iter_lines()
                           if line.startswith("data: {"))
    else:
        response = httpx.post(servers["proxy"] + "/v1/completions", json=body, headers=headers, timeout=300)
        assert response.status_code == 200, response.text
        text = response.json()["choices"][0]["text"]
    assert text == reference
    fields = _access_fields(servers, request_id)
    assert fields["route"] == "up" and int(fields["completion_tokens"]) == N
    assert int(fields["prompt_tokens"]) > 0 and int(fields["accepted_prediction_tokens"]) > 20
    assert int(fields["rejected_prediction_tokens"]) >= 1 and int(fields["target_passes"]) >= 2
    after = {name: _metric(servers["proxy"], name, 'model="up"') for name in before}
    assert after["foretell_generation_tokens_total"] - before["foretell_generation_tokens_total"] == N
    assert after["foretell_accepted_prediction_tokens_total"] - before["foretell_accepted_prediction_tokens_total"] > 20
    assert after["foretell_spec_decode_num_target_passes_total"] > before["foretell_spec_decode_num_target_passes_total"]
    assert after["foretell_request_success_total"] - before["foretell_request_success_total"] == 1


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "stream"])
def test_stop_and_max_tokens_inside_an_accepted_draft(servers, reference, streamed):
    words = reference.split(" ")
    stop = " " + words[15]  # a word the accepted draft runs through
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0, "stop": [stop, "zzzz"],
            "prediction": {"type": "content", "content": reference}}
    text, finish, final = _through(servers, "tiny", body, streamed)
    assert (text, finish) == _own(servers, body) and finish == "stop"
    assert text == reference[:reference.index(stop)] and stop not in text
    body = {"prompt": PROMPT, "max_tokens": 17, "temperature": 0,
            "prediction": {"type": "content", "content": reference}}
    text, finish, final = _through(servers, "tiny", body, streamed)
    assert (text, finish) == _own(servers, body) and finish == "length"
    assert final["usage"]["completion_tokens"] == 17
    assert final["speculation"]["upstream_requests"] == 1  # one verify: 16 accepted + the recovered/bonus


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "stream"])
def test_output_that_does_not_retokenise_as_written_is_still_verified(servers, streamed):
    # After a prompt ending in a space the model writes "▁word" tokens, whose text re-tokenises
    # as "▁▁" + "word": sent as text, that context would end verification for the request; sent
    # as token ids, it is exactly the upstream's own.
    prompt = PROMPT + " "
    own, _ = _own(servers, {"prompt": prompt, "max_tokens": N, "temperature": 0})
    assert own.startswith(" ")
    body = {"prompt": prompt, "max_tokens": N, "temperature": 0,
            "prediction": {"type": "content", "content": _edit(own)}}
    text, finish, final = _through(servers, "tiny", body, streamed)
    assert (text, finish) == _own(servers, body)
    report = final["speculation"]
    assert report["remote_verification"] == {"alignment": "token_ids", "prompts": "token_ids", "fallback": None}
    assert report["accepted_tokens"] >= N // 2


def test_an_upstream_refusing_token_id_prompts_gets_text_prompts(servers, reference):
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0,
            "prediction": {"type": "content", "content": _edit(reference)}}
    received = len(servers["stub"].received)
    text, finish, final = _through(servers, "gate-tiny", body, False)
    assert (text, finish) == (reference, "length")
    report = final["speculation"]
    assert report["remote_verification"] == {"alignment": "token_ids", "prompts": "text", "fallback": None}
    assert report["accepted_tokens"] >= N // 2
    sent = [r["body"]["prompt"] for r in servers["stub"].received[received:]]
    assert isinstance(sent[0], list) and all(isinstance(p, str) for p in sent[1:])  # refused once
    assert "upstream 'gate': refused a prompt of token ids" in servers["log"]()
    text, _, final = _through(servers, "gate-tiny", body, True)  # later requests: text from the start
    assert text == reference and final["speculation"]["remote_verification"]["prompts"] == "text"
    assert all(isinstance(r["body"]["prompt"], str) for r in servers["stub"].received[received + len(sent):])


def test_a_useless_prediction_is_still_exact(servers, reference):
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0,
            "prediction": {"type": "content", "content": "def main():\n    return 42\n" * 3}}
    text, finish, final = _through(servers, "tiny", body, False)
    assert (text, finish) == _own(servers, body)
    assert final["speculation"]["accepted_tokens"] == 0


def test_prompt_lookup_alone(servers, reference):
    # No prediction: drafts are copied from the prompt and the output (ids decoded locally).
    prompt = PROMPT + reference + "\n" + PROMPT
    body = {"prompt": prompt, "max_tokens": 30, "temperature": 0, "speculation": {"prompt_lookup": True}}
    answer = complete(servers["proxy"], {"model": "tiny", **body})
    assert (answer["choices"][0]["text"], answer["choices"][0]["finish_reason"]) == _own(servers, body)
    report = answer["speculation"]
    assert set(report["per_source"]) == {"prompt_lookup"} and report["remote_verification"]["fallback"] is None
    assert answer["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0


def test_chat_with_the_routes_template(servers, reference):
    messages = [{"role": "user", "content": "the quick brown fox"}]
    own = post(servers["up"], "/v1/chat/completions",
               {"model": "tiny", "messages": messages, "max_tokens": 24, "temperature": 0}).json()
    text = own["choices"][0]["message"]["content"]
    response = post(servers["proxy"], "/v1/chat/completions", {
        "model": "tiny", "messages": messages, "max_tokens": 24, "temperature": 0,
        "prediction": {"type": "content", "content": _edit(text)}}).json()
    assert response["choices"][0]["message"]["content"] == text
    assert response["choices"][0]["finish_reason"] == own["choices"][0]["finish_reason"]
    assert response["object"] == "chat.completion" and response["speculation"]["accepted_tokens"] > 0


def test_text_alignment_without_a_tokenizer(servers, reference):
    log = servers["log"]()
    assert "upstream 'up-text': remote verification on" in log and "token ids: yes" in log
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0,
            "prediction": {"type": "content", "content": _edit(reference)}}
    text, finish, final = _through(servers, "tiny-text", body, False)
    assert (text, finish) == (reference, "length")
    report = final["speculation"]
    assert report["remote_verification"]["alignment"] == "text"
    # Drafts aligned on text were accepted and saved passes. No ratio: the word model's greedy text
    # follows the CPU's float order, and where it repeats a word four times (as on Zen 4 with
    # AVX-512) an edit inside the run re-anchors slowly, with or without a tokenizer.
    assert report["accepted_tokens"] > 0 and report["target_passes"] < N


def test_verify_when_it_pays_by_measured_costs(servers, reference):
    # Without verify_always a verify is sent only while its expected yield beats plain decoding
    # at the measured costs: whatever it decides, the text is the upstream's own.
    for prediction in (_edit(reference), "def main():\n    return 42\n" * 3):
        body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0,
                "prediction": {"type": "content", "content": prediction}}
        text, finish, final = _through(servers, "tiny-measured", body, False)
        assert (text, finish) == (reference, "length")
        assert final["speculation"]["upstream_requests"] >= 1


def _session(state, prompt: str):
    from foretell.proxy.server.remote_verify import RemoteRequest, Session

    return Session(None, state, RemoteRequest("m", prompt, None, 200, (), "y" * 400, False, 128, "req"))


def _worth(session, available: int, run: float) -> tuple[int, float | None]:
    """(draft length, expected yield) the session chooses for a prediction offering ``available``
    tokens after an agreement run of ``run``, with the request's own estimates."""
    from foretell.proxy.engine.draft_length import DraftOption
    from foretell.proxy.server.remote_verify.draft_choice import choose

    spec = session.spec
    option = DraftOption("prediction", spec.estimates["prediction"].rate, run, available,
                         spec.calibration["prediction"])
    _, length, expected = choose(session, [option])
    return length, expected


def test_the_cost_policy_chooses_plain_decoding_when_prefill_is_dear():
    from foretell.proxy.server.remote_verify import UpstreamState
    from foretell.proxy.server.upstream import Upstream

    state = UpstreamState(Upstream(name="u", base_url="http://127.0.0.1:9/v1", verify_predictions="echo"))
    session = _session(state, "x" * 400)
    assert _worth(session, 64, 8.0)[0] == 64  # nothing measured yet: verify all of it
    state.verify_cost.observe(150, 3.0)  # an echo request of 150 tokens took 3 s
    state.verify_measured = True
    state.plain_token_seconds.extend([0.1, 0.1, 0.1])  # a plain token 0.1 s
    assert _worth(session, 64, 8.0)[0] == 64  # the request's first try of its prediction
    session.spec.tried.add("prediction")
    assert _worth(session, 64, 8.0)[0] == 0  # a fresh run yields less than 30 tokens
    assert _worth(session, 128, 1000.0)[0] == 0  # acceptance 0.9 still caps the yield
    session.spec.estimates["prediction"].accepted, session.spec.estimates["prediction"].rejected = 1000.0, 0.01
    length, expected = _worth(session, 128, 1000.0)
    assert length == 128 and expected > 100  # a long proven copy pays
    session.spec.calibration["prediction"] = 0.2  # ...unless its verifies have yielded a fifth of that
    assert _worth(session, 128, 1000.0)[0] == 0
    state.verify_cost.observe(150, 0.05)  # a GPU-like upstream: prefill nearly free
    state.verify_cost.observe(150, 0.05)
    assert _worth(session, 64, 8.0)[0] > 0


def test_an_upstream_reusing_prompts_is_charged_for_new_tokens_only():
    from foretell.proxy.server.remote_verify import UpstreamState
    from foretell.proxy.server.upstream import Upstream

    state = UpstreamState(Upstream(name="u", base_url="http://127.0.0.1:9/v1", verify_predictions="echo"))
    session = _session(state, "x" * 2000)
    session.spec.tried.add("prediction")
    for new_tokens, seconds in [(500, 2.0), (500, 2.0), (20, 0.3), (20, 0.3)]:
        state.verify_cost.observe(new_tokens, seconds)
    state.verify_measured = True
    state.plain_token_seconds.extend([0.1, 0.1, 0.1])
    assert _worth(session, 64, 40.0)[0] == 0  # the whole ~500-token context re-sent: plain wins
    session.shared_with_last_verify = 500  # the last verify held this context...
    assert _worth(session, 64, 40.0)[0] == 0  # ...but the upstream has not said it reuses it
    state.reuses_prompts = True
    length, expected = _worth(session, 64, 40.0)
    assert length > 0 and expected > 1  # only the draft is new: a verify pays


def test_the_source_is_the_engine_s_choice_not_a_fixed_order():
    # A prediction that keeps missing beside a prompt lookup run that keeps matching: the
    # engine's chooser drafts from prompt lookup (a fixed "prediction first" order would not).
    from foretell.proxy.engine.draft_length import DraftOption
    from foretell.proxy.server.remote_verify import UpstreamState
    from foretell.proxy.server.remote_verify.draft_choice import choose
    from foretell.proxy.server.upstream import Upstream

    state = UpstreamState(Upstream(name="u", base_url="http://127.0.0.1:9/v1", verify_predictions="echo"))
    session = _session(state, "x" * 400)
    session.spec.tried.add("prediction")
    state.verify_cost.observe(100, 0.2)
    state.verify_measured = True
    state.plain_token_seconds.extend([0.1, 0.1, 0.1])
    missing = DraftOption("prediction", 0.2, 1.0, 64, 1.0)
    matching = DraftOption("prompt_lookup", 0.95, 60.0, 32, 1.0)
    for measured in (True, False):  # measured costs, or not yet (then: the most promising, all of it)
        state.verify_measured = measured
        source, length, _ = choose(session, [missing, matching])
        assert (source, length) == ("prompt_lookup", 32)
    state.verify_measured = True
    assert choose(session, [missing])[1] < 64  # alone, the missing prediction drafts little or nothing


def test_a_prompt_of_token_ids_is_forwarded_as_sent(servers, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    body = {"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 0}
    response = post(servers["proxy"], "/v1/completions", {**body, "prediction": {"type": "content",
                                                                                 "content": "anything"}})
    assert response.status_code == 200 and "prediction dropped" in response.headers["x-foretell-note"]
    assert response.json()["choices"][0]["text"] == complete(servers["up"], body)["choices"][0]["text"]


def test_requests_that_are_not_greedy_are_forwarded(servers):
    response = post(servers["proxy"], "/v1/completions", {
        "model": "tiny", "prompt": PROMPT, "max_tokens": 4,
        "prediction": {"type": "content", "content": "anything"}})  # no temperature: the upstream's
    assert response.status_code == 200
    assert "prediction dropped" in response.headers["x-foretell-note"]
    assert "remote_verification" not in response.json().get("speculation", {})


# ---- 3. an upstream that answers echo requests wrongly -------------------------------------------------

STUB_EXPECTED = "".join(echo_greedy(ECHO_PROMPT, 40)[0])
STUB_PREDICTION = ECHO_GOLD.replace(" eta", " eta inserted").replace(" pi rho", " pi")


@pytest.mark.parametrize("model", ["echo-ok", "echo-shifted", "echo-no-top", "echo-500-mid", "echo-drop"])
def test_wrong_echo_answers_never_give_wrong_text(servers, model):
    body = {"prompt": ECHO_PROMPT, "max_tokens": 40, "temperature": 0,
            "prediction": {"type": "content", "content": STUB_PREDICTION}}
    text, finish, final = _through(servers, model, body, False)
    assert (text, finish) == (STUB_EXPECTED, "stop")
    report = final["speculation"]
    assert report["remote_verification"]["alignment"] == "text"
    if model == "echo-ok":
        assert report["remote_verification"]["fallback"] is None and report["accepted_tokens"] >= 15
    else:
        assert report["remote_verification"]["fallback"]  # says why it went plain


def test_a_broken_echo_answer_mid_stream_continues_exactly(servers):
    body = {"prompt": ECHO_PROMPT, "max_tokens": 40, "temperature": 0,
            "prediction": {"type": "content", "content": STUB_PREDICTION}}
    text, finish, final = _through(servers, "echo-500-mid", body, True)
    assert (text, finish) == (STUB_EXPECTED, "stop")
    assert final["speculation"]["accepted_tokens"] > 0 and final["speculation"]["remote_verification"]["fallback"]


def test_an_upstream_failing_everything_is_a_clean_error(servers):
    body = {"model": "echo-all-fail", "prompt": ECHO_PROMPT, "max_tokens": 40, "temperature": 0,
            "prediction": {"type": "content", "content": STUB_PREDICTION}}
    response = post(servers["proxy"], "/v1/completions", body)
    assert response.status_code == 502 and response.json()["error"]["type"] == "upstream_error"
    events, response = stream(servers["proxy"], "/v1/completions", body)
    if response.status_code == 200:  # the stream had started: an error event ends it
        text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
        assert events and "error" in events[-1] and STUB_EXPECTED.startswith(text)
    else:
        assert response.status_code == 502
