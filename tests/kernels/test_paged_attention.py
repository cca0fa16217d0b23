"""Tests for foretell.kernels.paged_attention: the Triton kernel against the per-sequence torch
reference on random ragged steps, and the reference against plain attention over the whole
sequence (so the oracle itself is checked).

On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py
before triton is imported); under FORETELL_TEST_DEVICE=cuda the same tests run compiled.
Tolerances: float32 1e-5 (the kernel sums in another order: online softmax over key tiles);
bfloat16 / float16: 2e-2 absolute, two units in the last place of outputs near 1-2 (the
output is rounded once to the input dtype, after different float32 sums).
"""

import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "0" if os.environ.get("FORETELL_TEST_DEVICE") == "cuda" else "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from foretell.kernels import LAUNCHES  # noqa: E402

from tests.kernels.flat import DEVICE  # noqa: E402

pa = importlib.import_module("foretell.kernels.paged_attention")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}

pytestmark = pytest.mark.skipif(not pa.HAVE_TRITON, reason="triton is not installed")


@pytest.fixture(autouse=True)
def kernel_runs_here():
    if DEVICE.type == "cpu" and not pa._kernels_interpreted():
        pytest.fail("Triton's interpreter is not active: TRITON_INTERPRET=1 must be set before triton "
                    "is imported (tests/conftest.py does)")


def make_step(steps, *, heads=4, kv_heads=2, head_dim=32, block_size=4, dtype=torch.float32, seed=0,
              spare_blocks=5):
    """A random ragged step. ``steps``: per sequence (positions already cached, new positions).
    Every sequence's blocks are drawn from one shuffled pool (out of order, interleaved)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(cached + new) // block_size) for cached, new in steps]
    total = sum(need) + spare_blocks
    order = torch.randperm(total, generator=g).tolist()
    table = torch.full((len(steps), max(need)), -1, dtype=torch.int32)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    keys = torch.randn(kv_heads, total * block_size, head_dim, generator=g).to(dtype)
    values = torch.randn(kv_heads, total * block_size, head_dim, generator=g).to(dtype)
    counts = [new for _, new in steps]
    qsl = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor([cached + new for cached, new in steps], dtype=torch.int32)
    # The model's layout: [1, heads, T, D], read as a [T, heads, D] view (not contiguous).
    query = torch.randn(1, heads, sum(counts), head_dim, generator=g).to(dtype)[0].transpose(0, 1)
    to = dict(device=DEVICE)
    return (query.to(**to), keys.to(**to), values.to(**to), table.to(**to), qsl.to(**to),
            seq_lens.to(**to)), dict(block_size=block_size, scale=head_dim ** -0.5)


def check(step, options, window=None, dtype=torch.float32):
    want = pa.ragged_paged_attention_reference(*step, window=window, **options)
    got = pa.ragged_paged_attention_triton(*step, window=window, **options)
    assert got.shape == want.shape and got.dtype == want.dtype
    error = (got.float() - want.float()).abs().max().item()
    assert error <= TOLERANCE[dtype], f"kernel differs from the reference by {error}"
    return got


CASES = {
    "prefill only": [(0, 9), (0, 13), (4, 7)],
    "verify only": [(17, 1), (9, 4), (30, 6), (3, 2)],
    "mixed": [(0, 11), (21, 5), (8, 1), (12, 9)],
    "one position": [(0, 1)],
    "long context": [(70, 3), (45, 1)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window", [None, 6])
def test_kernel_equals_reference_on_ragged_steps(case, window, dtype):
    step, options = make_step(CASES[case], dtype=dtype, seed=len(case))
    check(step, options, window, dtype)


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 1), (8, 2), (6, 2)])
def test_grouped_query_attention_ratios(heads, kv_heads):
    step, options = make_step(CASES["mixed"], heads=heads, kv_heads=kv_heads, seed=heads)
    check(step, options, window=5)


def test_head_dim_not_a_power_of_two_and_large_blocks():
    step, options = make_step([(20, 3), (0, 17)], head_dim=40, block_size=16)
    check(step, options)
    check(step, options, window=9)


def test_sliding_window_crossing_with_released_blocks():
    """Blocks wholly behind every query's window are released (-1 in the table, their slots
    filled with NaN): neither implementation may read them."""
    steps = [(40, 3), (33, 8)]
    window, bs = 6, 4
    (query, keys, values, table, qsl, seq_lens), options = make_step(steps, block_size=bs)
    for b, (cached, _) in enumerate(steps):
        behind = max(0, cached - window + 1) // bs
        for index in range(behind):
            block = int(table[b, index])
            keys[:, block * bs:(block + 1) * bs] = float("nan")
            values[:, block * bs:(block + 1) * bs] = float("nan")
            table[b, index] = -1
    got = check((query, keys, values, table, qsl, seq_lens), options, window=window)
    assert bool(torch.isfinite(got).all())


def test_reference_equals_plain_causal_attention():
    """The oracle: for one sequence stored contiguously, the reference is torch's own causal
    attention over the whole sequence (the last rows of it), with and without a window."""
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, total, new, bs = 4, 2, 16, 23, 5, 4
    keys = torch.randn(kv_heads, total, dim, generator=g)
    values = torch.randn(kv_heads, total, dim, generator=g)
    query = torch.randn(total, heads, dim, generator=g)
    blocks = -(-total // bs)
    pool_k = torch.zeros(kv_heads, blocks * bs, dim)
    pool_v = torch.zeros(kv_heads, blocks * bs, dim)
    pool_k[:, :total], pool_v[:, :total] = keys, values
    layout = (torch.arange(blocks, dtype=torch.int32).view(1, -1), torch.tensor([0, new], dtype=torch.int32),
              torch.tensor([total], dtype=torch.int32))
    for window in (None, 7):
        mask = torch.ones(total, total).tril().bool()
        if window is not None:
            mask &= ~torch.ones(total, total).tril(-window).bool()
        full = F.scaled_dot_product_attention(
            query.transpose(0, 1), keys.repeat_interleave(2, 0), values.repeat_interleave(2, 0),
            attn_mask=mask, scale=0.3).transpose(0, 1)  # [total, heads, dim]
        got = pa.ragged_paged_attention_reference(query[-new:], pool_k, pool_v, *layout, block_size=bs,
                                                  scale=0.3, window=window)
        torch.testing.assert_close(got, full[-new:], atol=1e-5, rtol=1e-5)


def test_one_launch_per_call_and_given_tiles():
    step, options = make_step(CASES["mixed"])
    lens = [9 - 0, 5, 1, 9]
    block_q = pa.block_q_for(lens, 4, 2)
    tiles = pa.query_tiles([11, 5, 1, 9], block_q, DEVICE)
    before = LAUNCHES["paged_attention"]
    out = torch.empty(26, 4, 32, device=DEVICE)
    result = pa.ragged_paged_attention_triton(*step, tiles=tiles, block_q=block_q, out=out, **options)
    assert result is out and LAUNCHES["paged_attention"] == before + 1
    want = pa.ragged_paged_attention_reference(*step, **options)
    assert (out - want).abs().max().item() <= TOLERANCE[torch.float32]


def test_query_tiles_cover_every_query_once():
    seqs, firsts = pa.query_tiles([5, 0, 1, 8], 4, "cpu")
    assert list(zip(seqs.tolist(), firsts.tolist())) == [(0, 0), (0, 4), (2, 0), (3, 0), (3, 4)]
    assert pa.block_q_for([1, 1, 3], heads=8, kv_heads=2) == 4  # decoding: 16 rows of 4 heads
    assert pa.block_q_for([1, 40], heads=8, kv_heads=2) == 16  # a prefill chunk: 64 rows
    assert pa.block_q_for([1], heads=6, kv_heads=2) == 4  # a group of 3 pads to 4


def test_bad_inputs_say_what_is_wrong():
    (query, keys, values, table, qsl, seq_lens), options = make_step(CASES["mixed"])
    with pytest.raises(ValueError, match="int32"):
        pa.ragged_paged_attention_triton(query, keys, values, table.long(), qsl, seq_lens, **options)
    with pytest.raises(ValueError, match="grouped"):
        pa.ragged_paged_attention_reference(query[:, :3], keys, values, table, qsl, seq_lens, **options)
    with pytest.raises(ValueError, match="disagree on B"):
        pa.ragged_paged_attention_triton(query, keys, values, table[:2], qsl, seq_lens, **options)
    with pytest.raises(ValueError, match="share one of"):
        pa.ragged_paged_attention_triton(query.double(), keys, values, table, qsl, seq_lens, **options)
    with pytest.raises(ValueError, match="unit stride"):
        pa.ragged_paged_attention_triton(query, keys.transpose(1, 2).contiguous().transpose(1, 2),
                                         values, table, qsl, seq_lens, **options)
