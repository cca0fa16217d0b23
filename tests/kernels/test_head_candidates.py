"""The native search of the head's candidates (foretell/kernels/head_candidates.cpp) against
torch: each row's top and its first index as torch's max gives them, every token at or above a
line as torch's nonzero finds them, and the rescored logits unchanged by which of the two serves."""

import pytest
import torch

from foretell.proxy.engine import precision
from foretell.proxy.engine.precision import native_head_candidates, rescore_in_fp32

pytestmark = pytest.mark.skipif(native_head_candidates() is None, reason="the native search is not built")


def _scores(n, width, seed):
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("width", [1, 15, 16, 17, 100, 4099])
def test_row_tops_are_torchs_max_and_its_first_index(width):
    scores = _scores(6, width, width)
    scores[1] = scores[1].max() if width == 1 else scores[1]
    if width > 3:
        scores[2, width // 2] = scores[2, width - 1] = scores[2].max() + 1.0  # a tie: the first wins
    scores[3] = float("-inf")  # nothing but -inf
    scores[4, width - 1] = float("inf")
    top, leader = native_head_candidates().row_tops(scores)
    values, indices = scores.max(dim=-1, keepdim=True)
    assert torch.equal(top, values)
    assert torch.equal(leader, indices)
    assert top.shape == leader.shape == (6, 1) and leader.dtype == torch.long


def test_a_nan_is_the_largest_as_torch_takes_it():
    scores = _scores(2, 40, 0)
    scores[0, 33] = float("nan")
    scores[0, 35] = float("nan")
    top, leader = native_head_candidates().row_tops(scores)
    assert torch.isnan(top[0, 0]) and leader[0, 0] == 33
    assert top[1, 0] == scores[1].max() and leader[1, 0] == scores[1].argmax()


@pytest.mark.parametrize("width", [1, 16, 37, 4099])
def test_at_or_above_finds_what_torch_finds_in_row_and_token_order(width):
    scores = _scores(5, width, width + 1)
    line = torch.tensor([1.5, float("-inf"), float("inf"), float("nan"), 0.0])
    scores[4, :3] = 0.0  # equal to the line: found
    rows, cols = native_head_candidates().at_or_above(scores, line)
    expected_rows, expected_cols = torch.nonzero(scores >= line[:, None], as_tuple=True)
    assert torch.equal(rows, expected_rows) and torch.equal(cols, expected_cols)
    assert int((rows == 1).sum()) == width and int((rows == 3).sum()) == 0  # -inf: all; NaN: none


def test_the_rescored_logits_are_the_same_whichever_search_serves(monkeypatch):
    """Sparse rows (a clear winner), crowded ones (thousands within the bound) and a near twin on
    top: the same float32 logits with the native search and with topk's."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(20000, 48, generator=generator)
    hidden = torch.randn(7, 48, generator=generator)
    exact = hidden @ weight.t()
    approx = exact.to(torch.bfloat16)  # a bf16 head's logits: the rounding bound applies
    approx[2] = approx[2] * 0.01  # flat: crowded
    approx[3, 17] = approx[3].max() + 10.0  # one clear winner
    native = rescore_in_fp32(hidden, lambda rows: weight[rows], None, approx.clone())
    monkeypatch.setattr(precision, "native_head_candidates", lambda: None)
    torch_ops = rescore_in_fp32(hidden, lambda rows: weight[rows], None, approx.clone())
    assert torch.equal(native, torch_ops)
    assert not torch.equal(native, approx.float())  # something was rescored


def test_bad_inputs_are_refused():
    native = native_head_candidates()
    with pytest.raises(RuntimeError, match="contiguous float32"):
        native.row_tops(torch.randn(4, 3).t())
    with pytest.raises(RuntimeError, match="contiguous float32"):
        native.row_tops(torch.randn(3, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="V >= 1"):
        native.row_tops(torch.empty(3, 0))
    with pytest.raises(RuntimeError, match="one value per row"):
        native.at_or_above(torch.randn(3, 4), torch.zeros(2))
