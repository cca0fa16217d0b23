"""Sampling with speculation keeps exactly the target's distribution.

A tiny Gemma 3 over a 12-token vocabulary makes the exact distribution of the first three
tokens enumerable (1 + 12 + 144 forward passes); the engine, drafting from a prediction, is
sampled a few thousand times at fixed seeds and compared with it by a chi-square test. The same
test run with two wrong verify rules must fail, which shows the test has the power to notice.
"""

from __future__ import annotations

import pytest
import torch

import foretell.proxy.engine.sampling as sampling
from foretell.kernels import rejection_sample_reference
from foretell.proxy.engine import GenerationRequest, SpeculativeEngine
from foretell.proxy.engine.sampling import InvalidDistributionError, target_probs
from tests.helpers import SAMPLES, build_small_vocab_model, chi_square, exact_distribution, next_probs, sample_many

PROMPT = "abcabd"


@pytest.fixture(scope="module")
def small():
    model, tokenizer = build_small_vocab_model(logit_scale=0.3)
    return model, tokenizer, SpeculativeEngine(model, tokenizer)


def greedy_text(engine, prompt_ids, n=3) -> str:
    return engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=n)).text


# ---- wrong verify rules, to show the test can tell -------------------------------------------

def accept_always(target, draft_tokens, cu_num_draft_tokens, uniform, exp_noise):
    """Wrong: every draft token the target does not rule out is accepted (u = 0)."""
    return rejection_sample_reference(target, draft_tokens, cu_num_draft_tokens, torch.zeros_like(uniform),
                                      exp_noise)


def resample_from_p(target, draft_tokens, cu_num_draft_tokens, uniform, exp_noise):
    """Wrong: after a rejection, draw from p itself instead of p without the draft token."""
    accepted, output, invalid = rejection_sample_reference(target, draft_tokens, cu_num_draft_tokens,
                                                           uniform, exp_noise)
    first_row = 0
    for b, drafted in enumerate(torch.diff(cu_num_draft_tokens, prepend=cu_num_draft_tokens.new_zeros(1))):
        n = int(accepted[b])
        if n < int(drafted):
            weights = target[first_row + n]
            score = torch.where(weights > 0, weights / exp_noise[b], torch.full_like(weights, -1.0))
            output[first_row + n] = score.argmax()
        first_row += int(drafted) + 1
    return accepted, output, invalid


# ---- tests ---------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_first_tokens_follow_the_exact_target_distribution(small, temperature):
    model, tokenizer, engine = small
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    prediction = greedy_text(engine, prompt_ids)  # a likely prediction: drafts are often accepted
    expected = exact_distribution(model, prompt_ids, 3, tokenizer.eos_token_id, temperature=temperature)
    counts, drafted, accepted = sample_many(engine, prompt_ids, prediction, temperature=temperature)
    assert drafted >= SAMPLES and 0 < accepted < drafted  # speculation really ran, with both outcomes
    stat, critical = chi_square(counts, expected, SAMPLES)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}: not the target distribution"


def test_drafts_from_earlier_samples_keep_the_exact_distribution(small):
    """The draft cache of earlier outputs: each sample drafts from the samples before it (and
    those running beside it), so its drafts are the likeliest continuations: still exact."""
    from foretell.proxy.engine.draft_cache import DraftCache

    model, tokenizer, _ = small
    engine = SpeculativeEngine(model, tokenizer)
    engine.draft_cache = DraftCache()
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    expected = exact_distribution(model, prompt_ids, 3, tokenizer.eos_token_id, temperature=1.0)
    counts, drafted, accepted = sample_many(engine, prompt_ids, None, temperature=1.0, draft_cache_scope="s")
    assert drafted >= SAMPLES // 2 and 0 < accepted < drafted  # the cache's drafts really ran
    stat, critical = chi_square(counts, expected, SAMPLES)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}: not the target distribution"


@pytest.mark.parametrize("wrong_rule", [accept_always, resample_from_p])
def test_the_distribution_test_catches_a_wrong_rule(small, monkeypatch, wrong_rule):
    model, tokenizer, engine = small
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    prediction = greedy_text(engine, prompt_ids)
    expected = exact_distribution(model, prompt_ids, 3, tokenizer.eos_token_id, temperature=1.0)
    monkeypatch.setattr(engine.kernels, "rejection_sample", wrong_rule)
    counts, _, _ = sample_many(engine, prompt_ids, prediction, temperature=1.0)
    stat, critical = chi_square(counts, expected, SAMPLES)
    assert stat > critical, f"the wrong rule {wrong_rule.__name__} passed: chi-square {stat:.1f}"


@pytest.mark.parametrize("top_k,top_p", [(2, 1.0), (None, 0.5), (3, 0.6)])
def test_top_k_and_top_p_never_emit_tokens_outside_the_kept_set(small, top_k, top_p):
    model, tokenizer, engine = small
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    # A prediction of unlikely tokens, so that drafts outside the kept set are proposed.
    probs = next_probs(model, prompt_ids, 1.0)
    unlikely = tokenizer.decode(torch.argsort(probs)[3:6].tolist(), skip_special_tokens=True) * 2
    kept_cache: dict[tuple, set[int]] = {}
    for seed in range(150):
        result = engine.generate(GenerationRequest(
            prompt_ids=prompt_ids, max_tokens=4, prediction=unlikely, prompt_lookup=False,
            temperature=1.0, top_k=top_k, top_p=top_p, seed=seed))
        for i, token in enumerate(result.token_ids):
            prefix = tuple(result.token_ids[:i])
            if prefix not in kept_cache:
                p = next_probs(model, prompt_ids + list(prefix), 1.0, top_k, top_p)
                kept_cache[prefix] = set(torch.nonzero(p > 0).flatten().tolist())
            assert token in kept_cache[prefix], f"token {token} outside the kept set at {i}"


def test_target_probs_filters():
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0, -1.0]])
    plain = target_probs(logits, 0.5)
    assert torch.allclose(plain, torch.softmax(logits / 0.5, dim=-1))
    top2 = target_probs(logits, 1.0, top_k=2)  # ties at the edge are kept: tokens 0, 1, 2
    assert (top2[0] > 0).tolist() == [True, True, True, False, False]
    assert torch.allclose(top2.sum(), torch.tensor(1.0))
    distinct = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])  # p = 0.563, 0.207, 0.126, ...
    nucleus = target_probs(distinct, 1.0, top_p=0.6)  # 0.563 < 0.6: token 1 joins, token 2 not
    assert (nucleus[0] > 0).tolist() == [True, True, False, False, False]
    assert torch.allclose(nucleus.sum(), torch.tensor(1.0))
    assert (target_probs(distinct, 1.0, top_p=0.01)[0] > 0).sum() == 1  # at least one token
    with pytest.raises(ValueError):
        target_probs(logits, 0.0)


def test_nucleus_head_shortcut_keeps_the_same_set():
    g = torch.Generator().manual_seed(0)
    sharp = torch.softmax(torch.randn(4, 5000, generator=g) * 4, dim=-1)  # nucleus inside the head
    flat = torch.softmax(torch.randn(3, 5000, generator=g) * 0.1, dim=-1)  # needs the full sort
    for probs in (sharp, flat, torch.cat([sharp, flat])):
        for top_p in (0.3, 0.9, 0.999):
            assert torch.equal(sampling._nucleus(probs, top_p, head=64) > 0,
                               sampling._nucleus(probs, top_p, head=5000) > 0)


def test_seeded_requests_reproduce_whatever_runs_between(small):
    _, tokenizer, engine = small
    prompt_ids = tokenizer(PROMPT)["input_ids"]

    def run(seed, prediction="ddd"):
        return engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=12, prediction=prediction,
                                                 temperature=0.9, top_p=0.95, seed=seed))

    first = run(11)
    run(12, prediction="ghi")  # another request in between, with other drafts and draws
    again = run(11)
    assert again.token_ids == first.token_ids and again.seed == first.seed == 11
    assert len({tuple(run(seed).token_ids) for seed in range(6)}) > 1  # the seed matters
    unseeded = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=4, temperature=1.0))
    assert isinstance(unseeded.seed, int)  # reported, so the caller can replay it


def test_sampling_reports_the_same_statistics_as_greedy(small):
    _, tokenizer, engine = small
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    result = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=20, prediction="dddddd",
                                               prompt_lookup=True, temperature=0.7, seed=3))
    stats = result.stats
    assert set(stats.per_source) == {"prediction", "prompt_lookup"}
    assert stats.completion_tokens == len(result.token_ids) == len(result.token_origins)
    assert stats.drafted_tokens == sum(s.drafted for s in stats.per_source.values())
    assert stats.accepted_tokens == sum(s.accepted for s in stats.per_source.values()) <= stats.drafted_tokens
    assert stats.target_passes >= 1 and stats.decode_seconds > 0


def test_a_model_that_yields_nan_fails_safe(small):
    _, tokenizer, _ = small
    broken, _ = build_small_vocab_model(logit_scale=0.3)
    with torch.no_grad():
        broken.lm_head.weight.fill_(float("nan"))
    engine = SpeculativeEngine(broken, tokenizer)
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    with pytest.raises(InvalidDistributionError, match="not a distribution"):
        engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=5, prediction="abc",
                                          temperature=1.0, seed=0))


def test_logprobs_are_the_raw_model_log_probabilities(small):
    model, tokenizer, engine = small
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    for temperature in (0.0, 0.8):
        result = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=6, prediction="ddd",
                                                   temperature=temperature, seed=1, logprobs=3))
        assert [lp.token_id for lp in result.logprobs] == result.token_ids
        for i, entry in enumerate(result.logprobs):
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([prompt_ids + result.token_ids[:i]])).logits[0, -1]
            expected = torch.log_softmax(logits.float(), dim=-1)
            assert entry.logprob == pytest.approx(float(expected[entry.token_id]), abs=1e-4)
            assert [t for t, _ in entry.top] == torch.topk(expected, 3).indices.tolist()


def test_calibration_measures_the_sampling_overhead(tiny_model, tokenizer):
    engine = SpeculativeEngine(tiny_model, tokenizer)
    pass_cost = engine.calibrate(context_tokens=32)
    assert pass_cost.fixed > 0 and pass_cost.per_position > 0
    # Distributions over the 262k vocabulary cost something per verified position.
    assert engine.sampling_cost.fixed > 0 and engine.sampling_cost.per_position > 0
    combined = engine.pass_cost + engine.sampling_cost
    assert combined.cost(8) == pytest.approx(pass_cost.cost(8) + engine.sampling_cost.cost(8))
