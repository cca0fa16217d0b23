"""Attention whose every query row is computed in the same order whatever else is in the pass.

``scaled_dot_product_attention`` on a CPU rounds a query's row differently by the number of
queries beside it and between the decoding pattern (keys up to the position, no mask) and the
verify pattern (every key of the pass, and a mask), so a near tie can break one way in plain
decoding and the other in speculation. Here the keys are cut in chunks of ``CHUNK`` at absolute
positions (0, CHUNK, 2 * CHUNK, ...), and a query row's result depends only on its own visible
keys:

- scores: one matrix product per KV head, [rows, d] x [d, keys]; measured with MKL, a row of a
  product whose rows are a multiple of 4 (MKL takes them four at a time and rounds a remainder
  of 1-3 rows otherwise) and whose columns are at least 12 has the same bits however many rows
  and columns it shares the product with, so the query rows are padded to a whole number of row
  groups. The group is measured when the engine starts (``row_group``: 4 on an AVX2 EPYC; the
  smallest of 4, 8, 16, 32 whose multiples all round alike) and checked by
  ``tests/proxy/engine/test_batch_invariance.py`` on the machine that runs the tests;
- the row's maximum over its visible keys (exact in any order), then exp(score - max), masked
  keys exactly 0;
- per chunk: the sum of its C weights and its C x d product with the values, shapes that do not
  depend on the pass; then the chunks added one after another in position order, where a chunk
  a row cannot see adds exactly 0.

A decoding query at position p and the same query verified beside k others therefore compute the
same bits, and so does a prompt position whether it was prefilled in a chunk of 256 or decoded.
"""

from __future__ import annotations

import functools

import torch

CHUNK = 256  # keys per chunk: >= 12 (see above); larger means fewer sequential additions
ROW_GROUPS = (4, 8, 16, 32)  # candidates for the rows a product takes at once


@functools.lru_cache(maxsize=None)
def row_group(head_dim: int, dtype: torch.dtype = torch.float32) -> int:
    """The smallest group size whose whole multiples of rows give every row the same bits in
    both of the attention's products (scores [rows, d] x [d, C], values [rows, C] x [C, d]),
    measured on random data of this head size and dtype (MKL's float32 and oneDNN's bf16 kernels
    differ); 64 if none of the candidates does."""
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(1, CHUNK * 2, head_dim, generator=generator).to(dtype)
    values = torch.randn(2, CHUNK, head_dim, generator=generator).to(dtype)
    for group in ROW_GROUPS:
        most = 8 * group
        queries = torch.randn(1, most, head_dim, generator=generator).to(dtype)
        weights = torch.rand(2, most, CHUNK, generator=generator).to(dtype)
        scores, mixed = torch.bmm(queries, keys.transpose(1, 2)), torch.bmm(weights, values)
        if all(torch.equal(torch.bmm(queries[:, :n], keys.transpose(1, 2)), scores[:, :n])
               and torch.equal(torch.bmm(weights[:, :n], values), mixed[:, :n])
               for n in range(group, most, group)):
            return group
    return 64


def key_span(first: int, end: int) -> tuple[int, int]:
    """The chunk-aligned positions [start, stop) that cover keys [first, end)."""
    start = (first // CHUNK) * CHUNK
    stop = -(-end // CHUNK) * CHUNK
    return start, stop


def fixed_split_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          visible: torch.Tensor, scale: float, group_rows: int | None = None) -> torch.Tensor:
    """query [heads, q, d]; keys, values [kv_heads, N, d] (N a multiple of CHUNK, positions from a
    chunk boundary); visible [q, N] bool; ``group_rows``: ``row_group(d, dtype)`` unless given.
    Returns [q, heads, d]."""
    heads, q, d = query.shape
    kv_heads, n, _ = keys.shape
    group = heads // kv_heads
    chunks = n // CHUNK
    rows = group * q
    x = (query * scale).reshape(kv_heads, rows, d)  # [kv, group * q, d], rows (head, query)
    step = group_rows or row_group(d, query.dtype)
    padded = -(-rows // step) * step
    if padded > rows:
        x = torch.cat([x, x.new_zeros(kv_heads, padded - rows, d)], dim=1)
    scores = torch.bmm(x, keys.transpose(1, 2))[:, :rows]  # [kv, rows, N]
    scores = scores.reshape(kv_heads, group, q, n).masked_fill(~visible, float("-inf")).view(kv_heads, rows, n)
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))  # [kv, rows, N]
    by_chunk = weights.view(kv_heads, rows, chunks, CHUNK)
    sums = by_chunk.sum(dim=-1)  # [kv, rows, chunks]
    tiles = by_chunk.permute(0, 2, 1, 3)  # [kv, chunks, rows, C]
    if padded > rows:
        tiles = torch.cat([tiles, tiles.new_zeros(kv_heads, chunks, padded - rows, CHUNK)], dim=2)
    parts = torch.bmm(tiles.reshape(kv_heads * chunks, padded, CHUNK),
                      values.reshape(kv_heads * chunks, CHUNK, d)).view(kv_heads, chunks, padded, d)
    total, out = sums[:, :, 0], parts[:, 0, :rows]
    for c in range(1, chunks):  # in position order, one chunk at a time
        total = total + sums[:, :, c]
        out = out + parts[:, c, :rows]
    out = out / total[:, :, None]  # [kv, rows, d]
    return out.view(heads, q, d).transpose(0, 1)  # [q, heads, d]
