"""Constrained decoding (``engine/grammar.py``): with a grammar, the engine's output equals
transformers' greedy decoding under the same grammar (``tests/helpers.py: GrammarOracle``) token
for token, for every draft source, and a draft token the grammar forbids never costs a position."""

from __future__ import annotations

import json

import torch

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


# ---- sampling under a mask ----------------------------------------------------------------------

REGEX = "[a-d][b-f][a-i]*"  # the first two tokens held to a few letters, then any letter or the end


@pytest.fixture(scope="module")
def small():
    import llguidance

    from tests.helpers import build_small_vocab_model

    model, tokenizer = build_small_vocab_model(logit_scale=0.3)
    engine = SpeculativeEngine(model, tokenizer)

    class Characters:  # llguidance's view of the 12-token character vocabulary
        eos_token_id, bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
        special_token_ids = [0, 1, 2]
        tokens = [b"<pad>", b"<eos>", b"<bos>"] + [tokenizer.convert_ids_to_tokens(i).encode()
                                                  for i in range(3, model.config.vocab_size)]

        def __call__(self, text):
            return tokenizer(text if isinstance(text, str) else text.decode(), add_special_tokens=False)["input_ids"]

    llg = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Characters()), n_vocab=model.config.vocab_size)
    return model, tokenizer, engine, llg


def _masked_exact_distribution(model, llg, grammar, prompt_ids, length, eos, temperature):
    """P(first ``length`` tokens) of sampling under the grammar, enumerated: each prefix's
    allowed tokens from a fresh matcher, the target's probabilities renormalised over them."""
    import llguidance

    from foretell.proxy.engine.sampling import target_probs

    result = {}

    def walk(prefix, mass):
        if len(prefix) == length or (prefix and prefix[-1] == eos):
            result[tuple(prefix)] = result.get(tuple(prefix), 0.0) + mass
            return
        matcher = llguidance.LLMatcher(llg, grammar, log_level=0)
        assert all(matcher.consume_token(t) for t in prefix)
        allowed = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8) > 0
        logits = model(input_ids=torch.tensor([prompt_ids + prefix])).logits[0, -1:]
        logits = logits.masked_fill(~allowed[:logits.shape[-1]], float("-inf"))
        for token, p in enumerate(target_probs(logits, temperature, None, 1.0)[0].tolist()):
            if p > 0:
                walk(prefix + [token], mass * p)

    with torch.inference_mode():
        walk([], 1.0)
    return result


def _constrained_counts(small, grammar, prediction):
    from tests.proxy.engine import test_sampling

    model, tokenizer, engine, llg = small
    prompt_ids = tokenizer("abcabd")["input_ids"]
    template = Grammar(llg, grammar, model.config.vocab_size)
    real_add = engine.add

    def add_with_grammar(request):  # each sampled request its own copy of the grammar
        import dataclasses
        return real_add(dataclasses.replace(request, grammar=template.copy()))

    engine.add = add_with_grammar
    try:
        return test_sampling.sample_many(engine, prompt_ids, prediction, temperature=1.0)
    finally:
        engine.add = real_add


@pytest.fixture(scope="module")
def masked_expected(small):
    import llguidance

    model, tokenizer, engine, llg = small
    grammar = llguidance.LLMatcher.grammar_from_regex(REGEX)
    expected = _masked_exact_distribution(model, llg, grammar, tokenizer("abcabd")["input_ids"], 3,
                                          tokenizer.eos_token_id, 1.0)
    return grammar, expected


def test_sampling_under_a_mask_follows_the_masked_distribution(small, masked_expected):
    from tests.proxy.engine.test_sampling import SAMPLES, chi_square

    grammar, expected = masked_expected
    # A prediction the grammar allows at first ("ab...") and forbids later ("z" is no letter here).
    counts, drafted, accepted = _constrained_counts(small, grammar, "bcaaz")
    assert drafted > 0 and 0 < accepted < drafted  # speculation ran, with both outcomes
    stat, critical = chi_square(counts, expected, SAMPLES)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}: not the masked distribution"


def test_the_masked_test_catches_a_mask_that_ignores_the_draft(small, masked_expected, monkeypatch):
    # Wrong: every row masked as the first one is (the draft tokens before it not consumed).
    from tests.proxy.engine.test_sampling import SAMPLES, chi_square

    right = Grammar.masks

    def first_row_everywhere(self, draft):
        return right(self, []).expand(len(draft) + 1, -1).clone()

    monkeypatch.setattr(Grammar, "masks", first_row_everywhere)
    grammar, expected = masked_expected
    # It emits a token the grammar forbids (the matcher refuses it: the request fails) or
    # skews the distribution.
    with pytest.raises((AssertionError, ValueError)):
        counts, _, _ = _constrained_counts(small, grammar, "bcaaz")
        stat, critical = chi_square(counts, expected, SAMPLES)
        assert stat < critical


def test_a_draft_ending_in_eos_leaves_the_grammar_where_it_was(tiny, tokenizer):
    # llguidance's rollback does not count a consumed EOS: masks over a draft that ends the
    # output must not undo one token too many (the draft cache proposes earlier answers, EOS
    # included).
    engine, llg = tiny
    grammar = _grammar(llg, engine, {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                     "required": ["ok"], "additionalProperties": False})
    answer = tokenizer('{"ok": true}', add_special_tokens=False)["input_ids"]
    grammar.advance(answer[:2])
    draft = answer[2:] + [tokenizer.eos_token_id]
    assert grammar.allowed(draft) == len(draft)
    allowed = grammar.masks(draft)
    assert allowed.shape == (len(draft) + 1, engine.model.config.vocab_size)
    assert [bool(allowed[i, token]) for i, token in enumerate(draft)] == [True] * len(draft)
    grammar.advance(draft)  # the state was left where it was: the whole draft still fits
    assert grammar.matcher.is_stopped()


def test_drafts_from_an_earlier_constrained_answer_are_exact(tiny_model, tokenizer):
    from foretell.proxy.engine.draft_cache import DraftCache

    engine = SpeculativeEngine(tiny_model, tokenizer, draft_cache=DraftCache())
    llg = grammar_tokenizer(tokenizer, tiny_model.config.vocab_size, engine.eos_token_ids)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    reference = constrained_greedy_reference(tiny_model, prompt_ids, 40, llg, json_grammar(schema),
                                             engine.eos_token_ids)
    for _ in range(2):  # the second drafts the first's answer, its EOS included
        result = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=40, draft_cache_scope="s",
                                                   grammar=_grammar(llg, engine, schema)))
        assert_greedy_equal(tiny_model, prompt_ids, result.token_ids, reference, 1e-4)
    assert result.stats.accepted_tokens > 0


@pytest.mark.embedded
@pytest.mark.parametrize("draft", ["none", "edited"])
def test_the_embedded_model_under_a_schema_equals_its_oracle(embedded, draft):
    loaded = embedded
    model, tokenizer = loaded.model, loaded.tokenizer
    engine = SpeculativeEngine(model, tokenizer)
    llg = grammar_tokenizer(tokenizer, model.config.vocab_size, engine.eos_token_ids)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population_millions": {"type": "integer", "maximum": 99}},
              "required": ["city", "population_millions"], "additionalProperties": False}
    prompt_ids = tokenizer("Paris has about 2 million people. As JSON with city and population_millions:\n")["input_ids"]
    reference = constrained_greedy_reference(model, prompt_ids, 30, llg, json_grammar(schema), engine.eos_token_ids)
    text = tokenizer.decode(reference, skip_special_tokens=True)
    prediction = None if draft == "none" else text.replace("Paris", "Lyon")
    result = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=30, prediction=prediction,
                                               grammar=Grammar(llg, json_grammar(schema), model.config.vocab_size)))
    assert_greedy_equal(model, prompt_ids, result.token_ids, reference, 5e-3)
    assert json.loads(result.text)["city"]


def test_the_grammar_table_is_built_once_per_tokenizer_and_goes_with_it(tiny, tiny_model, tokenizer):
    import copy
    import gc
    import weakref

    from foretell.proxy.engine import grammar

    engine, llg = tiny
    vocab_size, eos = tiny_model.config.vocab_size, engine.eos_token_ids
    assert grammar_tokenizer(tokenizer, vocab_size, eos) is llg
    before = len(grammar._TOKENIZERS)
    twin = copy.copy(tokenizer)  # another tokenizer object: its own table, not the first's
    assert grammar_tokenizer(twin, vocab_size, eos) is not llg
    assert len(grammar._TOKENIZERS) == before + 1
    gone = weakref.ref(twin)
    del twin
    gc.collect()
    # Its table went with it: no later tokenizer at its address can be handed that table.
    assert gone() is None and len(grammar._TOKENIZERS) == before
    assert grammar_tokenizer(tokenizer, vocab_size, eos) is llg
