"""The model's RMSNorms as one native call each (``foretell/kernels/row_norm.cpp``), for the
batch-invariant int8 precision.

Why: a decoding step of the embedded model runs 109 RMSNorms, each ~8 torch operations (~3.6 ms
of a ~30 ms plain int8 step on a 2-core CPU); the loop does a row in one call. It rounds otherwise
than torch's mean (another summation order), so it serves only where the text is already not the
float32 oracle's: the int8 precision promises one text per request (batch invariance), which the
loop keeps by construction (each row summed alone, in one fixed order). ``--dtype float32`` keeps
transformers' own norms and so ``generate(do_sample=False)``'s bits.

Which modules: any whose class name ends in ``RMSNorm`` with a float32 weight [d] and an
``eps`` (Gemma) or ``variance_epsilon`` (Llama, Qwen, Mistral...), whose own output on a random
input agrees with ``x / rms(x) * (offset + weight)`` to float32 rounding for offset 1 (Gemma's
``1 + weight``) or 0; any other norm (a norm without a weight, another formula) is left as it is.
"""

from __future__ import annotations

import torch

from foretell.kernels.row_norm import native_rms_norm, rms_norm_reference

_OFFSETS = (1.0, 0.0)  # Gemma's (1 + weight), then Llama's (weight)


class RowInvariantRMSNorm(torch.nn.Module):
    """RMSNorm of each row alone in a fixed order: the same bits whatever rows share the pass."""

    def __init__(self, weight: torch.nn.Parameter, eps: float, offset: float, launch) -> None:
        super().__init__()
        self.weight = weight  # the replaced module's own parameter (state-dict names unchanged)
        self.eps, self.offset, self.launch = eps, offset, launch

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, offset={self.offset}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.launch(x, self.weight, self.eps, self.offset)


def _epsilon(module: torch.nn.Module) -> float | None:
    for name in ("eps", "variance_epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _offset_of(module: torch.nn.Module, eps: float) -> float | None:
    """The offset for which the module computes ``x / rms(x) * (offset + weight)``, else None."""
    d = module.weight.shape[0]
    x = torch.randn(3, d, generator=torch.Generator().manual_seed(0)) * 4
    with torch.no_grad():
        theirs = module(x).double()
        for offset in _OFFSETS:
            if torch.allclose(theirs, rms_norm_reference(x, module.weight, eps, offset), rtol=1e-5, atol=1e-6):
                return offset
    return None


def use_row_invariant_norms(model: torch.nn.Module) -> int:
    """Replace ``model``'s RMSNorms of float32 CPU weights by ``RowInvariantRMSNorm`` where the
    native loop is available; returns how many were replaced."""
    launch = native_rms_norm()
    if launch is None:
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            weight = getattr(child, "weight", None)
            eps = _epsilon(child)
            if (not type(child).__name__.endswith("RMSNorm") or eps is None
                    or not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1
                    or weight.dtype != torch.float32 or weight.device.type != "cpu"):
                continue
            offset = _offset_of(child, eps)
            if offset is not None:
                setattr(parent, name, RowInvariantRMSNorm(weight, eps, offset, launch))
                count += 1
    return count
