"""Rejection sampling for speculative decoding with drafts that come from text.

A draft source that copies text (a caller's prediction, prompt lookup) proposes each token with
certainty: its draft distribution q is a point mass on the draft token x. The rule of speculative
sampling (accept with probability min(1, p(x) / q(x)), else sample from the residual
max(0, p - q) renormalised) then reads:

* **accept** draft token x at position j when ``u[j] < p_j(x)`` (u uniform in [0, 1));
* at the first rejection, emit a **recovered** token drawn from p_j with x removed,
  renormalised;
* when all ``k`` drafts are accepted, emit a **bonus** token drawn from p_k, the row after the
  last draft.

The emitted tokens are then distributed exactly as if the target had sampled them one by one.

A draft model proposes from a distribution of its own: with ``draft_probs`` (q, one row per draft
token, the distribution its token was drawn from) the rule is the general one: accept x at j when
``u[j] * q_j(x) < p_j(x)`` (u < p/q without a division), and at the first rejection draw the
recovered token from ``max(0, p_j - q_j)`` renormalised (x itself can come back where p_j(x) >
q_j(x)); the bonus is still drawn from p_k. A one-hot q gives exactly the point-mass path.

Draws use precomputed noise, so the kernel and the reference give identical tokens for identical
inputs: a token is drawn from weights w as ``argmax_i w_i / e_i`` with ``e_i ~ Exp(1)``
(the exponential race: the smallest of independent Exp(w_i) variables ``e_i / w_i`` is at index
i with probability ``w_i / sum(w)``). Division is IEEE round-to-nearest in both.

Flat batched layout (vLLM's): B sequences, sequence b has ``k_b >= 0`` drafts, vocabulary V.

* ``cu_num_draft_tokens`` int     [B]        the inclusive cumulative sum of ``k_b``:
  ``k_b = cu[b] - cu[b-1]`` with ``cu[-1] = 0``. ``N = cu[B-1]`` (0 when B == 0).
* ``draft_tokens``        int     [N]        sequence b's drafts at ``[cu[b-1], cu[b])``.
* ``target_probs``        float32 [N + B, V] the target's distributions after temperature, top-k
  and top-p, each row summing to 1. Sequence b owns the ``k_b + 1`` rows
  ``[row_start_b, row_start_b + k_b + 1)`` with ``row_start_b = cu[b-1] + b``; its row j is the
  distribution after its j-th draft token (row 0: after the last accepted token). No padding.
* ``uniform``             float32 [N]        U[0, 1) draws for the acceptance tests, one per draft
  token (aligned with ``draft_tokens``).
* ``exp_noise``           float32 [B, V]     Exp(1) draws for the one sampled token per sequence.
* ``draft_probs``         float32 [N, V]     optional: the draft distribution each draft token was
  drawn from (aligned with ``draft_tokens``); None: point masses (drafts copied from text).

Returned (int64):

* ``num_accepted``  [B]
* ``output_tokens`` [N + B]  flat like the rows: at sequence b's rows, ``draft[:n]``, then the
  recovered or bonus token at row ``row_start_b + n``, then -1 to the end of its rows.
* ``invalid_row``   [B]      -1, or the index j within the sequence of a row that was not a
  distribution (a NaN, an infinity, a negative entry, or no mass at all; also a rejection whose
  residual has no mass; with ``draft_probs``, a q row that is not a distribution or gives its
  draft token no mass). Such a row fails safe: its draft token is rejected, nothing is sampled
  from it, so the sequence gains only ``draft[:n]`` and its row n holds -1. Callers must report it.

Entry points: :func:`rejection_sample_reference` (pure torch; the CPU path and the test oracle),
:func:`rejection_sample_triton` (two Triton kernels: a check per row, then an accept-and-sample
pass per sequence), :func:`rejection_sample` (dispatch).
"""

from __future__ import annotations

import contextlib

import torch

from foretell.kernels.flat_layout import check_cu_values, check_flat, sequence_span
from foretell.kernels.launches import count_launch

try:  # Triton is optional: the package (and its CPU path) must import without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

__all__ = ["rejection_sample", "rejection_sample_reference", "rejection_sample_triton"]

HAVE_TRITON = triton is not None

DEFAULT_BLOCK_V = 1024  # vocabulary tile (a power of two)
DEFAULT_BLOCK_K = 64  # draft-position tile (a power of two)


def _check_inputs(target_probs, draft_tokens, cu_num_draft_tokens, uniform, exp_noise,
                  draft_probs=None) -> tuple[int, int, int]:
    """Validate without reading values (no sync); return (B, N, V). Raises ValueError."""
    B, N, V = check_flat("target_probs", target_probs, draft_tokens, cu_num_draft_tokens)
    given = [("uniform", uniform, (N,)), ("exp_noise", exp_noise, (B, V))]
    if draft_probs is not None:
        given.append(("draft_probs", draft_probs, (N, V)))
    for name, t, want in given:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must have shape {list(want)} (N = draft_tokens.shape[0], "
                             f"B = cu_num_draft_tokens.shape[0], V = target_probs.shape[1]), "
                             f"got {tuple(t.shape)}")
        if t.device != target_probs.device:
            raise ValueError(f"{name} is on {t.device}, target_probs on {target_probs.device}: "
                             "all inputs must be on the same device")
    for name, t, _ in [("target_probs", target_probs, None)] + given:
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")
    return B, N, V


# --------------------------------------------------------------------------- #
# Reference (pure torch)
# --------------------------------------------------------------------------- #


def _race(weights: torch.Tensor, exp_noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exponential race over non-negative weights [B, V]: (token [B], found [B])."""
    score = torch.where(weights > 0, weights / exp_noise, torch.full_like(weights, -1.0))  # [B, V]
    token = score.argmax(dim=1)  # [B], first index on ties
    found = score.gather(1, token.unsqueeze(1)).squeeze(1) >= 0  # [B] False: no mass at all
    return token, found


def _rows_ok(probs: torch.Tensor) -> torch.Tensor:
    """[rows] bool: the row is a distribution, finite, non-negative and with some mass (its
    minimum is >= 0, which a NaN fails, and its sum finite and > 0; two passes over the rows)."""
    row_sum = probs.sum(dim=1)
    return (probs.amin(dim=1) >= 0) & torch.isfinite(row_sum) & (row_sum > 0)


def rejection_sample_reference(target_probs, draft_tokens, cu_num_draft_tokens, uniform, exp_noise,
                               draft_probs=None):
    """Rejection sampling in plain torch (CPU or CUDA). See the module docstring.

    Returns ``(num_accepted [B], output_tokens [N + B], invalid_row [B])``, all int64.
    Raises ValueError on bad types/shapes/dtypes/devices, or a ``cu_num_draft_tokens`` that is
    negative, decreasing or does not end at ``N`` (that check synchronises on CUDA).
    """
    B, N, V = _check_inputs(target_probs, draft_tokens, cu_num_draft_tokens, uniform, exp_noise, draft_probs)
    check_cu_values(cu_num_draft_tokens, N)
    device = target_probs.device
    num_rows = N + B
    if B == 0:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, empty.clone(), empty.clone()
    probs = target_probs

    cu = cu_num_draft_tokens.to(torch.int64)  # [B]
    draft_start = torch.cat([cu.new_zeros(1), cu[:-1]])  # [B] cu[b-1]
    k = cu - draft_start  # [B]
    seqs = torch.arange(B, device=device)  # [B]
    row_start = draft_start + seqs  # [B]

    row_ok = _rows_ok(probs)  # [N + B]

    # Draft token i of sequence s is position j = i - cu[s-1], judged by row row_start[s] + j = i + s.
    draft = draft_tokens.to(torch.int64)  # [N]
    idx = torch.arange(N, device=device)  # [N]
    seq_of_draft = torch.repeat_interleave(seqs, k, output_size=N)  # [N]
    pos_of_draft = idx - draft_start[seq_of_draft]  # [N]
    draft_row = idx + seq_of_draft  # [N]
    in_vocab = (draft >= 0) & (draft < V)
    p_draft = probs[draft_row, draft.clamp(0, V - 1)]  # [N]
    p_draft = torch.where(in_vocab, p_draft, torch.zeros_like(p_draft))
    if draft_probs is None:  # point masses: q(x) = 1
        passes = row_ok[draft_row] & (uniform < p_draft)  # [N]
    else:
        q_draft = torch.where(in_vocab, draft_probs[idx, draft.clamp(0, V - 1)], torch.zeros_like(p_draft))  # [N]
        q_ok = _rows_ok(draft_probs) & (q_draft > 0)  # [N] a draw from q has mass under q
        passes = row_ok[draft_row] & q_ok & (uniform * q_draft < p_draft)  # [N]
    # num_accepted[s] = the first position of s whose test fails, else k[s].
    num_accepted = k.scatter_reduce(
        0, seq_of_draft, torch.where(passes, k[seq_of_draft], pos_of_draft), reduce="amin")  # [B]

    # The row to sample from: the rejection's residual (the draft token removed, or p - q) or
    # the bonus.
    stop_row = row_start + num_accepted  # [B]
    rejected = num_accepted < k  # [B]
    draft_ext = torch.cat([draft, draft.new_full((1,), -1)])  # [N + 1]
    stop_probs = probs[stop_row]  # [B, V]
    stop_ok = row_ok[stop_row]  # [B]
    if draft_probs is None:
        excluded = torch.where(rejected, draft_ext[draft_start + num_accepted], torch.full_like(k, -1))  # [B]
        vocab = torch.arange(V, device=device)
        weights = torch.where(vocab.unsqueeze(0) == excluded.unsqueeze(1), torch.zeros_like(stop_probs),
                              stop_probs)  # [B, V]
    elif N == 0:  # no drafts: every row is a bonus
        weights = stop_probs
    else:
        q_at = (draft_start + num_accepted).clamp(max=N - 1)  # [B] the rejected draft's q row
        weights = torch.where(rejected.unsqueeze(1), (stop_probs - draft_probs[q_at]).clamp(min=0),
                              stop_probs)  # [B, V]
        stop_ok = stop_ok & (~rejected | q_ok[q_at])
    token, found = _race(weights, exp_noise)
    stop_ok = stop_ok & found  # [B]
    invalid_row = torch.where(stop_ok, torch.full_like(num_accepted, -1), num_accepted)
    sampled = torch.where(stop_ok, token, torch.full_like(token, -1))  # [B]

    # Row r of sequence s is position p = r - row_start[s]; its draft (p < k[s]) is draft[r - s].
    rows = torch.arange(num_rows, device=device)  # [N + B]
    seq_of_row = torch.repeat_interleave(seqs, k + 1, output_size=num_rows)  # [N + B]
    pos = rows - row_start[seq_of_row]  # [N + B]
    na = num_accepted[seq_of_row]  # [N + B]
    from_draft = draft_ext[rows - seq_of_row]  # [N + B]
    output_tokens = torch.where(pos < na, from_draft,
                                torch.where(pos == na, sampled[seq_of_row], torch.full_like(from_draft, -1)))
    return num_accepted, output_tokens, invalid_row


# --------------------------------------------------------------------------- #
# Triton kernels
# --------------------------------------------------------------------------- #

if HAVE_TRITON:

    @triton.jit
    def _row_check_kernel(
        probs_ptr,  # [N + B, V] fp32, unit stride along V
        row_ok_ptr,  # [N + B] int32
        stride_pr,  # probs stride along rows (elements)
        V,
        BLOCK_V: tl.constexpr,
    ):
        """row_ok[r] = row r is finite, non-negative and has mass. One program per row."""
        r = tl.program_id(0)
        row_ptr = probs_ptr + r.to(tl.int64) * stride_pr
        lanes = tl.arange(0, BLOCK_V)  # [BLOCK_V]
        bad = tl.zeros([BLOCK_V], tl.int32)  # [BLOCK_V] lane saw a NaN, inf or negative
        mass = tl.zeros([BLOCK_V], tl.int32)  # [BLOCK_V] lane saw a positive entry
        for start in range(0, V, BLOCK_V):
            offs = start + lanes  # [BLOCK_V]
            p = tl.load(row_ptr + offs, mask=offs < V, other=0.0)  # [BLOCK_V]
            finite = (p == p) & (p != float("inf"))
            bad = tl.maximum(bad, tl.where(finite & (p >= 0), 0, 1))
            mass = tl.maximum(mass, tl.where(p > 0, 1, 0))
        ok = (tl.max(bad, axis=0) == 0) & (tl.max(mass, axis=0) > 0)  # []
        tl.store(row_ok_ptr + r, ok.to(tl.int32))

    @triton.jit
    def _accept_and_sample_kernel(
        probs_ptr,  # [N + B, V] fp32, unit stride along V
        draft_ptr,  # [N] int32/int64, contiguous
        cu_ptr,  # [B] int32/int64, inclusive cumsum of the draft counts
        uniform_ptr,  # [N] fp32, contiguous
        noise_ptr,  # [B, V] fp32, contiguous
        row_ok_ptr,  # [N + B] int32 from _row_check_kernel
        q_ptr,  # [N, V] fp32, unit stride along V (HAS_Q; else unused)
        q_ok_ptr,  # [N] int32 from _row_check_kernel over q (HAS_Q; else unused)
        num_accepted_ptr,  # [B] int64
        output_ptr,  # [N + B] int64, contiguous
        invalid_row_ptr,  # [B] int64
        stride_pr,  # probs stride along rows (elements)
        stride_qr,  # q stride along rows (elements)
        N, V,
        HAS_Q: tl.constexpr,  # drafts drawn from q (a draft model); else point masses
        BLOCK_K: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        """One program per sequence: the accepted prefix, then one exponential race.

        ``cu`` is clamped, never trusted: start in [0, N], end in [start, N], so with any values
        every access stays inside [0, N) for drafts and [0, N + B) for rows.
        """
        b = tl.program_id(0)
        start, end = sequence_span(cu_ptr, b, N)  # [] [] its drafts, clamped
        k = end - start  # [] draft count
        row_start = start + b  # [] this sequence's first row
        probs_seq = probs_ptr + row_start.to(tl.int64) * stride_pr
        draft_seq = draft_ptr + start
        ok_seq = row_ok_ptr + row_start
        lanes_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]

        # num_accepted = the first position < k whose test fails, else k.
        first = k
        for j0 in range(0, k, BLOCK_K):
            offs = j0 + lanes_k  # [BLOCK_K]
            in_draft = offs < k
            x = tl.load(draft_seq + offs, mask=in_draft, other=-1).to(tl.int64)  # [BLOCK_K]
            in_vocab = in_draft & (x >= 0) & (x < V)
            p_x = tl.load(probs_seq + offs.to(tl.int64) * stride_pr + x, mask=in_vocab, other=0.0)  # [BLOCK_K]
            u = tl.load(uniform_ptr + start + offs, mask=in_draft, other=1.0)  # [BLOCK_K]
            ok = tl.load(ok_seq + offs, mask=in_draft, other=0)  # [BLOCK_K]
            if HAS_Q:  # accept when u * q(x) < p(x); a q row must be a distribution giving x mass
                q_x = tl.load(q_ptr + (start + offs).to(tl.int64) * stride_qr + x, mask=in_vocab,
                              other=0.0)  # [BLOCK_K]
                q_ok = tl.load(q_ok_ptr + start + offs, mask=in_draft, other=0)  # [BLOCK_K]
                fails = in_draft & ((ok == 0) | (q_ok == 0) | ~(q_x > 0) | ~(u * q_x < p_x))
            else:
                fails = in_draft & ((ok == 0) | ~(u < p_x))
            first = tl.minimum(first, tl.min(tl.where(fails, offs, k), axis=0))
        tl.store(num_accepted_ptr + b, first.to(tl.int64))

        # Sample from row `first`: the residual (the draft token removed, or max(0, p - q)), or
        # the bonus row.
        rejected = first < k  # []
        stop_ok = tl.load(ok_seq + first) != 0  # []
        q_row = q_ptr + (start + first).to(tl.int64) * stride_qr
        if HAS_Q:  # the residual p - q keeps x where p(x) > q(x): nothing excluded
            q_width = tl.where(rejected, V, 0)  # [] the q row is read only after a rejection
            excluded = tl.full([], -1, tl.int64)  # []
            # After a rejection: its q row is a distribution that gives the rejected draft mass
            # (a token q could not have drawn is bad input, reported as the row).
            x = tl.load(draft_seq + first, mask=first < k, other=-1).to(tl.int64)  # []
            q_x = tl.load(q_row + x, mask=(first < k) & (x >= 0) & (x < V), other=0.0)  # []
            q_row_ok = tl.load(q_ok_ptr + start + first, mask=first < k, other=0) != 0  # []
            stop_ok = stop_ok & ((first >= k) | (q_row_ok & (q_x > 0)))
        else:
            excluded = tl.load(draft_seq + first, mask=rejected, other=-1).to(tl.int64)  # []
        stop_row = probs_seq + first.to(tl.int64) * stride_pr
        noise_row = noise_ptr + b.to(tl.int64) * V
        lanes_v = tl.arange(0, BLOCK_V)  # [BLOCK_V]
        best = tl.full([BLOCK_V], -1.0, tl.float32)  # [BLOCK_V] per-lane best score
        best_idx = lanes_v.to(tl.int64)  # [BLOCK_V] its first index
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + lanes_v  # [BLOCK_V]
            valid = offs < V
            w = tl.load(stop_row + offs, mask=valid, other=0.0)  # [BLOCK_V]
            e = tl.load(noise_row + offs, mask=valid, other=1.0)  # [BLOCK_V]
            if HAS_Q:
                q = tl.load(q_row + offs, mask=offs < q_width, other=0.0)  # [BLOCK_V]
                w = tl.where(rejected, tl.maximum(w - q, 0.0), w)
            w = tl.where(offs == excluded, 0.0, w)
            score = tl.where(w > 0, tl.math.div_rn(w, e), -1.0)  # [BLOCK_V]
            better = score > best  # strictly: each lane keeps its first index of its maximum
            best = tl.where(better, score, best)
            best_idx = tl.where(better, offs.to(tl.int64), best_idx)
        top = tl.max(best, axis=0)  # []
        token = tl.min(tl.where(best == top, best_idx, 2147483647), axis=0)  # []
        stop_ok = stop_ok & (top >= 0)
        tl.store(invalid_row_ptr + b, tl.where(stop_ok, -1, first).to(tl.int64))

        out_seq = output_ptr + row_start
        sampled = tl.where(stop_ok, token, -1)  # []
        for j0 in range(0, k + 1, BLOCK_K):
            offs = j0 + lanes_k  # [BLOCK_K]
            d = tl.load(draft_seq + offs, mask=offs < first, other=-1).to(tl.int64)  # [BLOCK_K]
            out = tl.where(offs < first, d, tl.where(offs == first, sampled, -1))  # [BLOCK_K]
            tl.store(out_seq + offs, out, mask=offs < k + 1)


def _kernels_interpreted() -> bool:
    """True when Triton's interpreter runs the kernels on CPU tensors (TRITON_INTERPRET=1 was
    set before triton was first imported)."""
    return HAVE_TRITON and type(_row_check_kernel).__name__ == "InterpretedFunction"


def rejection_sample_triton(target_probs, draft_tokens, cu_num_draft_tokens, uniform, exp_noise,
                            draft_probs=None, *, block_v: int = DEFAULT_BLOCK_V, block_k: int = DEFAULT_BLOCK_K):
    """Rejection sampling with Triton kernels; same contract as the reference.

    Tensors must be on CUDA, or on CPU under Triton's interpreter. Nothing here reads a value
    from the device: N is ``draft_tokens.shape[0]`` and ``cu_num_draft_tokens`` is not checked
    (the reference does that); the kernel clamps it so that bad values never read or write out
    of bounds. Counts one launch of ``"rejection_sample"`` per call that launches (B > 0).
    """
    if not HAVE_TRITON:
        raise RuntimeError("rejection_sample_triton needs the 'triton' package; "
                           "use rejection_sample (falls back to the torch reference)")
    B, N, V = _check_inputs(target_probs, draft_tokens, cu_num_draft_tokens, uniform, exp_noise, draft_probs)
    for name, blk in (("block_v", block_v), ("block_k", block_k)):
        if not isinstance(blk, int) or blk < 1 or blk & (blk - 1):
            raise ValueError(f"{name} must be a positive power of two, got {blk!r}")
    device = target_probs.device
    if device.type == "cpu" and not _kernels_interpreted():
        raise ValueError("rejection_sample_triton got CPU tensors but Triton's interpreter is not "
                         "active; use CUDA tensors or set TRITON_INTERPRET=1 before importing triton")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"rejection_sample_triton supports CUDA tensors only, got {device}")

    num_rows = N + B
    num_accepted = torch.empty(B, dtype=torch.int64, device=device)
    output_tokens = torch.empty(num_rows, dtype=torch.int64, device=device)
    invalid_row = torch.empty(B, dtype=torch.int64, device=device)
    if B == 0:
        return num_accepted, output_tokens, invalid_row
    if target_probs.stride(1) != 1:
        target_probs = target_probs.contiguous()
    draft_tokens, cu_num_draft_tokens = draft_tokens.contiguous(), cu_num_draft_tokens.contiguous()
    uniform, exp_noise = uniform.contiguous(), exp_noise.contiguous()
    row_ok = torch.empty(num_rows, dtype=torch.int32, device=device)
    has_q = draft_probs is not None and N > 0
    if has_q and draft_probs.stride(1) != 1:
        draft_probs = draft_probs.contiguous()
    q = draft_probs if has_q else target_probs  # unused without q
    q_ok = torch.empty(N, dtype=torch.int32, device=device) if has_q else row_ok

    count_launch("rejection_sample")
    with torch.cuda.device(device) if target_probs.is_cuda else contextlib.nullcontext():
        _row_check_kernel[(num_rows,)](
            target_probs, row_ok, target_probs.stride(0), V, BLOCK_V=block_v)
        if has_q:
            _row_check_kernel[(N,)](q, q_ok, q.stride(0), V, BLOCK_V=block_v)
        _accept_and_sample_kernel[(B,)](
            target_probs, draft_tokens, cu_num_draft_tokens, uniform, exp_noise, row_ok, q, q_ok,
            num_accepted, output_tokens, invalid_row,
            target_probs.stride(0), q.stride(0), N, V,
            HAS_Q=has_q, BLOCK_K=block_k, BLOCK_V=block_v)
    return num_accepted, output_tokens, invalid_row


# --------------------------------------------------------------------------- #
# Dispatch
# --------------------------------------------------------------------------- #


def rejection_sample(target_probs, draft_tokens, cu_num_draft_tokens, uniform, exp_noise, draft_probs=None):
    """The Triton kernel for CUDA tensors when Triton is available, else the reference.

    Returns ``(num_accepted [B], output_tokens [N + B], invalid_row [B])``, all int64.
    """
    if target_probs.is_cuda and HAVE_TRITON:
        return rejection_sample_triton(target_probs, draft_tokens, cu_num_draft_tokens, uniform, exp_noise,
                                       draft_probs)
    return rejection_sample_reference(target_probs, draft_tokens, cu_num_draft_tokens, uniform, exp_noise,
                                      draft_probs)
