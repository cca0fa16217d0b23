"""Constrained decoding (``engine/grammar.py``): with a grammar, the engine's output equals
transformers' greedy decoding under the same grammar (``tests/helpers.py: GrammarOracle``) token
for token, for every draft source, and a draft token the grammar forbids never costs a position."""

from __future__ import annotations

import json

import pytest

from foretell.proxy.engine import GenerationRequest, SpeculativeEngine
from foretell.proxy.engine.grammar import Grammar, grammar_tokenizer, json_grammar
from tests.helpers import assert_greedy_equal, constrained_greedy_reference

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 4}},
          "required": ["name", "tags"], "additionalProperties": False}
PROMPT = 'Reply in JSON. {"name": "parser", "tags": [1, 2, 3]}\nAgain:\n'
MAX_NEW = 40


@pytest.fixture(scope="module")
def tiny(tiny_model, tokenizer):
    engine = SpeculativeEngine(tiny_model, tokenizer)
    llg = grammar_tokenizer(tokenizer, tiny_model.config.vocab_size, engine.eos_token_ids)
    return engine, llg


def _grammar(llg, engine, schema) -> Grammar:
    return Grammar(llg, json_grammar(schema), engine.model.config.vocab_size)


@pytest.mark.parametrize("schema", [SCHEMA, None], ids=["schema", "any-object"])
@pytest.mark.parametrize("draft", ["none", "oracle", "edited", "invalid", "lookup"])
def test_constrained_greedy_equals_constrained_plain_greedy(tiny, tiny_model, tokenizer, schema, draft):
    engine, llg = tiny
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    reference = constrained_greedy_reference(tiny_model, prompt_ids, MAX_NEW, llg, json_grammar(schema),
                                             engine.eos_token_ids)
    text = tokenizer.decode(reference, skip_special_tokens=True)
    prediction = {"none": None, "oracle": text, "edited": text[:len(text) // 2] + ' "x": 1}',
                  # Not JSON at all: every draft token is refused by the grammar, none verified.
                  "invalid": "Completely unrelated words, no braces at all " * 3,
                  "lookup": None}[draft]
    result = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=MAX_NEW, prediction=prediction,
                                               prompt_lookup=draft == "lookup",
                                               grammar=_grammar(llg, engine, schema)))
    assert_greedy_equal(tiny_model, prompt_ids, result.token_ids, reference, 1e-4)
    if draft == "oracle":
        assert result.stats.accepted_tokens > 0 and result.stats.target_passes < len(result.token_ids)
    if draft == "invalid":
        # The prediction's drafts are cut before their first token: nothing drafted is verified.
        assert result.stats.drafted_tokens == 0


def test_the_free_output_is_not_the_constrained_one(tiny, tiny_model, tokenizer):
    # The mask does something: the tiny random model's free text is not JSON.
    engine, llg = tiny
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    free = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=MAX_NEW)).text
    held = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=MAX_NEW,
                                             grammar=_grammar(llg, engine, SCHEMA))).text
    assert free != held and held.lstrip().startswith("{")


def test_a_finished_constrained_output_is_valid_json(tiny, tokenizer):
    engine, llg = tiny
    # Without flexible whitespace (llguidance's "x-guidance" option): the random model would
    # otherwise write newlines until max_tokens, which JSON allows.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    result = engine.generate(GenerationRequest(prompt_ids=tokenizer(PROMPT)["input_ids"], max_tokens=40,
                                               grammar=_grammar(llg, engine, schema)))
    assert result.finish_reason == "stop"
    assert set(json.loads(result.text)) == {"ok"}


def test_batched_constrained_and_free_sequences_each_match_their_oracle(tiny, tiny_model, tokenizer):
    engine, llg = tiny
    prompts = [tokenizer(p)["input_ids"] for p in (PROMPT, "def f(x):\n    return", PROMPT + "{")]
    grammars = [_grammar(llg, engine, SCHEMA), None, _grammar(llg, engine, None)]
    sequences = [engine.add(GenerationRequest(prompt_ids=ids, max_tokens=24, grammar=grammar, prompt_lookup=True))
                 for ids, grammar in zip(prompts, grammars)]
    results = {}
    while len(results) < len(sequences):
        for update in engine.step([s for s in sequences if s not in results]):
            assert update.error is None
            if update.result is not None:
                results[update.sequence] = update.result
    for seq, ids, grammar in zip(sequences, prompts, grammars):
        if grammar is None:
            from tests.helpers import greedy_reference
            reference = greedy_reference(tiny_model, ids, 24)
        else:
            schema = SCHEMA if grammar is grammars[0] else None
            reference = constrained_greedy_reference(tiny_model, ids, 24, llg, json_grammar(schema),
                                                     engine.eos_token_ids)
        assert_greedy_equal(tiny_model, ids, results[seq].token_ids, reference, 1e-4)
