"""The native row-invariant attention loop against its float64 reference, and its row bits: a
query row gives the same bits alone, among other rows, and over a longer key span whose extra
keys it cannot see (decode, verify and prefill compute a position alike)."""

import pytest
import torch

from foretell.kernels.row_attention import native_module, row_attention, row_attention_reference
from foretell.proxy.engine import kv_cache

pytestmark = pytest.mark.skipif(native_module() is None, reason="no C++ compiler for the native loop")


def _case(heads, kv_heads, d, rows, first_position, pool=1024, seed=0):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(kv_heads, pool, d, generator=generator)
    values = torch.randn(kv_heads, pool, d, generator=generator)
    keys[:, 7] *= 40  # an outlier key: the softmax's maximum matters
    n = first_position + rows
    slots = torch.randperm(pool, generator=generator)[:n]  # keys scattered over the pool
    # [1, rows, heads, d] transposed, as the model hands queries over: not contiguous
    query = torch.randn(1, rows, heads, d, generator=generator).transpose(1, 2)[0]
    positions = torch.arange(first_position, first_position + rows)
    visible = torch.arange(n).view(1, -1) <= positions.view(-1, 1)  # causal
    return query, keys, values, slots, visible


@pytest.mark.parametrize("heads,kv_heads,d", [(4, 1, 256), (4, 2, 64), (2, 2, 32), (6, 2, 80), (10, 1, 32)])
def test_matches_the_float64_reference(heads, kv_heads, d):
    query, keys, values, slots, visible = _case(heads, kv_heads, d, rows=37, first_position=200)
    out = row_attention(query, keys, values, slots, visible, d ** -0.5)
    reference = row_attention_reference(query, keys, values, slots, visible, d ** -0.5)
    assert out.shape == (37, heads, d)
    torch.testing.assert_close(out.double(), reference, atol=2e-6, rtol=1e-5)


def test_weights_far_below_the_largest_vanish_and_near_ones_are_exact():
    """The loop's own exp: a score 1000 below the largest weighs exactly 0 (no NaN, no denormal
    trouble), and scores spread over [-80, 0] weigh as float64's exp does."""
    query, keys, values, slots, visible = _case(4, 1, 64, rows=3, first_position=40, seed=2)
    keys[:, slots[5]] = query[0, 0] * 1000  # key 5: far above every other for head 0, row 0
    out = row_attention(query, keys, values, slots, visible, 1.0)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, 0], values[0, slots[5]])  # every other weight exactly 0
    spread = torch.linspace(-80, 0, 43)  # scores of row 2 (43 visible keys) against a unit query
    unit = torch.zeros(4, 3, 64)
    unit[:, 2, 0] = 1.0
    keys[:, slots[:43], 0] = spread
    keys[:, slots[:43], 1:] = 0.0
    out = row_attention(unit, keys, values, slots, visible, 1.0)
    reference = row_attention_reference(unit, keys, values, slots, visible, 1.0)
    torch.testing.assert_close(out[2].double(), reference[2], atol=1e-6, rtol=1e-6)


def test_a_sliding_window_mask_is_honoured():
    query, keys, values, slots, visible = _case(4, 1, 64, rows=20, first_position=100)
    positions = torch.arange(100, 120)
    visible &= torch.arange(120).view(1, -1) > positions.view(-1, 1) - 16  # a window of 16 keys
    out = row_attention(query, keys, values, slots, visible, 0.125)
    torch.testing.assert_close(out.double(), row_attention_reference(query, keys, values, slots, visible, 0.125),
                               atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("heads,d", [(4, 256), (4, 32), (4, 80), (6, 32)])
def test_a_row_has_the_same_bits_in_every_pass(heads, d):
    """A row computed among 64 (rows taken from both ends, split between threads), alone, and in
    shorter passes; six heads over one KV head are done four, then two, at a time."""
    rows = 64
    query, keys, values, slots, visible = _case(heads, 1, d, rows=rows, first_position=150, seed=1)
    together = row_attention(query, keys, values, slots, visible, d ** -0.5)
    for r in (0, 1, 5, 31, 63):
        position = 150 + r
        alone = row_attention(query[:, r:r + 1], keys, values, slots[:position + 1],
                              visible[r:r + 1, :position + 1], d ** -0.5)  # decoded: keys up to itself
        assert torch.equal(alone[0], together[r]), f"row {r} alone"
        for width in (2, 3, 17):  # verified among others of a shorter pass
            start = max(0, r - width + 1)
            part = row_attention(query[:, start:r + 1], keys, values, slots, visible[start:r + 1], d ** -0.5)
            assert torch.equal(part[-1], together[r]), f"row {r} among {width}"


def test_the_float32_cache_of_an_invariant_engine_attends_natively():
    class Config:
        num_hidden_layers, num_key_value_heads, num_attention_heads, head_dim = 1, 1, 4, 64
        hidden_size = 256

    class Model(torch.nn.Module):
        config = Config()

        def __init__(self, dtype):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1, dtype=dtype))

    cache = kv_cache.PagedKVCache(Model(torch.float32), max_tokens=64)
    assert cache.row_attention is None
    cache.batch_invariant = True
    assert cache.row_attention is row_attention
    cache.batch_invariant = False
    assert cache.row_attention is None
    bf16 = kv_cache.PagedKVCache(Model(torch.bfloat16), max_tokens=64)
    bf16.batch_invariant = True  # bf16 keeps the torch operations
    assert bf16.batch_invariant and bf16.row_attention is None


def test_bad_shapes_are_refused():
    query, keys, values, slots, visible = _case(4, 1, 64, rows=3, first_position=10)
    with pytest.raises(AssertionError, match="visible"):
        row_attention(query, keys, values, slots, visible[:, :-1], 0.125)
    with pytest.raises(AssertionError, match="float32"):
        row_attention(query.double(), keys, values, slots, visible, 0.125)
    with pytest.raises(AssertionError, match="multiple of 16"):
        row_attention(query[..., :40], keys[..., :40], values[..., :40], slots, visible, 0.125)
