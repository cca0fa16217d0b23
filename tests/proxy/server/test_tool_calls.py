"""Tool calls on the local model over HTTP (``proxy/server/tool_calls/``): the official client's
round trip and its ``parse`` helper on the real embedded model, a prediction drafting a call's
arguments, streams whose deltas add up to the body (on the tiny random model, whose calls are
full of unicode split across tokens), the bare-JSON format of a Llama-like template, and every
refusal by name."""

from __future__ import annotations

import copy
import json

import httpx
import openai
import pydantic
import pytest

from tests.helpers import assert_envelope
from tests.proxy.server.test_tool_format import LLAMA_LIKE, NOTE, STRICT_WEATHER, WEATHER
from tests.serving import serve, tiny_app

MODEL = "gemma-3-270m"
ASK = [{"role": "user", "content": "What is the weather in Paris today?"}]


class GetWeather(pydantic.BaseModel):
    """The weather in a city today."""

    city: str = pydantic.Field(max_length=24)


def chat(server, model: str, **fields) -> httpx.Response:
    body = {"model": model, "messages": ASK, "temperature": 0, "max_tokens": 60, "tools": [WEATHER, NOTE], **fields}
    return httpx.post(server.base + "/v1/chat/completions", json=body, timeout=600)


def streamed(server, model: str, **fields) -> tuple[str, list[dict], str]:
    """A stream's content, calls and finish reason, assembled as the openai package does."""
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)
    body = {"temperature": 0, "max_tokens": 60, "tools": [WEATHER, NOTE], "messages": ASK, **fields}
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=model, stream=True, **body):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": None, "arguments": "", "ids": []})
                if call.id:
                    entry["ids"].append(call.id)
                if call.function and call.function.name:
                    assert entry["name"] is None, "the name comes once"
                    entry["name"] = call.function.name
                entry["arguments"] += (call.function.arguments or "") if call.function else ""
            finish = choice.finish_reason or finish
    assert all(len(entry.pop("ids")) == 1 for entry in calls.values()), "the id comes once"
    return content, [calls[i] for i in sorted(calls)], finish


def message_of(response: httpx.Response) -> tuple[str, list[dict], str]:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in choice["message"].get("tool_calls") or []]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in choice["message"].get("tool_calls") or [])
    return choice["message"]["content"] or "", calls, choice["finish_reason"]


# ---- the real embedded model ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def embedded_server(embedded_folder):
    with serve(tiny_app(embedded_folder, served_model_name=MODEL), "tool-calls") as served:
        yield served


@pytest.mark.embedded
def test_the_openai_round_trip(embedded_server):
    client = openai.OpenAI(base_url=embedded_server.base + "/v1", api_key="unused", max_retries=0)
    tools = [openai.pydantic_function_tool(GetWeather)]
    # The client's parse helper: the call's arguments come back as the pydantic model.
    first = client.chat.completions.parse(model=MODEL, messages=ASK, tools=tools, tool_choice="required",
                                          parallel_tool_calls=False, temperature=0, max_tokens=40)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "GetWeather" and isinstance(call.function.parsed_arguments, GetWeather)
    # The call and its result go back; the model answers from them.
    history = ASK + [{"role": "assistant", "content": None,
                      "tool_calls": [{"id": call.id, "type": "function",
                                      "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "clear", "celsius": 21})}]
    # tool_choice auto, the tool strict (as pydantic_function_tool makes it): any call it makes
    # follows the schema, or parse would raise.
    second = client.chat.completions.parse(model=MODEL, messages=history, tools=tools, parallel_tool_calls=False,
                                           temperature=0, max_tokens=160)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    for later in second.choices[0].message.tool_calls or []:
        assert isinstance(later.function.parsed_arguments, GetWeather)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and the result are in the prompt


@pytest.mark.embedded
def test_a_named_function_is_the_one_called(embedded_server):
    content, calls, finish = message_of(chat(embedded_server, MODEL, max_tokens=30, parallel_tool_calls=False,
                                             tool_choice={"type": "function", "function": {"name": "take_note"}}))
    assert finish == "tool_calls" and content == ""
    assert [c["name"] for c in calls] == ["take_note"] * len(calls) and json.loads(calls[0]["arguments"]) == {}


@pytest.mark.embedded
def test_a_prediction_drafts_the_call_and_changes_nothing(embedded_server):
    plain = chat(embedded_server, MODEL, tool_choice="required", parallel_tool_calls=False)
    content, calls, _ = message_of(plain)
    # The caller holds the arguments it expects (an agent re-issuing a call with one value changed).
    arguments = json.loads(calls[0]["arguments"])
    arguments["days"] = 5
    predicted = chat(embedded_server, MODEL, tool_choice="required", parallel_tool_calls=False,
                     prediction={"type": "content", "content": json.dumps(arguments)})
    assert message_of(predicted)[:2] == (content, calls)
    assert predicted.json()["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0


# ---- the tiny random model: streams, formats, refusals ----------------------------------------------

@pytest.mark.parametrize("fields", [
    {"tool_choice": "required"},  # calls full of arbitrary text
    {"tool_choice": "required", "parallel_tool_calls": False},
    {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {},  # auto: the random model writes text
    {"tools": [STRICT_WEATHER, NOTE]},  # auto under the grammar a strict function asks for
    {"tool_choice": "none"},
], ids=["required", "one-call", "named", "auto", "auto-strict", "none"])
def test_the_stream_adds_up_to_the_body(tiny_server, fields):
    body = message_of(chat(tiny_server, "tiny", **fields))
    assert streamed(tiny_server, "tiny", **fields) == body
    content, calls, finish = body
    if "tool_choice" in fields and fields["tool_choice"] != "none":
        assert calls and content == ""
        assert finish in ("tool_calls", "length")
    else:
        assert not calls and finish in ("stop", "length") and content


def test_several_choices_are_read_each_on_its_own(tiny_server):
    response = chat(tiny_server, "tiny", tool_choice="required", n=2, temperature=1.0, seed=5)
    assert response.status_code == 200, response.text
    ids = [call["id"] for choice in response.json()["choices"] for call in choice["message"]["tool_calls"]]
    assert len(ids) >= 2 and len(set(ids)) == len(ids)


@pytest.fixture(scope="module")
def llama_like_server(tmp_path_factory, tiny_model, tokenizer):
    """The tiny model with a chat template of Llama 3's kind: calls as bare JSON objects."""
    folder = tmp_path_factory.mktemp("tiny-llama-like")
    tiny_model.save_pretrained(folder)
    templated = copy.copy(tokenizer)
    templated.chat_template = LLAMA_LIKE
    templated.save_pretrained(folder)
    with serve(tiny_app(folder, served_model_name="llama-like"), "tool-calls-llama-like") as served:
        yield served


def test_a_bare_json_template_gets_its_own_format(llama_like_server):
    content, calls, finish = body = message_of(chat(llama_like_server, "llama-like", tool_choice="required",
                                                    parallel_tool_calls=False, max_tokens=40))
    assert calls and content == "" and calls[0]["name"] in ("get_weather", "take_note")
    assert streamed(llama_like_server, "llama-like", tool_choice="required", parallel_tool_calls=False,
                    max_tokens=40) == body


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logprobs": True}, "logprobs"),
    ({"speculation": {"report_origins": True}, "stream": True}, "speculation.report_origins"),
    ({"tools": [{"type": "custom", "custom": {"name": "grep"}}]}, "tools.0.type"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}]}, "tools"),
    ({"messages": ASK + [{"role": "tool", "content": "{}"}]}, "messages.1"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "custom", "custom": {}}]}]},
     "messages.1.tool_calls.0"),
])
def test_what_the_local_model_cannot_do_with_tools_is_refused_by_name(tiny_server, fields, param):
    assert_envelope(chat(tiny_server, "tiny", **fields), 400, param=param)


def test_a_forward_relays_tools_of_any_kind(tiny_server, stub_upstream):
    custom = [{"type": "custom", "custom": {"name": "grep", "description": "search"}}]
    response = chat(tiny_server, "up-ok", tools=custom, tool_choice={"type": "allowed_tools", "mode": "auto",
                                                                      "tools": [{"type": "custom", "name": "grep"}]})
    assert response.status_code == 200, response.text
    assert stub_upstream.received[-1]["body"]["tools"] == custom


def test_tokenize_counts_the_prompt_with_its_tools(tiny_server):
    # vLLM's /tokenize takes the chat's tools: the count is the prompt the chat will run on.
    used = chat(tiny_server, "tiny", max_tokens=1).json()["usage"]["prompt_tokens"]
    # With the BOS the plain transcript's prompt gets (vLLM's /tokenize adds none to messages).
    asked = {"model": "tiny", "messages": ASK, "add_special_tokens": True}
    counted = httpx.post(tiny_server.base + "/tokenize", json={**asked, "tools": [WEATHER, NOTE]}, timeout=60).json()
    without = httpx.post(tiny_server.base + "/tokenize", json=asked, timeout=60).json()
    assert counted["count"] == used > without["count"]
