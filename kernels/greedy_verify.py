"""Greedy verification for speculative decoding.

A draft source (a caller-supplied prediction, prompt lookup, a small model, ...)
proposes up to K tokens per request. The target model scores them all in one
forward pass, which yields K+1 rows of logits per request: row 0 is the
target's distribution after the last token that was already accepted, and row
j (1 <= j <= K) is its distribution after the j-th draft token.

Under greedy decoding the target would have emitted ``target[j] = argmax(row j)``
(the first index on ties, exactly like ``torch.argmax``), so verification is a
left-to-right comparison:

* **accepted** tokens: the longest prefix of the draft that equals the target's
  own choices, ``draft[:n] == target[:n]``. ``n`` is ``num_accepted``.
* **recovered** token: at the first mismatch (``n < num_draft``) the target's
  choice ``target[n]`` replaces the rejected draft token.
* **bonus** token: when every draft token was accepted (``n == num_draft``)
  the last row still gives one more token for free, ``target[num_draft]``.

Either way each request gains ``n + 1`` tokens per verify step, and the output
is exactly what plain greedy decoding with the target would have produced.

Batched layout (B requests, padded to the longest draft K):

* ``logits``       float  [B, K+1, V]  rows ``j > num_draft[b]`` are padding and
  are never read by the kernel nor used by the reference (they may hold
  garbage, even NaN).
* ``draft_tokens`` int    [B, K]       valid for ``j < num_draft[b]``, padded with -1.
* ``num_draft``    int    [B]          ``0 <= num_draft[b] <= K``; K may be 0.

Returned:

* ``num_accepted``  int64 [B]
* ``output_tokens`` int64 [B, K+1]  ``draft[b, :n]``, then ``target[b, n]``
  (recovered or bonus), then -1 padding.

Three entry points: :func:`greedy_verify_reference` (pure torch; the CPU path
and the test oracle), :func:`greedy_verify_triton` (two Triton kernels) and
:func:`greedy_verify` (dispatches to the kernel for CUDA tensors when Triton
is available, else to the reference).

NaN in a *valid* row follows ``torch.argmax``: NaN counts as the maximum and
the first NaN wins. Both implementations do that.
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

__all__ = ["greedy_verify", "greedy_verify_reference", "greedy_verify_triton"]

HAVE_TRITON = triton is not None

_INT_DTYPES = (torch.int32, torch.int64)
_KERNEL_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Default vocabulary block of the argmax kernel (a power of two).
DEFAULT_BLOCK_V = 1024
# Block of draft positions in the accept kernel (a power of two).
DEFAULT_BLOCK_K = 64


# --------------------------------------------------------------------------- #
# Input checks shared by both implementations
# --------------------------------------------------------------------------- #


def _check_inputs(
    logits: torch.Tensor, draft_tokens: torch.Tensor, num_draft: torch.Tensor
) -> tuple[int, int, int]:
    """Validate shapes, dtypes and devices; return (B, K, V). Raises ValueError."""
    for name, t in (("logits", logits), ("draft_tokens", draft_tokens), ("num_draft", num_draft)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if logits.dim() != 3:
        raise ValueError(f"logits must be 3-D [B, K+1, V], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor, got {logits.dtype}")
    B, K1, V = logits.shape
    if K1 < 1:
        raise ValueError(f"logits must have K+1 >= 1 rows per request, got shape {tuple(logits.shape)}")
    if V < 1:
        raise ValueError(f"logits must have a non-empty vocabulary dimension, got shape {tuple(logits.shape)}")
    K = K1 - 1
    if draft_tokens.dim() != 2 or tuple(draft_tokens.shape) != (B, K):
        raise ValueError(
            f"draft_tokens must have shape [B, K] = [{B}, {K}] to match logits "
            f"{tuple(logits.shape)}, got {tuple(draft_tokens.shape)}"
        )
    if draft_tokens.dtype not in _INT_DTYPES:
        raise ValueError(f"draft_tokens must be int64 or int32, got {draft_tokens.dtype}")
    if num_draft.dim() != 1 or num_draft.shape[0] != B:
        raise ValueError(f"num_draft must have shape [B] = [{B}], got {tuple(num_draft.shape)}")
    if num_draft.dtype not in _INT_DTYPES:
        raise ValueError(f"num_draft must be int64 or int32, got {num_draft.dtype}")
    if draft_tokens.device != logits.device or num_draft.device != logits.device:
        raise ValueError(
            "logits, draft_tokens and num_draft must be on the same device, got "
            f"{logits.device}, {draft_tokens.device}, {num_draft.device}"
        )
    return B, K, V


# --------------------------------------------------------------------------- #
# Reference (pure torch)
# --------------------------------------------------------------------------- #


def greedy_verify_reference(
    logits: torch.Tensor, draft_tokens: torch.Tensor, num_draft: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verify in plain torch (CPU or CUDA). See the module docstring.

    Returns ``(num_accepted [B] int64, output_tokens [B, K+1] int64)``.
    Raises ValueError on bad shapes/dtypes/devices or if some
    ``num_draft[b]`` lies outside ``[0, K]`` (that check synchronises on CUDA).
    """
    B, K, V = _check_inputs(logits, draft_tokens, num_draft)
    device = logits.device
    n = num_draft.to(torch.int64)
    if B > 0 and bool(((n < 0) | (n > K)).any()):
        raise ValueError(f"num_draft values must lie in [0, K] = [0, {K}], got {n.tolist()}")

    # target[b, j]: the target's greedy choice after j draft tokens. Padding rows
    # (j > num_draft[b]) get an argmax too, possibly of garbage/NaN, but every
    # use below is masked so they never reach the output.
    target = logits.argmax(dim=-1)  # [B, K+1] int64, first index on ties
    draft = draft_tokens.to(torch.int64)  # [B, K]
    pos = torch.arange(K + 1, device=device)  # [K+1]

    # A draft position counts only inside the draft; the accepted prefix ends at
    # the first position that is not a match.
    match = (draft == target[:, :K]) & (pos[:K].unsqueeze(0) < n.unsqueeze(1))  # [B, K]
    num_accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]

    na = num_accepted.unsqueeze(1)  # [B, 1]
    next_token = target.gather(1, na)  # [B, 1] recovered or bonus
    draft_ext = torch.cat([draft, draft.new_full((B, 1), -1)], dim=1)  # [B, K+1]
    output_tokens = torch.where(
        pos.unsqueeze(0) < na,
        draft_ext,
        torch.where(pos.unsqueeze(0) == na, next_token, torch.full_like(draft_ext, -1)),
    )
    return num_accepted, output_tokens


# --------------------------------------------------------------------------- #
# Triton kernels
# --------------------------------------------------------------------------- #

if HAVE_TRITON:

    @triton.jit
    def _row_argmax_kernel(
        logits_ptr,  # [B, K+1, V] fp32/fp16/bf16, unit stride along V
        num_draft_ptr,  # [B] int32/int64
        target_ptr,  # [B, K+1] int64, written for rows j <= num_draft[b] only
        stride_lb,  # logits stride along B (elements)
        stride_lj,  # logits stride along K+1 (elements)
        K,  # number of draft slots (logits.shape[1] - 1)
        V,  # vocabulary size
        BLOCK_V: tl.constexpr,
    ):
        """target[b, j] = first-index argmax of logits[b, j, :] (NaN counts as max)."""
        b = tl.program_id(0)
        j = tl.program_id(1)
        n = tl.load(num_draft_ptr + b).to(tl.int32)
        n = tl.minimum(tl.maximum(n, 0), K)
        if j > n:  # padding row: never read it, it may hold garbage
            return

        row_ptr = logits_ptr + b.to(tl.int64) * stride_lb + j.to(tl.int64) * stride_lj
        lanes = tl.arange(0, BLOCK_V)

        # Per-lane running state. Lane i sees indices i, i+BLOCK_V, i+2*BLOCK_V, ...
        # in increasing order and only moves to a later index when it is strictly
        # greater, so each lane holds the first index of its own maximum. A NaN
        # beats any number and, once a lane holds a NaN, nothing replaces it
        # (x > NaN is false), so the lane keeps its first NaN.
        best_val = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_idx = lanes
        for start in range(0, V, BLOCK_V):
            offs = start + lanes
            x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            better = (x > best_val) | ((x != x) & (best_val == best_val))
            best_val = tl.where(better, x, best_val)
            best_idx = tl.where(better, offs, best_idx)

        # Combine lanes: the smallest index among the lanes holding the maximum
        # (or holding a NaN, if any lane does). If the whole row is -inf, no lane
        # ever moved and lane 0 still holds index 0, which is torch's answer.
        big = 2147483647
        is_nan = best_val != best_val
        nan_idx = tl.min(tl.where(is_nan, best_idx, big), axis=0)
        row_max = tl.max(tl.where(is_nan, float("-inf"), best_val), axis=0)
        max_idx = tl.min(tl.where(best_val == row_max, best_idx, big), axis=0)
        result = tl.where(nan_idx < big, nan_idx, max_idx)
        tl.store(target_ptr + b.to(tl.int64) * (K + 1) + j, result.to(tl.int64))

    @triton.jit
    def _accept_kernel(
        draft_ptr,  # [B, K] int32/int64, contiguous, -1 padded
        num_draft_ptr,  # [B] int32/int64
        target_ptr,  # [B, K+1] int64, valid for rows j <= num_draft[b]
        num_accepted_ptr,  # [B] int64
        output_ptr,  # [B, K+1] int64, contiguous
        K,  # number of draft slots
        BLOCK_K: tl.constexpr,
    ):
        """One program per request: accepted prefix, then recovered/bonus token."""
        b = tl.program_id(0).to(tl.int64)
        n = tl.load(num_draft_ptr + b).to(tl.int32)
        n = tl.minimum(tl.maximum(n, 0), K)
        draft_row = draft_ptr + b * K
        target_row = target_ptr + b * (K + 1)
        lanes = tl.arange(0, BLOCK_K)

        # num_accepted = first position < n where draft != target, else n.
        first = n
        for start in range(0, K, BLOCK_K):
            offs = start + lanes
            in_draft = offs < n
            d = tl.load(draft_row + offs, mask=in_draft, other=-1).to(tl.int64)
            t = tl.load(target_row + offs, mask=in_draft, other=-1)
            mismatch = in_draft & (d != t)
            first = tl.minimum(first, tl.min(tl.where(mismatch, offs, n), axis=0))
        tl.store(num_accepted_ptr + b, first.to(tl.int64))

        # Recovered token (first < n) or bonus token (first == n): target[first].
        next_token = tl.load(target_row + first)
        out_row = output_ptr + b * (K + 1)
        for start in range(0, K + 1, BLOCK_K):
            offs = start + lanes
            d = tl.load(draft_row + offs, mask=offs < first, other=-1).to(tl.int64)
            out = tl.where(offs < first, d, tl.where(offs == first, next_token, -1))
            tl.store(out_row + offs, out, mask=offs < K + 1)


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
    num_draft: torch.Tensor,
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

    Unlike the reference, ``num_draft`` values are not range-checked here (that
    would synchronise the device); the kernels clamp them to ``[0, K]``.
    """
    if not HAVE_TRITON:
        raise RuntimeError(
            "greedy_verify_triton needs the 'triton' package, which is not importable; "
            "use greedy_verify (falls back to the torch reference) or install triton"
        )
    B, K, V = _check_inputs(logits, draft_tokens, num_draft)
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
    num_accepted = torch.empty(B, dtype=torch.int64, device=device)
    output_tokens = torch.empty(B, K + 1, dtype=torch.int64, device=device)
    if B == 0:
        return num_accepted, output_tokens

    if logits.stride(2) != 1:
        logits = logits.contiguous()
    draft_tokens = draft_tokens.contiguous()
    num_draft = num_draft.contiguous()
    # Only rows j <= num_draft[b] are written (and read back).
    target = torch.empty(B, K + 1, dtype=torch.int64, device=device)

    with torch.cuda.device(device) if logits.is_cuda else contextlib.nullcontext():
        _row_argmax_kernel[(B, K + 1)](
            logits,
            num_draft,
            target,
            logits.stride(0),
            logits.stride(1),
            K,
            V,
            BLOCK_V=block_v,
        )
        _accept_kernel[(B,)](
            draft_tokens,
            num_draft,
            target,
            num_accepted,
            output_tokens,
            K,
            BLOCK_K=block_k,
        )
    return num_accepted, output_tokens


# --------------------------------------------------------------------------- #
# Dispatch
# --------------------------------------------------------------------------- #


def greedy_verify(
    logits: torch.Tensor, draft_tokens: torch.Tensor, num_draft: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verify: the Triton kernel for CUDA tensors when Triton is available, else the reference.

    (CUDA logits in a dtype the kernel does not take, e.g. float64, also go to the reference.)

    Returns ``(num_accepted [B] int64, output_tokens [B, K+1] int64)``.
    """
    if logits.is_cuda and HAVE_TRITON and logits.dtype in _KERNEL_FLOAT_DTYPES:
        return greedy_verify_triton(logits, draft_tokens, num_draft)
    return greedy_verify_reference(logits, draft_tokens, num_draft)
