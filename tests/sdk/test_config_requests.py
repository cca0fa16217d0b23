"""Configuration, request bodies, foretell detection and typed responses, offline."""

from __future__ import annotations

import json
import warnings

import httpx
import pytest

from foretell.sdk import Client, ForetellWarning, RetryPolicy, normalize_prediction, prediction_from_file
from foretell.sdk._config import DEFAULT_BASE_URL, resolve_config
from foretell.sdk.types import ChatCompletion
from tests.sdk.conftest import Script
from tests.sdk.fakes import CHAT, answer, completion, error


def body_of(request: httpx.Request) -> dict:
    return json.loads(request.content)


def client_for(script: Script, base_url: str = "http://test.local/v1", **kwargs) -> Client:
    return Client(base_url, "k", http_client=httpx.Client(transport=script.transport()), **kwargs)


# ---- configuration ------------------------------------------------------------------------------

def test_arguments_win_then_foretell_env_then_openai_env_then_the_default():
    env = {"FORETELL_BASE_URL": "http://f:1/v1/", "FORETELL_API_KEY": "fk",
           "OPENAI_BASE_URL": "https://o/v1", "OPENAI_API_KEY": "ok"}
    assert resolve_config("http://arg/v1", "ak", env=env).base_url == "http://arg/v1"
    assert resolve_config("http://arg/v1", "ak", env=env).api_key == "ak"
    config = resolve_config(env=env)
    assert (config.base_url, config.api_key) == ("http://f:1/v1", "fk")  # trailing slash dropped
    config = resolve_config(env={"OPENAI_BASE_URL": "https://o/v1", "OPENAI_API_KEY": "ok"})
    assert (config.base_url, config.api_key) == ("https://o/v1", "ok")
    config = resolve_config(env={})
    assert (config.base_url, config.api_key) == (DEFAULT_BASE_URL, None)


def test_an_openai_key_is_not_sent_to_a_foretell_base_url_from_the_environment():
    config = resolve_config(env={"FORETELL_BASE_URL": "http://f/v1", "OPENAI_API_KEY": "ok"})
    assert config.api_key is None
    # With the default base URL the OpenAI key is still the fallback.
    assert resolve_config(env={"OPENAI_API_KEY": "ok"}).api_key == "ok"


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="http"):
        resolve_config("127.0.0.1:8000/v1", env={})
    with pytest.raises(ValueError, match="server must be"):
        resolve_config(server="vllm", env={})


def test_client_reads_the_environment(monkeypatch):
    monkeypatch.setenv("FORETELL_BASE_URL", "http://env.local/v1")
    monkeypatch.setenv("FORETELL_API_KEY", "env-key")
    script = Script(answer())
    client = Client(http_client=httpx.Client(transport=script.transport()))
    client.chat.completions.create(**CHAT)
    request = script.requests[0]
    assert str(request.url) == "http://env.local/v1/chat/completions"
    assert request.headers["authorization"] == "Bearer env-key"
    assert "env-key" not in repr(client)


def test_the_client_closes_its_own_pool_only():
    own = Client("http://test.local/v1")
    with own:
        pass
    assert own._http.is_closed
    mine = httpx.Client()
    with Client("http://test.local/v1", http_client=mine):
        pass
    assert not mine.is_closed


# ---- request bodies -----------------------------------------------------------------------------

def test_create_sends_openai_parameters_prediction_and_pass_through_fields():
    script = Script(answer())
    client = client_for(script, server="openai-compatible")
    client.chat.completions.create(**CHAT, prediction=["def f():", {"type": "text", "text": " pass\n"}],
                                   max_tokens=20, temperature=0, stop=["\n\n"], seed=None,
                                   extra_body={"top_k": 5}, extra_headers={"x-trace": "t1"})
    request = script.requests[0]
    body = body_of(request)
    assert body == {"model": "m", "messages": CHAT["messages"], "max_tokens": 20, "temperature": 0,
                    "stop": ["\n\n"], "top_k": 5,
                    "prediction": {"type": "content", "content": [{"type": "text", "text": "def f():"},
                                                                  {"type": "text", "text": " pass\n"}]}}
    assert request.headers["x-trace"] == "t1"


def test_an_unknown_parameter_is_a_type_error_pointing_at_extra_body():
    client = client_for(Script(answer()))
    with pytest.raises(TypeError, match="extra_body"):
        client.chat.completions.create(**CHAT, max_tokenz=3)


def test_prompt_lookup_is_sent_as_speculation_to_a_foretell_server():
    script = Script(answer(foretell=True))
    client = client_for(script)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        client.chat.completions.create(**CHAT, prompt_lookup=True, max_draft=32)
        client.completions.create(model="m", prompt="p", prompt_lookup=False)
    # One probe (GET /models) decided the kind; later calls reuse it.
    assert script.paths() == ["GET /v1/models", "POST /v1/chat/completions", "POST /v1/completions"]
    assert body_of(script.requests[1])["speculation"] == {"prompt_lookup": True, "max_draft": 32}
    assert body_of(script.requests[2])["speculation"] == {"prompt_lookup": False}
    assert client.server_kind == "foretell"


def test_prompt_lookup_is_dropped_with_one_warning_for_other_servers():
    script = Script(answer(foretell=False))
    client = client_for(script)
    with pytest.warns(ForetellWarning, match="not foretell"):
        response = client.chat.completions.create(**CHAT, prompt_lookup=True)
    assert response.text == "hello"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second time: no warning
        client.chat.completions.create(**CHAT, prompt_lookup=True)
    assert all("speculation" not in body_of(r) for r in script.requests if r.method == "POST")
    assert client.server_kind == "openai-compatible"


def test_known_hosts_and_the_server_argument_skip_the_probe():
    script = Script(answer(foretell=False))
    client = client_for(script, base_url="https://api.openai.com/v1")
    with pytest.warns(ForetellWarning):
        client.chat.completions.create(**CHAT, prompt_lookup=True)
    script2 = Script(answer(foretell=False))
    client2 = client_for(script2, server="foretell")
    client2.chat.completions.create(**CHAT, prompt_lookup=True)
    assert script.paths() == ["POST /v1/chat/completions"]
    assert script2.paths() == ["POST /v1/chat/completions"]
    assert body_of(script2.requests[0])["speculation"] == {"prompt_lookup": True}


def test_an_explicit_server_kind_is_not_overridden_by_headers():
    script = Script(answer(foretell=True))
    client = client_for(script, server="openai-compatible")
    client.chat.completions.create(**CHAT)
    with pytest.warns(ForetellWarning):
        client.chat.completions.create(**CHAT, prompt_lookup=True)
    assert "speculation" not in body_of(script.requests[1])
    assert client.server_kind == "openai-compatible"


def test_a_gateway_error_without_the_header_does_not_decide_the_kind():
    script = Script(error(502, foretell=False), answer(foretell=True))
    client = client_for(script, retry_policy=RetryPolicy(random=lambda: 0.0), sleep=lambda s: None)
    client.chat.completions.create(**CHAT, prompt_lookup=True)
    # The probe met the 502 first, retried, then saw the header: speculation was sent.
    assert script.paths() == ["GET /v1/models", "GET /v1/models", "POST /v1/chat/completions"]
    assert body_of(script.requests[2])["speculation"] == {"prompt_lookup": True}


def test_the_kind_is_learnt_from_any_response_without_a_probe():
    script = Script(answer(foretell=True))
    client = client_for(script)
    client.chat.completions.create(**CHAT)
    client.chat.completions.create(**CHAT, prompt_lookup=True)
    assert script.paths() == ["POST /v1/chat/completions"] * 2
    assert body_of(script.requests[1])["speculation"] == {"prompt_lookup": True}


def test_explicit_speculation_in_extra_body_wins():
    script = Script(answer(foretell=True))
    client = client_for(script, server="foretell")
    client.chat.completions.create(**CHAT, prompt_lookup=True,
                                   extra_body={"speculation": {"prompt_lookup": False}})
    assert body_of(script.requests[0])["speculation"] == {"prompt_lookup": False}


def test_openai_prediction_limits_warn_only_for_servers_that_are_not_foretell():
    other = Script(answer(foretell=False))
    client = client_for(other, base_url="https://api.openai.com/v1")
    with pytest.warns(ForetellWarning) as caught:
        client.chat.completions.create(model="gpt-4o", messages=CHAT["messages"], prediction="x",
                                       n=2, logprobs=True, tools=[{"type": "function"}])
    messages = " | ".join(str(w.message) for w in caught)
    assert "n > 1" in messages and "logprobs" in messages and "tools" in messages
    with pytest.warns(ForetellWarning, match="n > 1"):  # fields given through extra_body count too
        client_for(Script(answer(foretell=False)), base_url="https://api.openai.com/v1").chat.completions.create(
            model="gpt-4o", messages=CHAT["messages"], prediction="x", extra_body={"n": 2})
    with pytest.warns(ForetellWarning, match="gpt-3.5-turbo"):
        client.chat.completions.create(model="gpt-3.5-turbo", messages=CHAT["messages"], prediction="x")
    foretell = Script(answer(foretell=True))
    client = client_for(foretell, server="foretell")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        client.chat.completions.create(model="gpt-4o", messages=CHAT["messages"], prediction="x", n=2)


# ---- predictions ---------------------------------------------------------------------------------

def test_prediction_forms_normalise(tmp_path):
    assert normalize_prediction("abc") == {"type": "content", "content": "abc"}
    assert normalize_prediction(None) is None
    assert normalize_prediction(["a", {"type": "text", "text": "b"}]) == {
        "type": "content", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert normalize_prediction({"type": "content", "content": "x"}) == {"type": "content", "content": "x"}
    file = tmp_path / "a.py"
    file.write_bytes(b"x = 1\r\ny = 2\n")
    assert prediction_from_file(file) == {"type": "content", "content": "x = 1\r\ny = 2\n"}
    assert normalize_prediction(file) == prediction_from_file(file)  # a Path means the file
    for bad in (42, [1], {"type": "other"}, [{"type": "image"}]):
        with pytest.raises(TypeError):
            normalize_prediction(bad)
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="not valid utf-8"):
        prediction_from_file(tmp_path / "bin")


# ---- typed responses ----------------------------------------------------------------------------

def test_typed_responses_tolerate_missing_and_unknown_fields():
    data = completion(speculation={"target_passes": 3, "acceptance_rate": 0.5, "new_field": 1,
                                   "per_source": {"prediction": {"rounds": 2, "accepted": 9}}},
                      foretell={"notes": ["prediction dropped"]})
    data["choices"][0]["message"]["annotations"] = []
    response = ChatCompletion.from_dict(data)
    assert response.text == "hello"
    assert response.usage.accepted_prediction_tokens == 2
    assert response.usage.rejected_prediction_tokens == 1
    assert response.speculation.target_passes == 3
    assert response.speculation.per_source["prediction"].accepted == 9
    assert response.speculation.per_source["prediction"].drafted == 0
    assert response.speculation.new_field == 1
    assert response.foretell == {"notes": ["prediction dropped"]}
    assert response.choices[0].message.annotations == []
    assert response.to_dict() == data and response.to_dict() is not data
    with pytest.raises(AttributeError):
        response.no_such_field
    empty = ChatCompletion.from_dict({"choices": [{}], "usage": None})
    assert empty.text == "" and empty.usage is None and empty.speculation is None and empty.id is None
    assert ChatCompletion.from_dict("not a dict").choices == []


def test_responses_carry_the_request_id():
    client = client_for(Script(answer()))
    assert client.chat.completions.create(**CHAT).request_id == "req-abc"
