"""Reading an answer into content and tool calls (``proxy/server/tool_calls/parser.py``): the
same events whatever pieces the text comes in, so a stream's deltas add up to the body; an answer
without calls is its text exactly; a call's arguments are the model's own JSON text."""

from __future__ import annotations

import json
import random

import pytest

from foretell.proxy.server.tool_calls.format import CallFormat
from foretell.proxy.server.tool_calls.parser import Arguments, CallStart, ToolCallParser, collect, delta

TAGGED = CallFormat(tagged=True, arguments_key="arguments", template_reads_tools=False)
BARE = CallFormat(tagged=False, arguments_key="parameters", template_reads_tools=True)
NAMES = frozenset({"get_weather", "read_file"})
WEATHER = '{"city": "Z\\u00fcrich \\"centre\\"", "days": [1, {"a": "}]"}], "note": "東京 🙂"}'


def read(form, text: str, pieces=None, parallel: bool = True) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of ``text`` fed in ``pieces`` (lengths; None: whole)."""
    parser = ToolCallParser(form, NAMES, parallel)
    events, at = [], 0
    for length in pieces or [len(text)]:
        events += parser.feed(text[at:at + length])
        at += length
    events += parser.feed(text[at:]) + parser.finish()
    content, calls = collect(events)
    return content, [(call["function"]["name"], call["function"]["arguments"]) for call in calls]


def splits(text: str, seed: int) -> list[int]:
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < len(text):
        lengths.append(rng.randint(1, 6))
    return lengths


TAGGED_CASES = [
    # (answer, content, calls)
    ("Hello there.  \n", "Hello there.  \n", []),
    ("  leading space, a < sign and a partial tag <tool", "  leading space, a < sign and a partial tag <tool", []),
    ("Sure.\n<tool_call>\n" + f'{{"name": "get_weather", "arguments": {WEATHER}}}' + "\n</tool_call>\n",
     "Sure.", [("get_weather", WEATHER)]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name":"read_file","arguments":{}}\n</tool_call>',
     "", [("get_weather", '{"city": "Paris"}'), ("read_file", "{}")]),
    # Keys in another order: read whole once the tag closes.
    ('<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>',
     "", [("get_weather", '{"city": "Paris"}')]),
    # A function nobody offered, and a tag around no call: content, as written.
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> ok', '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> ok', []),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    # Cut off (max_tokens) inside the arguments: the call with what was written; before them: dropped.
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "", [("get_weather", '{"city": "Par')]),
    ('<tool_call>\n{"name": "read_file", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_w',
     "", [("read_file", "{}")]),
    ("First.\n<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"a\"}}\n</tool_call>\nThen more.",
     "First.\nThen more.", [("read_file", '{"path": "a"}')]),  # the space before a call is not content
]


@pytest.mark.parametrize("answer,content,calls", TAGGED_CASES)
@pytest.mark.parametrize("seed", [None, 0, 1, 2])
def test_tagged_answers_read_the_same_in_any_pieces(answer, content, calls, seed):
    pieces = None if seed is None else splits(answer, seed)
    assert read(TAGGED, answer, pieces) == (content, calls)


def test_character_by_character_is_the_same():
    for answer, content, calls in TAGGED_CASES:
        assert read(TAGGED, answer, [1] * len(answer)) == (content, calls), answer


BARE_CASES = [
    (' {"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", '{"city": "Paris"}')]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "read_file", "parameters": {}}',
     "", [("get_weather", '{"city": "Paris"}'), ("read_file", "{}")]),
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON that is no call: content
    ('It is sunny. {"name": "read_file", "parameters": {}}', 'It is sunny. {"name": "read_file", "parameters": {}}', []),
]


@pytest.mark.parametrize("answer,content,calls", BARE_CASES)
@pytest.mark.parametrize("seed", [None, 3, 4])
def test_bare_json_calls_are_read_at_the_start(answer, content, calls, seed):
    pieces = None if seed is None else splits(answer, seed)
    assert read(BARE, answer, pieces) == (content, calls)


def test_one_call_at_most_without_parallel_calls():
    two = ('<tool_call>\n{"name": "read_file", "arguments": {"path": "a"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "read_file", "arguments": {"path": "b"}}\n</tool_call>')
    content, calls = read(TAGGED, two, parallel=False)
    assert calls == [("read_file", '{"path": "a"}')]
    assert content.strip().startswith("<tool_call>") and '"b"' in content
    assert read(BARE, '{"name": "read_file", "parameters": {}}; {"name": "read_file", "parameters": {}}',
                parallel=False)[1] == [("read_file", "{}")]


def test_the_stream_deltas_add_up_to_the_body():
    answer = TAGGED_CASES[2][0] + TAGGED_CASES[3][0]
    parser = ToolCallParser(TAGGED, NAMES, True)
    events = []
    for length in splits(answer, 7):
        events += parser.feed(answer[:length])
        answer = answer[length:]
    events += parser.finish()
    # What a client (the openai package's stream helper) assembles from the deltas.
    content, calls = "", {}
    for event in events:
        change = delta(event)
        content += change.get("content", "")
        for call in change.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
            entry["id"] = call.get("id", entry["id"])
            entry["name"] = call.get("function", {}).get("name", entry["name"])
            entry["arguments"] += call["function"]["arguments"]
    body_content, body_calls = collect(events)
    assert content == body_content
    assert [calls[i] for i in sorted(calls)] == [{"id": c["id"], "name": c["function"]["name"],
                                                  "arguments": c["function"]["arguments"]} for c in body_calls]
    # Each call's name comes once, before any piece of its arguments.
    starts = {e.index: i for i, e in enumerate(events) if isinstance(e, CallStart)}
    assert len(starts) == len(body_calls) == 3
    assert all(starts[e.index] < i for i, e in enumerate(events) if isinstance(e, Arguments))
    assert sum(isinstance(e, Arguments) for e in events) > len(body_calls)  # in pieces, not whole
    assert [json.loads(call["function"]["arguments"]) for call in body_calls][0]["note"] == "東京 🙂"
