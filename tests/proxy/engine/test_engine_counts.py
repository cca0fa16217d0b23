"""Engine counts where a round is cut short, on the tiny model: a stop string or an EOS token
early inside a long accepted draft, prompt lookup that really drafts, batched steps, and greedy
verification's tie rule. Each output token has exactly one origin (and one logprob), accepted
counts never exceed the tokens kept, and the tokens are those of plain decoding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from foretell.proxy.engine import GenerationRequest, SpeculativeEngine
from foretell.proxy.engine.verify import VerifyRows, verify_step
from tests.helpers import assert_greedy_equal, greedy_reference, stop_string_cut

PROMPT = "def parse(line):\n    key, value = line.split('=')\n    return key.strip(), value\n"
MAX_NEW = 48
TIE_EPSILON = 1e-4


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer):
    return SpeculativeEngine(tiny_model, tokenizer, kv_cache_tokens=8192)


@pytest.fixture(scope="module")
def case(tiny_model, tokenizer, engine):
    """The prompt, the greedy tokens and text, and how many drafts the first round of a
    perfect-prediction run accepts (where "early inside an accepted draft" lies)."""
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    reference = greedy_reference(tiny_model, prompt_ids, MAX_NEW)
    text = tokenizer.decode(reference, skip_special_tokens=True)
    rounds = []
    engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=MAX_NEW, prediction=text),
                    on_update=lambda update: rounds.append(update.origins.count("prediction")))
    assert rounds[0] >= 4, "the first round should accept a long draft of the perfect prediction"
    return SimpleNamespace(prompt_ids=prompt_ids, reference=reference, text=text, first_accepted=rounds[0])


def check_counts(result, expected_tokens: list[int]) -> None:
    stats = result.stats
    assert result.token_ids == expected_tokens
    assert len(result.token_origins) == len(result.token_ids)
    assert stats.completion_tokens == len(result.token_ids)
    assert stats.accepted_tokens <= stats.completion_tokens
    assert stats.accepted_tokens == sum(origin is not None for origin in result.token_origins)
    assert sum(s.accepted for s in stats.per_source.values()) == stats.accepted_tokens
    assert all(s.accepted <= s.drafted for s in stats.per_source.values())
    assert sum(stats.accepted_by_position) == stats.accepted_tokens
    assert all(a <= d for a, d in zip(stats.accepted_by_position, stats.drafted_by_position))
    assert stats.accepted_prediction_tokens <= stats.completion_tokens
    if result.logprobs is not None:
        assert [lp.token_id for lp in result.logprobs] == result.token_ids


def run_with_rounds(engine, request):
    """Generate; also return per round (draft length, tokens kept, origins)."""
    rounds = []
    result = engine.generate(request, on_update=lambda u: rounds.append(
        (len(u.sequence.draft), len(u.token_ids), list(u.origins))))
    return result, rounds


def early_stop(tokenizer, case) -> str:
    """A stop string spanning two tokens that both lie inside the first round's accepted draft."""
    j = max(2, case.first_accepted // 2)
    before, after = (tokenizer.decode([t]) for t in case.reference[j - 1:j + 1])
    return before[-2:] + after[:2]


def test_stop_string_early_inside_an_accepted_draft(engine, tokenizer, case):
    stop = early_stop(tokenizer, case)
    expected_tokens, expected_text = stop_string_cut(tokenizer, case.reference, stop)
    assert len(expected_tokens) < case.first_accepted  # the cut lies inside the first draft

    result, rounds = run_with_rounds(engine, GenerationRequest(
        prompt_ids=case.prompt_ids, max_tokens=MAX_NEW, prediction=case.text, stop=(stop,), logprobs=1))
    check_counts(result, expected_tokens)
    assert result.text == expected_text and result.finish_reason == "stop"
    draft_length, kept, origins = rounds[-1]
    assert origins[-1] == "prediction" and draft_length > kept  # cut inside an accepted draft


def test_eos_early_inside_an_accepted_draft(tiny_model, tokenizer, case):
    # The first token, after the first two, that has not appeared before becomes EOS.
    j = next(i for i in range(2, len(case.reference)) if case.reference[i] not in case.reference[:i])
    assert j < case.first_accepted - 1
    saved = tiny_model.generation_config.eos_token_id
    tiny_model.generation_config.eos_token_id = case.reference[j]
    try:
        engine = SpeculativeEngine(tiny_model, tokenizer, kv_cache_tokens=4096)
        result, rounds = run_with_rounds(engine, GenerationRequest(
            prompt_ids=case.prompt_ids, max_tokens=MAX_NEW, prediction=case.text, logprobs=0))
    finally:
        tiny_model.generation_config.eos_token_id = saved
    check_counts(result, case.reference[:j + 1])
    assert result.finish_reason == "stop"
    draft_length, kept, origins = rounds[-1]
    assert origins[-1] == "prediction" and draft_length > kept


def test_max_tokens_inside_an_accepted_draft(engine, case):
    limit = case.first_accepted - 2
    result, rounds = run_with_rounds(engine, GenerationRequest(
        prompt_ids=case.prompt_ids, max_tokens=limit, prediction=case.text, logprobs=2))
    check_counts(result, case.reference[:limit])
    assert result.finish_reason == "length" and len(rounds) == 1


def test_prompt_lookup_drafts_accepts_and_stays_exact(engine, tiny_model, tokenizer):
    prompt_ids = tokenizer(PROMPT * 3)["input_ids"]
    reference = greedy_reference(tiny_model, prompt_ids, MAX_NEW)
    result = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=MAX_NEW, prompt_lookup=True))
    assert_greedy_equal(tiny_model, prompt_ids, result.token_ids, reference, TIE_EPSILON)
    lookup = result.stats.per_source["prompt_lookup"]
    assert lookup.drafted > 0 and lookup.accepted > 0
    assert result.token_origins.count("prompt_lookup") == lookup.accepted
    assert result.stats.target_passes < len(result.token_ids)


def test_batched_steps_equal_each_request_alone(engine, tokenizer, case):
    """Several sequences in one pass (a cut-short one among them) give what each gives alone."""
    stop = early_stop(tokenizer, case)
    requests = [
        GenerationRequest(prompt_ids=case.prompt_ids, max_tokens=MAX_NEW, prediction=case.text, stop=(stop,)),
        GenerationRequest(prompt_ids=case.prompt_ids, max_tokens=20),
        GenerationRequest(prompt_ids=tokenizer(PROMPT * 2)["input_ids"], max_tokens=24, prompt_lookup=True),
        GenerationRequest(prompt_ids=case.prompt_ids, max_tokens=MAX_NEW, prediction=case.text[: len(case.text) // 2]),
    ]
    alone = [engine.generate(r) for r in requests]
    assert alone[0].finish_reason == "stop" and len(alone[0].token_ids) < case.first_accepted
    sequences = [engine.add(r) for r in requests]
    assert all(s is not None for s in sequences)
    results, texts = {}, {i: "" for i in range(len(requests))}
    for _ in range(200):
        running = [s for s in sequences if not s.finished]
        if not running:
            break
        for update in engine.step(running):
            assert update.error is None
            i = sequences.index(update.sequence)
            texts[i] += update.text
            if update.result is not None:
                results[i] = update.result
    assert sorted(results) == list(range(len(requests)))
    for i, single in enumerate(alone):
        check_counts(results[i], single.token_ids)
        assert results[i].text == single.text == texts[i]
        assert results[i].finish_reason == single.finish_reason


# ---- greedy verification's tie rule -------------------------------------------------------

def _verify(engine, draft: list[int], rows: torch.Tensor) -> tuple[int, list[int]]:
    return verify_step(engine.kernels, rows, [VerifyRows(0, draft, None)])[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_verify_takes_the_first_index_on_ties(engine, dtype):
    rows = torch.full((3, 16), -2.0, dtype=dtype)
    rows[0, 3] = rows[0, 7] = 5.0  # tie: 3 wins
    rows[1, 9] = rows[1, 2] = rows[1, 12] = 1.0  # three-way tie: 2 wins
    rows[2].fill_(0.25)  # all equal: 0 wins
    assert _verify(engine, [7, 2], rows) == (0, [3])  # the later tied index is not the target's
    assert _verify(engine, [3, 9], rows) == (1, [3, 2])
    assert _verify(engine, [3, 2], rows) == (2, [3, 2, 0])
    assert _verify(engine, [], rows[:1]) == (0, [3])


# ---- the room a round leaves ----------------------------------------------------------------

@pytest.mark.parametrize("max_tokens", [1, 2, 7, 20])
def test_a_draft_leaves_room_for_the_rounds_own_token(engine, case, max_tokens):
    """A round yields its accepted drafts plus one token of the target's, so a draft may hold at
    most ``room - 1`` tokens: one more would verify a position plain decoding never reaches. The
    perfect prediction (48 tokens) can always offer that many, so it offers exactly that."""
    seq = engine.add(GenerationRequest(prompt_ids=case.prompt_ids, max_tokens=max_tokens, prediction=case.text))
    tokens, rounds = [], 0
    while not seq.finished:
        offered = {option.source: option.available for option in seq.speculation.draft_options()}
        assert offered["prediction"] == seq.speculation.room - 1, (offered, seq.speculation.room)
        for update in engine.step([seq]):
            tokens += update.token_ids
        rounds += 1
    assert tokens == case.reference[:max_tokens] and rounds >= 1
