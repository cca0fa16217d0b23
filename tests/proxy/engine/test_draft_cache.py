"""The suffix draft cache: what it proposes, whom it shares with, its bounds, and the engine's
text with it (greedy equal to transformers' generate, cold and warm; sampling in test_sampling.py).

Synthetic token ids make the cache's own behaviour exact to assert: a prompt of ids 1..10 and
outputs of ids from 100 up, which appear nowhere else."""

from __future__ import annotations

import pytest

from foretell.proxy.engine import GenerationRequest, SpeculativeEngine
from foretell.proxy.engine.draft_cache import DraftCache
from tests.helpers import assert_greedy_equal, greedy_reference

PROMPT = list(range(1, 11))
OUTPUT = list(range(100, 140))


def complete(cache: DraftCache, scope: str, prompt=PROMPT, output=OUTPUT, rounds=8, completed=True):
    """A request of ``scope`` whose output arrives in rounds, then ends."""
    source = cache.source(scope, prompt)
    for end in range(rounds, len(output) + rounds, rounds):
        source.observe(output[:end], "")
    source.close(completed=completed)


def proposal_after(cache: DraftCache, scope: str, seen: int, limit: int = 16) -> list[int]:
    """What a new request of ``scope`` proposes once its output begins with ``OUTPUT[:seen]``."""
    source = cache.source(scope, PROMPT)
    source.observe(OUTPUT[:seen], "")
    try:
        return source.propose(limit)
    finally:
        source.close(completed=False)


def test_an_earlier_output_is_drafted_as_far_as_the_match_is_long():
    cache = DraftCache()
    assert proposal_after(cache, "a", 6) == []  # cold: nothing anywhere continues 100..105
    complete(cache, "a")
    # A match of 6 tokens earns up to 6 drafted tokens (the draft is bounded by the match).
    assert proposal_after(cache, "a", 6) == OUTPUT[6:12]
    assert proposal_after(cache, "a", 12, limit=4) == OUTPUT[12:16]


def test_the_most_frequent_continuation_is_drafted():
    cache = DraftCache()
    forks = [OUTPUT[:8] + [500 + i] * 4 for i in (1, 2, 2)]
    for fork in forks:
        complete(cache, "a", output=fork)
    assert proposal_after(cache, "a", 8)[:1] == [502]


def test_a_prompt_longer_than_the_depth_drafts_from_its_tail():
    """A long prompt's match is sought for its last ``max_depth`` tokens, not its first."""
    cache = DraftCache(max_depth=8)
    complete(cache, "a")
    head = list(range(200, 212))  # tokens nothing earlier continues, but the prompt itself does
    source = cache.source("a", head + OUTPUT[:8])  # 20 tokens: only the tail matches the earlier output
    assert source.propose(16) == OUTPUT[8:12]  # the head would draft the prompt's own 208..211
    source.close(completed=False)
    source = cache.source("a", OUTPUT[:8] + head)  # the earlier output at the head: no match
    assert source.propose(16) == []
    source.close(completed=False)


def test_a_request_drafts_from_its_own_prompt_and_output():
    cache = DraftCache()
    source = cache.source("a", PROMPT + [7, 8, 9, 10, 11, 12])
    source.observe([7, 8], "")  # the output repeats the prompt: the local tree knows what follows
    assert source.propose(8)[:2] == [9, 10]
    source.close(completed=True)


def test_tenants_never_draft_from_each_other_unless_the_scope_is_shared():
    cache = DraftCache()
    complete(cache, "key:alice")
    assert proposal_after(cache, "key:alice", 6) == OUTPUT[6:12]
    assert proposal_after(cache, "key:bob", 6) == []  # bob's drafts never come from alice's output
    assert cache.cached_requests("key:bob") == 0
    # One shared scope (--draft-cache-scope global) does share.
    complete(cache, "global")
    assert proposal_after(cache, "global", 6) == OUTPUT[6:12]


def test_an_output_that_did_not_complete_leaves_nothing_behind():
    cache = DraftCache()
    before = cache.snapshot()
    complete(cache, "a", completed=False)  # cancelled after the whole output was observed
    assert proposal_after(cache, "a", 6) == []
    assert cache.snapshot() == before == {"scopes": 0, "open_requests": 0, "cached_requests": 0,
                                          "cached_tokens": 0}


def test_outputs_join_while_they_are_produced_for_requests_running_beside_them():
    cache = DraftCache()
    running = cache.source("a", PROMPT)
    running.observe(OUTPUT[:20], "")
    assert proposal_after(cache, "a", 6) == OUTPUT[6:12]
    running.close(completed=False)
    assert proposal_after(cache, "a", 6) == []


def test_the_cache_holds_its_token_and_request_bounds_oldest_out_first():
    cache = DraftCache(max_tokens=100, max_requests=50)
    for i in range(40):  # 40 outputs of 10 tokens each, every one distinct, two scopes
        complete(cache, f"s{i % 2}", output=[1000 + 10 * i + j for j in range(10)], rounds=3)
        snapshot = cache.snapshot()
        assert snapshot["cached_tokens"] <= 100 and snapshot["cached_requests"] <= 50
    assert cache.snapshot() == {"scopes": 2, "open_requests": 0, "cached_requests": 10, "cached_tokens": 100}
    first, last = [1000 + j for j in range(10)], [1390 + j for j in range(10)]
    probe = cache.source("s1", PROMPT)
    probe.observe(last[:5], "")
    assert probe.propose(5) == last[5:]  # the newest stays
    probe.close(completed=False)
    probe = cache.source("s0", PROMPT)
    probe.observe(first[:5], "")
    assert probe.propose(5) == []  # the oldest went first
    probe.close(completed=False)
    small = DraftCache(max_tokens=10_000, max_requests=3)
    for i in range(5):
        complete(small, "a", output=[2000 + 10 * i + j for j in range(10)])
    assert small.snapshot()["cached_requests"] == 3


def test_an_empty_scope_is_dropped_when_its_last_output_is_evicted():
    cache = DraftCache(max_tokens=20)
    complete(cache, "old", output=OUTPUT[:20])
    complete(cache, "new", output=[900 + j for j in range(20)])
    assert cache.snapshot()["scopes"] == 1 and cache.cached_requests("old") == 0


def test_an_output_longer_than_the_whole_bound_is_not_kept():
    cache = DraftCache(max_tokens=16)
    complete(cache, "a", output=OUTPUT)  # 40 tokens
    assert cache.snapshot()["cached_tokens"] == 0
    assert proposal_after(cache, "a", 6) == []


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        DraftCache(max_tokens=0)


# ---- the engine with the cache ------------------------------------------------------------------

MAX_NEW = 40
TEXTS = ["def parse(line):\n    key, value = line.split('=')\n", "for item in items:\n    print(item)\n",
         "class Point:\n    def __init__(self, x, y):\n"]


@pytest.fixture(scope="module")
def cached_engine(tiny_model, tokenizer):
    engine = SpeculativeEngine(tiny_model, tokenizer)
    engine.draft_cache = DraftCache()
    return engine


def test_greedy_text_equals_generate_with_the_cache_cold_and_warm(cached_engine, tiny_model, tokenizer):
    engine = cached_engine
    accepted = 0
    for round_ in ("cold", "warm"):
        for text in TEXTS:
            prompt_ids = tokenizer(text)["input_ids"]
            reference = greedy_reference(tiny_model, prompt_ids, MAX_NEW)
            for lookup in (False, True):
                result = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=MAX_NEW,
                                                           prompt_lookup=lookup, draft_cache_scope="t"))
                assert_greedy_equal(tiny_model, prompt_ids, result.token_ids, reference, 1e-4)
                assert "suffix_cache" in result.stats.per_source
                if round_ == "warm":
                    accepted += result.stats.per_source["suffix_cache"].accepted
    # The path under test really ran: a warm cache's drafts were verified and accepted.
    assert accepted > 0


def test_a_prediction_lookup_and_the_cache_together_stay_exact(cached_engine, tiny_model, tokenizer):
    prompt_ids = tokenizer(TEXTS[0] * 2)["input_ids"]
    reference = greedy_reference(tiny_model, prompt_ids, MAX_NEW)
    text = tokenizer.decode(reference, skip_special_tokens=True)
    for prediction in (text, text[: len(text) // 2] + " something else " + text[len(text) // 2:]):
        result = cached_engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=MAX_NEW,
                                                          prediction=prediction, draft_cache_scope="t"))
        assert_greedy_equal(tiny_model, prompt_ids, result.token_ids, reference, 1e-4)
        assert set(result.stats.per_source) == {"prediction", "prompt_lookup", "suffix_cache"}
        origins = set(result.token_origins) - {None}
        assert origins <= {"prediction", "prompt_lookup", "suffix_cache"}


def test_a_request_without_a_scope_neither_drafts_from_nor_feeds_the_cache(cached_engine, tokenizer):
    before = cached_engine.draft_cache.snapshot()
    result = cached_engine.generate(GenerationRequest(prompt_ids=tokenizer("print(1)\n")["input_ids"],
                                                      max_tokens=8))
    assert "suffix_cache" not in result.stats.per_source
    assert cached_engine.draft_cache.snapshot() == before


def test_a_cancelled_request_leaves_nothing_in_the_cache(tiny_model, tokenizer):
    engine = SpeculativeEngine(tiny_model, tokenizer)
    engine.draft_cache = DraftCache()
    seq = engine.add(GenerationRequest(prompt_ids=tokenizer(TEXTS[1])["input_ids"], max_tokens=MAX_NEW,
                                       draft_cache_scope="t"))
    for _ in range(3):
        engine.step([seq])
    assert engine.draft_cache.snapshot()["cached_tokens"] > 0  # its output so far was shared
    engine.abort(seq)
    assert engine.draft_cache.snapshot() == {"scopes": 0, "open_requests": 0, "cached_requests": 0,
                                             "cached_tokens": 0}


def test_a_completed_request_stays_in_the_cache(tiny_model, tokenizer):
    engine = SpeculativeEngine(tiny_model, tokenizer)
    engine.draft_cache = DraftCache()
    result = engine.generate(GenerationRequest(prompt_ids=tokenizer(TEXTS[1])["input_ids"], max_tokens=12,
                                               draft_cache_scope="t"))
    assert engine.draft_cache.snapshot() == {"scopes": 1, "open_requests": 0, "cached_requests": 1,
                                             "cached_tokens": len(result.token_ids)}
