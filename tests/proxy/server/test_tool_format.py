"""How the local model is offered tools and writes its calls (``proxy/server/tool_calls/``): the
call format each kind of chat template implies, the prompt with the tools and an earlier round's
call and result, and the grammar of a required call, which holds speculative decoding to exactly
what constrained plain greedy decoding writes (transformers' ``generate`` under the same grammar)."""

from __future__ import annotations

import copy
import json

import pytest

from foretell.proxy.engine import GenerationRequest, SpeculativeEngine
from foretell.proxy.engine.grammar import Grammar, grammar_tokenizer
from foretell.proxy.server.api_error import APIError
from foretell.proxy.server.prompts import chat_prompt
from foretell.proxy.server.schema import ChatCompletionRequest
from foretell.proxy.server.tool_calls.format import CallFormat, call_format, call_grammar, tool_plan
from foretell.proxy.server.tool_calls.parser import ToolCallParser, collect
from tests.helpers import assert_greedy_equal, constrained_greedy_reference

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city"], "additionalProperties": False}}}
NOTE = {"type": "function", "function": {"name": "take_note"}}  # no parameters: an empty argument list
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
]

# Chat templates of the three kinds, small enough to read: Qwen's (tools in <tools>, calls in
# <tool_call> tags), Llama 3's (bare JSON with "parameters"), and one without tools (Gemma's).
QWEN_LIKE = """{%- if tools %}<|im_start|>system
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
Return each call as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
LLAMA_LIKE = """{%- if tools %}Answer a call as {"name": function name, "parameters": its arguments}. Functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}{% endif %}{% for m in messages %}[{{ m.role }}] {% if m.tool_calls %}{% for c in m.tool_calls %}\
{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}{% endfor %}\
{% else %}{{ m.content }}{% endif %}
{% endfor %}[assistant] """
GEMMA_LIKE = """{% for m in messages %}<start_of_turn>{{ m.role }}
{{ m.content }}<end_of_turn>
{% endfor %}<start_of_turn>model
"""


def with_template(tokenizer, template: str | None):
    twin = copy.copy(tokenizer)
    twin.chat_template = template
    return twin


def parsed(messages, **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **fields})


def test_the_call_format_follows_the_template():
    assert call_format("") == CallFormat(tagged=True, arguments_key="arguments", template_reads_tools=False)
    assert call_format(GEMMA_LIKE) == CallFormat(tagged=True, arguments_key="arguments", template_reads_tools=False)
    assert call_format(QWEN_LIKE) == CallFormat(tagged=True, arguments_key="arguments", template_reads_tools=True)
    assert call_format(LLAMA_LIKE) == CallFormat(tagged=False, arguments_key="parameters", template_reads_tools=True)


def test_a_template_that_reads_tools_gets_them_and_the_history_as_objects(tokenizer):
    body = {"tools": [WEATHER]}
    for template in (QWEN_LIKE, LLAMA_LIKE):
        prompt = chat_prompt(with_template(tokenizer, template), parsed(HISTORY).messages, tool_plan(body))
        assert json.dumps(WEATHER["function"]["parameters"]) in prompt  # the tools, as sent
        # The earlier call's arguments as an object (tojson of the parsed JSON), not a string of it.
        assert '{"city": "Paris"}}' in prompt and '"{\\"city' not in prompt
        assert '{"sky": "clear"}' in prompt


def test_without_a_template_the_plain_transcript_holds_foretells_instructions(tokenizer):
    prompt = chat_prompt(with_template(tokenizer, None), parsed(HISTORY).messages, tool_plan({"tools": [WEATHER]}))
    system, rest = prompt.split("\nUser: ", 1)
    assert system.startswith("System: You can call these functions:")
    assert json.dumps(WEATHER["function"]) in system and "<tool_call>" in system
    # The earlier call in the format the answer is read in, then the result as its own turn.
    assert 'Assistant: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in rest
    assert '\nTool: {"sky": "clear"}\nAssistant:' in rest


def test_a_template_without_tools_gets_the_instructions_and_results_as_user_turns(tokenizer):
    prompt = chat_prompt(with_template(tokenizer, GEMMA_LIKE), parsed(HISTORY).messages,
                         tool_plan({"tools": [WEATHER], "tool_choice": "required"}))
    assert prompt.startswith("<start_of_turn>system\nYou can call these functions:")
    assert "Call one of the functions." in prompt
    assert '<start_of_turn>user\nResult of call call_1: {"sky": "clear"}' in prompt


def test_no_tools_offered_with_tool_choice_none(tokenizer):
    assert tool_plan({"tools": [WEATHER], "tool_choice": "none"}) is None
    prompt = chat_prompt(with_template(tokenizer, None), parsed(HISTORY).messages, None)
    assert "You can call" not in prompt and '"get_weather"' in prompt  # the history still shows


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "custom", "custom": {"name": "grep"}}]}, "tools.0.type"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_tool_fields_the_local_model_cannot_take_are_refused_by_name(body, param):
    with pytest.raises(APIError) as refused:
        tool_plan(body)
    assert (refused.value.status, refused.value.param) == (400, param)


def test_a_history_call_of_another_kind_is_refused_by_name(tokenizer):
    history = [HISTORY[0], {"role": "assistant", "tool_calls": [{"id": "c", "type": "custom", "custom": {}}]}]
    with pytest.raises(APIError) as refused:
        chat_prompt(with_template(tokenizer, None), parsed(history).messages, None)
    assert refused.value.param == "messages.1.tool_calls.0"


# ---- the grammar of a required call --------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_model, tokenizer):
    engine = SpeculativeEngine(tiny_model, tokenizer)
    return engine, grammar_tokenizer(tokenizer, tiny_model.config.vocab_size, engine.eos_token_ids)


def accepts(llg, tokenizer, grammar: str, text: str) -> bool:
    from llguidance import LLMatcher

    matcher = LLMatcher(llg, grammar, log_level=0)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if matcher.validate_tokens(ids) != len(ids):  # validates without moving on
        return False
    matcher.consume_tokens(ids)
    return matcher.is_accepting()


@pytest.mark.parametrize("form", [call_format(""), call_format(LLAMA_LIKE)], ids=["tagged", "bare"])
def test_the_grammar_takes_the_functions_calls_and_nothing_else(tiny, tokenizer, form):
    _, llg = tiny
    required = tool_plan({"tools": [WEATHER, NOTE], "tool_choice": "required", "parallel_tool_calls": False})
    grammar = call_grammar(required, form)
    assert accepts(llg, tokenizer, grammar, form.write("get_weather", '{"city": "Paris", "days": 3}'))
    assert accepts(llg, tokenizer, grammar, form.write("take_note", "{}"))
    assert not accepts(llg, tokenizer, grammar, form.write("get_weather", '{"days": 3}'))  # city is required
    assert not accepts(llg, tokenizer, grammar, form.write("get_weather", '{"city": "Paris", "days": 9}'))
    assert not accepts(llg, tokenizer, grammar, form.write("take_note", '{"text": "x"}'))  # no parameters
    assert not accepts(llg, tokenizer, grammar, form.write("delete_all", "{}"))
    assert not accepts(llg, tokenizer, grammar, "It is sunny.")
    two = form.write("take_note", "{}") + form.separator() + form.write("take_note", "{}")
    assert not accepts(llg, tokenizer, grammar, two)  # one call at most
    parallel = call_grammar(tool_plan({"tools": [WEATHER, NOTE], "tool_choice": "required"}), form)
    assert accepts(llg, tokenizer, parallel, two)
    named = call_grammar(tool_plan({"tools": [WEATHER, NOTE],
                                    "tool_choice": {"type": "function", "function": {"name": "take_note"}}}), form)
    assert accepts(llg, tokenizer, named, form.write("take_note", "{}"))
    assert not accepts(llg, tokenizer, named, form.write("get_weather", '{"city": "Paris"}'))


STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True}}


@pytest.mark.parametrize("form", [call_format(""), call_format(LLAMA_LIKE)], ids=["tagged", "bare"])
def test_a_strict_function_holds_a_free_answers_calls_to_its_schema(tiny, tokenizer, form):
    _, llg = tiny
    free = tool_plan({"tools": [WEATHER, NOTE]})
    assert not free.constrained()  # no strict function: decoded freely, read as it comes
    strict = tool_plan({"tools": [STRICT_WEATHER, NOTE]})
    assert strict.constrained() and not strict.required
    grammar = call_grammar(strict, form)
    assert accepts(llg, tokenizer, grammar, "It is sunny in Paris, I think.")
    assert accepts(llg, tokenizer, grammar, "")
    call = form.write("get_weather", '{"city": "Paris"}')
    assert accepts(llg, tokenizer, grammar, call)
    assert not accepts(llg, tokenizer, grammar, form.write("get_weather", '{"town": "Paris"}'))
    if form.tagged:  # text, then the calls
        assert accepts(llg, tokenizer, grammar, "Let me look.\n" + call + "\n" + form.write("take_note", "{}"))
        assert not accepts(llg, tokenizer, grammar, "Let me look. " + form.write("get_weather", '{"days": 1}'))
        assert not accepts(llg, tokenizer, grammar, call + " and some text after")
    else:  # the bare format's calls come first, or the answer is text
        assert not accepts(llg, tokenizer, grammar, '{"name": "get_weather", "parameters": {"days": 1}}')
        assert not accepts(llg, tokenizer, grammar, '{"answer": 42}')


@pytest.mark.parametrize("draft", ["none", "oracle", "edited", "lookup"])
def test_a_required_call_with_speculation_equals_constrained_plain_greedy(tiny, tiny_model, tokenizer, draft):
    engine, llg = tiny
    plan = tool_plan({"tools": [WEATHER, NOTE], "tool_choice": "required"})
    form = call_format("")
    prompt = chat_prompt(with_template(tokenizer, None), parsed(HISTORY[:1]).messages, plan)
    prompt_ids = tokenizer(prompt)["input_ids"]
    grammar = call_grammar(plan, form)
    reference = constrained_greedy_reference(tiny_model, prompt_ids, 48, llg, grammar, engine.eos_token_ids)
    text = tokenizer.decode(reference, skip_special_tokens=True)
    prediction = {"none": None, "oracle": text, "edited": text[:len(text) // 2] + ' "days": 2}}', "lookup": None}[draft]
    result = engine.generate(GenerationRequest(
        prompt_ids=prompt_ids, max_tokens=48, prediction=prediction, prompt_lookup=draft == "lookup",
        grammar=Grammar(llg, grammar, tiny_model.config.vocab_size)))
    assert_greedy_equal(tiny_model, prompt_ids, result.token_ids, reference, 1e-4)
    if draft == "oracle":
        assert result.stats.accepted_prediction_tokens > 0
    # The random model's answer is a call of an offered function, whatever it wrote inside.
    parser = ToolCallParser(form, plan.names(), plan.parallel)
    content, calls = collect(parser.feed(result.text) + parser.finish())
    assert calls and calls[0]["function"]["name"] in plan.names() and content == ""



@pytest.mark.parametrize("draft", ["none", "oracle"])
def test_a_free_answer_under_a_strict_function_equals_constrained_plain_greedy(tiny, tiny_model, tokenizer, draft):
    engine, llg = tiny
    plan = tool_plan({"tools": [STRICT_WEATHER, NOTE]})
    prompt_ids = tokenizer(chat_prompt(with_template(tokenizer, None), parsed(HISTORY[:1]).messages, plan))["input_ids"]
    grammar = call_grammar(plan, call_format(""))
    reference = constrained_greedy_reference(tiny_model, prompt_ids, 40, llg, grammar, engine.eos_token_ids)
    prediction = tokenizer.decode(reference, skip_special_tokens=True) if draft == "oracle" else None
    result = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=40, prediction=prediction,
                                               grammar=Grammar(llg, grammar, tiny_model.config.vocab_size)))
    assert_greedy_equal(tiny_model, prompt_ids, result.token_ids, reference, 1e-4)
