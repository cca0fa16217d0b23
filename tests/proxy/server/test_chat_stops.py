"""Chat answers end where the turn ends (issue 11, item 4).

- The plain transcript (a model without a chat template): the next role marker (``\\nUser:``,
  ...) is an implied stop of every chat request, on top of the caller's own (up to 16) stops.
- A chat template: its end-of-turn tokens (Gemma 3: ``<end_of_turn>``) end the output as EOS
  does, and never appear in the text.

The server tests run in process on models built to write a fixed cycle of tokens (so that their
greedy answer is known to run into the next turn), saved as folders with and without a template.
"""

from __future__ import annotations

import copy
import json
import time

import pytest
from starlette.testclient import TestClient

from foretell.proxy.engine import GenerationRequest, SpeculativeEngine
from foretell.proxy.server import ServerSettings, create_app
from foretell.proxy.server.prompts import PLAIN_TRANSCRIPT_STOPS, chat_prompt, implied_chat_stops
from foretell.proxy.server.schema import ChatCompletionRequest
from tests.proxy.server.test_stream_equals_final import build_cycle_model

# A minimal template in Gemma 3's turn format (written here; the embedded model's tokenizer has
# no template, its GGUF file carries none).
GEMMA_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# A template that refuses assistant messages: the end-of-turn token is found in its source.
REFUSING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ raise_exception('no') }}{% endif %}"
    "<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
)
# The plain transcript ends with "Assistant:" (its last token ":"); this model then writes
# " Four\nUser: Four\nUser: ..." for ever.
PLAIN_CYCLE = ["▁Four", "\n", "User", ":"]
# Gemma's template ends with "<start_of_turn>model\n"; this model then writes " Four<end_of_turn>\n"
# over and over.
TEMPLATE_CYCLE = ["\n", "▁Four", "<end_of_turn>"]
QUESTION = [{"role": "user", "content": "What is 2+2?"}]


def with_template(tokenizer, template: str | None):
    """A copy of ``tokenizer`` with this chat template (a shallow copy: a deep one of the 262k
    vocabulary takes ~2 s; the template and the settings are the copy's own)."""
    changed = copy.copy(tokenizer)
    changed.init_kwargs = dict(tokenizer.init_kwargs)
    changed.chat_template = template
    return changed


# ---- which stops are implied -------------------------------------------------------------------

def test_the_plain_transcript_stops_at_every_role_marker(tokenizer):
    assert tokenizer.chat_template is None  # the embedded model's tokenizer: plain transcript
    strings, ids = implied_chat_stops(tokenizer)
    assert strings == PLAIN_TRANSCRIPT_STOPS
    assert set(strings) == {"\nUser:", "\nSystem:", "\nAssistant:", "\nDeveloper:", "\nTool:"}
    assert ids == ()


def test_gemmas_template_stops_at_end_of_turn(tokenizer):
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert implied_chat_stops(with_template(tokenizer, GEMMA_STYLE_TEMPLATE)) == ((), (end_of_turn,))
    # Found from the template's source when rendering an assistant turn fails.
    assert implied_chat_stops(with_template(tokenizer, REFUSING_TEMPLATE)) == ((), (end_of_turn,))


def test_a_template_that_ends_turns_with_plain_text_implies_no_stop_token(tokenizer):
    plain_turns = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}"
    assert implied_chat_stops(with_template(tokenizer, plain_turns)) == ((), ())


# ---- the engine ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def template_cycle(tokenizer):
    model, ids = build_cycle_model(tokenizer, TEMPLATE_CYCLE)
    return SpeculativeEngine(model, tokenizer, kv_cache_tokens=2048), ids


def test_stop_token_ids_end_the_output_like_eos(template_cycle, tokenizer):
    engine, (newline, four, end_of_turn) = template_cycle
    prompt = [tokenizer.bos_token_id, newline]
    running_on = engine.generate(GenerationRequest(prompt_ids=prompt, max_tokens=7))
    assert running_on.token_ids == [four, end_of_turn, newline] * 2 + [four]
    assert running_on.finish_reason == "length"
    for prediction in (None, " Four\n Four\n"):  # a draft running past the stop changes nothing
        pieces = []
        result = engine.generate(
            GenerationRequest(prompt_ids=prompt, max_tokens=7, stop_token_ids=(end_of_turn,),
                              prediction=prediction),
            on_tokens=lambda _ids, text, _lp: pieces.append(text))
        assert result.token_ids == [four, end_of_turn]
        assert result.finish_reason == "stop"
        assert result.text == "".join(pieces) == " Four"  # the end-of-turn token is not text
    # The engine's own EOS still ends outputs that ask for other stop tokens.
    eos = next(iter(engine.eos_token_ids))
    seq_eos = engine.add(GenerationRequest(prompt_ids=prompt, stop_token_ids=(end_of_turn,)))
    assert seq_eos.output.eos_ids == {eos, end_of_turn}
    engine.abort(seq_eos)


# ---- over HTTP, in process ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer):
    """A client for a server on a cycle model: ``served("plain")`` (no template) or
    ``served("template")`` (Gemma's turn format)."""
    clients, stack = {}, []

    def start(kind: str) -> TestClient:
        if kind not in clients:
            pieces, template = (PLAIN_CYCLE, None) if kind == "plain" else (TEMPLATE_CYCLE, GEMMA_STYLE_TEMPLATE)
            model, _ = build_cycle_model(tokenizer, pieces)
            folder = tmp_path_factory.mktemp(f"cycle-{kind}")
            model.save_pretrained(folder)
            with_template(tokenizer, template).save_pretrained(folder)
            app = create_app(ServerSettings(model=str(folder), served_model_name="cycle",
                                            calibrate=False, dtype="float32"))
            client = TestClient(app, base_url="http://127.0.0.1")
            client.__enter__()  # runs the lifespan: the model loads on a thread
            stack.append(client)
            deadline = time.time() + 120
            while client.get("/health").status_code != 200:
                assert time.time() < deadline, client.get("/health").text
                time.sleep(0.1)
            clients[kind] = client
        return clients[kind]

    yield start
    for client in stack:
        client.__exit__(None, None, None)


def chat(client, **fields) -> dict:
    response = client.post("/v1/chat/completions",
                           json={"model": "cycle", "messages": QUESTION, "max_tokens": 40, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def stream_text(client, path: str, body: dict) -> str:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    if path.endswith("chat/completions"):
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    return "".join(e["choices"][0]["text"] for e in events if e["choices"])


def test_the_plain_transcript_is_what_the_cycle_model_continues(served, tokenizer):
    parsed = ChatCompletionRequest.model_validate({"model": "cycle", "messages": QUESTION})
    prompt = chat_prompt(tokenizer, parsed.messages)
    assert prompt == "User: What is 2+2?\nAssistant:"
    # Without the implied stop (the completions endpoint has none) it invents the next turn.
    response = served("plain").post("/v1/completions",
                                    json={"model": "cycle", "prompt": prompt, "max_tokens": 12})
    assert response.json()["choices"][0]["text"] == " Four\nUser: Four\nUser: Four\nUser:"


def test_a_plain_transcript_chat_stops_at_the_next_role_marker(served):
    client = served("plain")
    answer = chat(client)
    assert answer["choices"][0]["message"]["content"] == " Four"
    assert answer["choices"][0]["finish_reason"] == "stop"
    # " Four", "\n", "User", ":": the marker is known complete at its last token, then cut off.
    assert answer["usage"]["completion_tokens"] == 4
    assert stream_text(client, "/v1/chat/completions",
                       {"model": "cycle", "messages": QUESTION, "max_tokens": 40}) == " Four"


def test_implied_stops_do_not_count_against_the_callers_sixteen(served):
    client = served("plain")
    own = [f"never-{i}" for i in range(16)]
    assert chat(client, stop=own)["choices"][0]["message"]["content"] == " Four"
    # The caller's own stops still apply, and still at most 16 of them.
    assert chat(client, stop=["our"])["choices"][0]["message"]["content"] == " F"
    refused = client.post("/v1/chat/completions",
                          json={"model": "cycle", "messages": QUESTION, "stop": own + ["one more"]})
    assert refused.status_code == 400


def test_a_template_chat_stops_at_end_of_turn(served):
    client = served("template")
    answer = chat(client)
    assert answer["choices"][0]["message"]["content"] == " Four"
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == 2  # " Four", <end_of_turn>
    assert stream_text(client, "/v1/chat/completions",
                       {"model": "cycle", "messages": QUESTION, "max_tokens": 40}) == " Four"
    # The completions endpoint implies nothing: the model writes on past its turn.
    response = client.post("/v1/completions", json={"model": "cycle", "prompt": "<start_of_turn>model\n",
                                                    "max_tokens": 6})
    assert response.json()["usage"]["completion_tokens"] == 6


@pytest.mark.embedded
def test_the_embedded_model_answers_one_turn(embedded):
    """The issue's example: the embedded model used to write ' 2+2 = 4\\nUser: What is 2+2?...'."""
    from foretell.proxy.engine.scheduler import Scheduler
    from foretell.proxy.server.app import LocalModel

    def load(metrics):
        engine = SpeculativeEngine(embedded.model, embedded.tokenizer, kv_cache_tokens=4096)
        return LocalModel(embedded, Scheduler(engine), "gemma-3-270m")

    with TestClient(create_app(ServerSettings(), load_local=load), base_url="http://127.0.0.1") as client:
        deadline = time.time() + 120
        while client.get("/health").status_code != 200:
            assert time.time() < deadline
            time.sleep(0.1)
        answer = client.post("/v1/chat/completions", json={
            "model": "gemma-3-270m", "messages": QUESTION, "max_tokens": 40}).json()
    content = answer["choices"][0]["message"]["content"]
    assert "4" in content, content
    assert "User:" not in content and "Assistant:" not in content, content
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] < 40
