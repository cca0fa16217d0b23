"""Small pure functions: stop decisions, draft-length choice, prediction usage."""

from __future__ import annotations

import pytest

from foretell.proxy.engine.draft_length import (
    AcceptanceEstimate,
    PassCostModel,
    best_draft_length,
    expected_tokens,
)
from foretell.proxy.engine.prediction_usage import prediction_token_usage
from foretell.proxy.engine.stopping import decide_stop, find_stop_string

COST = PassCostModel(fixed=0.07, per_position=0.004)


def char_decode(ids):  # a toy detokeniser: token i is chr(i)
    return "".join(chr(i) for i in ids)


@pytest.mark.parametrize("new,prev,stop,eos,max_tokens,keep,reason", [
    ([97, 98, 99], [], (), {1}, 10, 3, None),
    ([97, 1, 99], [], (), {1}, 10, 2, "stop"),  # EOS inside the draft
    ([97, 98, 99], [97] * 8, (), {1}, 10, 2, "length"),  # max_tokens mid-draft
    ([97, 98, 99], [97] * 7, (), {1}, 10, 3, "length"),  # exactly reaches max_tokens
    ([97, 98, 99, 100], [], ("bc",), {1}, 10, 3, "stop"),  # stop string completed at token 3
    ([99, 100], [97, 98], ("bc",), {1}, 10, 1, "stop"),  # stop string across rounds
])
def test_decide_stop(new, prev, stop, eos, max_tokens, keep, reason):
    decision = decide_stop(new, prev, len(char_decode(prev)), char_decode,
                           eos_token_ids=frozenset(eos), stop=stop, max_tokens=max_tokens)
    assert (decision.keep, decision.finish_reason) == (keep, reason)


def test_stop_text_ends_before_the_stop_string():
    decision = decide_stop([97, 98, 99, 100], [], 0, char_decode,
                           eos_token_ids=frozenset(), stop=("cd", "bc"), max_tokens=10)
    assert decision.text_end == 1  # "a|bc": the earliest stop string wins
    assert find_stop_string("xxabc", ("bc",), 3) == 3


def test_expected_tokens_formula():
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2)
    assert expected_tokens(1.0, 7) == 8


def test_draft_length_grows_with_acceptance_and_vanishes_without():
    lengths = [best_draft_length(a, 256, COST)[0] for a in (0.01, 0.5, 0.9, 0.99, 0.999)]
    assert lengths[0] == 0  # a source that keeps missing is not used
    assert lengths == sorted(lengths) and lengths[-1] >= 64
    assert best_draft_length(0.999, 5, COST)[0] == 5  # never more than the source offers
    # A long agreement run earns a long draft; a fresh one a short draft.
    assert best_draft_length(0.999, 256, COST, run=3)[0] < best_draft_length(0.999, 256, COST, run=200)[0]


def test_acceptance_estimate_learns_from_shadow_scores():
    estimate = AcceptanceEstimate()
    for _ in range(20):
        estimate.update([5, 6, 7], [9, 9])  # always wrong at once
    assert estimate.rate < 0.1
    for _ in range(20):
        estimate.update([5, 6, 7], [5, 6, 7, 8])
    assert estimate.rate > 0.9


def test_pass_cost_fit_recovers_a_line():
    calls = []

    def fake_forward(n):  # deterministic timing is not available; fit on a busy loop instead
        calls.append(n)
        total = 0
        for i in range(2000 * (20 + n)):
            total += i
        return total

    model = PassCostModel.measure(fake_forward, positions=(1, 9, 33), repeats=3)
    assert model.per_position > 0 and model.fixed > 0
    assert calls[0] == 1 and len(calls) == 10


@pytest.mark.parametrize("prediction,completion,accepted,rejected", [
    ("a\nb\nc\n", "a\nb\nc\n", 3, 0),
    ("a\nb\nc\n", "a\nb\nX\nc\n", 3, 0),  # an insertion rejects nothing
    ("a\nb\nc\n", "a\nc\n", 2, 1),  # a deleted line is rejected
    ("a\nb\nc\n", "", 0, 3),
])
def test_prediction_usage(prediction, completion, accepted, rejected):
    starts = [i for i, ch in enumerate(prediction) if i == 0 or prediction[i - 1] == "\n"]
    assert prediction_token_usage(prediction, starts, completion) == (accepted, rejected)
