"""Prompt logprobs reused from an earlier prompt that starts the same way: the cache's own rules,
and the engine's entries for a prompt served partly from it against a full forward pass."""

from __future__ import annotations

import pytest
import torch

from foretell.proxy.engine import GenerationRequest, SpeculativeEngine
from foretell.proxy.engine.draft_sources import common_prefix_length
from foretell.proxy.engine.prompt_logprob_cache import PromptLogprobCache
from foretell.proxy.engine.sequence import TokenLogprob

CONTEXT = "def parse(line):\n    key, value = line.split('=')\n    return key.strip(), value\n" * 3


def entries(prompt: list[int], top: int) -> list[TokenLogprob]:
    return [TokenLogprob(t, -float(i), [(t, -0.5)] * top) for i, t in enumerate(prompt[1:])]


def test_common_prefix_length_of_token_lists():
    assert common_prefix_length((1, 2, 3), [1, 2, 4]) == 2
    assert common_prefix_length((1, 2), [1, 2, 3]) == 2
    assert common_prefix_length((), [1]) == 0


def test_lookup_returns_the_entries_of_the_shared_tokens_only():
    cache = PromptLogprobCache()
    first = list(range(10, 30))
    cache.store(first, 2, entries(first, 2))
    second = first[:12] + [99, 98]
    known = cache.lookup(second, 1)
    # Shared tokens 0..11: entries of tokens 1..11 are known, token 12's (99) is not.
    assert [e.token_id for e in known] == first[1:12]
    assert all(len(e.top) == 1 for e in known)  # cut to the alternatives asked for
    assert cache.lookup(second, 3) == []  # more alternatives than were computed
    assert cache.lookup([5, 6, 7], 1) == []
    # A prompt that extends a cached one knows every cached entry.
    assert len(cache.lookup(first + [7, 8], 2)) == len(first) - 1


def test_the_oldest_prompts_make_room():
    cache = PromptLogprobCache(max_positions=30)
    a, b, c = list(range(0, 16)), list(range(100, 116)), list(range(200, 216))
    cache.store(a, 1, entries(a, 1))
    cache.store(b, 1, entries(b, 1))
    assert cache.positions == 30
    cache.lookup(a + [1], 1)  # a is used: b is now the oldest
    cache.store(c, 1, entries(c, 1))
    assert cache.positions <= 30
    assert cache.lookup(b + [1], 1) == [] and cache.lookup(a + [1], 1) and cache.lookup(c + [1], 1)


def test_storing_a_prompt_again_with_fewer_alternatives_keeps_the_richer_entries():
    cache = PromptLogprobCache()
    prompt = list(range(40, 60))
    cache.store(prompt, 3, entries(prompt, 3))
    cache.store(prompt, 1, entries(prompt, 1))  # the same prompt, asked with fewer alternatives
    assert cache.positions == len(prompt) - 1  # one entry list, not two
    known = cache.lookup(prompt + [1], 3)
    assert len(known) == len(prompt) - 1 and all(len(e.top) == 3 for e in known)
    cache.store(prompt, 5, entries(prompt, 5))  # a richer one replaces it
    assert all(len(e.top) == 5 for e in cache.lookup(prompt + [1], 5))


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer):
    return SpeculativeEngine(tiny_model, tokenizer, kv_cache_tokens=4096)


def prompt_logprobs(engine, prompt_ids: list[int], top: int):
    result = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=1, prompt_logprobs=top))
    return result.prompt_logprobs, result.stats.cached_tokens


def test_a_prompt_sharing_a_prefix_reuses_its_entries_and_equals_a_full_forward(engine, tiny_model, tokenizer):
    context = tokenizer(CONTEXT)["input_ids"]
    first = context + tokenizer(" first ending")["input_ids"][1:]
    second = context + tokenizer(" another, longer ending of it")["input_ids"][1:]
    assert len(context) > 2 * engine.cache.block_size
    _, cached = prompt_logprobs(engine, first, 3)
    assert cached == 0
    got, cached = prompt_logprobs(engine, second, 2)
    assert cached >= len(context) - engine.cache.block_size  # the shared blocks were not computed again
    with torch.inference_mode():
        oracle = torch.log_softmax(tiny_model(input_ids=torch.tensor([second])).logits[0].float(), dim=-1)  # [n, V]
    assert [e.token_id for e in got] == second[1:]
    for j, entry in enumerate(got):
        assert entry.logprob == pytest.approx(float(oracle[j, second[j + 1]]), abs=1e-4)
        best = torch.topk(oracle[j], 2)
        assert [t for t, _ in entry.top] == best.indices.tolist() or \
            abs(float(best.values[0] - best.values[1])) < 1e-4  # a tie may come in either order
        assert [v for _, v in entry.top] == pytest.approx(best.values.tolist(), abs=1e-4)
