"""Row-invariant attention over a paged KV pool on the CPU: a native loop (``row_attention.cpp``,
built by ``cpu_native``) with a pure-torch reference.

Why: the batch-invariant attention as torch operations (``proxy/engine/invariant_attention.py``)
cost ~330 us a layer for one decoding row of the embedded model (a gather, pads, two batched
products, masks, per-chunk sums: mostly per-operation overhead), a sixth of a plain int8 step on
a 2-core CPU; with this loop the attention takes ~110 us a layer, Python included
(``benchmarks/step_parts.py --torch-attention`` beside the default, docs/benchmarks.md). Each
(head, query row) reads only its own visible keys, in slot order, with a fixed summation order,
so a row's bits do not depend on the pass it is in. Where the loop cannot be built,
``native_row_attention()`` returns None and the engine keeps the torch operations.
"""

from __future__ import annotations

import torch

from foretell.kernels.cpu_native import load_native

HEAD_SIZE_STEP = 16  # the loop takes head sizes in whole vectors of 16 floats


def native_module():
    """The compiled loop, or None where it cannot be built."""
    return load_native("row_attention")


def native_row_attention():
    """The launcher if the extension is available, else None."""
    return row_attention if native_module() is not None else None


def row_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                  visible: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """query [heads, q, d]; keys, values [kv_heads, pool slots, d] (the whole pool of one layer);
    slots [n] the pool slots of the keys in position order; visible [q, n] bool.
    Returns out [q, heads, d] (written in place when given). float32 on the CPU."""
    heads, rows, d = query.shape
    kv_heads, _, kd = keys.shape
    n = slots.shape[0]
    assert keys.shape == values.shape and kd == d, f"keys {tuple(keys.shape)}, values {tuple(values.shape)}, d {d}"
    assert heads % kv_heads == 0, f"{heads} heads over {kv_heads} KV heads"
    assert visible.shape == (rows, n) and visible.dtype == torch.bool, f"visible {tuple(visible.shape)}"
    assert d % HEAD_SIZE_STEP == 0, f"head size {d} is not a multiple of {HEAD_SIZE_STEP}"
    assert query.dtype == keys.dtype == values.dtype == torch.float32, "float32 only"
    assert all(t.stride(-1) == 1 for t in (query, keys, values, visible)), "last dimensions must be contiguous"
    if out is None:
        out = query.new_empty(rows, heads, d)
    assert out.shape == (rows, heads, d) and out.stride(-1) == 1 and out.dtype == torch.float32
    native_module().row_attention(query, keys, values, slots.to(torch.int64).contiguous(), visible, float(scale), out)
    return out


def row_attention_reference(query, keys, values, slots, visible, scale) -> torch.Tensor:
    """The same attention in float64 torch operations: softmax over each row's visible keys."""
    heads = query.shape[0]
    k = keys.index_select(1, slots).double()  # [kv, n, d]
    v = values.index_select(1, slots).double()
    group = heads // keys.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)  # [heads, n, d]
    scores = torch.bmm(query.double() * scale, k.transpose(1, 2)).masked_fill(~visible, float("-inf"))
    return torch.bmm(torch.softmax(scores, dim=-1), v).transpose(0, 1)  # [q, heads, d]
