"""Ragged paged attention: every sequence of a step in one launch per layer.

A step feeds each sequence a run of new positions (a prefill chunk, ``[pending] + draft`` for a
verify, or both), laid end to end in one flat batch of T query tokens. Each sequence's keys and
values live in a pool of fixed-size blocks, found through its block table: position p of
sequence b is slot ``block_table[b, p // block_size] * block_size + p % block_size`` of the pool.
The kernel reads them in place (no gather into a contiguous copy), so one launch covers prefill
chunks and verify rows of every sequence.

Layout (B sequences, T query tokens, H query heads, KVH key/value heads, head dim D):

* ``query``           [T, H, D]       any strides with unit stride along D (a transposed view is fine).
* ``key_pool``        [KVH, S, D]     S = blocks * block_size slots, unit stride along D;
  ``value_pool`` alike.
* ``block_table``     int32 [B, max_blocks]  -1 where a block is not held (a sliding layer's blocks
  behind the window); such blocks are never read.
* ``query_start_loc`` int32 [B+1]     sequence b's queries are rows ``[qsl[b], qsl[b+1])``.
* ``seq_lens``        int32 [B]       positions held after this step's writes; sequence b's queries
  sit at positions ``seq_lens[b] - q_len_b + i``.

Query q attends to key k of its own sequence when ``k <= q`` (causal) and, on a sliding layer of
window W, ``k > q - W``. Grouped-query attention: query head h reads key/value head ``h // (H //
KVH)``. Scores are ``scale * q . k``; softmax in float32; the output has the query's dtype.
Products run on float32 values: exact float32 ("ieee") for float32 inputs, tf32 for bf16/fp16
inputs, whose values tf32 holds exactly (the probabilities are rounded to tf32 for P.V, finer
than the bf16 a native bf16 product would round them to).

Entry points: :func:`ragged_paged_attention_reference` (pure torch, one sequence at a time: the
test oracle and the CPU path's twin), :func:`ragged_paged_attention_triton` (one Triton kernel,
online softmax over key tiles) and :func:`query_tiles` (the host-side list of query tiles the
kernel's grid runs over, built once per step and shared by every layer).
"""

from __future__ import annotations

import contextlib
import math

import torch

from foretell.kernels.launches import count_launch

try:  # Triton is optional: the package (and its CPU path) must import without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

__all__ = ["query_tiles", "ragged_paged_attention_reference", "ragged_paged_attention_triton"]

HAVE_TRITON = triton is not None
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Query rows (query tokens x heads of one KV head) per program; tl.dot needs at least 16.
BLOCK_M_DECODE = 16
BLOCK_M_PREFILL = 64
BLOCK_N = 32  # key positions per inner iteration


def _check_inputs(query, key_pool, value_pool, block_table, query_start_loc, seq_lens, block_size):
    """Validate shapes, dtypes and devices; return (T, H, D, KVH, B). Raises ValueError."""
    if query.dim() != 3:
        raise ValueError(f"query must be [T, H, D], got shape {tuple(query.shape)}")
    T, H, D = query.shape
    for name, pool in (("key_pool", key_pool), ("value_pool", value_pool)):
        if pool.dim() != 3 or pool.shape[2] != D:
            raise ValueError(f"{name} must be [KVH, slots, {D}], got shape {tuple(pool.shape)}")
    if key_pool.shape != value_pool.shape:
        raise ValueError(f"key_pool {tuple(key_pool.shape)} and value_pool {tuple(value_pool.shape)} differ")
    KVH = key_pool.shape[0]
    if KVH < 1 or H % KVH:
        raise ValueError(f"{H} query heads cannot be grouped over {KVH} key/value heads")
    if query.dtype not in _FLOAT_DTYPES or key_pool.dtype != query.dtype or value_pool.dtype != query.dtype:
        raise ValueError(f"query and pools must share one of float32/float16/bfloat16, got "
                         f"{query.dtype}, {key_pool.dtype}, {value_pool.dtype}")
    if block_table.dim() != 2 or seq_lens.dim() != 1 or query_start_loc.dim() != 1:
        raise ValueError("block_table must be [B, max_blocks], seq_lens [B] and query_start_loc [B+1]")
    B = seq_lens.shape[0]
    if block_table.shape[0] != B or query_start_loc.shape[0] != B + 1:
        raise ValueError(f"block_table {tuple(block_table.shape)}, query_start_loc "
                         f"{tuple(query_start_loc.shape)} and seq_lens {tuple(seq_lens.shape)} disagree on B")
    for name, t in (("block_table", block_table), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    for name, t in (("key_pool", key_pool), ("value_pool", value_pool), ("block_table", block_table),
                    ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, query on {query.device}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    return T, H, D, KVH, B


# --------------------------------------------------------------------------- #
# Reference (pure torch)
# --------------------------------------------------------------------------- #


def ragged_paged_attention_reference(query, key_pool, value_pool, block_table, query_start_loc, seq_lens,
                                     *, block_size: int, scale: float, window: int | None = None):
    """Attention one sequence at a time, in float32, from the block tables. Returns [T, H, D]."""
    T, H, D, KVH, B = _check_inputs(query, key_pool, value_pool, block_table, query_start_loc, seq_lens,
                                    block_size)
    group = H // KVH
    out = torch.zeros(T, H, D, dtype=query.dtype, device=query.device)
    starts, lens, tables = query_start_loc.tolist(), seq_lens.tolist(), block_table.tolist()
    for b in range(B):
        q_first, q_end, seq_len = starts[b], starts[b + 1], lens[b]
        if q_end == q_first:
            continue
        q_pos = torch.arange(seq_len - (q_end - q_first), seq_len, device=query.device)  # [q]
        lowest = 0 if window is None else max(0, int(q_pos[0]) - window + 1)
        k_pos = torch.arange(lowest, seq_len, device=query.device)  # [keys]
        blocks = torch.tensor(tables[b], device=query.device)[k_pos // block_size]
        if bool((blocks < 0).any()):
            raise ValueError(f"sequence {b} reads a block that is not held")
        slots = blocks * block_size + k_pos % block_size  # [keys]
        k = key_pool[:, slots].float().repeat_interleave(group, dim=0)  # [H, keys, D]
        v = value_pool[:, slots].float().repeat_interleave(group, dim=0)
        q = query[q_first:q_end].float().transpose(0, 1)  # [H, q, D]
        visible = k_pos.view(1, -1) <= q_pos.view(-1, 1)  # [q, keys]
        if window is not None:
            visible &= k_pos.view(1, -1) > q_pos.view(-1, 1) - window
        scores = (q @ k.transpose(1, 2)) * scale  # [H, q, keys]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[q_first:q_end] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).to(query.dtype)
    return out


# --------------------------------------------------------------------------- #
# Triton kernel
# --------------------------------------------------------------------------- #

if HAVE_TRITON:

    @triton.jit
    def _ragged_paged_attention_kernel(
        out_ptr,  # [T, H, D]
        query_ptr,  # [T, H, D]
        key_ptr, value_ptr,  # [KVH, S, D]
        block_table_ptr,  # [B, max_blocks] int32
        query_start_ptr,  # [B+1] int32
        seq_lens_ptr,  # [B] int32
        tile_seq_ptr, tile_first_ptr,  # [num_tiles] int32: the tile's sequence and its first query
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kh, stride_ks, stride_vh, stride_vs, stride_bt,
        scale, window,  # window: 0 on full-attention layers
        GROUP: tl.constexpr,  # query heads per key/value head
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,  # positions per cache block
        GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
        BLOCK_Q: tl.constexpr,  # query tokens per program: BLOCK_Q * GROUP_PAD rows
        BLOCK_N: tl.constexpr,  # key positions per iteration
        DIM_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two
        SLIDING: tl.constexpr,
        DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs; "tf32" for bf16/fp16 (exact for them)
    ):
        """One program per (query tile, key/value head): online softmax over the tile's keys."""
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq = tl.load(tile_seq_ptr + tile)
        first = tl.load(tile_first_ptr + tile)
        q_start = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_start
        context = tl.load(seq_lens_ptr + seq) - q_len  # positions held before this step

        rows = tl.arange(0, BLOCK_Q * GROUP_PAD)  # [M] row = query token x head of this KV head
        q_index = first + rows // GROUP_PAD  # [M] query within the sequence
        head = kv_head * GROUP + rows % GROUP_PAD  # [M]
        row_ok = (q_index < q_len) & (rows % GROUP_PAD < GROUP)  # [M]
        q_pos = context + q_index  # [M]
        dims = tl.arange(0, DIM_PAD)  # [DIM_PAD]
        dim_ok = dims < HEAD_DIM

        q_rows = (q_start + q_index).to(tl.int64)
        q = tl.load(query_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)  # [M, DIM_PAD]

        # Keys from the lowest any row of the tile sees to the highest query position.
        last_q = tl.minimum(first + BLOCK_Q, q_len) - 1
        hi = context + last_q
        lo = 0
        if SLIDING:
            lo = tl.maximum(context + first - window + 1, 0)
        lo_aligned = (lo // BLOCK_N) * BLOCK_N

        m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)  # [M] running max
        l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)  # [M] running sum
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, DIM_PAD], tl.float32)  # [M, DIM_PAD]
        for start in range(lo_aligned, hi + 1, BLOCK_N):
            k_pos = start + tl.arange(0, BLOCK_N)  # [N]
            col_ok = (k_pos >= lo) & (k_pos <= hi)
            block = tl.load(block_table_ptr + seq.to(tl.int64) * stride_bt + k_pos // BLOCK_SIZE,
                            mask=col_ok, other=-1)  # [N]
            col_ok = col_ok & (block >= 0)
            slot = block.to(tl.int64) * BLOCK_SIZE + k_pos % BLOCK_SIZE  # [N]
            kv_mask = col_ok[:, None] & dim_ok[None, :]
            k = tl.load(key_ptr + kv_head.to(tl.int64) * stride_kh + slot[:, None] * stride_ks + dims[None, :],
                        mask=kv_mask, other=0.0).to(tl.float32)  # [N, DIM_PAD]
            v = tl.load(value_ptr + kv_head.to(tl.int64) * stride_vh + slot[:, None] * stride_vs + dims[None, :],
                        mask=kv_mask, other=0.0).to(tl.float32)  # [N, DIM_PAD]
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [M, N]
            visible = col_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])  # [M, N]
            if SLIDING:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # [M]
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
            p = tl.exp(scores - m_safe[:, None])  # [M, N]
            alpha = tl.exp(m_i - m_safe)  # [M]
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)  # [M, DIM_PAD]
            m_i = m_new

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # [M, DIM_PAD]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def block_q_for(query_lens: list[int], heads: int, kv_heads: int) -> int:
    """Query tokens per program: 16 rows when every sequence feeds a few tokens (decoding,
    short drafts), 64 rows once some sequence feeds more (prefill chunks)."""
    group_pad = _next_power_of_2(heads // kv_heads)
    rows = BLOCK_M_PREFILL if max(query_lens, default=0) * group_pad > BLOCK_M_DECODE else BLOCK_M_DECODE
    return max(1, rows // group_pad)


def query_tiles(query_lens: list[int], block_q: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's grid, built on the host: (tile_seq, tile_first), int32 [num_tiles] each."""
    seqs, firsts = [], []
    for b, length in enumerate(query_lens):
        for first in range(0, length, block_q):
            seqs.append(b)
            firsts.append(first)
    tiles = torch.tensor([seqs, firsts], dtype=torch.int32).to(device)  # one transfer
    return tiles[0], tiles[1]


def _kernels_interpreted() -> bool:
    """True when Triton's interpreter runs the kernel on CPU tensors (TRITON_INTERPRET=1 was set
    before triton was first imported)."""
    return HAVE_TRITON and type(_ragged_paged_attention_kernel).__name__ == "InterpretedFunction"


def ragged_paged_attention_triton(query, key_pool, value_pool, block_table, query_start_loc, seq_lens,
                                  *, block_size: int, scale: float, window: int | None = None,
                                  tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
                                  block_q: int | None = None, out: torch.Tensor | None = None):
    """The same attention in one Triton launch. ``tiles`` / ``block_q`` come from
    :func:`query_tiles` / :func:`block_q_for` (computed here, with a host sync, when omitted);
    ``out`` [T, H, D] may be given to write into (e.g. a transposed view of the caller's buffer)."""
    if not HAVE_TRITON:
        raise RuntimeError("ragged_paged_attention_triton needs the 'triton' package; "
                           "use the reference (the engine's per-sequence loop)")
    T, H, D, KVH, B = _check_inputs(query, key_pool, value_pool, block_table, query_start_loc, seq_lens,
                                    block_size)
    device = query.device
    if device.type == "cpu" and not _kernels_interpreted():
        raise ValueError("ragged_paged_attention_triton got CPU tensors but Triton's interpreter is not "
                         "active; use CUDA tensors or set TRITON_INTERPRET=1 before importing triton")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"ragged_paged_attention_triton supports CUDA tensors only, got {device}")
    for name, t in (("query", query), ("key_pool", key_pool), ("value_pool", value_pool)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along the head dimension")
    if out is None:
        out = torch.empty(T, H, D, dtype=query.dtype, device=device)
    elif tuple(out.shape) != (T, H, D) or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [{T}, {H}, {D}] {query.dtype} with unit stride along D")
    if T == 0 or B == 0:
        return out
    if block_q is None:
        lens = query_start_loc.diff().tolist()
        block_q = block_q_for(lens, H, KVH)
    if tiles is None:
        tiles = query_tiles(query_start_loc.diff().tolist(), block_q, device)
    tile_seq, tile_first = tiles
    group = H // KVH
    group_pad = _next_power_of_2(group)
    count_launch("paged_attention")
    with torch.cuda.device(device) if query.is_cuda else contextlib.nullcontext():
        _ragged_paged_attention_kernel[(tile_seq.shape[0], KVH)](
            out, query, key_pool, value_pool, block_table, query_start_loc, seq_lens, tile_seq, tile_first,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            key_pool.stride(0), key_pool.stride(1), value_pool.stride(0), value_pool.stride(1),
            block_table.stride(0), float(scale), int(window or 0),
            GROUP=group, HEAD_DIM=D, BLOCK_SIZE=block_size, GROUP_PAD=group_pad, BLOCK_Q=block_q,
            BLOCK_N=BLOCK_N, DIM_PAD=_next_power_of_2(max(D, 16)), SLIDING=window is not None,
            DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
            # Untuned (no GPU has run it yet): more warps for the larger register tiles.
            num_warps=8 if block_q * group_pad * _next_power_of_2(max(D, 16)) >= 16384 else 4)
    return out
