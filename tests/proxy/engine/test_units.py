"""Small pure pieces: stop decisions, draft-length choice, the pass-cost fit, prediction usage."""

from __future__ import annotations

import itertools

import pytest
import torch

from foretell.proxy.engine.draft_length import (
    AcceptanceEstimate,
    DraftOption,
    OnlinePassCost,
    PassCostModel,
    best_draft_length,
    choose_step_drafts,
    expected_tokens,
)
from foretell.proxy.engine.draft_sources import PromptLookupSource
from foretell.proxy.engine.kv_cache import SequenceBlocks
from foretell.proxy.prediction_usage import prediction_token_usage
from foretell.proxy.engine.sequence import GenerationRequest, Sequence

COST = PassCostModel(fixed=0.07, per_position=0.004)


class CharTokenizer:  # a toy tokenizer: token i is chr(i); 1 is EOS and has no text
    eos_token_id = 1

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 1))


def run_round(new, prev, stop, eos, max_tokens, accepted=0):
    """Feed ``prev`` then ``new`` through a sequence's accept step, as the engine does."""
    seq = Sequence(GenerationRequest(prompt_ids=[97], max_tokens=max_tokens, stop=stop), max_tokens,
                   CharTokenizer(), "cpu", frozenset(eos), SequenceBlocks(tables={}))
    if prev:
        seq.accept(0, prev, None)
    update = seq.accept(accepted, new, None)
    return seq, update


@pytest.mark.parametrize("new,prev,stop,eos,max_tokens,keep,reason", [
    ([97, 98, 99], [], (), {1}, 10, 3, None),
    ([97, 1, 99], [], (), {1}, 10, 2, "stop"),  # EOS inside the draft
    ([97, 98, 99], [97] * 8, (), {1}, 10, 2, "length"),  # max_tokens mid-draft
    ([97, 98, 99], [97] * 7, (), {1}, 10, 3, "length"),  # exactly reaches max_tokens
    ([97, 98, 99, 100], [], ("bc",), {1}, 10, 3, "stop"),  # stop string completed at token 3
    ([99, 100], [97, 98], ("bc",), {1}, 10, 1, "stop"),  # stop string across rounds
])
def test_stop_decisions(new, prev, stop, eos, max_tokens, keep, reason):
    seq, update = run_round(new, prev, stop, eos, max_tokens)
    assert (len(update.token_ids), seq.speculation.finish_reason) == (keep, reason)


def test_stop_text_ends_before_the_stop_string_and_nothing_of_it_streams():
    seq, first = run_round([97, 98], [], ("cd", "bc"), {1}, 10)
    assert first.text == "a"  # "b" may start "bc": held back
    update = seq.accept(0, [99, 100], None)
    assert update.result.text == "a"  # "a|bc": the earliest stop string wins
    assert first.text + update.text == update.result.text


def test_accepted_count_is_clamped_at_a_stop_inside_the_draft():
    seq, update = run_round([97, 98, 99, 100, 101, 102], [], ("c",), {1}, 10, accepted=5)
    assert len(update.token_ids) == 3 and seq.stats.accepted_tokens == 0  # no draft source
    seq, update = run_round([97, 1, 99, 100], [], (), {1}, 10, accepted=3)
    assert update.origins == [None, None] and len(seq.speculation.origins) == len(seq.output.keys) == 2


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


class FakeClock:
    """A clock that advances only by what the fake pass says it cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_pass_cost_fit_recovers_a_line():
    clock, calls = FakeClock(), []

    def fake_forward(n):
        calls.append(n)
        clock.now += 0.05 + 0.003 * n

    model = PassCostModel.measure(fake_forward, positions=(1, 9, 33), repeats=3, clock=clock)
    assert model.fixed == pytest.approx(0.05) and model.per_position == pytest.approx(0.003)
    assert calls[0] == 1 and len(calls) == 10


def test_online_cost_recovers_from_a_disturbed_start():
    # Calibrated while the machine was busy: every draft looks dear.
    online = OnlinePassCost(PassCostModel(fixed=0.118, per_position=0.1179))
    true = PassCostModel(fixed=0.072, per_position=0.004)
    assert best_draft_length(0.95, 128, online.model)[0] <= 6
    # Real traffic: mostly short verify passes, now and then a prefill chunk, a few outliers.
    sizes = itertools.cycle([1, 1, 2, 1, 5, 1, 256, 1, 9, 1, 17, 1])
    for index in range(36):
        n = next(sizes)
        slowdown = 5.0 if index % 11 == 3 else 1.0  # another process took the CPU
        online.observe(n, true.at(n) * slowdown)
    fitted = online.model
    assert fitted.fixed == pytest.approx(true.fixed, rel=0.15)
    assert fitted.per_position == pytest.approx(true.per_position, rel=0.15)
    assert best_draft_length(0.95, 128, fitted)[0] >= 16


def test_a_false_anchor_with_a_poor_record_earns_no_draft():
    # The prediction source keeps re-anchoring on a 12-character match (a run of ~3 tokens)
    # while it has missed every draft: the measured acceptance must win over the fresh run.
    assert best_draft_length(0.02, 64, COST, run=3)[0] == 0
    assert best_draft_length(0.99, 64, COST, run=40)[0] >= 16


def test_prompt_lookup_copies_a_loop_with_its_long_continuation():
    source = PromptLookupSource([5, 6, 7] + [8, 9] * 30)  # a degenerate two-token loop
    proposal = source.propose(10)
    assert proposal == [8, 9] * 5  # the most recent match alone has 2 tokens of continuation
    assert PromptLookupSource([1, 2, 3, 4, 1, 2]).propose(8) == [3, 4, 1, 2]


def test_step_drafts_shrink_as_the_batch_grows():
    option = [DraftOption("prediction", acceptance=0.9, run=None, available=128)]
    alone = choose_step_drafts([option], 1, COST)[0][1]
    crowded = choose_step_drafts([option] * 16, 16, COST)
    assert alone > max(length for _, length in crowded) > 0
    # Drafts never lower the step's expected rate below no drafts at all.
    poor = [DraftOption("prompt_lookup", acceptance=0.05, run=None, available=64)]
    assert choose_step_drafts([poor] * 8, 8, COST) == [(None, 0)] * 8


def test_step_drafts_pick_the_better_source():
    options = [DraftOption("prompt_lookup", 0.3, None, 64), DraftOption("prediction", 0.97, None, 64)]
    assert choose_step_drafts([options], 1, COST)[0][0] == "prediction"


@pytest.mark.parametrize("prediction,completion,accepted,rejected", [
    ("a\nb\nc\n", "a\nb\nc\n", 3, 0),
    ("a\nb\nc\n", "a\nb\nX\nc\n", 3, 0),  # an insertion rejects nothing
    ("a\nb\nc\n", "a\nc\n", 2, 1),  # a deleted line is rejected
    ("a\nb\nc\n", "", 0, 3),
])
def test_prediction_usage(prediction, completion, accepted, rejected):
    starts = [i for i, ch in enumerate(prediction) if i == 0 or prediction[i - 1] == "\n"]
    assert prediction_token_usage(prediction, starts, completion) == (accepted, rejected)


def test_vocabulary_major_output_head_equals_the_linear_layer_and_is_restored():
    from foretell.proxy.engine.forward import VOCABULARY_MAJOR_MAX_ROWS, _output_head

    class WithHead(torch.nn.Module):
        def __init__(self, bias: bool):
            super().__init__()
            self.head = torch.nn.Linear(24, 1000, bias=bias)

        def get_output_embeddings(self):
            return self.head

    torch.manual_seed(0)
    for bias in (False, True):
        model = WithHead(bias)
        for rows in (0, 1, 5, VOCABULARY_MAJOR_MAX_ROWS, VOCABULARY_MAJOR_MAX_ROWS + 3):
            hidden = torch.randn(1, rows, 24)
            expected = torch.nn.functional.linear(hidden, model.head.weight, model.head.bias)  # [1, rows, V]
            with _output_head(model, fp32_head=False):
                assert "forward" in vars(model.head)
                got = model.head(hidden)
            assert got.shape == expected.shape and got.is_contiguous()
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            assert "forward" not in vars(model.head)  # the class's own forward again


def test_output_head_rescores_a_bf16_head_in_fp32_and_upcasts_a_quantized_one():
    from foretell.proxy.engine.forward import _output_head
    from foretell.proxy.engine.precision import Int8WeightOnlyLinear

    class WithHead(torch.nn.Module):
        def __init__(self, head):
            super().__init__()
            self.head = head

        def get_output_embeddings(self):
            return self.head

    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 1000, bias=False).to(torch.bfloat16)
    hidden = torch.randn(1, 6, 24, dtype=torch.bfloat16)
    oracle = torch.nn.functional.linear(hidden.float(), linear.weight.float())  # [1, 6, V]
    for fp32_head in (True, False):
        with _output_head(WithHead(linear), fp32_head):
            got = linear(hidden)
        assert got.dtype == torch.float32 and got.shape == oracle.shape
        if fp32_head:  # the winners are float32 products
            best = got.argmax(dim=-1, keepdim=True)
            assert torch.equal(best, oracle.argmax(dim=-1, keepdim=True))
            torch.testing.assert_close(got.gather(-1, best), oracle.gather(-1, best))
        else:  # bf16 logits, upcast
            assert torch.equal(got, torch.nn.functional.linear(hidden, linear.weight).float())
    int8 = Int8WeightOnlyLinear(torch.nn.Linear(32, 1000, bias=False).to(torch.bfloat16))
    hidden = torch.randn(1, 6, 32, dtype=torch.bfloat16)
    with _output_head(WithHead(int8), fp32_head=False):
        got = int8(hidden)
    assert got.dtype == torch.float32 and torch.equal(got, Int8WeightOnlyLinear.forward(int8, hidden).float())
