"""Rejection sampling for speculative decoding with drafts that come from text.

A draft source that copies text (a caller's prediction, prompt lookup) proposes each token with
certainty: its draft distribution q is a point mass on the draft token x. The rule of speculative
sampling (accept with probability min(1, p(x) / q(x)), else sample from the residual
max(0, p - q) renormalised) then reads:

* **accept** draft token x at position j when ``u[j] < p_j(x)`` (u uniform in [0, 1));
* at the first rejection, emit a **recovered** token drawn from p_j with x removed,
  renormalised;
* when all drafts are accepted, emit a **bonus** token drawn from p_K, the row after the last
  draft.

The emitted tokens are then distributed exactly as if the target had sampled them one by one.

Draws use precomputed noise, so the kernel and the reference give identical tokens for identical
inputs: a token is drawn from weights w as ``argmax_i w_i / e_i`` with ``e_i ~ Exp(1)``
(the exponential race: the smallest of independent Exp(w_i) variables ``e_i / w_i`` is at index
i with probability ``w_i / sum(w)``). Division is IEEE round-to-nearest in both.

Batched layout (B requests, padded to the longest draft K, vocabulary V):

* ``target_probs`` float32 [B, K+1, V]  the target's distributions after temperature, top-k and
  top-p, each row summing to 1. Rows ``j > num_draft[b]`` are padding, never read.
* ``draft_tokens`` int     [B, K]       valid for ``j < num_draft[b]``, padded with -1.
* ``num_draft``    int     [B]          ``0 <= num_draft[b] <= K``.
* ``uniform``      float32 [B, K]       U[0, 1) draws for the acceptance tests.
* ``exp_noise``    float32 [B, V]       Exp(1) draws for the one sampled token per request.

Returned:

* ``num_accepted``  int64 [B]
* ``output_tokens`` int64 [B, K+1]  ``draft[b, :n]``, then the recovered or bonus token, then -1.
* ``invalid_row``   int64 [B]       -1, or the index of a row that was not a distribution (a NaN,
  an infinity, a negative entry, or no mass at all; also a rejection whose residual has no mass).
  Such a row fails safe: its draft token is rejected, nothing is sampled from it, so the request
  gains only ``draft[b, :n]`` with ``output_tokens[b, n] == -1``. Callers must report it.

Entry points: :func:`rejection_sample_reference` (pure torch; the CPU path and the test oracle),
:func:`rejection_sample_triton` (two Triton kernels), :func:`rejection_sample` (dispatch).
"""

from __future__ import annotations

import contextlib

import torch

try:  # Triton is optional: the package (and its CPU path) must import without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

__all__ = ["rejection_sample", "rejection_sample_reference", "rejection_sample_triton"]

HAVE_TRITON = triton is not None

_INT_DTYPES = (torch.int32, torch.int64)
DEFAULT_BLOCK_V = 1024  # vocabulary tile (a power of two)
DEFAULT_BLOCK_K = 64  # draft-position tile (a power of two)


def _check_inputs(target_probs, draft_tokens, num_draft, uniform, exp_noise) -> tuple[int, int, int]:
    """Validate shapes, dtypes and devices; return (B, K, V). Raises ValueError."""
    tensors = (("target_probs", target_probs), ("draft_tokens", draft_tokens),
               ("num_draft", num_draft), ("uniform", uniform), ("exp_noise", exp_noise))
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if target_probs.dim() != 3 or target_probs.shape[1] < 1 or target_probs.shape[2] < 1:
        raise ValueError(f"target_probs must be [B, K+1, V] with K+1 >= 1 and V >= 1, "
                         f"got shape {tuple(target_probs.shape)}")
    B, K1, V = target_probs.shape
    K = K1 - 1
    expected = {"draft_tokens": (B, K), "num_draft": (B,), "uniform": (B, K), "exp_noise": (B, V)}
    for name, t in tensors[1:]:
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"{name} must have shape {list(expected[name])} to match target_probs "
                             f"{tuple(target_probs.shape)}, got {tuple(t.shape)}")
        if t.device != target_probs.device:
            raise ValueError(f"{name} is on {t.device}, target_probs on {target_probs.device}")
    for name, t in (("target_probs", target_probs), ("uniform", uniform), ("exp_noise", exp_noise)):
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")
    for name, t in (("draft_tokens", draft_tokens), ("num_draft", num_draft)):
        if t.dtype not in _INT_DTYPES:
            raise ValueError(f"{name} must be int64 or int32, got {t.dtype}")
    return B, K, V


# --------------------------------------------------------------------------- #
# Reference (pure torch)
# --------------------------------------------------------------------------- #


def _race(weights: torch.Tensor, exp_noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exponential race over non-negative weights [B, V]: (token [B], found [B])."""
    score = torch.where(weights > 0, weights / exp_noise, torch.full_like(weights, -1.0))  # [B, V]
    token = score.argmax(dim=1)  # [B], first index on ties
    found = score.gather(1, token.unsqueeze(1)).squeeze(1) >= 0  # [B] False: no mass at all
    return token, found


def rejection_sample_reference(target_probs, draft_tokens, num_draft, uniform, exp_noise):
    """Rejection sampling in plain torch (CPU or CUDA). See the module docstring.

    Returns ``(num_accepted [B], output_tokens [B, K+1], invalid_row [B])``, all int64.
    Raises ValueError on bad shapes/dtypes/devices or a ``num_draft`` outside ``[0, K]``.
    """
    B, K, V = _check_inputs(target_probs, draft_tokens, num_draft, uniform, exp_noise)
    device = target_probs.device
    n = num_draft.to(torch.int64)  # [B]
    if B > 0 and bool(((n < 0) | (n > K)).any()):
        raise ValueError(f"num_draft values must lie in [0, K] = [0, {K}], got {n.tolist()}")
    pos = torch.arange(K + 1, device=device)  # [K+1]
    probs = target_probs

    # A row is a distribution when it is finite, non-negative and has some mass: its minimum is
    # >= 0 (a NaN makes it NaN) and its sum is finite and > 0. Two passes over the rows, which
    # matter on a CPU. Padding rows get a verdict too, but only rows j <= num_draft are used.
    row_sum = probs.sum(dim=2)  # [B, K+1]
    row_ok = (probs.amin(dim=2) >= 0) & torch.isfinite(row_sum) & (row_sum > 0)  # [B, K+1]

    draft = draft_tokens.to(torch.int64)  # [B, K]
    in_vocab = (draft >= 0) & (draft < V)
    p_draft = probs[:, :K, :].gather(2, draft.clamp(0, V - 1).unsqueeze(2)).squeeze(2)  # [B, K]
    p_draft = torch.where(in_vocab, p_draft, torch.zeros_like(p_draft))
    accept = row_ok[:, :K] & (uniform < p_draft) & (pos[:K].unsqueeze(0) < n.unsqueeze(1))  # [B, K]
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]

    # The row to sample from: the rejection's residual (the draft token removed) or the bonus.
    stop = num_accepted  # [B]
    stop_row = probs.gather(1, stop.view(B, 1, 1).expand(B, 1, V)).squeeze(1)  # [B, V]
    draft_ext = torch.cat([draft, draft.new_full((B, 1), -1)], dim=1)  # [B, K+1]
    excluded = draft_ext.gather(1, stop.unsqueeze(1)).squeeze(1)  # [B]
    excluded = torch.where(stop < n, excluded, torch.full_like(excluded, -1))  # bonus: none
    vocab = torch.arange(V, device=device)
    weights = torch.where(vocab.unsqueeze(0) == excluded.unsqueeze(1), torch.zeros_like(stop_row), stop_row)
    token, found = _race(weights, exp_noise)
    stop_ok = row_ok.gather(1, stop.unsqueeze(1)).squeeze(1) & found  # [B]
    invalid_row = torch.where(stop_ok, torch.full_like(stop, -1), stop)

    sampled = torch.where(stop_ok, token, torch.full_like(token, -1)).unsqueeze(1)  # [B, 1]
    na = num_accepted.unsqueeze(1)
    output_tokens = torch.where(pos < na, draft_ext,
                                torch.where(pos == na, sampled, torch.full_like(draft_ext, -1)))
    return num_accepted, output_tokens, invalid_row


# --------------------------------------------------------------------------- #
# Triton kernels
# --------------------------------------------------------------------------- #

if HAVE_TRITON:

    @triton.jit
    def _row_check_kernel(
        probs_ptr,  # [B, K+1, V] fp32, unit stride along V
        num_draft_ptr,  # [B] int32/int64
        row_ok_ptr,  # [B, K+1] int32, written for rows j <= num_draft[b] only
        stride_pb, stride_pj,  # probs strides along B and K+1 (elements)
        K, V,
        BLOCK_V: tl.constexpr,
    ):
        """row_ok[b, j] = row j is finite, non-negative and has mass."""
        b = tl.program_id(0)
        j = tl.program_id(1)
        n = tl.minimum(tl.maximum(tl.load(num_draft_ptr + b).to(tl.int32), 0), K)
        if j > n:  # padding row: never read it
            return
        row_ptr = probs_ptr + b.to(tl.int64) * stride_pb + j.to(tl.int64) * stride_pj
        lanes = tl.arange(0, BLOCK_V)
        bad = tl.zeros([BLOCK_V], tl.int32)  # [BLOCK_V] lane saw a NaN, inf or negative
        mass = tl.zeros([BLOCK_V], tl.int32)  # [BLOCK_V] lane saw a positive entry
        for start in range(0, V, BLOCK_V):
            offs = start + lanes
            p = tl.load(row_ptr + offs, mask=offs < V, other=0.0)
            finite = (p == p) & (p != float("inf"))
            bad = tl.maximum(bad, tl.where(finite & (p >= 0), 0, 1))
            mass = tl.maximum(mass, tl.where(p > 0, 1, 0))
        ok = (tl.max(bad, axis=0) == 0) & (tl.max(mass, axis=0) > 0)
        tl.store(row_ok_ptr + b.to(tl.int64) * (K + 1) + j, ok.to(tl.int32))

    @triton.jit
    def _accept_and_sample_kernel(
        probs_ptr,  # [B, K+1, V] fp32, unit stride along V
        draft_ptr,  # [B, K] int32/int64, contiguous
        num_draft_ptr,  # [B] int32/int64
        uniform_ptr,  # [B, K] fp32, contiguous
        noise_ptr,  # [B, V] fp32, contiguous
        row_ok_ptr,  # [B, K+1] int32 from _row_check_kernel
        num_accepted_ptr,  # [B] int64
        output_ptr,  # [B, K+1] int64, contiguous
        invalid_row_ptr,  # [B] int64
        stride_pb, stride_pj,
        K, V,
        BLOCK_K: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        """One program per request: the accepted prefix, then one exponential race."""
        b = tl.program_id(0).to(tl.int64)
        n = tl.minimum(tl.maximum(tl.load(num_draft_ptr + b).to(tl.int32), 0), K)
        probs_b = probs_ptr + b * stride_pb
        draft_row = draft_ptr + b * K
        ok_row = row_ok_ptr + b * (K + 1)
        lanes_k = tl.arange(0, BLOCK_K)

        # num_accepted = the first position < n whose test fails, else n.
        first = n
        for start in range(0, K, BLOCK_K):
            offs = start + lanes_k  # [BLOCK_K]
            in_draft = offs < n
            x = tl.load(draft_row + offs, mask=in_draft, other=-1).to(tl.int64)
            in_vocab = in_draft & (x >= 0) & (x < V)
            p_x = tl.load(probs_b + offs.to(tl.int64) * stride_pj + x, mask=in_vocab, other=0.0)
            u = tl.load(uniform_ptr + b * K + offs, mask=in_draft, other=1.0)
            ok = tl.load(ok_row + offs, mask=in_draft, other=0)
            fails = in_draft & ((ok == 0) | ~(u < p_x))
            first = tl.minimum(first, tl.min(tl.where(fails, offs, n), axis=0))
        tl.store(num_accepted_ptr + b, first.to(tl.int64))

        # Sample from row `first`: the residual with the draft token removed, or the bonus row.
        excluded = tl.load(draft_row + first, mask=first < n, other=-1).to(tl.int64)
        stop_ok = tl.load(ok_row + first) != 0
        stop_row = probs_b + first.to(tl.int64) * stride_pj
        lanes_v = tl.arange(0, BLOCK_V)
        best = tl.full([BLOCK_V], -1.0, tl.float32)  # [BLOCK_V] per-lane best score
        best_idx = lanes_v.to(tl.int64)  # [BLOCK_V] its first index
        for start in range(0, V, BLOCK_V):
            offs = start + lanes_v
            valid = offs < V
            w = tl.load(stop_row + offs, mask=valid, other=0.0)
            e = tl.load(noise_ptr + b * V + offs, mask=valid, other=1.0)
            w = tl.where(offs == excluded, 0.0, w)
            score = tl.where(w > 0, tl.math.div_rn(w, e), -1.0)
            better = score > best  # strictly: each lane keeps its first index of its maximum
            best = tl.where(better, score, best)
            best_idx = tl.where(better, offs.to(tl.int64), best_idx)
        top = tl.max(best, axis=0)
        token = tl.min(tl.where(best == top, best_idx, 2147483647), axis=0)
        stop_ok = stop_ok & (top >= 0)
        tl.store(invalid_row_ptr + b, tl.where(stop_ok, -1, first).to(tl.int64))

        out_row = output_ptr + b * (K + 1)
        sampled = tl.where(stop_ok, token, -1)
        for start in range(0, K + 1, BLOCK_K):
            offs = start + lanes_k
            d = tl.load(draft_row + offs, mask=offs < first, other=-1).to(tl.int64)
            out = tl.where(offs < first, d, tl.where(offs == first, sampled, -1))
            tl.store(out_row + offs, out, mask=offs < K + 1)


def _kernels_interpreted() -> bool:
    """True when Triton's interpreter runs the kernels on CPU tensors (TRITON_INTERPRET=1 was
    set before triton was first imported)."""
    return HAVE_TRITON and type(_row_check_kernel).__name__ == "InterpretedFunction"


def rejection_sample_triton(target_probs, draft_tokens, num_draft, uniform, exp_noise, *,
                            block_v: int = DEFAULT_BLOCK_V, block_k: int = DEFAULT_BLOCK_K):
    """Rejection sampling with Triton kernels; same contract as the reference.

    Tensors must be on CUDA, or on CPU under Triton's interpreter. ``num_draft`` is not
    range-checked (that would synchronise the device); the kernels clamp it to ``[0, K]``.
    """
    if not HAVE_TRITON:
        raise RuntimeError("rejection_sample_triton needs the 'triton' package; "
                           "use rejection_sample (falls back to the torch reference)")
    B, K, V = _check_inputs(target_probs, draft_tokens, num_draft, uniform, exp_noise)
    for name, blk in (("block_v", block_v), ("block_k", block_k)):
        if not isinstance(blk, int) or blk < 1 or blk & (blk - 1):
            raise ValueError(f"{name} must be a positive power of two, got {blk!r}")
    device = target_probs.device
    if device.type == "cpu" and not _kernels_interpreted():
        raise ValueError("rejection_sample_triton got CPU tensors but Triton's interpreter is not "
                         "active; use CUDA tensors or set TRITON_INTERPRET=1 before importing triton")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"rejection_sample_triton supports CUDA tensors only, got {device}")

    num_accepted = torch.empty(B, dtype=torch.int64, device=device)
    output_tokens = torch.empty(B, K + 1, dtype=torch.int64, device=device)
    invalid_row = torch.empty(B, dtype=torch.int64, device=device)
    if B == 0:
        return num_accepted, output_tokens, invalid_row
    if target_probs.stride(2) != 1:
        target_probs = target_probs.contiguous()
    draft_tokens, num_draft = draft_tokens.contiguous(), num_draft.contiguous()
    uniform, exp_noise = uniform.contiguous(), exp_noise.contiguous()
    row_ok = torch.empty(B, K + 1, dtype=torch.int32, device=device)

    with torch.cuda.device(device) if target_probs.is_cuda else contextlib.nullcontext():
        _row_check_kernel[(B, K + 1)](
            target_probs, num_draft, row_ok, target_probs.stride(0), target_probs.stride(1),
            K, V, BLOCK_V=block_v)
        _accept_and_sample_kernel[(B,)](
            target_probs, draft_tokens, num_draft, uniform, exp_noise, row_ok,
            num_accepted, output_tokens, invalid_row,
            target_probs.stride(0), target_probs.stride(1), K, V,
            BLOCK_K=block_k, BLOCK_V=block_v)
    return num_accepted, output_tokens, invalid_row


# --------------------------------------------------------------------------- #
# Dispatch
# --------------------------------------------------------------------------- #


def rejection_sample(target_probs, draft_tokens, num_draft, uniform, exp_noise):
    """The Triton kernel for CUDA tensors when Triton is available, else the reference."""
    if target_probs.is_cuda and HAVE_TRITON:
        return rejection_sample_triton(target_probs, draft_tokens, num_draft, uniform, exp_noise)
    return rejection_sample_reference(target_probs, draft_tokens, num_draft, uniform, exp_noise)
