"""The draft model as a draft source: greedy text equal to transformers' greedy decoding, sampled
text keeping the target's exact distribution against the draft's q, the tokenizer check, and the
chooser weighing its passes.

The chooser drafts from a model only where its passes pay for themselves; tiny models on a CPU
cost about what the target does, so the tests that must see drafts hold a cheap draft cost and a
dear target pass fixed (``force_drafting``): the engine's decisions, not its exactness, depend
on the costs."""

from __future__ import annotations

import pytest
import torch

from foretell.kernels import rejection_sample_reference
from foretell.proxy.engine import GenerationRequest, SpeculativeEngine
from foretell.proxy.engine.draft_length import DraftOption, PassCostModel, choose_drafts
from foretell.proxy.engine.draft_model import (DRAFT_SOURCE, check_draft_spec, load_draft_model,
                                               tokenizer_difference)
from foretell.proxy.engine.model_loader import LoadedModel
from tests.helpers import (build_small_vocab_model, build_tiny_gemma, chi_square, exact_distribution,
                           greedy_reference, sample_many)

PROMPTS = ["def total(items):\n    result = 0\n", "The quick brown fox", "x",
           "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, item):\n"]


def force_drafting(engine: SpeculativeEngine) -> SpeculativeEngine:
    """A dear target pass and a cheap draft pass, held fixed (no online fit)."""
    engine.cost.reset(PassCostModel(fixed=1.0, per_position=0.001))
    engine.cost.observe = lambda *args: None
    engine.draft_model.cost.reset(PassCostModel(fixed=0.001, per_position=0.0001))
    engine.draft_model.cost.observe = lambda *args: None
    return engine


def run_batch(engine, requests):
    """Every request in flight at once; their results in order."""
    sequences = [engine.add(request) for request in requests]
    assert all(seq is not None for seq in sequences)
    results = {}
    while len(results) < len(sequences):
        for update in engine.step([seq for seq in sequences if not seq.finished]):
            if update.error is not None:
                raise update.error
            if update.result is not None:
                results[id(update.sequence)] = update.result
    return [results[id(seq)] for seq in sequences]


@pytest.fixture(scope="module")
def drafts(tokenizer):
    """The tiny target and two drafts: itself (every draft accepted) and another random model
    (most rejected)."""
    return build_tiny_gemma(tokenizer, seed=0), build_tiny_gemma(tokenizer, seed=0), build_tiny_gemma(tokenizer, seed=1)


@pytest.mark.parametrize("which", ["same", "other"])
def test_greedy_with_a_draft_model_equals_transformers_generate(drafts, tokenizer, which):
    target, same, other = drafts
    # A short prefill chunk, so the draft follows the target's prefill over several steps, and
    # the tiny model's sliding window of 8 is crossed by every draft.
    engine = force_drafting(SpeculativeEngine(target, tokenizer, prefill_chunk=8,
                                              draft_model=same if which == "same" else other))
    requests = [GenerationRequest(prompt_ids=tokenizer(p)["input_ids"], max_tokens=30) for p in PROMPTS]
    results = run_batch(engine, requests)
    drafted = accepted = 0
    for request, result in zip(requests, results):
        assert result.token_ids == greedy_reference(target, request.prompt_ids, 30)
        drafted += result.stats.per_source[DRAFT_SOURCE].drafted
        accepted += result.stats.per_source[DRAFT_SOURCE].accepted
    assert drafted > 0
    if which == "same":
        assert accepted == drafted and any(DRAFT_SOURCE in r.token_origins for r in results)
    else:
        assert accepted < drafted
    # Every draft block is given back with its sequence (prompt blocks stay in the prefix cache).
    cache = engine.draft_model.cache
    assert all(cache.pools[g].refs.count(0) + sum(1 for e in cache.prefix.values() if e.blocks.get(g) is not None)
               >= cache.pools[g].num_blocks for g in cache.groups)


def test_the_draft_model_drafts_only_where_asked(drafts, tokenizer):
    target, same, _ = drafts
    engine = force_drafting(SpeculativeEngine(target, tokenizer, draft_model=same))
    ids = tokenizer(PROMPTS[0])["input_ids"]
    plain = greedy_reference(target, ids, 12)
    prediction = tokenizer.decode(plain)
    with_prediction = engine.generate(GenerationRequest(prompt_ids=ids, max_tokens=12, prediction=prediction))
    assert DRAFT_SOURCE not in with_prediction.stats.per_source  # a prediction drafts, the model does not
    asked = engine.generate(GenerationRequest(prompt_ids=ids, max_tokens=12, prediction="zzz", draft_model=True))
    assert asked.token_ids == plain and asked.stats.per_source[DRAFT_SOURCE].accepted > 0
    refused = engine.generate(GenerationRequest(prompt_ids=ids, max_tokens=12, draft_model=False))
    assert refused.token_ids == plain and DRAFT_SOURCE not in refused.stats.per_source


def test_a_self_int8_draft_of_the_embedded_model_keeps_float32_greedy(embedded):
    """``self:int8``: the target's own weights at int8 draft for the float32 target; the text is
    transformers' float32 greedy decoding."""
    draft = load_draft_model("self:int8", embedded)
    assert draft.model.get_input_embeddings() is embedded.model.get_input_embeddings()  # shared table
    engine = force_drafting(SpeculativeEngine(embedded.model, embedded.tokenizer, draft_model=draft.model,
                                              draft_model_name="self:int8", kv_cache_tokens=4096))
    ids = embedded.tokenizer("Speculative decoding makes a large language model faster by")["input_ids"]
    result = engine.generate(GenerationRequest(prompt_ids=ids, max_tokens=24))
    assert result.token_ids == greedy_reference(embedded.model, ids, 24)
    stats = result.stats.per_source[DRAFT_SOURCE]
    assert stats.accepted > stats.drafted // 2  # int8 agrees with float32 most of the time


# ---- sampling against the draft's distribution ---------------------------------------------

@pytest.fixture(scope="module")
def small_with_draft():
    model, tokenizer = build_small_vocab_model(logit_scale=0.3)
    draft, _ = build_small_vocab_model(seed=1, logit_scale=0.3)  # a different distribution q
    return model, tokenizer, draft


def test_sampling_from_a_draft_model_keeps_the_exact_target_distribution(small_with_draft):
    model, tokenizer, draft = small_with_draft
    engine = force_drafting(SpeculativeEngine(model, tokenizer, draft_model=draft))
    prompt_ids = tokenizer("abcabd")["input_ids"]
    expected = exact_distribution(model, prompt_ids, 3, tokenizer.eos_token_id, temperature=1.0)
    counts, drafted, accepted = sample_many(engine, prompt_ids, None, temperature=1.0)
    assert drafted >= 3000 and 0 < accepted < drafted  # drafts from q ran, with both outcomes
    stat, critical = chi_square(counts, expected, 3000)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}: not the target distribution"


def ignoring_q(target, draft_tokens, cu, uniform, exp_noise, draft_probs=None):
    """The point-mass rule (accept with p(x), recover from p without x): exact for any draft, a
    drawn one too, but it accepts less than min(1, p/q) does."""
    return rejection_sample_reference(target, draft_tokens, cu, uniform, exp_noise)


def claiming_uniform_q(target, draft_tokens, cu, uniform, exp_noise, draft_probs=None):
    """Wrong: q rows other than those the tokens were drawn from (uniform)."""
    if draft_probs is None:
        return rejection_sample_reference(target, draft_tokens, cu, uniform, exp_noise)
    return rejection_sample_reference(target, draft_tokens, cu, uniform, exp_noise,
                                      torch.full_like(draft_probs, 1.0 / draft_probs.shape[-1]))


def recovering_from_p_without_x(target, draft_tokens, cu, uniform, exp_noise, draft_probs=None):
    """Wrong: accepted with min(1, p/q), but recovered from p without x, not from max(0, p - q)."""
    if draft_probs is None:
        return rejection_sample_reference(target, draft_tokens, cu, uniform, exp_noise)
    accepted, _, _ = rejection_sample_reference(target, draft_tokens, cu, uniform, exp_noise, draft_probs)
    mixed = uniform.clone()
    first = 0
    for b, drafted in enumerate(torch.diff(cu, prepend=cu.new_zeros(1)).tolist()):
        n = int(accepted[b])
        mixed[first:first + n] = 0.0  # the same acceptances under the point-mass rule
        if n < drafted:
            mixed[first + n] = 1.0  # and the same rejection
        first += drafted
    return rejection_sample_reference(target, draft_tokens, cu, mixed, exp_noise)


def test_q_raises_acceptance_and_the_point_mass_rule_stays_exact(small_with_draft, monkeypatch):
    model, tokenizer, draft = small_with_draft
    prompt_ids = tokenizer("abcabd")["input_ids"]
    expected = exact_distribution(model, prompt_ids, 3, tokenizer.eos_token_id, temperature=1.0)
    engine = force_drafting(SpeculativeEngine(model, tokenizer, draft_model=draft))
    _, drafted_q, accepted_q = sample_many(engine, prompt_ids, None, n=1000, temperature=1.0)
    monkeypatch.setattr(engine.kernels, "rejection_sample", ignoring_q)
    counts, drafted, accepted = sample_many(engine, prompt_ids, None, temperature=1.0)
    stat, critical = chi_square(counts, expected, 3000)
    assert stat < critical, f"the point-mass rule is exact for any draft: chi-square {stat:.1f}"
    assert accepted_q / drafted_q > accepted / drafted + 0.05


@pytest.mark.parametrize("wrong_rule", [claiming_uniform_q, recovering_from_p_without_x])
def test_the_distribution_test_catches_a_wrong_use_of_q(small_with_draft, monkeypatch, wrong_rule):
    model, tokenizer, draft = small_with_draft
    engine = force_drafting(SpeculativeEngine(model, tokenizer, draft_model=draft))
    monkeypatch.setattr(engine.kernels, "rejection_sample", wrong_rule)
    prompt_ids = tokenizer("abcabd")["input_ids"]
    expected = exact_distribution(model, prompt_ids, 3, tokenizer.eos_token_id, temperature=1.0)
    counts, _, _ = sample_many(engine, prompt_ids, None, temperature=1.0)
    stat, critical = chi_square(counts, expected, 3000)
    assert stat > critical, f"the wrong rule {wrong_rule.__name__} passed: chi-square {stat:.1f}"


def test_a_seeded_request_with_a_draft_model_replays_whatever_runs_beside_it(small_with_draft):
    model, tokenizer, draft = small_with_draft
    engine = force_drafting(SpeculativeEngine(model, tokenizer, draft_model=draft))
    ids = tokenizer("abcabd")["input_ids"]
    request = GenerationRequest(prompt_ids=ids, max_tokens=16, temperature=0.9, seed=7)
    alone = engine.generate(request)
    others = [GenerationRequest(prompt_ids=ids[:k], max_tokens=12, temperature=1.0, seed=k) for k in (2, 3, 4)]
    beside = run_batch(engine, [request] + others)[0]
    assert beside.token_ids == alone.token_ids and alone.stats.per_source[DRAFT_SOURCE].drafted > 0


# ---- the tokenizer check and the spec ------------------------------------------------------

def test_a_draft_with_another_tokenizer_is_refused_naming_the_difference(tmp_path, tokenizer, drafts):
    small, small_tokenizer = build_small_vocab_model()
    assert "vocabulary of 12 tokens" in tokenizer_difference(tokenizer, small_tokenizer)
    assert tokenizer_difference(tokenizer, tokenizer) is None
    other = tmp_path / "other-tokenizer"
    small.save_pretrained(other)
    small_tokenizer.save_pretrained(other)
    target = LoadedModel(model=drafts[0], tokenizer=tokenizer, name="tiny", source=tmp_path)
    with pytest.raises(ValueError, match=r"another tokenizer than the target: a vocabulary of 12 tokens"):
        load_draft_model(str(other), target)
    with pytest.raises(ValueError, match="does not exist"):
        load_draft_model(str(tmp_path / "missing"), target)


def test_a_special_token_difference_is_named(small_with_draft):
    _, tokenizer, _ = small_with_draft
    _, other = build_small_vocab_model()
    other.eos_token = "<pad>"
    assert "eos_token_id 0, the target's 1" == tokenizer_difference(tokenizer, other)


@pytest.mark.parametrize("spec", ["self:int3", "self:", " "])
def test_a_bad_draft_spec_is_refused_before_loading(spec):
    with pytest.raises(ValueError, match="self:int8|model path"):
        check_draft_spec(spec)


# ---- the chooser ---------------------------------------------------------------------------

def test_the_chooser_weighs_the_draft_models_passes():
    step = PassCostModel(fixed=1.0, per_position=0.01)
    cheap = PassCostModel(fixed=0.05, per_position=0.01)
    model = DraftOption(DRAFT_SOURCE, acceptance=0.8, run=None, available=64, pass_cost=cheap)
    # One request, drafting from the model: chosen with a cheap draft, never with a dear one.
    (source, length), = choose_drafts([[model]], step.at)
    assert source == DRAFT_SOURCE and length > 1
    dear = DraftOption(DRAFT_SOURCE, acceptance=0.8, run=None, available=64, pass_cost=PassCostModel(1.0, 0.01))
    assert choose_drafts([[dear]], step.at) == [(None, 0)]
    # Beside a prediction that has been agreeing for long, the prediction wins: it is free.
    prediction = DraftOption("prediction", acceptance=0.95, run=200.0, available=64)
    (source, _), = choose_drafts([[prediction, model]], step.at)
    assert source == "prediction"


def test_draft_passes_cost_one_pass_per_position_of_the_longest_draft():
    from foretell.proxy.engine.draft_length import DraftPasses

    cost = PassCostModel(fixed=0.5, per_position=0.1)
    option = DraftOption(DRAFT_SOURCE, 0.8, None, 16, pass_cost=cost)
    passes = DraftPasses()
    passes.leave_out([(option, 4), (option, 2), (None, 0)], index=2)
    assert passes.cost(None, 0) == pytest.approx(0.5 * 4 + 0.1 * 6)  # 4 passes over 2, 2, 1, 1 rows
    assert passes.cost(option, 6) == pytest.approx(0.5 * 6 + 0.1 * 12)
    assert passes.cost(DraftOption("prediction", 0.9, None, 8), 8) == pytest.approx(0.5 * 4 + 0.1 * 6)

