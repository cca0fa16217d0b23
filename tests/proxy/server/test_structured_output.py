"""Structured output on the local model (``response_format``, ``engine/grammar.py``) over HTTP,
on the real embedded model: the official client's ``parse`` helper with a pydantic model, JSON
mode, a prediction drafting the JSON (same text, prediction tokens accepted), the stream's text
equal to the body's, and bad schemas refused by name."""

from __future__ import annotations

import json

import httpx
import openai
import pydantic
import pytest

from tests.helpers import assert_envelope
from tests.serving import serve, tiny_app

pytestmark = pytest.mark.embedded

MODEL = "gemma-3-270m"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                         "country": {"type": "string", "maxLength": 24},
                                         # Bounded: the small model would write digits forever.
                                         "population_millions": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["city", "country", "population_millions"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Paris is the capital of France and has about 2 million people. "
                                   "Describe Paris as JSON with city, country and population_millions."}]


class City(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)
    population_millions: int = pydantic.Field(ge=0, le=99)


@pytest.fixture(scope="module")
def server(embedded_folder):
    with serve(tiny_app(embedded_folder, served_model_name=MODEL), "structured") as served:
        yield served


def chat(server, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 80, **fields}
    return httpx.post(server.base + "/v1/chat/completions", json=body, timeout=600)


def schema_format(schema=CITY) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}


def test_the_openai_parse_helper_gets_its_pydantic_model(server):
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)
    completion = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=City, temperature=0,
                                               max_tokens=80)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)


def test_json_mode_answers_a_json_object(server):
    ask = [{"role": "user", "content": 'Answer with a JSON object {"capital": ...} naming the capital of France.'}]
    response = chat(server, messages=ask, response_format={"type": "json_object"})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_a_prediction_drafts_the_json_and_changes_nothing(server):
    plain = chat(server, response_format=schema_format()).json()
    assert "choices" in plain, plain
    text = plain["choices"][0]["message"]["content"]
    assert set(json.loads(text)) == set(CITY["properties"])
    # The caller holds the answer's JSON with one value changed (an agent re-emitting a document).
    document = json.loads(text)
    document["population_millions"] += 1
    prediction = json.dumps(document)
    with_prediction = chat(server, response_format=schema_format(),
                           prediction={"type": "content", "content": prediction}).json()
    assert with_prediction["choices"][0]["message"]["content"] == text
    assert with_prediction["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
    assert with_prediction["speculation"]["target_passes"] < with_prediction["usage"]["completion_tokens"]
    # Streamed, the same text.
    with httpx.stream("POST", server.base + "/v1/chat/completions", timeout=600, json={
            "model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 80, "stream": True,
            "response_format": schema_format(), "prediction": {"type": "content", "content": prediction}}) as streamed:
        events = [json.loads(line[len("data: "):]) for line in streamed.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == text


def test_the_schema_holds_where_the_free_answer_would_not(server):
    # Free text first: the small model answers in prose, not JSON of the schema.
    free = chat(server).json()["choices"][0]["message"]["content"]
    held_body = chat(server, response_format=schema_format()).json()
    assert "choices" in held_body, held_body
    held = held_body["choices"][0]["message"]["content"]
    assert free != held
    assert City.model_validate_json(held)


@pytest.mark.parametrize("response_format, param", [
    ({"type": "json_schema"}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}},
     "response_format.json_schema.schema"),
    ({"type": "yaml"}, "response_format.type"),
])
def test_a_bad_response_format_is_refused_by_name(server, response_format, param):
    assert_envelope(chat(server, response_format=response_format), 400, param=param)
