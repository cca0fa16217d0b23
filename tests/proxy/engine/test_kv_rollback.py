"""KV rollback in the paged cache: after a rejection at any draft position (or full acceptance),
a sequence's cache must be exactly the cache of its accepted prefix, so its next logits equal a
fresh forward over the same tokens. Checked with several sequences sharing every pass, after
prefix reuse, and after the prefix cache has been evicted under memory pressure."""

from __future__ import annotations

import pytest
import torch

from foretell.proxy.engine import SpeculativeEngine
from tests.helpers import greedy_reference

DRAFT = 6


@torch.inference_mode()
def fresh_logits(model, ids, last: int):
    """The next-token logits after each of the ``last`` longest prefixes of ``ids`` from one fresh
    forward: row ``i`` is what a forward over ``ids[:len(ids) - last + i + 1]`` alone gives
    (causal attention), up to matmul shapes. Only those rows pass the output head (262k columns
    for every prompt position would be a gigabyte of logits for the embedded model)."""
    return model(input_ids=torch.tensor([ids]), logits_to_keep=last).logits[0]


_ORACLE: dict = {}  # (model, prompt) -> (greedy reference, fresh logits): each computed once


def oracle(model, prompt_ids):
    key = (id(model), tuple(prompt_ids))
    if key not in _ORACLE:
        reference = greedy_reference(model, prompt_ids, DRAFT + 1)
        _ORACLE[key] = reference, fresh_logits(model, list(prompt_ids) + reference, len(reference) + 1)
    return _ORACLE[key]


def drafts_rejected_at_every_position(reference):
    """Drafts that follow the greedy output but break at position j (j = DRAFT: all accepted)."""
    for j in range(DRAFT + 1):
        draft = list(reference[:DRAFT])
        if j < DRAFT:
            draft[j] = (draft[j] + 7) % 1000 + 3  # any other token
        yield j, draft


@torch.inference_mode()
def rounds_in_one_batch(engine, prompt_ids, drafts):
    """Prefill one sequence per draft, verify every draft in one shared pass (rolling back what
    is rejected), then take one more step for all of them in another shared pass."""
    cache = engine.cache
    seqs = []
    for _ in drafts:
        blocks = cache.reserve(len(prompt_ids) + DRAFT + 2, engine.prefill_chunk + DRAFT + 1)
        assert blocks is not None
        reused = cache.match_prefix(blocks, prompt_ids)
        seqs.append((blocks, reused))
    engine._forward([(b, prompt_ids[b.committed:-1], None) for b, _ in seqs])
    for blocks, _ in seqs:
        blocks.committed = len(prompt_ids) - 1
    logits = engine._forward([(b, [prompt_ids[-1]] + d, 0) for (b, _), d in zip(seqs, drafts)])
    results, row = [], 0
    for (blocks, reused), draft in zip(seqs, drafts):
        target = logits[row:row + len(draft) + 1].argmax(dim=-1).tolist()
        row += len(draft) + 1
        accepted = 0
        while accepted < len(draft) and draft[accepted] == target[accepted]:
            accepted += 1
        blocks.committed += 1 + accepted
        cache.register_prompt_blocks(blocks, prompt_ids)
        cache.release_behind_window(blocks)
        results.append((blocks, reused, accepted, target[: accepted + 1]))
    after = engine._forward([(b, [new[-1]], 0) for b, _, _, new in results])
    for blocks, *_ in results:
        cache.free(blocks)
    return [(reused, accepted, new, after[i]) for i, (_, reused, accepted, new) in enumerate(results)]


def check_rollback(engine, model, prompt_ids, atol, expect_reuse=False):
    reference, fresh = oracle(model, prompt_ids)  # every case's tokens are a prefix of prompt + reference
    cases = list(drafts_rejected_at_every_position(reference))
    outcomes = rounds_in_one_batch(engine, prompt_ids, [draft for _, draft in cases])
    for (j, _), (reused, accepted, new_tokens, logits) in zip(cases, outcomes):
        assert accepted == j
        assert new_tokens == reference[: j + 1]
        if expect_reuse:
            assert reused > 0
        expected = fresh[j + 1]  # after prompt + new_tokens (row 0: after the prompt's last token but one)
        torch.testing.assert_close(logits, expected, atol=atol, rtol=0)


def test_rollback_tiny_model_beyond_sliding_window(tiny_model, tokenizer):
    # The tiny model's window is 8 tokens; the prompt is far longer.
    engine = SpeculativeEngine(tiny_model, tokenizer, kv_cache_tokens=2048, block_size=4)
    prompt_ids = tokenizer("one two three four five six seven eight nine ten " * 4)["input_ids"]
    check_rollback(engine, tiny_model, prompt_ids, atol=1e-5)
    # Again: the prompt's blocks now come from the prefix cache.
    check_rollback(engine, tiny_model, prompt_ids, atol=1e-5, expect_reuse=True)
    assert engine.cache.hits > 0


def test_rollback_after_the_prefix_cache_was_evicted(tiny_model, tokenizer):
    # A cache so small that each new prompt must evict the previous prompts' cached blocks.
    engine = SpeculativeEngine(tiny_model, tokenizer, kv_cache_tokens=288, block_size=4,
                               prefill_chunk=32, max_sequences=7)
    prompts = [tokenizer(f"{word} is a word and {word} again, " * 3)["input_ids"]
               for word in ("apple", "river", "stone", "cloud", "grass")]
    for prompt_ids in prompts + prompts[:1]:
        check_rollback(engine, tiny_model, prompt_ids, atol=1e-5)
    assert engine.cache.evictions > 0
    full = engine.cache.pools["full_attention"]
    assert len(full.free) + sum(1 for e in engine.cache.prefix.values()
                                if full.refs[e.blocks["full_attention"]] == 1) == full.num_blocks


@pytest.mark.embedded
def test_rollback_embedded_model_beyond_sliding_window(embedded):
    # Over Gemma 3's 512-token sliding window.
    engine = SpeculativeEngine(embedded.model, embedded.tokenizer, kv_cache_tokens=16384)
    text = "\n".join(f"line {i}: value = compute({i}, {i * 7 % 13})" for i in range(60))
    prompt_ids = embedded.tokenizer(text)["input_ids"]
    assert len(prompt_ids) > 600
    # Cached decoding and one full forward differ by ~4e-5 in fp32 (different matmul shapes).
    check_rollback(engine, embedded.model, prompt_ids, atol=2e-3)
    check_rollback(engine, embedded.model, prompt_ids, atol=2e-3, expect_reuse=True)
