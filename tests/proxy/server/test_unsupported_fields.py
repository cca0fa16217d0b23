"""Fields that would change the text and that the local engine does not implement
(``proxy/server/unsupported_fields.py``): a 400 naming the field on the local model, their
neutral values accepted, a plain forward relaying them unchanged, and remote verification never
taking a request that carries one.

The table's own tests need no server; the rest run over real HTTP against the tiny model in
process (tests/serving.py) with the session's stub upstream (tests/conftest.py)."""

from __future__ import annotations

import httpx
import pytest

from foretell.proxy.server.api_error import APIError
from foretell.proxy.server.unsupported_fields import UNSUPPORTED, first_unsupported, refuse_unsupported
from tests.helpers import assert_envelope
from harness.upstream_stub import ECHO_GOLD, ECHO_PROMPT
from tests.serving import route_table, serve, tiny_app

MODEL = "tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "def f(", "max_tokens": 2, "temperature": 0}

# A value of every field in the table that asks for something the engine does not do.
NOT_NEUTRAL = {
    "tools": [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}],
    "tool_choice": "required",
    "functions": [{"name": "read_file", "parameters": {"type": "object"}}],
    "function_call": {"name": "read_file"},
    "logit_bias": {"1": 5},
    "presence_penalty": 0.5,
    "frequency_penalty": -1,
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "web_search_options": {"search_context_size": "low"},
    "reasoning_effort": "high",  # refused where the template reads it: see the context below
    "verbosity": "low",
    "best_of": 3,
    "suffix": "\n    return x\n",
    "repetition_penalty": 1.2,
    "min_p": 0.05,
    "min_tokens": 4,
    "ignore_eos": True,
    "stop_token_ids": [1],
    "bad_words": ["foo"],
    "allowed_token_ids": [5, 6],
    "logits_processors": ["my.module:Processor"],
    "guided_json": {"type": "object"},
    "guided_regex": "[a-z]+",
    "guided_choice": ["yes", "no"],
    "guided_grammar": "root ::= \"a\"",
    "structured_outputs": {"choice": ["yes", "no"]},
    "use_beam_search": True,
    "length_penalty": 0.5,
    "include_stop_str_in_output": True,
    "truncate_prompt_tokens": 8,
    "chat_template": "{{ messages[0]['content'] }}",
    "chat_template_kwargs": {"enable_thinking": False},  # refused where the template reads it
    "add_generation_prompt": False,
    "continue_final_message": True,
    "repeat_penalty": 1.1,
    "typical_p": 0.9,
    "tfs_z": 0.95,
    "mirostat": 2,
    "dynatemp_range": 0.5,
    "dry_multiplier": 0.8,
    "xtc_probability": 0.5,
    "grammar": "root ::= \"a\"",
    "json_schema": {"type": "object"},
    "n_predict": 64,
}
# Values that ask for nothing: what clients send by default. (A field without one is refused
# whatever its value; null is not sent.)
NEUTRAL = {
    "tools": [[]],
    "tool_choice": ["none", "auto"],
    "functions": [[]],
    "function_call": ["none", "auto"],
    "logit_bias": [{}, {"7": 0}],
    "presence_penalty": [0, 0.0],
    "frequency_penalty": [0],
    "modalities": [["text"]],
    "web_search_options": [{}],
    "reasoning_effort": ["low"],  # the tiny model has no chat template: nothing reads it
    "verbosity": ["medium"],
    "best_of": [1],
    "suffix": [""],
    "repetition_penalty": [1, 1.0],
    "min_p": [0],
    "min_tokens": [0],
    "ignore_eos": [False],
    "stop_token_ids": [[]],
    "bad_words": [[]],
    "logits_processors": [[]],
    "structured_outputs": [{}],
    "use_beam_search": [False],
    "length_penalty": [1],
    "include_stop_str_in_output": [False],
    "chat_template_kwargs": [{}, {"enable_thinking": False}],  # nothing reads it without a template
    "add_generation_prompt": [True],
    "continue_final_message": [False],
    "repeat_penalty": [1],
    "typical_p": [1],
    "tfs_z": [1],
    "mirostat": [0],
    "dynatemp_range": [0],
    "dry_multiplier": [0],
    "xtc_probability": [0],
    "grammar": [""],
    "n_predict": [2],  # as max_tokens
}
# Fields that leave the tokens alone: accepted and ignored (or implemented) as before.
HARMLESS = {"store": False, "metadata": {"client": "test"}, "service_tier": "auto", "user": "someone",
            "parallel_tool_calls": True, "prompt_cache_key": "k", "safety_identifier": "s",
            "stream_options": None, "seed": 3, "n": 1}
# Refused only where the model's chat template reads them.
READ_BY_THE_TEMPLATE = {"reasoning_effort", "verbosity", "chat_template_kwargs"}
CHAT_ONLY = {name for name, field in UNSUPPORTED.items() if field.chat_only}
# Implemented on the local model's chats (tool_calls/): refused on its completions only.
LOCAL_CHAT = {name for name, field in UNSUPPORTED.items() if field.local_chat}
NO_TEMPLATE = {"is_chat": True, "chat_template": ""}  # a chat prompt in the plain transcript


# ---- the table ------------------------------------------------------------------------------------

def test_every_field_of_the_table_has_test_values():
    assert set(NOT_NEUTRAL) == set(UNSUPPORTED)
    assert set(NEUTRAL) <= set(UNSUPPORTED)
    # Every field with neutral values is tested with them.
    assert {name for name, field in UNSUPPORTED.items() if field.accepted} <= set(NEUTRAL)


@pytest.mark.parametrize("name", sorted(NOT_NEUTRAL))
def test_a_value_that_asks_for_something_is_found(name):
    reads_everything = "reasoning_effort verbosity enable_thinking"  # a template that reads them
    assert first_unsupported({name: NOT_NEUTRAL[name]}, is_chat=True, chat_template=reads_everything) == name


@pytest.mark.parametrize("name,value", [(name, value) for name, values in NEUTRAL.items() for value in values])
def test_a_neutral_value_is_not(name, value):
    body = {name: value, "max_tokens": 2}
    assert first_unsupported(body, **NO_TEMPLATE) is None


def test_a_number_is_not_a_boolean_nor_a_boolean_a_number():
    assert first_unsupported({"presence_penalty": False}, **NO_TEMPLATE) == "presence_penalty"
    assert first_unsupported({"ignore_eos": 0}, **NO_TEMPLATE) == "ignore_eos"


def test_reasoning_effort_is_refused_only_where_the_template_reads_it():
    body = {"reasoning_effort": "high"}
    gpt_oss_like = "{%- if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}{%- endif %}"
    assert first_unsupported(body, is_chat=True, chat_template=gpt_oss_like) == "reasoning_effort"
    assert first_unsupported(body, is_chat=True, chat_template="{{ messages }}") is None
    assert first_unsupported(body, is_chat=False, chat_template=gpt_oss_like) is None  # raw text
    # An upstream's template is not known: it might read it.
    assert first_unsupported(body, is_chat=True, chat_template=None) == "reasoning_effort"


def test_chat_template_kwargs_are_refused_only_where_the_template_reads_them():
    body = {"chat_template_kwargs": {"enable_thinking": False}}
    qwen_like = "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>{%- endif %}"
    assert first_unsupported(body, is_chat=True, chat_template=qwen_like) == "chat_template_kwargs"
    assert first_unsupported(body, is_chat=True, chat_template="{{ messages }}") is None


def test_tool_choice_auto_is_neutral_but_tools_are_not():
    assert first_unsupported({"tools": [], "tool_choice": "auto", "parallel_tool_calls": False}, **NO_TEMPLATE) is None
    body = {"tool_choice": "auto", "tools": NOT_NEUTRAL["tools"]}
    assert first_unsupported(body, **NO_TEMPLATE) == "tools"  # remote verification: forwarded


def test_tools_are_the_local_engines_on_chats_only():
    assert LOCAL_CHAT == {"tools", "tool_choice"}
    body = {"tools": NOT_NEUTRAL["tools"], "tool_choice": "required"}
    assert first_unsupported(body, **NO_TEMPLATE, local=True) is None
    assert first_unsupported(body, is_chat=False, chat_template="", local=True) == "tools"
    with pytest.raises(APIError) as refused:
        refuse_unsupported(body, is_chat=False, chat_template="")
    assert refused.value.param == "tools" and "not supported on completions" in refused.value.message


def test_best_of_n_selects_nothing():
    assert first_unsupported({"best_of": 2, "n": 2}, **NO_TEMPLATE) is None
    assert first_unsupported({"best_of": 3, "n": 2}, **NO_TEMPLATE) == "best_of"


def test_chat_prompt_fields_mean_nothing_on_completions():
    for name in CHAT_ONLY:
        assert first_unsupported({name: NOT_NEUTRAL[name]}, is_chat=False, chat_template="") is None, name


def test_the_refusal_names_the_field_and_what_is_accepted():
    with pytest.raises(APIError) as refused:
        refuse_unsupported({"logit_bias": {"7": 3}}, **NO_TEMPLATE)
    error = refused.value
    assert (error.status, error.param, error.code) == (400, "logit_bias", "unsupported_value")
    assert "not supported on local models yet" in error.message and "{} (or biases of 0)" in error.message
    with pytest.raises(APIError) as refused:
        refuse_unsupported({"guided_json": {"type": "object"}}, **NO_TEMPLATE)
    assert (refused.value.param, refused.value.code) == ("guided_json", "unsupported_parameter")


# ---- over HTTP --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_folder, stub_upstream):
    """The tiny model as "tiny"; "up-ok" forwarded plainly to the stub, and "echo-ok" its echo
    model with remote verification on (every draft verified, so nothing hangs on timings)."""
    routes = route_table(f"""
[upstreams.stub]
base_url = "{stub_upstream.base_url}"
max_retries = 0
[models.up-ok]
upstream = "stub"

[upstreams.stub-verify]
base_url = "{stub_upstream.base_url}"
verify_predictions = "echo"
verify_always = true
max_retries = 0
[models.echo-ok]
upstream = "stub-verify"
""", tmp_path_factory.mktemp("unsupported-fields"))
    with serve(tiny_app(tiny_model_folder, served_model_name=MODEL, routes=routes), "unsupported-fields") as served:
        yield served


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base + path, json=body, timeout=120)


# Every field on both endpoints, but a chat prompt's fields on chat only (vLLM ignores them on
# completions too), and those only a chat template reads: the tiny model has none.
REFUSED_HERE = [(endpoint, name) for name in sorted(NOT_NEUTRAL) for endpoint in ("chat", "completions")
                if name not in READ_BY_THE_TEMPLATE
                and (endpoint == "chat" or name not in CHAT_ONLY)
                and not (endpoint == "chat" and name in LOCAL_CHAT)]


@pytest.mark.parametrize("endpoint,name", REFUSED_HERE)
def test_the_local_model_refuses_the_field_by_name(server, endpoint, name):
    path, base = ("/v1/chat/completions", CHAT) if endpoint == "chat" else ("/v1/completions", COMPLETION)
    error = assert_envelope(post(server, path, {**base, name: NOT_NEUTRAL[name]}), 400, param=name)
    where = "on completions" if name in LOCAL_CHAT else "on local models yet"
    assert f"not supported {where}" in error["message"]


def test_a_stream_is_refused_before_it_starts(server):
    response = post(server, "/v1/chat/completions", {**CHAT, "stream": True, "logit_bias": {"1": 5}})
    assert_envelope(response, 400, param="logit_bias")


def test_remote_verification_leaves_tools_to_the_upstream(server, stub_upstream):
    # Tools are implemented by the local engine; on an upstream they are the upstream's to honour.
    seen = len(stub_upstream.received)
    post(server, "/v1/completions", _verify_request({"tools": NOT_NEUTRAL["tools"], "tool_choice": "required"}))
    sent = stub_upstream.received[seen:]
    assert len(sent) == 1 and sent[0]["body"]["tools"] == NOT_NEUTRAL["tools"] and not sent[0]["body"].get("echo")


def test_neutral_and_harmless_fields_are_accepted(server):
    neutral = {name: values[-1] for name, values in NEUTRAL.items()}
    for path, base in [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]:
        response = post(server, path, {**base, **neutral, **HARMLESS})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 2


def test_a_prediction_without_a_type_is_content_and_a_wrong_type_is_refused(server):
    answer = post(server, "/v1/completions", {**COMPLETION, "prediction": {"content": "x = 1"}})
    assert answer.status_code == 200, answer.text
    assert "accepted_prediction_tokens" in answer.json()["usage"]["completion_tokens_details"]
    assert_envelope(post(server, "/v1/completions", {**COMPLETION, "prediction": {"type": "text", "content": "x"}}),
                    400, param="prediction.type")


def test_a_plain_forward_relays_every_field_unchanged(server, stub_upstream):
    body = {"model": "up-ok", "messages": [{"role": "user", "content": "hi"}], **NOT_NEUTRAL}
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    received = stub_upstream.received[-1]["body"]
    assert {name: received.get(name) for name in NOT_NEUTRAL} == NOT_NEUTRAL


def _verify_request(extra: dict) -> dict:
    return {"model": "echo-ok", "prompt": ECHO_PROMPT, "max_tokens": 8, "temperature": 0,
            "prediction": {"type": "content", "content": ECHO_GOLD}, **extra}


def test_remote_verification_takes_neutral_values(server, stub_upstream):
    seen = len(stub_upstream.received)
    # As clients send them by default (Cody's response_format with every request): verified.
    neutral = {"presence_penalty": 0, "min_p": 0, "ignore_eos": False, "response_format": {"type": "text"},
               "logit_bias": {}, "repetition_penalty": 1, "tools": []}
    answer = post(server, "/v1/completions", _verify_request(neutral))
    assert answer.status_code == 200, answer.text
    assert "remote_verification" in answer.json()["speculation"]
    assert any(r["body"].get("echo") for r in stub_upstream.received[seen:])


@pytest.mark.parametrize("field,value", [("repetition_penalty", 0), ("typical_p", 0.0)])
def test_remote_verification_leaves_other_values_to_the_upstream(server, stub_upstream, field, value):
    # remote_verify's own check takes 0 for unset; these zeros ask for something.
    seen = len(stub_upstream.received)
    answer = post(server, "/v1/completions", _verify_request({field: value}))
    assert answer.status_code == 200, answer.text
    assert "speculation" not in answer.json()  # the upstream's answer, relayed
    sent = stub_upstream.received[seen:]
    assert len(sent) == 1 and sent[0]["body"][field] == value and not sent[0]["body"].get("echo")
