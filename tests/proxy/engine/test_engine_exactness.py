"""Exactness: the engine's output equals transformers' greedy generate() token for token, for
every draft source and combination (near-tie rule in tests/helpers.py)."""

from __future__ import annotations

import pytest

from foretell.proxy.engine import GenerationRequest, SpeculativeEngine
from tests.helpers import assert_greedy_equal, greedy_reference, stop_string_cut

TINY_TIE_EPSILON = 1e-4
EMBEDDED_TIE_EPSILON = 5e-3
MAX_NEW = 60

PROMPT = "def parse(line):\n    key, value = line.split('=')\n    return key.strip(), value\n"


def edited_predictions(text: str) -> dict[str, str]:
    """Predictions derived from the true output, each wrong in one typical way."""
    third, middle = len(text) // 3, len(text) // 2
    return {
        "none": None,
        "perfect": text,
        "disjoint": "Completely unrelated words about gardens, rivers and quiet mornings.\n" * 4,
        "empty": "",
        "longer": text + " and then some more words that never come" * 3,
        "shorter": text[:middle],
        # The prediction holds text the output lacks: the output skips it (a deletion).
        "output_deletes": text[:third] + " words the model never writes here " + text[third:],
        # The prediction lacks text the output has: the output inserts it.
        "output_inserts": text[:third] + text[middle:],
        "replacement": text[:third] + " other words instead " + text[middle:],
        "repeated_lines": (text[:middle] + "\n") * 3 + text[middle:],
        "unicode_whitespace": text[:third] + "\t  é 😀 ∑\n\n    " + text[third:],
    }


@pytest.fixture(scope="module")
def tiny_engine(tiny_model, tokenizer):
    return SpeculativeEngine(tiny_model, tokenizer)


@pytest.fixture(scope="module")
def tiny_case(tiny_model, tokenizer):
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    reference = greedy_reference(tiny_model, prompt_ids, MAX_NEW)
    return prompt_ids, reference, tokenizer.decode(reference, skip_special_tokens=True)


@pytest.mark.parametrize("prompt_lookup", [False, True], ids=["prediction", "prediction+lookup"])
@pytest.mark.parametrize("case", list(edited_predictions("x").keys()))
def test_tiny_model_matches_greedy(tiny_engine, tiny_model, tiny_case, case, prompt_lookup):
    prompt_ids, reference, text = tiny_case
    prediction = edited_predictions(text)[case]
    result = tiny_engine.generate(GenerationRequest(
        prompt_ids=prompt_ids, max_tokens=MAX_NEW, prediction=prediction, prompt_lookup=prompt_lookup))
    assert_greedy_equal(tiny_model, prompt_ids, result.token_ids, reference, TINY_TIE_EPSILON)
    assert result.finish_reason == ("length" if len(reference) == MAX_NEW else "stop")
    assert result.stats.completion_tokens == len(result.token_ids)
    assert result.stats.target_passes <= len(result.token_ids)
    if case == "perfect":
        # The path under test really ran: drafts were verified and accepted.
        assert result.stats.per_source["prediction"].accepted > 0
        assert result.stats.target_passes < len(result.token_ids)


def test_tiny_model_prompt_lookup_alone(tiny_engine, tiny_model, tokenizer):
    # A prompt that repeats itself gives prompt lookup something to copy.
    prompt_ids = tokenizer(PROMPT * 3)["input_ids"]
    reference = greedy_reference(tiny_model, prompt_ids, MAX_NEW)
    result = tiny_engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=MAX_NEW,
                                                    prompt_lookup=True))
    assert_greedy_equal(tiny_model, prompt_ids, result.token_ids, reference, TINY_TIE_EPSILON)


def test_max_tokens_reached_mid_draft(tiny_engine, tiny_model, tiny_case):
    prompt_ids, reference, text = tiny_case
    result = tiny_engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=13, prediction=text))
    assert result.token_ids == reference[:13]
    assert result.finish_reason == "length"
    assert result.stats.accepted_tokens > 0


def test_stop_string_inside_accepted_draft(tiny_engine, tiny_model, tokenizer, tiny_case):
    prompt_ids, reference, text = tiny_case
    stop = text[len(text) // 2 : len(text) // 2 + 5]
    expected_tokens, expected_text = stop_string_cut(tokenizer, reference, stop)
    result = tiny_engine.generate(GenerationRequest(
        prompt_ids=prompt_ids, max_tokens=MAX_NEW, prediction=text, stop=(stop,)))
    assert result.token_ids == expected_tokens
    assert result.text == expected_text
    assert result.finish_reason == "stop"
    assert result.stats.accepted_tokens > 0


def test_eos_inside_accepted_draft(tiny_model, tokenizer, tiny_case):
    prompt_ids, reference, text = tiny_case
    # Make a token the model writes mid-output its end-of-sequence token, for oracle and engine.
    eos = reference[len(reference) // 2]
    saved = tiny_model.generation_config.eos_token_id
    tiny_model.generation_config.eos_token_id = eos
    try:
        expected = greedy_reference(tiny_model, prompt_ids, MAX_NEW)
        engine = SpeculativeEngine(tiny_model, tokenizer)
        result = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=MAX_NEW, prediction=text))
    finally:
        tiny_model.generation_config.eos_token_id = saved
    assert expected[-1] == eos and len(expected) < len(reference)
    assert result.token_ids == expected
    assert result.finish_reason == "stop"
    assert result.stats.accepted_tokens > 0


def test_bad_requests_raise_clear_errors(tiny_engine):
    with pytest.raises(ValueError, match="at least one token"):
        tiny_engine.generate(GenerationRequest(prompt_ids=[]))
    with pytest.raises(ValueError, match="max_tokens"):
        tiny_engine.generate(GenerationRequest(prompt_ids=[2, 10], max_tokens=0))
    with pytest.raises(ValueError, match="context"):
        tiny_engine.generate(GenerationRequest(prompt_ids=[2] * 5000))


def test_streaming_callback_reassembles_the_text(tiny_engine, tiny_case):
    prompt_ids, reference, text = tiny_case
    pieces, tokens = [], []
    result = tiny_engine.generate(
        GenerationRequest(prompt_ids=prompt_ids, max_tokens=MAX_NEW, prediction=text),
        on_tokens=lambda ids, piece, _: (tokens.extend(ids), pieces.append(piece)))
    assert "".join(pieces) == result.text
    assert tokens == result.token_ids


def test_cancellation_stops_promptly(tiny_engine, tiny_case):
    prompt_ids, _, _ = tiny_case
    rounds = []
    result = tiny_engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=MAX_NEW),
                                  on_tokens=lambda ids, piece, _: rounds.append(ids),
                                  should_stop=lambda: len(rounds) >= 3)
    assert result.finish_reason == "cancelled"
    assert len(rounds) == 3
    assert_no_blocks_held(tiny_engine.cache)


def assert_no_blocks_held(cache):
    """Every block is free or held once by the prefix cache alone, and nothing is promised: a
    cancelled sequence left nothing behind (checked on the blocks, not by a later symptom)."""
    assert all(promised == 0 for promised in cache._promised.values())
    for group, pool in cache.pools.items():
        cached = [e.blocks[group] for e in cache.prefix.values() if e.blocks.get(group) is not None]
        held = {block: refs for block, refs in enumerate(pool.refs) if refs}
        assert held == {block: 1 for block in cached}, group
        assert len(pool.free) + len(cached) == pool.num_blocks, group


# ---- the real embedded model -------------------------------------------------------------

EDIT_DIR = __import__("pathlib").Path(__file__).resolve().parents[3] / "examples" / "edit"


@pytest.fixture(scope="module")
def embedded_engine(embedded):
    return SpeculativeEngine(embedded.model, embedded.tokenizer)


@pytest.fixture(scope="module")
def embedded_case(embedded):
    # Over 512 tokens of context, so Gemma's sliding-window layers hold more than their window.
    prompt = (EDIT_DIR / "before.py").read_text() + "\n\n" + (EDIT_DIR / "prompt.txt").read_text()
    prompt_ids = embedded.tokenizer(prompt)["input_ids"]
    assert len(prompt_ids) > 600
    reference = greedy_reference(embedded.model, prompt_ids, 80)
    return prompt_ids, reference, embedded.tokenizer.decode(reference, skip_special_tokens=True)


@pytest.mark.embedded
@pytest.mark.parametrize("case,prompt_lookup", [
    ("perfect", False), ("output_inserts", False), ("replacement", True), ("disjoint", False),
    ("none", True),
])
def test_embedded_model_matches_greedy(embedded, embedded_engine, embedded_case, case, prompt_lookup):
    prompt_ids, reference, text = embedded_case
    prediction = edited_predictions(text)[case]
    result = embedded_engine.generate(GenerationRequest(
        prompt_ids=prompt_ids, max_tokens=len(reference), prediction=prediction,
        prompt_lookup=prompt_lookup))
    assert_greedy_equal(embedded.model, prompt_ids, result.token_ids, reference, EMBEDDED_TIE_EPSILON)
    if case == "perfect":
        assert result.stats.accepted_tokens >= 0.8 * len(reference)
        assert result.stats.rejected_prediction_tokens == 0


@pytest.mark.embedded
def test_embedded_model_real_edit_prediction(embedded, embedded_engine, embedded_case):
    """The file before the edit as the prediction, the true use case."""
    prompt_ids, reference, _ = embedded_case
    result = embedded_engine.generate(GenerationRequest(
        prompt_ids=prompt_ids, max_tokens=len(reference),
        prediction=(EDIT_DIR / "before.py").read_text()))
    assert_greedy_equal(embedded.model, prompt_ids, result.token_ids, reference, EMBEDDED_TIE_EPSILON)
