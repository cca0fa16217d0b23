"""bf16 linear layers whose every output row has the one-row bits, whatever else shares the pass.

Why: on a CPU with native bf16 (AVX512-BF16, AMX) oneDNN's bf16 product is the fastest kernel
from a few rows up (on an AMX Xeon the 262144 x 640 head takes about as long at 32 rows as at
one), which is what a verify pass needs. But it is not batch invariant: the kernel it runs
depends on the row count, and so do the bits. Measured on that Xeon (2 threads, the embedded
model's own weights): every row count from 1 to 32 gives a row the bits it has alone, wherever it
sits in the call and whatever the other rows hold; from 33 rows on, ``o_proj`` (640 x 1024),
``gate``/``up``-shaped products (2048 x 640) and the head round otherwise. So a pass of k + 1
draft rows could give a row other bits than k + 1 one-row passes would, and at a near tie
speculation could change the text (4 of 6 edit prompts equal to plain, ``benchmarks/
bf16_invariance_probe.py``).

Here each bf16 ``nn.Linear`` multiplies in calls of at most ``rows`` rows, ``rows`` the largest
of ``ROW_CANDIDATES`` for which every count up to it gave one-row bits in a check run when the
model loads, on the model's own weights (``largest_alike_rows``). A one-row decoding pass makes
one call as before; a verify pass of up to ``rows`` rows too; only long prefills make more calls.
With the attention's fixed key split (``invariant_attention.py``) and the head decided by
rescoring in float32 (``precision.rescore_in_fp32``), a row's bits then do not depend on the pass
it is in, and speculative text equals plain text at bf16.

The check is what makes this a property of the CPU the engine runs on, not of the one it was
measured on: where no candidate passes (another kernel library, another CPU), the layers stay as
they are and the engine reports ``batch_invariant`` false.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("foretell.engine")

ROW_CANDIDATES = (32, 16, 8, 4)  # rows per call, largest first: fewer calls for a long prefill


class RowChunkedLinear(torch.nn.Linear):
    """``linear`` (its own weight and bias tensors, so a tied head stays tied) multiplied in
    calls of at most ``rows`` rows."""

    def __init__(self, linear: torch.nn.Linear, rows: int):
        torch.nn.Module.__init__(self)  # not Linear's: it would allocate a new weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.rows = rows

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rows={self.rows}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        flat = x.reshape(-1, x.shape[-1])  # [n, in]
        n = flat.shape[0]
        if n <= self.rows:
            out = product(flat, self.weight, self.bias)
        else:  # each call writes its rows of one output: no concatenation
            out = flat.new_empty(n, self.out_features)
            for start in range(0, n, self.rows):
                product(flat[start:start + self.rows], self.weight, self.bias, out=out[start:start + self.rows])
        return out.reshape(*x.shape[:-1], self.out_features)


def product(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """rows [n, in] x weight [out, in] (+ bias) -> [n, out], the one product both the layer and
    the check run (``F.linear``'s own kernels: mm, or addmm with a bias). Inference only: ``out=``
    takes no autograd, so the weights are read detached."""
    if bias is None:
        return torch.mm(rows, weight.detach().t(), out=out)
    return torch.addmm(bias.detach(), rows, weight.detach().t(), out=out)


def first_count_unlike_one_row(weight: torch.Tensor, bias: torch.Tensor | None, most: int,
                               seed: int = 0) -> int | None:
    """The smallest row count n in 1..``most`` at which a row of an n-row product (placed first,
    in the middle and last, the other rows random) does not have the bits it has alone; None if
    every count gives them."""
    generator = torch.Generator().manual_seed(seed)
    width = weight.shape[1]
    others = torch.randn(most, width, generator=generator)
    others[:, 3] *= 30  # an outlier channel, as real hidden states have
    others = others.to(weight.dtype)
    row = others[-1:].clone()  # [1, in]
    with torch.inference_mode():
        alone = product(row, weight, bias)  # [1, out]
        for n in range(2, most + 1):
            places = sorted({0, n // 2, n - 1})
            batch = others[:n].clone()
            batch[places] = row
            out = product(batch, weight, bias)  # [n, out]
            if not all(torch.equal(out[p], alone[0]) for p in places):
                return n
    return None


def largest_alike_rows(linears: list[torch.nn.Linear]) -> int | None:
    """The largest of ``ROW_CANDIDATES`` at which every count up to it gives one-row bits on each
    distinct weight shape of ``linears`` (checked on one layer of each shape), or None."""
    best = ROW_CANDIDATES[0]
    checked: set[tuple] = set()
    for linear in linears:
        shape = (tuple(linear.weight.shape), linear.bias is not None)
        if shape in checked:
            continue
        checked.add(shape)
        unlike = first_count_unlike_one_row(linear.weight.detach(), linear.bias, best)
        if unlike is not None:
            fitting = [rows for rows in ROW_CANDIDATES if rows < unlike]
            if not fitting:
                log.warning("bf16 products of %s weights round a row otherwise beside %d others: "
                            "bf16 stays batch variant on this CPU", "x".join(map(str, shape[0])), unlike - 1)
                return None
            best = fitting[0]
    return best


def chunk_linear_rows(model) -> int | None:
    """Make every bf16 ``nn.Linear`` of ``model`` (its head too) a ``RowChunkedLinear`` of the
    checked row count, and mark the model batch invariant (``foretell_batch_invariant``, which
    also turns on the attention's fixed key split). Returns the row count, or None where the
    check found none (the model is left as it was)."""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.dtype == torch.bfloat16]
    if not linears:
        return None
    rows = largest_alike_rows(linears)
    if rows is None:
        return None
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child.weight.dtype == torch.bfloat16:
                setattr(parent, name, RowChunkedLinear(child, rows))
    model.foretell_batch_invariant = True
    log.info("bf16 products in calls of at most %d rows: every row count up to it rounds as one row here", rows)
    return rows
