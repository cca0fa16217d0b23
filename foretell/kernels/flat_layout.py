"""The flat layout both verify kernels take (vLLM's), and its checks.

B sequences, sequence b with ``k_b >= 0`` draft tokens:

* ``cu_num_draft_tokens`` int [B]  inclusive cumulative sum of ``k_b`` (``cu[-1] = 0``);
  ``N = cu[B-1]``.
* ``draft_tokens``        int [N]  sequence b's drafts at ``[cu[b-1], cu[b])``.
* rows (logits or probabilities) float [N + B, V]: sequence b owns the ``k_b + 1`` rows from
  ``cu[b-1] + b``.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: the package (and its CPU path) must import without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

INT_DTYPES = (torch.int32, torch.int64)


def check_flat(rows_name: str, rows, draft_tokens, cu_num_draft_tokens) -> tuple[int, int, int]:
    """Types, dims, integer dtypes, devices and the row count, without reading any value (no
    device sync); return (B, N, V). Raises ValueError."""
    tensors = ((rows_name, rows), ("draft_tokens", draft_tokens), ("cu_num_draft_tokens", cu_num_draft_tokens))
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if rows.dim() != 2 or rows.shape[1] < 1:
        raise ValueError(f"{rows_name} must be [N + B, V] with V >= 1, got shape {tuple(rows.shape)}")
    for name, t in tensors[1:]:
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
        if t.dtype not in INT_DTYPES:
            raise ValueError(f"{name} must be int64 or int32, got {t.dtype}")
        if t.device != rows.device:
            raise ValueError(f"{name} is on {t.device}, {rows_name} on {rows.device}: all inputs must be on "
                             "the same device")
    num_rows, V = rows.shape
    N, B = draft_tokens.shape[0], cu_num_draft_tokens.shape[0]
    if B == 0 and N != 0:
        raise ValueError(f"draft_tokens must be empty when there are no sequences (B = 0), got N = {N}")
    if num_rows != N + B:
        raise ValueError(f"{rows_name} must have N + B = {N} + {B} = {N + B} rows (one per draft token "
                         f"plus one per sequence), got {num_rows}")
    return B, N, V


def check_cu_values(cu: torch.Tensor, N: int) -> None:
    """The references' value check of ``cu_num_draft_tokens`` (synchronises on CUDA; the kernels
    clamp instead)."""
    if cu.shape[0] == 0:
        return
    cu = cu.to(torch.int64)
    first, decreasing, last = torch.stack([cu[0], (cu[1:] < cu[:-1]).any().to(torch.int64), cu[-1]]).tolist()
    if first < 0:
        raise ValueError(f"cu_num_draft_tokens must be non-negative, got {cu.tolist()}")
    if decreasing:
        raise ValueError(f"cu_num_draft_tokens must be non-decreasing (an inclusive cumsum), got {cu.tolist()}")
    if last != N:
        raise ValueError(f"cu_num_draft_tokens must end at N = draft_tokens.shape[0] = {N}, got {cu.tolist()}")


if triton is not None:

    @triton.jit
    def sequence_span(cu_ptr, b, N):
        """Sequence b's drafts ``[start, end)`` read from the inclusive cumsum inside a kernel,
        clamped into ``[0, N]`` so that bad values never read or write out of bounds (the
        kernels do not synchronise to check them)."""
        start = tl.minimum(tl.maximum(tl.load(cu_ptr + b - 1, mask=b > 0, other=0), 0), N).to(tl.int32)  # []
        end = tl.minimum(tl.maximum(tl.load(cu_ptr + b), start), N).to(tl.int32)  # []
        return start, end
else:  # pragma: no cover - exercised only where triton is absent
    sequence_span = None
