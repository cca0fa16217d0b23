"""The probe's table of bad (and a few good but unusual) requests, each with the status it must
get from the tiny-model serve process (tests/e2e/conftest.py starts it with the key and limits
below). tests/e2e/test_probe.py sends them all; benchmarks/soak.py mixes most of them into its
traffic.

Add a row whenever a new kind of bad input turns up."""

from __future__ import annotations

import base64
import json

# The probe's serve process: its API key, served model name and limits.
API_KEY = "sk-e2e-serve-3141"
MODEL = "tiny"
LIMIT = 4_000_000  # --max-body-bytes: room for a 3.5 MB prompt
PREDICTION_LIMIT = 5000  # --max-prediction-chars
C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = 200


def completion(**fields):
    return {"model": MODEL, "prompt": "def f(", "max_tokens": 3, **fields}


def chat(**fields):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, **fields}


def raw(text: str) -> bytes:
    return text.encode()


# (name, path, body: dict / list / bytes, expected status, extra headers)
PROBES = [
    # ---- not JSON, or not an object
    ("truncated json", C, raw('{"model": "tiny", "prompt": '), 400, {}),
    ("empty body", C, b"", 400, {}),
    ("null body", C, raw("null"), 400, {}),
    ("array body", C, raw("[]"), 400, {}),
    ("string body", C, raw('"def f("'), 400, {}),
    ("number body", C, raw("5"), 400, {}),
    ("NaN", C, raw('{"model": "tiny", "prompt": "x", "temperature": NaN}'), 400, {}),
    ("Infinity", C, raw('{"model": "tiny", "prompt": "x", "top_p": Infinity}'), 400, {}),
    ("5000-digit integer", C, raw('{"model": "tiny", "prompt": "x", "max_tokens": ' + "9" * 5000 + "}"), 400, {}),
    ("1e400", C, raw('{"model": "tiny", "prompt": "x", "temperature": 1e400}'), 400, {}),
    ("nested 1000 deep", C, raw('{"model": "tiny", "prompt": ' + "[" * 1000 + "]" * 1000 + "}"), 400, {}),
    ("nested 100 deep in an unknown field", C, raw('{"model": "tiny", "prompt": "x", "x": ' + "{\"a\": " * 100
                                                   + "1" + "}" * 100 + "}"), 400, {}),
    ("invalid utf-8", C, b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, {}),
    ("utf-8 BOM", C, b"\xef\xbb\xbf" + json.dumps(completion()).encode(), 400, {}),
    ("body over the limit", C, completion(prompt="x" * (LIMIT + 1)), 413, {}),
    # ---- headers
    ("text/plain body", C, completion(), 415, {"content-type": "text/plain"}),
    ("form body", C, completion(), 415, {"content-type": "application/x-www-form-urlencoded"}),
    ("no content type", C, completion(), 415, {"content-type": None}),
    ("foreign host", C, completion(), 421, {"host": "attacker.example"}),
    ("no key", C, completion(), 401, {"authorization": None}),
    ("wrong key", C, completion(), 401, {"authorization": "Bearer nope"}),
    ("basic auth", C, completion(), 401,
     {"authorization": "Basic " + base64.b64encode(f"{API_KEY}:".encode()).decode()}),
    ("unknown path", "/v1/engines", completion(), 404, {}),
    # ---- model and prompt
    ("no model", C, {"prompt": "x"}, 400, {}),
    ("model is a number", C, completion(model=5), 400, {}),
    ("empty model", C, completion(model=""), 404, {}),
    ("unknown model", C, completion(model="gpt-9"), 404, {}),
    ("no prompt", C, {"model": MODEL}, 400, {}),
    ("prompt is a number", C, completion(prompt=5), 400, {}),
    ("prompt of token ids", C, completion(prompt=[2, 1018, 1035]), OK, {}),
    ("one prompt of token ids in a list", C, completion(prompt=[[2, 1018, 1035]]), OK, {}),
    ("empty token ids", C, completion(prompt=[]), 400, {}),
    ("empty token ids in a list", C, completion(prompt=[[]]), 400, {}),
    ("negative token id", C, completion(prompt=[2, -1]), 400, {}),
    ("token id past the vocabulary", C, completion(prompt=[2, 10**9]), 400, {}),
    ("token id fraction", C, completion(prompt=[2, 1.5]), 400, {}),
    ("token id true", C, completion(prompt=[2, True]), 400, {}),
    ("token ids and text mixed", C, completion(prompt=[2, "x"]), 400, {}),
    ("two prompts of token ids", C, completion(prompt=[[2, 3], [4, 5]]), 400, {}),
    ("token ids over the context", C, completion(prompt=[2] + [1018] * 5000), 400, {}),
    ("token ids with echo", C, completion(prompt=[2, 1018, 1035], echo=True, logprobs=1), OK, {}),
    ("two prompts", C, completion(prompt=["a", "b"]), 400, {}),
    ("prompt is an object", C, completion(prompt={"text": "x"}), 400, {}),
    ("lone surrogate in prompt", C, raw('{"model": "tiny", "prompt": "a\\ud800"}'), 400, {}),
    ("prompt over the context", C, completion(prompt=" word" * 5000), 400, {}),
    # ---- numbers
    ("max_tokens string", C, completion(max_tokens="3"), 400, {}),
    ("max_tokens zero", C, completion(max_tokens=0), 400, {}),
    ("max_tokens negative", C, completion(max_tokens=-1), 400, {}),
    ("max_tokens fraction", C, completion(max_tokens=1.5), 400, {}),
    ("max_tokens true", C, completion(max_tokens=True), 400, {}),
    ("max_tokens huge", C, completion(max_tokens=10**30), 400, {}),
    ("temperature negative", C, completion(temperature=-1), 400, {}),
    ("temperature 2.5", C, completion(temperature=2.5), 400, {}),
    ("temperature string", C, completion(temperature="0.5"), 400, {}),
    ("temperature true", C, completion(temperature=True), 400, {}),
    ("temperature list", C, completion(temperature=[0.5]), 400, {}),
    ("top_p zero", C, completion(top_p=0), 400, {}),
    ("top_p 1.5", C, completion(top_p=1.5), 400, {}),
    ("top_p string", C, completion(top_p="1"), 400, {}),
    ("top_p false", C, completion(top_p=False), 400, {}),
    ("top_k negative", C, completion(top_k=-1), 400, {}),
    ("top_k string", C, completion(top_k="5"), 400, {}),
    ("top_k fraction", C, completion(top_k=2.5), 400, {}),
    ("seed 2**64", C, completion(seed=2**64), 400, {}),
    ("seed below -2**63", C, completion(seed=-(2**63) - 1), 400, {}),
    ("seed string", C, completion(seed="1"), 400, {}),
    ("seed fraction", C, completion(seed=1.5), 400, {}),
    ("n zero", C, completion(n=0), 400, {}),
    ("n nine", C, completion(n=9), 400, {}),
    ("n string", C, completion(n="2"), 400, {}),
    ("n true", C, completion(n=True), 400, {}),
    ("n with stream", C, completion(n=2, stream=True), 400, {}),
    ("logprobs six", C, completion(logprobs=6), 400, {}),
    ("logprobs negative", C, completion(logprobs=-1), 400, {}),
    ("logprobs true on completions", C, completion(logprobs=True), 400, {}),
    # ---- other fields
    ("stream string", C, completion(stream="yes"), 400, {}),
    ("stream one", C, completion(stream=1), 400, {}),
    ("stream_options string", C, completion(stream=True, stream_options="usage"), 400, {}),
    ("include_usage string", C, completion(stream=True, stream_options={"include_usage": "yes"}), 400, {}),
    ("empty stop", C, completion(stop=""), 400, {}),
    ("empty stop in a list", C, completion(stop=["a", ""]), 400, {}),
    ("17 stops", C, completion(stop=[str(i) for i in range(17)]), 400, {}),
    ("stop number", C, completion(stop=[5]), 400, {}),
    ("stop object", C, completion(stop={"a": 1}), 400, {}),
    ("lone surrogate in stop", C, raw('{"model": "tiny", "prompt": "x", "stop": "\\udc00"}'), 400, {}),
    ("user number", C, completion(user=5), 400, {}),
    ("prediction string", C, completion(prediction="def f("), 400, {}),
    ("prediction other type", C, completion(prediction={"type": "other", "content": "x"}), 400, {}),
    ("prediction content number", C, completion(prediction={"type": "content", "content": 5}), 400, {}),
    ("prediction image part", C, completion(prediction={"type": "content", "content": [{"type": "image_url"}]}),
     400, {}),
    ("prediction surrogate", C, raw('{"model": "tiny", "prompt": "x", "prediction": {"type": "content", '
                                    '"content": [{"type": "text", "text": "\\ud800"}]}}'), 400, {}),
    ("prediction over the limit", C, completion(prediction={"type": "content", "content": "y" * 6000}), 413, {}),
    ("max_draft zero", C, completion(speculation={"max_draft": 0}), 400, {}),
    ("prompt_lookup string", C, completion(speculation={"prompt_lookup": "yes"}), 400, {}),
    ("speculation string", C, completion(speculation="on"), 400, {}),
    # ---- chat
    ("no messages", CHAT, {"model": MODEL}, 400, {}),
    ("empty messages", CHAT, chat(messages=[]), 400, {}),
    ("messages string", CHAT, chat(messages="hi"), 400, {}),
    ("message without role", CHAT, chat(messages=[{}]), 400, {}),
    ("unknown role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, {}),
    ("content number", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, {}),
    ("image content", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
     400, {}),
    ("content surrogate", CHAT, raw('{"model": "tiny", "messages": [{"role": "user", "content": "\\udbff"}]}'),
     400, {}),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, {}),
    ("top_logprobs 21", CHAT, chat(logprobs=True, top_logprobs=21), 400, {}),
    ("logprobs string", CHAT, chat(logprobs="yes"), 400, {}),
    ("max_completion_tokens zero", CHAT, chat(max_completion_tokens=0), 400, {}),
    ("decoding fields the local model does not do", C, completion(frequency_penalty=0.5, logit_bias={"1": 2},
                                                                   suffix="x"), 400, {}),
    ("json_schema without its schema", CHAT, chat(response_format={"type": "json_schema"}), 400, {}),
    ("an unknown response_format", CHAT, chat(response_format={"type": "yaml"}), 400, {}),
    ("a json_schema that is no schema", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}), 400, {}),
    ("response_format with echo", C, completion(echo=True, response_format={"type": "json_object"}), 400, {}),
    ("tools on local completions", C, completion(tools=[{"type": "function", "function": {"name": "f"}}]), 400, {}),
    ("a tool that is no function", CHAT, chat(tools=[{"type": "custom", "custom": {"name": "f"}}]), 400, {}),
    ("tool_choice naming no tool", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                              tool_choice={"type": "function", "function": {"name": "g"}}), 400, {}),
    # ---- unusual but good
    ("unicode prompt", C, completion(prompt="héllo wörld — 日本語 🙂 עברית\n"), OK, {}),
    ("emoji prompt", C, completion(prompt="🙂" * 50), OK, {}),
    ("empty prompt", C, completion(prompt=""), OK, {}),
    ("NUL in prompt", C, completion(prompt="a\u0000b"), OK, {}),
    ("special-token text in prompt", C, completion(prompt="<bos><eos><start_of_turn>"), OK, {}),
    ("a list of one prompt", C, completion(prompt=["def f("]), OK, {}),
    ("optional fields null", C, completion(n=None, stream=None, temperature=None, top_p=None, seed=None, stop=None,
                                           logprobs=None, prediction=None, user=None), OK, {}),
    ("json with charset", C, completion(), OK, {"content-type": "application/json; charset=utf-8"}),
    ("loopback by name", C, completion(), OK, {"host": "localhost"}),
    ("extreme sampling", C, completion(temperature=2, top_p=1e-300, top_k=1, seed=-1), OK, {}),
    ("largest seed, two choices", C, completion(temperature=0.7, seed=2**64 - 1, n=2), OK, {}),
    ("integer temperature", C, completion(temperature=1, top_p=1), OK, {}),
    ("stream", C, completion(stream=True, stream_options={"include_usage": True}), OK, {}),
    ("unknown fields", C, completion(store=True, metadata={"a": "b"}, service_tier="auto", frequency_penalty_v9=1), OK, {}),
    ("neutral decoding fields", CHAT, chat(response_format={"type": "text"}, presence_penalty=0, frequency_penalty=0,
                                           logit_bias={}, tools=[], tool_choice="auto", parallel_tool_calls=True),
     OK, {}),
    ("json mode", CHAT, chat(response_format={"type": "json_object"}, max_tokens=4), OK, {}),
    ("a required tool call", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required",
                                        max_tokens=4), OK, {}),
    ("chat with null content", CHAT, chat(messages=[{"role": "system", "content": None},
                                                    {"role": "user", "content": "Hi"}]), OK, {}),
    ("chat in unicode", CHAT, chat(messages=[{"role": "developer", "content": "Réponds en français ✓"},
                                             {"role": "user", "content": [{"type": "text", "text": "Grüß dich"}]}]),
     OK, {}),
    ("chat stream", CHAT, chat(stream=True), OK, {}),
]
