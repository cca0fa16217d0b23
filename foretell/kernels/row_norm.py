"""Row-invariant RMSNorm on the CPU: a native loop (``row_norm.cpp``, built by ``cpu_native``) with
a float64 reference.

Why: the embedded model runs 109 RMSNorms a decoding step (four a layer, the per-head query and
key norms, the final one); as torch operations each is ~8 calls, ~3.6 ms a plain int8 step on a
2-core CPU. The loop sums each row's squares in one fixed order whatever the row count, so a row's
bits do not depend on the pass it is in. Where the loop cannot be built, ``native_rms_norm()``
returns None and the model keeps its own norms.
"""

from __future__ import annotations

import torch

from foretell.kernels.cpu_native import load_native


def native_module():
    """The compiled loop, or None where it cannot be built."""
    return load_native("row_norm")


def native_rms_norm():
    """The launcher if the extension is available, else None."""
    return rms_norm if native_module() is not None else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """x [..., d], weight [d] -> [..., d]: x / sqrt(mean(x^2) + eps) * (offset + weight) per row.
    float32 on the CPU."""
    d = x.shape[-1]
    assert weight.shape == (d,), f"weight {tuple(weight.shape)} for rows of {d}"
    assert x.dtype == weight.dtype == torch.float32, "float32 only"
    rows = x.reshape(-1, d)
    return native_module().rms_norm(rows.contiguous(), weight.contiguous(), float(eps), float(offset)).view(x.shape)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """The same norm in float64 torch operations."""
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.double())
