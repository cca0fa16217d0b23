"""Greedy verification for speculative decoding.

A draft source (a caller-supplied prediction, prompt lookup, a small model, ...)
proposes ``k`` tokens for a sequence (``k >= 0``, different per sequence). The
target model scores them all in one forward pass, which yields ``k + 1`` rows of
logits for the sequence: row 0 is the target's distribution after the last token
that was already accepted, and row j (1 <= j <= k) is its distribution after the
j-th draft token.

Under greedy decoding the target would have emitted ``target[j] = argmax(row j)``
(the first index on ties, exactly like ``torch.argmax``), so verification is a
left-to-right comparison:

* **accepted** tokens: the longest prefix of the draft that equals the target's
  own choices, ``draft[:n] == target[:n]``. ``n`` is ``num_accepted``.
* **recovered** token: at the first mismatch (``n < k``) the target's choice
  ``target[n]`` replaces the rejected draft token.
* **bonus** token: when every draft token was accepted (``n == k``) the last row
  still gives one more token for free, ``target[k]``.

Either way each sequence gains ``n + 1`` tokens per verify step, and the output
is exactly what plain greedy decoding with the target would have produced.

Flat batched layout (vLLM's): B sequences, sequence b has ``k_b >= 0`` drafts.

* ``cu_num_draft_tokens`` int [B]    the inclusive cumulative sum of ``k_b``:
  ``k_b = cu[b] - cu[b-1]`` with ``cu[-1] = 0``. ``N = cu[B-1]`` (0 when B == 0).
* ``draft_tokens``        int [N]    sequence b's drafts at ``[cu[b-1], cu[b])``.
* ``logits``            float [N + B, V]  sequence b owns the ``k_b + 1`` rows
  ``[row_start_b, row_start_b + k_b + 1)`` with ``row_start_b = cu[b-1] + b``.
  There is no padding: every row is read.

Returned (int64):

* ``num_accepted``  [B]
* ``output_tokens`` [N + B]  flat like the logits: at sequence b's rows,
  ``draft[:n]``, then the recovered or bonus token at row ``row_start_b + n``,
  then -1 to the end of its rows.

Three entry points: :func:`greedy_verify_reference` (pure torch; the CPU path
and the test oracle), :func:`greedy_verify_triton` (two Triton kernels: an
argmax per row, then an accept pass per sequence) and :func:`greedy_verify`
(dispatches to the kernel for CUDA tensors when Triton is available, else to the
reference).

NaN in a row follows ``torch.argmax``: NaN counts as the maximum and the first
NaN wins. Both implementations do that.
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

__all__ = ["greedy_verify", "greedy_verify_reference", "greedy_verify_triton"]

HAVE_TRITON = triton is not None

_KERNEL_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Default vocabulary block of the argmax kernel (a power of two).
DEFAULT_BLOCK_V = 1024
# Block of draft positions in the accept kernel (a power of two).
DEFAULT_BLOCK_K = 64


# --------------------------------------------------------------------------- #
# Input checks shared by both implementations
# --------------------------------------------------------------------------- #


def _check_inputs(
    logits: torch.Tensor, draft_tokens: torch.Tensor, cu_num_draft_tokens: torch.Tensor
) -> tuple[int, int, int]:
    """Validate without reading values (no sync); return (B, N, V). Raises ValueError."""
    B, N, V = check_flat("logits", logits, draft_tokens, cu_num_draft_tokens)
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor, got {logits.dtype}")
    return B, N, V


# --------------------------------------------------------------------------- #
# Reference (pure torch)
# --------------------------------------------------------------------------- #


def greedy_verify_reference(
    logits: torch.Tensor, draft_tokens: torch.Tensor, cu_num_draft_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verify in plain torch (CPU or CUDA). See the module docstring.

    Returns ``(num_accepted [B] int64, output_tokens [N + B] int64)``.
    Raises ValueError on bad types/shapes/dtypes/devices, or if ``cu_num_draft_tokens``
    is negative, decreasing or does not end at ``N`` (that check synchronises on CUDA).
    """
    B, N, V = _check_inputs(logits, draft_tokens, cu_num_draft_tokens)
    check_cu_values(cu_num_draft_tokens, N)
    device = logits.device
    num_rows = N + B
    if B == 0:
        return torch.empty(0, dtype=torch.int64, device=device), torch.empty(0, dtype=torch.int64, device=device)

    cu = cu_num_draft_tokens.to(torch.int64)  # [B]
    draft_start = torch.cat([cu.new_zeros(1), cu[:-1]])  # [B] cu[b-1]
    k = cu - draft_start  # [B]
    seqs = torch.arange(B, device=device)  # [B]
    row_start = draft_start + seqs  # [B]

    # target[r]: the target's greedy choice at row r, first index on ties.
    target = logits.argmax(dim=-1)  # [N + B] int64

    # Draft token i of sequence s sits at position j = i - cu[s-1]; the row that judges it is
    # row_start[s] + j = i + s.
    draft = draft_tokens.to(torch.int64)  # [N]
    seq_of_draft = torch.repeat_interleave(seqs, k, output_size=N)  # [N]
    pos_of_draft = torch.arange(N, device=device) - draft_start[seq_of_draft]  # [N]
    mismatch = draft != target[torch.arange(N, device=device) + seq_of_draft]  # [N]
    # num_accepted[s] = the first mismatching position of s, else k[s].
    num_accepted = k.scatter_reduce(
        0, seq_of_draft, torch.where(mismatch, pos_of_draft, k[seq_of_draft]), reduce="amin"
    )  # [B]

    # Row r of sequence s is position p = r - row_start[s]; its draft (when p < k[s]) is
    # draft[r - s], an index in [0, N] (N only past the last draft, hence the -1 sentinel).
    rows = torch.arange(num_rows, device=device)  # [N + B]
    seq_of_row = torch.repeat_interleave(seqs, k + 1, output_size=num_rows)  # [N + B]
    pos = rows - row_start[seq_of_row]  # [N + B]
    na = num_accepted[seq_of_row]  # [N + B]
    draft_ext = torch.cat([draft, draft.new_full((1,), -1)])  # [N + 1]
    from_draft = draft_ext[rows - seq_of_row]  # [N + B]
    output_tokens = torch.where(
        pos < na, from_draft, torch.where(pos == na, target, torch.full_like(target, -1))
    )  # [N + B]: recovered or bonus at p == n is target[row_start + n]
    return num_accepted, output_tokens


# --------------------------------------------------------------------------- #
# Triton kernels
# --------------------------------------------------------------------------- #

if HAVE_TRITON:

    @triton.jit
    def _row_argmax_kernel(
        logits_ptr,  # [N + B, V] fp32/fp16/bf16, unit stride along V
        target_ptr,  # [N + B] int64
        stride_lr,  # logits stride along rows (elements)
        V,  # vocabulary size
        BLOCK_V: tl.constexpr,
    ):
        """target[r] = first-index argmax of logits[r, :] (NaN counts as max). One program per row."""
        r = tl.program_id(0)
        row_ptr = logits_ptr + r.to(tl.int64) * stride_lr
        lanes = tl.arange(0, BLOCK_V)  # [BLOCK_V]

        # Per-lane running state. Lane i sees indices i, i+BLOCK_V, i+2*BLOCK_V, ...
        # in increasing order and only moves to a later index when it is strictly
        # greater, so each lane holds the first index of its own maximum. A NaN
        # beats any number and, once a lane holds a NaN, nothing replaces it
        # (x > NaN is false), so the lane keeps its first NaN.
        best_val = tl.full([BLOCK_V], float("-inf"), tl.float32)  # [BLOCK_V]
        best_idx = lanes  # [BLOCK_V]
        for start in range(0, V, BLOCK_V):
            offs = start + lanes  # [BLOCK_V]
            x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)  # [BLOCK_V]
            better = (x > best_val) | ((x != x) & (best_val == best_val))  # [BLOCK_V]
            best_val = tl.where(better, x, best_val)
            best_idx = tl.where(better, offs, best_idx)

        # Combine lanes: the smallest index among the lanes holding the maximum
        # (or holding a NaN, if any lane does). If the whole row is -inf, no lane
        # ever moved and lane 0 still holds index 0, which is torch's answer.
        big = 2147483647
        is_nan = best_val != best_val  # [BLOCK_V]
        nan_idx = tl.min(tl.where(is_nan, best_idx, big), axis=0)  # []
        row_max = tl.max(tl.where(is_nan, float("-inf"), best_val), axis=0)  # []
        max_idx = tl.min(tl.where(best_val == row_max, best_idx, big), axis=0)  # []
        result = tl.where(nan_idx < big, nan_idx, max_idx)
        tl.store(target_ptr + r, result.to(tl.int64))

    @triton.jit
    def _accept_kernel(
        draft_ptr,  # [N] int32/int64, contiguous
        cu_ptr,  # [B] int32/int64, inclusive cumsum of the draft counts
        target_ptr,  # [N + B] int64 from _row_argmax_kernel
        num_accepted_ptr,  # [B] int64
        output_ptr,  # [N + B] int64, contiguous
        N,  # number of draft tokens (draft_tokens.shape[0])
        BLOCK_K: tl.constexpr,
    ):
        """One program per sequence: accepted prefix, then recovered/bonus token.

        ``cu`` is clamped, never trusted: start in [0, N], end in [start, N], so with any
        values every access stays inside [0, N) for drafts and [0, N + B) for rows.
        """
        b = tl.program_id(0)
        start, end = sequence_span(cu_ptr, b, N)  # [] [] its drafts, clamped
        k = end - start  # [] draft count
        draft_seq = draft_ptr + start  # this sequence's drafts
        target_seq = target_ptr + (start + b)  # this sequence's k + 1 rows
        lanes = tl.arange(0, BLOCK_K)  # [BLOCK_K]

        # num_accepted = first position < k where draft != target, else k.
        first = k
        for j0 in range(0, k, BLOCK_K):
            offs = j0 + lanes  # [BLOCK_K]
            in_draft = offs < k
            d = tl.load(draft_seq + offs, mask=in_draft, other=-1).to(tl.int64)  # [BLOCK_K]
            t = tl.load(target_seq + offs, mask=in_draft, other=-1)  # [BLOCK_K]
            mismatch = in_draft & (d != t)
            first = tl.minimum(first, tl.min(tl.where(mismatch, offs, k), axis=0))
        tl.store(num_accepted_ptr + b, first.to(tl.int64))

        # Recovered token (first < k) or bonus token (first == k): target[first].
        next_token = tl.load(target_seq + first)  # []
        out_seq = output_ptr + (start + b)
        for j0 in range(0, k + 1, BLOCK_K):
            offs = j0 + lanes  # [BLOCK_K]
            d = tl.load(draft_seq + offs, mask=offs < first, other=-1).to(tl.int64)  # [BLOCK_K]
            out = tl.where(offs < first, d, tl.where(offs == first, next_token, -1))  # [BLOCK_K]
            tl.store(out_seq + offs, out, mask=offs < k + 1)


def _kernels_interpreted() -> bool:
    """True when Triton's interpreter can run the kernels on CPU tensors.

    ``TRITON_INTERPRET=1`` is honoured at decoration time, so it must have been set
    before ``triton`` itself was imported (triton.language's helpers such as
    ``tl.max`` are jitted functions too) and before this module was imported.
    """
    if not HAVE_TRITON:
        return False

    def interpreted(fn) -> bool:
        return type(fn).__name__ == "InterpretedFunction"

    std_max = getattr(getattr(tl, "standard", None), "max", None)
    return (
        interpreted(_row_argmax_kernel)
        and interpreted(_accept_kernel)
        and (std_max is None or interpreted(std_max))
    )


def greedy_verify_triton(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    *,
    block_v: int = DEFAULT_BLOCK_V,
    block_k: int = DEFAULT_BLOCK_K,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verify with Triton kernels. Same contract as :func:`greedy_verify_reference`.

    Tensors must be on CUDA, or on CPU when Triton's interpreter is active
    (``TRITON_INTERPRET=1`` set before ``triton`` and ``foretell.kernels`` were
    first imported).
    ``logits`` may be fp32, fp16 or bf16; it is compared in fp32 in the kernel.
    ``block_v`` / ``block_k`` (powers of two) are the vocabulary and draft tiles.

    Nothing here reads a value from the device: N is ``draft_tokens.shape[0]``, and
    ``cu_num_draft_tokens`` is not checked (the reference does that); the kernel clamps
    it so that bad values never read or write out of bounds. Counts one launch of
    ``"greedy_verify"`` per call that launches (B > 0).
    """
    if not HAVE_TRITON:
        raise RuntimeError(
            "greedy_verify_triton needs the 'triton' package, which is not importable; "
            "use greedy_verify (falls back to the torch reference) or install triton"
        )
    B, N, V = _check_inputs(logits, draft_tokens, cu_num_draft_tokens)
    if logits.dtype not in _KERNEL_FLOAT_DTYPES:
        raise ValueError(f"logits must be float32, float16 or bfloat16 for the Triton kernel, got {logits.dtype}")
    for name, blk in (("block_v", block_v), ("block_k", block_k)):
        if not isinstance(blk, int) or blk < 1 or blk & (blk - 1):
            raise ValueError(f"{name} must be a positive power of two, got {blk!r}")
    if logits.device.type == "cpu" and not _kernels_interpreted():
        raise ValueError(
            "greedy_verify_triton got CPU tensors but Triton's interpreter is not active; "
            "move the tensors to CUDA, or set TRITON_INTERPRET=1 before triton and foretell.kernels are first imported"
        )
    if not logits.is_cuda and logits.device.type != "cpu":
        raise ValueError(f"greedy_verify_triton supports CUDA tensors only, got device {logits.device}")

    device = logits.device
    num_rows = N + B
    num_accepted = torch.empty(B, dtype=torch.int64, device=device)
    output_tokens = torch.empty(num_rows, dtype=torch.int64, device=device)
    if B == 0:
        return num_accepted, output_tokens

    if logits.stride(1) != 1:
        logits = logits.contiguous()
    draft_tokens = draft_tokens.contiguous()
    cu_num_draft_tokens = cu_num_draft_tokens.contiguous()
    target = torch.empty(num_rows, dtype=torch.int64, device=device)

    count_launch("greedy_verify")
    with torch.cuda.device(device) if logits.is_cuda else contextlib.nullcontext():
        _row_argmax_kernel[(num_rows,)](
            logits,
            target,
            logits.stride(0),
            V,
            BLOCK_V=block_v,
        )
        _accept_kernel[(B,)](
            draft_tokens,
            cu_num_draft_tokens,
            target,
            num_accepted,
            output_tokens,
            N,
            BLOCK_K=block_k,
        )
    return num_accepted, output_tokens


# --------------------------------------------------------------------------- #
# Dispatch
# --------------------------------------------------------------------------- #


def greedy_verify(
    logits: torch.Tensor, draft_tokens: torch.Tensor, cu_num_draft_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verify: the Triton kernel for CUDA tensors when Triton is available, else the reference.

    (CUDA logits in a dtype the kernel does not take, e.g. float64, also go to the reference.)

    Returns ``(num_accepted [B] int64, output_tokens [N + B] int64)``.
    """
    if logits.is_cuda and HAVE_TRITON and logits.dtype in _KERNEL_FLOAT_DTYPES:
        return greedy_verify_triton(logits, draft_tokens, cu_num_draft_tokens)
    return greedy_verify_reference(logits, draft_tokens, cu_num_draft_tokens)
