"""KV rollback: after a rejection at any draft position (or full acceptance), the cache must be
exactly the cache of the accepted prefix: the next step's logits equal a fresh forward."""

from __future__ import annotations

import pytest
import torch

from foretell.proxy.engine import prefill, verify_draft
from tests.helpers import greedy_reference

DRAFT = 6


@torch.inference_mode()
def next_logits_after_round(model, prompt_ids, draft):
    """Prefill, verify ``draft`` (rolling back what is rejected), then take one more step."""
    cache = prefill(model, prompt_ids)
    accepted, new_tokens, _ = verify_draft(model, cache, prompt_ids[-1], draft)
    assert cache.get_seq_length() == len(prompt_ids) + accepted
    logits = model(input_ids=torch.tensor([[new_tokens[-1]]]), cache=cache, use_cache=True).logits
    return accepted, new_tokens, logits[0, -1]


@torch.inference_mode()
def fresh_logits(model, ids):
    return model(input_ids=torch.tensor([ids])).logits[0, -1]


def drafts_rejected_at_every_position(reference):
    """Drafts that follow the greedy output but break at position j (j = DRAFT: all accepted)."""
    for j in range(DRAFT + 1):
        draft = list(reference[:DRAFT])
        if j < DRAFT:
            draft[j] = (draft[j] + 7) % 1000 + 3  # any other token
        yield j, draft


def check_rollback(model, prompt_ids, atol):
    reference = greedy_reference(model, prompt_ids, DRAFT + 1)
    for j, draft in drafts_rejected_at_every_position(reference):
        accepted, new_tokens, logits = next_logits_after_round(model, prompt_ids, draft)
        assert accepted == j
        assert new_tokens == reference[: j + 1]
        expected = fresh_logits(model, list(prompt_ids) + new_tokens)
        torch.testing.assert_close(logits, expected, atol=atol, rtol=0)


def test_rollback_tiny_model_beyond_sliding_window(tiny_model, tokenizer):
    # The tiny model's window is 8 tokens; the prompt is far longer.
    prompt_ids = tokenizer("one two three four five six seven eight nine ten " * 4)["input_ids"]
    check_rollback(tiny_model, prompt_ids, atol=1e-5)


@pytest.mark.embedded
def test_rollback_embedded_model_beyond_sliding_window(embedded):
    # Over Gemma 3's 512-token sliding window.
    text = "\n".join(f"line {i}: value = compute({i}, {i * 7 % 13})" for i in range(60))
    prompt_ids = embedded.tokenizer(text)["input_ids"]
    assert len(prompt_ids) > 600
    # Cached decoding and one full forward differ by ~4e-5 in fp32 (different matmul shapes).
    check_rollback(embedded.model, prompt_ids, atol=2e-3)
